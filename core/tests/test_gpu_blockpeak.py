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

    # each half on its own: the forward makes the 16 MiB output; the backward the two gradients
    from memfit.auto.blockpeak import measure_block

    run = measure_block(block, (frozen_input,), {}, cuda)
    assert 16 * MiB <= run.forward_peak_bytes < 20 * MiB, run.forward_peak_bytes / MiB
    assert 20 * MiB <= run.backward_peak_bytes < 24 * MiB, run.backward_peak_bytes / MiB
    assert run.peak_bytes == max(run.forward_peak_bytes, run.backward_peak_bytes)


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
    torch.cuda.synchronize()
    # the truth: the same forward+backward as in a step, the output's gradient coming out of autograd (here
    # from a multiplication by one, as it comes from the next block) and the output held by its graph only
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    torch.autograd.grad((block(x) * 1.0).sum(), [block.scale])
    truth = torch.cuda.max_memory_allocated() - before
    peak = measure_block_peak(block, (x,), {}, cuda)
    assert abs(peak - truth) <= MiB, (peak / MiB, truth / MiB)  # 16 MiB less if it were released


def test_block_runs_are_timed():
    from memfit.auto.blockpeak import measure_block

    block = torch.nn.Linear(1024, 1024, device=cuda)
    run = measure_block(block, (torch.randn(4096, 1024, device=cuda),), {}, cuda)
    assert run.peak_bytes > 0 and run.forward_seconds > 0 and run.backward_seconds > 0


def test_attention_phase_peak_starts_after_the_ffn_backward():
    """attention → wide FFN: backward runs the FFN first (its 4x-wide activations and their gradients), then
    the attention. The peak from the attention's first saved tensor on leaves the FFN's out, the whole
    block's keeps it; without attention modules named there is no phase."""
    from memfit.auto.blockpeak import measure_block

    n, d = 4096, 1024  # fp32: a 4096 x 4096 FFN activation is 64 MiB

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = torch.nn.Linear(d, d, device=cuda)
            self.ff_in = torch.nn.Linear(d, 4 * d, device=cuda)
            self.ff_out = torch.nn.Linear(4 * d, d, device=cuda)

        def forward(self, x):
            x = x + self.attn(x)
            return x + self.ff_out(torch.nn.functional.gelu(self.ff_in(x)))

    block, x = Block(), torch.randn(n, d, device=cuda, requires_grad=True)
    block(x).sum().backward()
    block.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    run = measure_block(block, (x,), {}, cuda, attention=[block.attn])
    # the FFN phase holds its two 64 MiB activations and a 64 MiB gradient at least; the attention phase
    # only 16 MiB tensors (the attention's input, the gradients) and the weight gradients
    assert run.peak_bytes >= run.attention_peak_bytes + 64 * MiB, (
        run.peak_bytes / MiB,
        run.attention_peak_bytes / MiB,
    )
    assert run.attention_peak_bytes >= 16 * MiB
    assert measure_block(block, (x,), {}, cuda).attention_peak_bytes == 0


def test_a_residual_blocks_run_peaks_as_in_a_step():
    """x + FFN(x): the output's gradient flows to x directly and through the FFN, and the FFN's share is added
    to it. The block run's backward peak is a real step's, where the output is dead and its gradient
    autograd's own (see blockpeak's "Output gradients")."""
    from memfit.auto.blockpeak import measure_block

    n, d = 4096, 1024  # fp32: the output and its gradients are 16 MiB

    class Residual(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff_in = torch.nn.Linear(d, 2 * d, device=cuda)
            self.ff_out = torch.nn.Linear(2 * d, d, device=cuda)

        def forward(self, x):
            return x + self.ff_out(torch.nn.functional.gelu(self.ff_in(x)))

    block, x = Residual(), torch.randn(n, d, device=cuda, requires_grad=True)
    wrt = [x, *block.parameters()]
    torch.autograd.grad(block(x).sum(), wrt)  # library workspaces exist before the measurements
    torch.cuda.synchronize()

    def backward_peak(run_backward) -> int:
        before = torch.cuda.memory_allocated()
        run_backward()
        return torch.cuda.max_memory_allocated() - before

    def step() -> None:  # the output dead, its gradient autograd's own
        loss = (block(x) * 1.0).sum()
        torch.cuda.reset_peak_memory_stats()
        torch.autograd.grad(loss, wrt)

    truth = backward_peak(step)
    run = measure_block(block, (x,), {}, cuda)
    assert abs(run.backward_peak_bytes - truth) <= 2 * MiB, (run.backward_peak_bytes / MiB, truth / MiB)
