"""The planner's per-block peak measurement on a GPU (run by `nox -s gpu`; skips on CPU machines).

One linear layer with a trainable weight: its backward needs the output's gradient and the weight's, plus the
input's gradient only when the input requires one. The output itself is dead in a real step's backward and
must not count. Bounds leave 4 MiB of slack for allocator rounding and library workspaces.
"""

from __future__ import annotations

import pytest
import torch

from memfit.auto.blockpeak import measure_block_peak

pytestmark = pytest.mark.gpu
MiB = 2**20
cuda = torch.device("cuda")


def test_block_peak_counts_what_a_real_backward_holds():
    n, d = 4096, 1024  # fp32: activations 16 MiB, weight gradient 4 MiB
    block = torch.nn.Linear(d, d, bias=False, device=cuda)
    frozen_input = torch.randn(n, d, device=cuda)
    block(frozen_input).sum().backward()  # library workspaces exist before the measurement
    block.zero_grad(set_to_none=True)
    torch.cuda.synchronize()

    # output gradient + weight gradient; the 16 MiB output no longer counts once backward runs
    peak = measure_block_peak(block, (frozen_input,), {}, cuda)
    assert 20 * MiB <= peak < 24 * MiB, peak / MiB
    # an input that requires a gradient adds its gradient (16 MiB) and nothing else
    trained_input = frozen_input.clone().requires_grad_()
    peak_with_input_grad = measure_block_peak(block, (trained_input,), {}, cuda)
    assert 36 * MiB <= peak_with_input_grad < 40 * MiB, peak_with_input_grad / MiB
    assert block.weight.grad is None  # the measurement never accumulates into .grad


def test_block_peak_keeps_an_output_the_graph_saved():
    """exp saves its result for backward: a real step holds that output through the backward too."""
    n, d = 4096, 1024

    class Exp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(d, device=cuda))

        def forward(self, x):
            return torch.exp(x * self.scale)

    block, x = Exp(), torch.randn(n, d, device=cuda)
    block(x).sum().backward()
    block.zero_grad(set_to_none=True)
    # backward holds the output (saved), its gradient of ones, exp's gradient and the product reduced into the
    # scale's gradient: 4 x 16 MiB (3 x 16 if the saved output were taken off like a dead one)
    peak = measure_block_peak(block, (x,), {}, cuda)
    assert 60 * MiB <= peak < 68 * MiB, peak / MiB
