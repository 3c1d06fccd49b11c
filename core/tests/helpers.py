"""Helpers shared by the core tests: one training step on the toy stack, and bitwise comparison of two."""

import torch
from torch import nn

from toy import build, loss_of

# Flux's usual LoRA targets: every linear of its blocks, the FFN linears memfit hooks regions on included
FLUX_LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "proj_mlp",
    "proj_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]


def step(model, x, *, residuals=None, retain=False, backwards=1):
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    loss = loss_of(model(x, residuals))
    for i in range(backwards):
        loss.backward(retain_graph=retain and i < backwards - 1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), x.grad.clone(), grads


def assert_same(a, b):
    assert torch.equal(a[0], b[0])
    assert torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


def frozen_toy(blocks: int = 6, **kw) -> nn.Module:
    """The toy stack with frozen linears; the LayerNorms train (a LoRA stand-in: small trainable weights inside
    every block). ``kw`` go to ``toy.build`` (``dim``, ``device``)."""
    model = build(blocks=blocks, **kw)
    model.requires_grad_(False)
    for block in model.blocks:
        block.norm1.requires_grad_(True)
        block.norm2.requires_grad_(True)
    return model
