"""A ``KeyboardInterrupt`` inside a region call skips the hooks that end it (``always_call`` hooks run for
``Exception`` only). The thread's autograd state must not stay poisoned: the next step, ``remove()`` and an
unrelated backward all work."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit_conformance.base import cpu_copy_engine

from helpers import assert_same, step
from toy import TOY, build

ON = {"gradient_checkpointing": True}


def interrupt_in(module: torch.nn.Module):
    """A forward pre-hook that raises KeyboardInterrupt once (registered after memfit's, so inside the call)."""
    fired = []

    def hook(m, args):
        if not fired:
            fired.append(1)
            raise KeyboardInterrupt

    return module.register_forward_pre_hook(hook)


@pytest.mark.parametrize(
    ("config", "where"),
    [
        ({**ON, "gradient_checkpointing_backend": "torch-ffn"}, "ff_out"),
        ({**ON, "gradient_checkpointing_backend": "torch"}, "norm2"),
        ({"gradient_checkpointing_offload_attention": True}, "attn"),
    ],
)
def test_the_next_step_after_an_interrupt_is_exact(x, config, where):
    model = build()
    ref = step(model, x)
    kw = {"copy_engine": cpu_copy_engine(), "min_offload_bytes": 0} if "offload" in str(config) else {}
    with memfit.apply(model, config, adapter=TOY, **kw):
        handle = interrupt_in(getattr(model.blocks[2], where))
        with pytest.raises(KeyboardInterrupt):
            step(model, x)
        handle.remove()
        assert_same(ref, step(model, x))  # the next step starts clean
    linear = torch.nn.Linear(4, 4)
    linear(torch.randn(2, 4, requires_grad=True)).sum().backward()  # and so does anything else


def test_remove_after_an_interrupt_leaves_the_thread_clean(x):
    model = build()
    handle = memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"}, adapter=TOY)
    hook = interrupt_in(model.blocks[0].ff_out)
    with pytest.raises(KeyboardInterrupt):
        step(model, x)
    hook.remove()
    handle.remove()
    linear = torch.nn.Linear(4, 4)
    linear(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert linear.weight.grad is not None
