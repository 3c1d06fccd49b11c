"""Helpers shared by the core tests: one training step on the toy stack, bitwise comparison of two, an ``auto``
plan forced, and the offload configurations whose failed steps are checked."""

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from memfit.auto import BlockPolicy
from memfit.offload.copy import StreamApi

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


def family_step(model, batch, adapter):
    """One step of a family's model on its preset's ``batch``: the adapter's loss and every gradient, cleared
    after (so the next step starts from none)."""
    model.zero_grad(set_to_none=True)
    loss = adapter.loss(model(**batch))
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_same_family_step(got, ref):
    """Two :func:`family_step` results are bitwise equal: the loss, and the same (non-empty) set of gradients."""
    assert torch.equal(got[0], ref[0])
    assert got[1].keys() == ref[1].keys() and ref[1]
    for name in ref[1]:
        assert torch.equal(got[1][name], ref[1][name]), name


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


def streamed_uploads(steps: int, streamed: int, *, kept_first: int) -> int:
    """Uploads ``steps`` training steps make with ``streamed`` blocks streaming: one per block for its forward and
    one for its recompute, less the turnarounds' (each step's last block recomputes on its forward's upload; each
    later step's forward runs the first ``kept_first`` streamed blocks on their previous recompute's uploads)."""
    return steps * 2 * streamed - steps - (steps - 1) * kept_first


def auto_config(budget: int | str, **extra) -> dict:
    """The config of ``auto`` at ``budget`` (and ``extra`` keys)."""
    return {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_memory_budget": budget,
        **extra,
    }


def force_auto_plan(
    monkeypatch,
    choose: Callable[[list[str]], Sequence[BlockPolicy]],
    stream: Callable[[list[str]], Sequence[str]] = lambda names: (),
    copies_in_flight: int = 0,
    reload_equal_ahead: bool = False,
) -> None:
    """``auto`` plans the policies ``choose`` gives for its blocks' names, whatever the budget (it still profiles
    the model and runs its closed loop): a plan the planner would not pick at a test's size, copies on CPU. The
    blocks ``stream`` names stream their weights (a GPU's plan: on CPU ``auto`` never streams); ``copies_in_flight``
    is the plan's copy queue (:attr:`memfit.auto.planner.Plan.copies_in_flight_bytes`), ``reload_equal_ahead`` its
    reloads ahead (:attr:`memfit.auto.planner.Plan.reload_equal_ahead`: on CPU ``auto`` never reloads ahead)."""
    from memfit.auto import budget_planner
    from memfit.auto.planner import Plan

    def forced(profile, budget, *, allowed, streamed=None, memo=None, copy_reserve=0.0):
        names = [b.name for b in profile.blocks]
        return Plan(
            blocks=tuple(zip(names, choose(names), strict=True)),
            budget_bytes=budget,
            predicted_peak_bytes=0,
            predicted_extra_seconds=0.0,
            no_checkpoint_peak_bytes=0,
            smallest_peak_bytes=0,
            copied_bytes=1,
            metric="held activations",
            streamed=tuple(stream(names)),
            copies_in_flight_bytes=copies_in_flight,
            reload_equal_ahead=reload_equal_ahead,
        )

    monkeypatch.setattr(budget_planner, "plan_policies", forced)


# Every policy ``auto`` may give a streamed block (memfit.offload.weights, "Saved weights"), cycled over the blocks
STREAMED_POLICIES = (
    BlockPolicy.KEEP,
    BlockPolicy.PARK,
    BlockPolicy.FFN,
    BlockPolicy.ATTENTION_OFFLOAD,
    BlockPolicy.FFN_ATTENTION_OFFLOAD,
    BlockPolicy.FFN_OFFLOAD,
    BlockPolicy.BLOCK_OFFLOAD,
)


def every_streamed_policy(names: list[str]) -> list[BlockPolicy]:
    """:data:`STREAMED_POLICIES` cycled over ``names`` (the step's last two regions never park: kept instead)."""
    out = [STREAMED_POLICIES[i % len(STREAMED_POLICIES)] for i in range(len(names))]
    return [
        BlockPolicy.KEEP if p is BlockPolicy.PARK and i >= len(names) - 2 else p for i, p in enumerate(out)
    ]


# The policies of the ``auto`` plan whose out-of-memory forward kept its activations on an H200, cycled over the
# blocks (test_failed_steps, test_gpu_failed_steps)
AUTO_MIX = (
    BlockPolicy.FFN_ATTENTION_OFFLOAD,
    BlockPolicy.FFN_OFFLOAD,
    BlockPolicy.BLOCK_OFFLOAD,
    BlockPolicy.KEEP,
)


def auto_mix(names: list[str]) -> list[BlockPolicy]:
    return [AUTO_MIX[i % len(AUTO_MIX)] for i in range(len(names))]


ON = {"gradient_checkpointing": True}
# configurations that park activations in host memory, whose failed steps must leave nothing behind
FAILED_STEP_CONFIGS = {
    "attention-offload": {"gradient_checkpointing_offload_attention": True},
    "torch-ffn+attention": {
        **ON,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_offload_attention": True,
    },
    "unsloth-ffn+attention": {
        **ON,
        "gradient_checkpointing_backend": "unsloth-ffn",
        "gradient_checkpointing_offload_attention": True,
    },
    "unsloth-i2": {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 2},
    # (with :func:`force_auto_plan` and :func:`auto_mix`)
    "auto": {
        **ON,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_memory_budget": "100GiB",
    },
}


class DelayedCopies(StreamApi):
    """CUDA's streams, with a copy stream put to sleep before every batch of copies (GPU tests): a copy lands long
    after compute asked for it, so a missing wait reads a half-written buffer, or compute reuses memory a copy is
    still writing."""

    def __init__(self, cycles: int) -> None:
        self.cycles = cycles

    @contextlib.contextmanager
    def use(self, stream, *, restore):
        with super().use(stream, restore=restore):
            torch.cuda._sleep(self.cycles)
            yield
