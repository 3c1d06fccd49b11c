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


def test_a_residual_blocks_input_gradient_is_summed_into_the_output_gradient_in_place():
    """The mechanism behind "Output gradients": the gradient of x in x + FFN(x) is the output's gradient plus
    the FFN's share. Held by autograd alone (as in a step, and from this root) the sum goes into the output
    gradient's own storage; passed in by the caller it cannot, and takes a new tensor of the output's size."""

    def summed_in_place(backward) -> bool:
        block = _residual_block()
        x = torch.randn(3, 8, requires_grad=True)
        seen = {}
        out, _ = block(x, torch.randn(2, 8))
        out.register_hook(lambda g: seen.update(out_grad=g.data_ptr()))
        grad_x = backward(out, x)
        return seen["out_grad"] == grad_x.data_ptr()

    def from_the_root(out, x):
        root = _OutputGradients.apply(out)
        del out
        return torch.autograd.grad(root, [x])[0]

    assert summed_in_place(lambda out, x: torch.autograd.grad((out * 1.0).sum(), [x])[0])  # a step
    assert summed_in_place(from_the_root)
    assert not summed_in_place(lambda out, x: torch.autograd.grad(out, [x], torch.ones_like(out))[0])
