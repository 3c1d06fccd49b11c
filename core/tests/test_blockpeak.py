"""The block run's backward root (CPU: the semantics; the peaks it changes are measured in test_gpu_blockpeak)."""

from __future__ import annotations

import weakref

import torch

from memfit.auto.blockpeak import _OutputGradients


def _residual_block(d: int = 8) -> torch.nn.Module:
    torch.manual_seed(0)
    ff = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d))

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = ff

        def forward(self, x, context):
            return x + self.ff(x), context * 2

    return Block()


def test_the_root_gives_the_gradients_of_ones_on_every_output():
    block = _residual_block()
    x = torch.randn(3, 8, requires_grad=True)
    context = torch.randn(2, 8, requires_grad=True)
    wrt = [x, context, *block.parameters()]
    outs = block(x, context)
    expected = torch.autograd.grad(outs, wrt, [torch.ones_like(o) for o in outs])
    got = torch.autograd.grad(_OutputGradients.apply(*block(x, context)), wrt)
    for e, g in zip(expected, got, strict=True):
        assert torch.equal(e, g)


def test_the_root_does_not_keep_the_outputs_alive():
    """Outputs nothing saved are freed once the caller drops them, as in a step's backward."""
    block = _residual_block()
    x = torch.randn(3, 8, requires_grad=True)
    out, context_out = block(x, torch.randn(2, 8))
    root = _OutputGradients.apply(out)
    alive = weakref.ref(out)
    del out
    assert alive() is None
    (grad_x,) = torch.autograd.grad(root, [x])
    assert grad_x.shape == x.shape
