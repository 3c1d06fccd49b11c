"""Early stop: a recompute replays only what backward still needs, and no gradient changes.

Counted, not assumed: ``calls_skipped_early_stop`` (whole calls not replayed), ``calls_cut_early_stop`` (calls
whose replay stopped after the last saved tensor still needed), and forward-hook counters on the modules that
must not run again.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import memfit
from memfit import BlockSpec, FamilyAdapter
from memfit.engine import frame
from memfit.engine.frame import CUT_TAIL_WEIGHTS
from memfit_conformance.base import cpu_copy_engine

from helpers import assert_same, step
from toy import TOY, ToyBlock, build

ON = {"gradient_checkpointing": True}


def count_calls(modules: list[tuple[str, nn.Module]]) -> tuple[Counter, list]:
    """Per name: entries (pre-hook) and completed calls (post-hook) of the named modules."""
    counts: Counter = Counter()
    handles = []
    for name, module in modules:
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: counts.update([n + ":entered"])))
        handles.append(module.register_forward_hook(lambda m, a, o, n=name: counts.update([n + ":returned"])))
    return counts, handles


def freeze_ff_out(model: nn.Module) -> None:
    """The FFN's last projection frozen (LoRA on the other linears only): its input is not saved."""
    for block in model.blocks:
        block.ff_out.requires_grad_(False)


def counted_step(model, x, config, *, offload=False):
    """One step with memfit, counting the calls of every block's ff_out and act."""
    counts, handles = count_calls([(n, getattr(b, n)) for b in model.blocks for n in ("ff_out", "act")])
    try:
        offload_kw = {"copy_engine": cpu_copy_engine(), "min_offload_bytes": 0} if offload else {}
        handle = memfit.apply(model, config, adapter=TOY, **offload_kw)
        with handle:
            result = step(model, x)
            stats = handle.stats()
    finally:
        for h in handles:
            h.remove()
    return result, stats, counts


def wide_input(dim: int) -> torch.Tensor:
    return torch.randn(2, 8, dim, generator=torch.Generator().manual_seed(1))


# Width 512: ff_out's weight has 512 x 2048 = CUT_TAIL_WEIGHTS elements, enough to cut a call short before it; at
# width 16 (the toy's default) cutting would cost more than the projection it skips.
WIDE = 512
assert WIDE * 4 * WIDE >= CUT_TAIL_WEIGHTS > 16 * 4 * 16


@pytest.mark.parametrize("offload", [False, True], ids=["torch-ffn", "unsloth-ffn"])
def test_trailing_frozen_projection_of_an_ffn_chain_is_skipped(x, offload):
    """The chain ff_in -> act -> ff_out with ff_out frozen: ff_out saves only its weight (kept, not recomputed),
    so each FFN recompute ends with act and never runs ff_out."""
    model = build()
    freeze_ff_out(model)
    ref = step(model, x)
    backend = "unsloth-ffn" if offload else "torch-ffn"
    got, stats, counts = counted_step(
        model, x, {**ON, "gradient_checkpointing_backend": backend}, offload=offload
    )
    assert_same(ref, got)
    frames = stats["frames"]
    assert frames == 6 and stats["recomputes"] == 6
    assert stats["calls_skipped_early_stop"] == frames  # ff_out, once per FFN region
    assert (
        stats["calls_cut_early_stop"] == 0
    )  # act is the last call needed, and nothing follows its saved input
    assert counts["ff_out:entered"] == 6  # forward only: never replayed
    assert counts["act:entered"] == 12 and counts["act:returned"] == 12


@pytest.mark.parametrize(("dim", "cut"), [(16, False), (WIDE, True)])
def test_trainable_trailing_projection_is_cut_after_its_input_when_large(dim, cut):
    """ff_out trainable saves its input, then its weight (kept): the replay of ff_out stops after the input when the
    matmul it skips is large, and runs to its end when it is not."""
    model = build(dim=dim, blocks=3)
    x = wide_input(dim)
    ref = step(model, x)
    got, stats, counts = counted_step(model, x, {**ON, "gradient_checkpointing_backend": "torch-ffn"})
    assert_same(ref, got)
    assert stats["calls_skipped_early_stop"] == 0
    assert stats["calls_cut_early_stop"] == (3 if cut else 0)
    assert counts["ff_out:entered"] == 6 and counts["ff_out:returned"] == (3 if cut else 6)
    assert counts["act:entered"] == 6 and counts["act:returned"] == 6


@pytest.mark.parametrize("interval", [1, 3])
@pytest.mark.parametrize("offload", [False, True], ids=["torch", "unsloth"])
def test_block_recompute_stops_inside_the_last_block(interval, offload):
    """Whole blocks (and a chunk of 3): the last block of each frame is replayed only up to its last saved tensor
    still needed (act's input, ff_out being frozen and large); the blocks before it run in full (their outputs
    feed it)."""
    model = build(dim=WIDE, blocks=3)
    freeze_ff_out(model)
    x = wide_input(WIDE)
    ref = step(model, x)
    backend = "unsloth" if offload else "torch"
    cfg = {**ON, "gradient_checkpointing_backend": backend, "gradient_checkpointing_interval": interval}
    got, stats, counts = counted_step(model, x, cfg, offload=offload)
    assert_same(ref, got)
    frames = 3 // interval
    assert stats["frames"] == stats["recomputes"] == frames
    assert stats["calls_skipped_early_stop"] == 0
    assert stats["calls_cut_early_stop"] == frames
    # forward: 3; recompute: every block but each frame's last reaches ff_out
    assert counts["ff_out:entered"] == 3 + (3 - frames)
    # act: entered by each replayed block, stopped (its input saved, its kernel not run) in each frame's last
    assert counts["act:entered"] == 6 and counts["act:returned"] == 6 - frames


def test_small_trailing_projection_is_not_worth_a_cut(x):
    """Width 16: what follows act's saved input (a 16 x 64 frozen projection) is cheaper than cutting the call."""
    model = build()
    freeze_ff_out(model)
    ref = step(model, x)
    got, stats, counts = counted_step(model, x, ON)
    assert_same(ref, got)
    assert stats["calls_cut_early_stop"] == stats["calls_skipped_early_stop"] == 0
    assert counts["ff_out:entered"] == counts["ff_out:returned"] == 12


def test_a_call_with_a_large_output_is_cut_though_no_large_weight_follows(x, monkeypatch):
    """The same width-16 blocks, their outputs counted as large: the passes over the output after act's saved input
    (the block's residual add) are worth a cut, as at a block's end at 4096 tokens, so each frame's replay stops
    there and ff_out is not run again."""
    monkeypatch.setattr(frame, "CUT_TAIL_OUTPUT", x.numel())  # a block's output: x's shape
    model = build()
    freeze_ff_out(model)
    ref = step(model, x)
    got, stats, counts = counted_step(model, x, ON)
    assert_same(ref, got)
    frames = stats["frames"]
    assert stats["calls_cut_early_stop"] == frames and stats["calls_skipped_early_stop"] == 0
    assert counts["ff_out:entered"] == frames  # the forward only
    assert counts["act:entered"] == 2 * frames and counts["act:returned"] == frames

    monkeypatch.setattr(frame, "CUT_TAIL_OUTPUT", x.numel() + 1)  # one element more: not large
    got, stats, counts = counted_step(model, x, ON)
    assert_same(ref, got)
    assert stats["calls_cut_early_stop"] == 0 and counts["ff_out:entered"] == 2 * frames


class FrozenHead(nn.Module):
    """A block that is only a frozen projection (no LoRA): it saves its weight, not its input."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.proj.requires_grad_(False)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class MixedStack(nn.Module):
    """Blocks, each group of three ending in a frozen projection block."""

    def __init__(self, dim: int = 16, groups: int = 2) -> None:
        super().__init__()
        self.proj_in = nn.Linear(dim, dim)
        layers: list[nn.Module] = []
        for _ in range(groups):
            layers += [ToyBlock(dim), ToyBlock(dim), FrozenHead(dim)]
        self.blocks = nn.ModuleList(layers)

    def forward(self, hidden_states: torch.Tensor, residuals=None) -> torch.Tensor:
        scale = torch.sigmoid(self.proj_in.bias.sum())
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            x = block(x, scale)
        return x


MIXED = FamilyAdapter(
    name="mixed",
    model_classes=("MixedStack",),
    block_lists=("blocks",),
    blocks={"ToyBlock": BlockSpec(), "FrozenHead": BlockSpec()},
    supports_interval=True,
)


def test_chunk_ending_in_a_frozen_projection_block_skips_it(x):
    """Interval 3: each chunk is (block, block, frozen projection). The projection saved only its weight, so no
    recompute replays it — the chunk's recompute ends inside the second block."""
    torch.manual_seed(0)
    model = MixedStack()
    ref = step(model, x)
    entered, handles = count_calls([("head", m) for m in model.blocks if isinstance(m, FrozenHead)])
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 3}, adapter=MIXED) as handle:
        got = step(model, x)
        stats = handle.stats()
    for h in handles:
        h.remove()
    assert_same(ref, got)
    assert stats["frames"] == stats["recomputes"] == 2
    assert stats["calls_skipped_early_stop"] == 2
    assert entered["head:entered"] == 2  # the forward's calls only


def test_retained_graph_replays_each_time_with_early_stop(x):
    model = build()
    freeze_ff_out(model)
    ref = step(model, x, retain=True, backwards=2)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"}, adapter=TOY) as handle:
        got = step(model, x, retain=True, backwards=2)
        stats = handle.stats()
    assert_same(ref, got)
    assert stats["recomputes"] == 12 and stats["calls_skipped_early_stop"] == 12


def test_model_code_that_swallows_the_stop_signal_stays_correct():
    """A module that catches every Exception around its body (the stop signal is one, as torch's) still gives
    the same gradients: the recompute keeps stopping at each later saved tensor."""

    class Swallowing(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                return self.inner(x)
            except Exception:
                return torch.tanh(x) * 2  # saves its output: ignored once the recompute stopped

    model = build(dim=WIDE, blocks=3)
    freeze_ff_out(model)
    for block in model.blocks:
        block.act = Swallowing(block.act)
    x = wide_input(WIDE)
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch"}, adapter=TOY) as handle:
        got = step(model, x)
        assert handle.stats()["calls_cut_early_stop"] == 3
    assert_same(ref, got)
