"""Weight streaming on CPU: which blocks stream, the plan around them, exact gradients, restore, host memory,
refusals.

On CPU the "device" is the CPU: uploads are synchronous CPU copies, the host masters pageable CPU buffers. The
logic (placeholders, uploads ahead of need, recompute, state_dict, remove) is the GPU's; the stream ordering is
checked over recording streams (``test_every_use_of_an_upload_waits_for_its_copy``).
"""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import memfit
import memfit.controller
from memfit import BlockPolicy, ConfigError, HostMemoryError, MemfitError, MemfitWarning, NotAvailableError
from memfit.engine import state
from memfit.offload import weights as weights_mod
from memfit.offload.streamable import choose_streamed_blocks, frozen_block_bytes
from memfit.offload.weights import WeightStreamer
from memfit.plan import RegionPlan
from memfit_conformance.base import cpu_copy_engine
from memfit_conformance.streams import RecordingEvent, RecordingStreams

from helpers import assert_same, frozen_toy, loss_of, step, streamed_uploads
from toy import TOY, build

ON = {"gradient_checkpointing": True}
KEY = "gradient_checkpointing_stream_blocks"


def apply(model, config, **kw):
    cfg = memfit.MemfitConfig.from_dict(config)
    if cfg.offload_attention or (cfg.enabled and cfg.backend.offloads_inputs):
        kw |= {"copy_engine": cpu_copy_engine(), "min_offload_bytes": 0}
    return memfit.apply(model, config, adapter=kw.pop("adapter", TOY), **kw)


def streamer_of(handle) -> WeightStreamer:
    streamer = handle._controller.installation.streamer
    assert streamer is not None
    return streamer


# -- which blocks -----------------------------------------------------------------------------------------------


def test_a_count_spreads_the_blocks_over_the_call_order():
    sizes = [(i, 100) for i in range(12)]
    assert choose_streamed_blocks(sizes, count=3) == [2, 6, 10]
    assert choose_streamed_blocks(sizes, count=1) == [6]
    assert choose_streamed_blocks(sizes, count=12) == list(range(12))
    assert choose_streamed_blocks(sizes, count=0) == []


def test_larger_blocks_are_chosen_in_proportion_to_their_bytes():
    # Flux-like: 4 blocks of 240 then 8 of 100 (double- then single-stream); bytes 960 + 800
    sizes = [(("double", i), 240) for i in range(4)] + [(("single", i), 100) for i in range(8)]
    chosen = choose_streamed_blocks(sizes, count=4)
    # one chosen block per quarter of the bytes: two in each list, since the double blocks hold about half
    assert [k[0] for k in chosen].count("double") == 2
    assert len(set(chosen)) == 4


def test_a_size_streams_the_fewest_spread_blocks_that_reach_it():
    sizes = [(i, 100) for i in range(10)]
    assert choose_streamed_blocks(sizes, min_bytes=250) == [1, 5, 8]
    assert choose_streamed_blocks(sizes, min_bytes=1000) == list(range(10))


def test_blocks_without_frozen_bytes_are_never_chosen():
    sizes = [(0, 0), (1, 50), (2, 0), (3, 50)]
    assert choose_streamed_blocks(sizes, count=2) == [1, 3]
    with pytest.raises(ValueError, match="2 have frozen weights"):
        choose_streamed_blocks(sizes, count=3)
    with pytest.raises(ValueError, match="100 B in all"):
        choose_streamed_blocks(sizes, min_bytes=101)


def test_frozen_block_bytes_counts_frozen_floating_weights_only():
    block = frozen_toy().blocks[0]
    linears = sum(p.numel() * 4 for m in (block.attn, block.ff_in, block.ff_out) for p in m.parameters())
    assert frozen_block_bytes(block) == linears  # the LayerNorms train


# -- the plan ---------------------------------------------------------------------------------------------------


def test_streamed_blocks_are_recomputed_alone_and_the_chunks_cut_around_them():
    model = frozen_toy(blocks=8)
    cfg = memfit.MemfitConfig.from_dict({**ON, "gradient_checkpointing_interval": 4, KEY: 2})
    plan = RegionPlan.from_config(cfg, {"blocks": model.blocks})
    streamed = [b.index for b in plan.streamed]
    assert streamed == [2, 6]
    chunks = {(b.index): (b.chunk_start, b.chunk_position, b.chunk_length) for b in plan.blocks}
    assert all(b.policy is BlockPolicy.BLOCK for b in plan.blocks)
    assert chunks == {
        0: (0, 0, 2),
        1: (0, 1, 2),
        2: (2, 0, 1),
        3: (3, 0, 1),
        4: (4, 0, 2),
        5: (4, 1, 2),
        6: (6, 0, 1),
        7: (7, 0, 1),
    }


@pytest.mark.parametrize(
    ("backend", "streamed_policy", "rest"),
    [
        ("unsloth", BlockPolicy.BLOCK_OFFLOAD, BlockPolicy.BLOCK_OFFLOAD),
        ("torch-ffn", BlockPolicy.BLOCK, BlockPolicy.FFN),
        ("unsloth-ffn", BlockPolicy.BLOCK_OFFLOAD, BlockPolicy.FFN_OFFLOAD),
    ],
)
def test_streamed_blocks_take_the_backends_whole_block_policy(backend, streamed_policy, rest):
    model = frozen_toy()
    cfg = memfit.MemfitConfig.from_dict({**ON, "gradient_checkpointing_backend": backend, KEY: 2})
    plan = RegionPlan.from_config(cfg, {"blocks": model.blocks})
    assert {b.policy for b in plan.streamed} == {streamed_policy}
    assert {b.policy for b in plan.blocks if not b.stream_weights} == {rest}


def test_a_streamed_block_in_a_stride_gap_is_still_recomputed():
    model = frozen_toy(blocks=8)
    cfg = memfit.MemfitConfig.from_dict({**ON, "gradient_checkpointing_segment_stride": 4, KEY: 2})
    plan = RegionPlan.from_config(cfg, {"blocks": model.blocks})
    policies = {b.index: b.policy for b in plan.blocks}
    assert [b.index for b in plan.streamed] == [2, 6]  # both in the gaps of stride 4
    assert policies == {
        0: "block",
        1: "keep",
        2: "block",
        3: "keep",
        4: "block",
        5: "keep",
        6: "block",
        7: "keep",
    }


def test_a_size_knob_streams_enough_blocks():
    model = frozen_toy()
    per_block = frozen_block_bytes(model.blocks[0])
    cfg = memfit.MemfitConfig.from_dict({**ON, KEY: str(2 * per_block + 1)})  # a count: digits only
    assert cfg.stream_blocks == 2 * per_block + 1
    cfg = memfit.MemfitConfig.from_dict({**ON, KEY: f"{(2 * per_block + 1) / 1024}KiB"})
    plan = RegionPlan.from_config(cfg, {"blocks": model.blocks})
    assert len(plan.streamed) == 3


@pytest.mark.parametrize(
    ("value", "message"),
    [(7, "6 have frozen weights"), ("1GiB", "1.00 GiB asked")],
)
def test_more_than_the_model_has_is_an_error_naming_what_it_has(value, message):
    with pytest.raises(ConfigError, match=message) as err:
        apply(frozen_toy(), {**ON, KEY: value})
    assert "At most 6 blocks" in str(err.value)


def test_a_model_whose_blocks_train_every_weight_is_refused():
    with pytest.raises(ConfigError, match="no frozen weights to stream") as err:
        apply(build(), {**ON, KEY: 2})
    assert "requires_grad_(False)" in str(err.value)


@pytest.mark.parametrize("value", [-1, True, 2.5, "abc", "0GiB", "-3", "²", [2]])
def test_bad_knob_values_name_the_key(value):
    with pytest.raises(ConfigError, match=f"{KEY} must be a number of blocks"):
        memfit.MemfitConfig.from_dict({**ON, KEY: value})


def test_knob_relations():
    assert memfit.MemfitConfig.from_dict({**ON, KEY: None}).stream_blocks is None
    assert (
        memfit.MemfitConfig.from_dict({KEY: 0}).stream_blocks == 0
    )  # nothing to stream: fine with checkpointing off
    # checkpointing off: a trainer config is read whatever its other keys hold (nothing is installed)
    assert memfit.MemfitConfig.from_dict({KEY: 2}).stream_blocks == 2
    with pytest.raises(ConfigError, match="'auto' plans every block itself"):
        memfit.MemfitConfig.from_dict({**ON, "gradient_checkpointing_backend": "auto", KEY: "4GiB"})
    cfg = memfit.MemfitConfig.from_dict({**ON, KEY: " 8GiB "})
    assert cfg.to_dict()[KEY] == "8GiB" and memfit.MemfitConfig.from_dict(cfg.to_dict()) == cfg
    assert KEY not in memfit.MemfitConfig.from_dict(ON).to_dict()  # unset: left out, like the budget


# -- exact gradients --------------------------------------------------------------------------------------------

CONFIGS = {
    "torch": {**ON, KEY: 2},
    "torch-all": {**ON, KEY: 6},
    "torch-i2-rest": {**ON, "gradient_checkpointing_interval": 2, KEY: 2},
    "torch-i2-s3": {
        **ON,
        "gradient_checkpointing_interval": 2,
        "gradient_checkpointing_segment_stride": 3,
        KEY: 2,
    },
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 3},
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn", KEY: 2},
    "unsloth-ffn": {**ON, "gradient_checkpointing_backend": "unsloth-ffn", KEY: 2},
    "torch-ffn+attn": {
        **ON,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_offload_attention": True,
        KEY: 2,
    },
    "size": {**ON, KEY: "40KiB"},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_gradients_and_outputs_bitwise(name, x):
    model = frozen_toy()
    ref = step(model, x)
    with apply(model, CONFIGS[name]) as handle:
        for _ in range(2):  # the second step runs on the uploads issued ahead by the first
            assert_same(ref, step(model, x))
        stats = handle.stats()
        kept_first = int(streamer_of(handle).blocks[0].module is model.blocks[0])
        assert streamer_of(handle).keep_first == kept_first  # the fixed knob's turnaround rule
    streamed = stats["streamed_blocks"]
    assert streamed >= 2 and stats["resident_blocks"] == 6 - streamed
    # none on demand; fewer than two per block and step at the turnarounds (see streamed_uploads)
    assert stats["weight_uploads_kept"] == 2 * (1 + kept_first)  # the last kept one waits for a third step
    uploads = streamed_uploads(2, streamed, kept_first=kept_first)
    assert stats["weight_uploads"] == uploads and stats["weight_uploads_on_demand"] == 0
    assert stats["weight_bytes_uploaded"] == uploads * frozen_block_bytes(model.blocks[0])
    assert stats["weight_held_after_forward"] == 0
    assert stats["weight_uploads_alive_max"] <= 2


def test_validation_forward_streams_too_and_keeps_nothing(x):
    model = frozen_toy()
    with torch.no_grad():
        ref = model(x)
    with apply(model, CONFIGS["torch"]) as handle, torch.no_grad():
        assert torch.equal(model(x), ref)
        streamer = streamer_of(handle)
        gc.collect()
        assert (
            streamer.alive() == []
        )  # no backward follows a forward without gradients: nothing uploaded for it
        assert handle.stats()["weight_uploads"] == 2


# -- not resident between forward and recompute ----------------------------------------------------------------


def _weights_on_device(streamer: WeightStreamer) -> int:
    """Bytes the streamed parameters point at now (a placeholder: one element)."""
    return sum(w.param.untyped_storage().nbytes() for b in streamer.blocks for w in b.weights)


def test_weights_are_not_resident_between_forward_and_recompute(x):
    model = frozen_toy()
    with apply(model, {**ON, KEY: 3}) as handle:
        streamer = streamer_of(handle)
        names = [b.name for b in streamer.blocks]
        seen: list[tuple[str, list[str]]] = []

        def watch(module, args):  # after memfit's pre-hook: which uploads are alive while each block runs
            gc.collect()
            seen.append((names[[b.module for b in streamer.blocks].index(module)], streamer.alive()))

        hooks = [b.module.register_forward_pre_hook(watch) for b in streamer.blocks]
        loss = model(x.clone().requires_grad_(True)).pow(2).mean()
        gc.collect()
        # the forward returned: every streamed parameter is a placeholder, and the only upload alive is the last
        # streamed block's, issued for the backward that starts with it
        assert _weights_on_device(streamer) == sum(
            w.dtype.itemsize for b in streamer.blocks for w in b.weights
        )
        assert streamer.alive() == [names[-1]]
        loss.backward()
        for h in hooks:
            h.remove()
        gc.collect()
        assert streamer.alive() == []  # backward used each upload and let it go
    forward, backward = seen[:3], seen[3:]
    # forward: the running block and the next one ahead; backward: the recomputing one and the previous one
    assert forward == [
        (names[0], [names[1], names[0]]),
        (names[1], [names[2], names[1]]),
        (names[2], [names[2]]),
    ]
    assert backward == [
        (names[2], [names[1], names[2]]),
        (names[1], [names[0], names[1]]),
        (names[0], [names[0]]),
    ]


def test_the_first_blocks_upload_waits_for_the_next_step_when_the_plan_starts_with_it(x):
    model = frozen_toy()
    ref = step(model, x)
    with apply(model, {**ON, KEY: 4}) as handle:
        streamer = streamer_of(handle)
        assert streamer.blocks[0].module is model.blocks[0] and streamer.keep_first
        assert_same(ref, step(model, x))
        gc.collect()
        first = streamer.blocks[0].name
        assert streamer.alive() == [first]  # kept from its recompute for the next forward
        uploads = handle.stats()["weight_uploads"]
        assert_same(ref, step(model, x))
        # the second step made one upload fewer than the first: the first block's forward used the kept one
        assert handle.stats()["weight_uploads"] - uploads == uploads - 1
        with torch.no_grad():  # a validation forward uses it too, and keeps nothing after it
            model(x)
        gc.collect()
        assert streamer.alive() == []
    assert all(not state.is_streamed(p) for p in model.parameters())
    assert_same(ref, step(model, x))  # remove() dropped it with the rest


def test_no_upload_is_kept_between_steps_when_a_block_runs_before_the_first_streamed_one(x):
    model = frozen_toy()
    with apply(model, {**ON, KEY: 3}) as handle:
        streamer = streamer_of(handle)
        assert streamer.blocks[0].module is not model.blocks[0] and not streamer.keep_first
        step(model, x)
        gc.collect()
        assert streamer.alive() == []  # block 0's backward would hold it otherwise


def test_a_streamer_keeps_the_first_uploads_it_is_told_to_for_the_next_forward(x):
    """``keep_first`` = 2 with block 0 resident: the first two streamed blocks run the next step's forward on the
    uploads of their recompute, held between steps; validation uses them and keeps nothing."""
    model = frozen_toy()
    ref = step(model, x)
    with apply(model, {**ON, KEY: 3}) as handle:
        streamer = streamer_of(handle)
        assert streamer.blocks[0].module is not model.blocks[0] and streamer.keep_first == 0
        streamer.keep_first = 2
        names = [b.name for b in streamer.blocks]
        assert_same(ref, step(model, x))
        gc.collect()
        assert sorted(streamer.alive()) == sorted(names[:2])  # kept from their recompute
        first = handle.stats()
        assert_same(ref, step(model, x))
        second = handle.stats()
        # the second step uploaded two fewer than the first (six less the last block's turnaround)
        assert (first["weight_uploads"], second["weight_uploads"] - first["weight_uploads"]) == (5, 3)
        assert second["weight_uploads_kept"] - first["weight_uploads_kept"] == 3  # the last block's, and two
        assert second["weight_uploads_on_demand"] == 0
        with torch.no_grad():
            model(x)
        gc.collect()
        assert streamer.alive() == []
    assert_same(ref, step(model, x))


def test_a_streamer_refuses_leads_and_kept_counts_out_of_range():
    model = frozen_toy()
    blocks = [("blocks.2", model.blocks[2])]
    with pytest.raises(ValueError, match="1 or more, not 0 and 1"):
        WeightStreamer(model, blocks, ahead=0, forward_ahead=1)
    with pytest.raises(ValueError, match="0 or more, not -1"):
        WeightStreamer(model, blocks, keep_first=-1)


def test_a_streamed_block_that_is_not_recomputed_is_reported(x):
    """The check behind ``weight_held_after_forward``: weights saved by autograd outside a recomputed region stay on
    the device until backward. (memfit's plans never do this; here a streamer is installed without regions.)"""
    model = frozen_toy()
    streamer = WeightStreamer(model, [("blocks.2", model.blocks[2])])
    streamer.install()
    streamer.begin_forward()
    out = model(x.clone().requires_grad_(True))
    with pytest.warns(MemfitWarning, match=r"blocks\.2 stayed on the device"):
        streamer.end_forward(failed=False)
    assert streamer.stats.held_after_forward == 1
    out.sum().backward()
    streamer.remove()


# -- ordering over recording streams ---------------------------------------------------------------------------


class _WeightStreams(RecordingStreams):
    def __init__(self) -> None:
        super().__init__(landed=False)  # events never complete by themselves: every wait must be there
        self._names = iter(["weights"])


def test_every_use_of_an_upload_waits_for_its_copy(monkeypatch, x):
    streams = _WeightStreams()
    monkeypatch.setattr(memfit.controller, "stream_api_for", lambda device: streams)
    model = frozen_toy()
    ref = step(model, x)
    with apply(model, {**ON, KEY: 3}) as handle:
        streamer = streamer_of(handle)
        used = []

        def check(module, args):  # runs after memfit's pre-hook: the block is about to compute on the upload
            upload = streamer.upload_of(module)
            assert upload is not None and upload.done.stream == "weights"
            assert upload.done.id in streams.waited.get("compute", set()), (
                "compute did not wait for the upload"
            )
            used.append(upload.done.id)

        hooks = [b.module.register_forward_pre_hook(check) for b in streamer.blocks]
        assert_same(ref, step(model, x))
        for h in hooks:
            h.remove()
        assert len(used) == 6  # three forwards and three recomputes, each checked
    # every copy: compute records an event after allocating the buffer, the upload stream waits for it, then copies
    log = streams.log
    uses = [i for i, entry in enumerate(log) if entry == ("use", "weights")]
    assert len(uses) == 5  # the last block's recompute runs on its forward's upload
    for i in uses:
        record, wait = log[i - 2], log[i - 1]
        assert record[:2] == ("record", "compute") and wait == ("wait", "weights", record[2])


def test_in_backward_a_blocks_upload_is_issued_before_the_reloads_its_backward_starts(monkeypatch, x):
    """Every block streams and parks its input (``unsloth``; the step's last two keep theirs). Block k-1's upload is
    issued as the first gradient reaches block k's output: before anything block k's backward issues, the reload of
    what block k-1 parked among it (an upload's copy starts where compute was when it was issued: the earlier, the
    more of the backward it hides behind)."""
    from memfit.offload.copy import (
        SyncCopyEngine,
    )  # the CPU engine (apply() here): CUDA's issues in the same order

    events, reloaded_ids, in_backward = [], set(), False
    issue, reload_many = WeightStreamer._issue, SyncCopyEngine.reload_many

    def issued(self, block):
        if in_backward:
            events.append(("upload", block.position))
        return issue(self, block)

    def reloaded(self, parked):
        new = {id(p) for p in parked} - reloaded_ids
        if in_backward and new:  # a region's input, brought back for the first time this backward
            reloaded_ids.update(new)
            events.append(("reload", None))
        return reload_many(self, parked)

    monkeypatch.setattr(WeightStreamer, "_issue", issued)
    monkeypatch.setattr(SyncCopyEngine, "reload_many", reloaded)
    model = frozen_toy()
    ref = step(model, x)
    with apply(model, {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 6}):
        step(model, x)  # the first step settles what the regions park
        model.zero_grad(set_to_none=True)
        inp = x.detach().clone().requires_grad_(True)
        loss = loss_of(model(inp))
        in_backward = True
        loss.backward()
        in_backward = False
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        assert_same(ref, (loss.detach(), inp.grad.clone(), grads))
    uploads = [events.index(("upload", k)) for k in (4, 3, 2, 1, 0)]  # the last block's recompute: no upload
    reloads = [at for at, (kind, _) in enumerate(events) if kind == "reload"]
    assert len(reloads) == 4  # blocks 3, 2, 1, 0 parked their inputs
    for block, at in zip((3, 2, 1, 0), reloads, strict=True):
        assert uploads[4 - block] < at, (block, events)


class _TimedWaits(_WeightStreams):
    """Uploads never land; the timing events of each wait (on the compute stream) complete, 1 ms apart."""

    def new_event(self, *, timing: bool = False):
        event = super().new_event()
        if timing:
            event.record = lambda stream: (
                RecordingEvent.record(event, stream),
                setattr(event, "done", stream.name == "compute"),
            )
            event.elapsed_time = lambda other: 1.0
        return event


def test_upload_waits_are_counted_by_phase(monkeypatch, x):
    """Three streamed blocks, recomputed: each forward waits for its upload, and backward for the recomputes of
    the first two (the last one's recompute runs on its forward's upload, waited for already)."""
    monkeypatch.setattr(memfit.controller, "stream_api_for", lambda device: _TimedWaits())
    model = frozen_toy()
    with apply(model, {**ON, KEY: 3}) as handle:
        step(model, x)
        stats = handle.stats()
    assert stats["weight_upload_wait_ms_backward"] == 2.0
    assert stats["weight_upload_wait_ms"] == 5.0


# -- host memory, refusals, misuse -----------------------------------------------------------------------------


def test_host_memory_is_checked_before_anything_is_copied(monkeypatch):
    model = frozen_toy()
    # a toy block's host buffer: its six tensors, each at a 512-byte boundary (10.5 KiB); room for two and a half
    room = int(2.5 * 10752)
    monkeypatch.setattr(weights_mod.hostmem, "available_host_bytes", lambda: room + (1 << 30))
    monkeypatch.setattr(weights_mod.hostmem, "default_host_reserve", lambda: 1 << 30)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(HostMemoryError, match=r"3 streamed block\(s\) need 31\.50 KiB of host memory") as err:
        apply(model, {**ON, KEY: 3})
    assert "Stream fewer blocks" in str(err.value)
    after = model.state_dict()  # nothing was touched
    assert all(torch.equal(after[k], before[k]) for k in before)
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
    with apply(model, {**ON, KEY: 2}):  # exactly what fits
        pass


def test_fsdp2_is_refused(monkeypatch):
    model = frozen_toy()
    monkeypatch.setattr(weights_mod, "is_fsdp_module", lambda m: m is model.blocks[0])
    with pytest.raises(NotAvailableError, match="does not work with FSDP2"):
        apply(model, {**ON, KEY: 2})


def test_fsdp_activation_checkpointing_on_the_model_is_refused():
    """FSDP's checkpoint wrapper turns memfit's checkpointing off (with its warning); streaming needs it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = frozen_toy()
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with (
        pytest.warns(MemfitWarning, match="FSDP activation checkpointing"),
        pytest.raises(ConfigError, match="remove FSDP's checkpoint wrapper"),
    ):
        apply(model, {**ON, KEY: 2})


class _QuantizedParameter(nn.Parameter):
    """A Parameter subclass standing for a quantized weight (bitsandbytes' Params4bit is one)."""


def test_a_tensor_subclass_weight_is_refused_by_name():
    model = frozen_toy()
    model.blocks[2].ff_in.weight = _QuantizedParameter(model.blocks[2].ff_in.weight.data, requires_grad=False)
    with pytest.raises(NotAvailableError, match=r"'ff_in\.weight' of ToyBlock is a _QuantizedParameter"):
        apply(model, {**ON, KEY: 2})


def test_tied_weights_stay_resident_and_tied(x):
    model = frozen_toy()
    model.blocks[2].ff_out.weight = model.blocks[3].ff_out.weight  # one Parameter in two blocks
    model.blocks[4].attn.weight = nn.Parameter(
        model.blocks[1].attn.weight.data, requires_grad=False
    )  # one storage
    ref = step(model, x)
    with apply(model, {**ON, KEY: 6}) as handle:
        streamer = streamer_of(handle)
        streamed = {id(w.param) for b in streamer.blocks for w in b.weights}
        for p in (model.blocks[3].ff_out.weight, model.blocks[1].attn.weight, model.blocks[4].attn.weight):
            assert id(p) not in streamed
        assert_same(ref, step(model, x))
    assert model.blocks[4].attn.weight.data_ptr() == model.blocks[1].attn.weight.data_ptr()


def test_loading_streamed_weights_is_refused_loading_trainable_ones_works():
    model = frozen_toy()
    with apply(model, {**ON, KEY: 2}):
        state = model.state_dict()
        with pytest.raises(MemfitError, match=r"would write blocks\.1\.\w+\.\w+.*handle\.remove\(\)"):
            model.load_state_dict(state)
        norms = {k: torch.full_like(v, 2.0) for k, v in state.items() if ".norm" in k}
        model.load_state_dict(norms, strict=False)
        assert torch.equal(model.blocks[1].norm1.weight, torch.full((16,), 2.0))


def test_a_streamed_weight_made_trainable_is_an_error(x):
    model = frozen_toy()
    with apply(model, {**ON, KEY: 2}):
        model.requires_grad_(True)
        with pytest.raises(MemfitError, match="requires grad now"):
            step(model, x)


def test_weights_replaced_while_streaming_is_an_error(x):
    model = frozen_toy()
    with apply(model, {**ON, KEY: 2}):
        model.double()
        with pytest.raises(MemfitError, match=r"data was replaced since memfit\.apply \(model\.to\(\)"):
            step(model, x.double())
        model.float()


def test_remove_restores_exactly_and_apply_again_works(x):
    model = frozen_toy()
    params = dict(model.named_parameters())
    values = {n: p.detach().clone() for n, p in params.items()}
    ref = step(model, x)
    for _ in range(2):
        handle = apply(model, {**ON, "gradient_checkpointing_backend": "unsloth", KEY: 4})
        step(model, x)
        handle.remove()
        assert dict(model.named_parameters()) == params
        assert all(torch.equal(p, values[n]) and p.is_contiguous() for n, p in params.items())
        assert_same(ref, step(model, x))


def test_stats_reset(x):
    model = frozen_toy()
    with apply(model, CONFIGS["torch"]) as handle:
        step(model, x)
        handle.reset_stats()
        assert handle.stats()["weight_uploads"] == 0
        step(model, x)
        assert (
            handle.stats()["weight_uploads"] == 3
        )  # two blocks, the last one's recompute on its forward's upload
    without = apply(model, ON).stats()
    assert (
        without["streamed_blocks"] == 0 and without["resident_blocks"] == 6 and without["weight_uploads"] == 0
    )


def test_a_deep_copy_is_an_ordinary_model_of_placeholders(x):
    """copy.deepcopy of a streaming model (an EMA copy) copies the placeholders: its outputs are NaN, never
    plausible numbers; the original keeps working."""
    model = frozen_toy()
    with apply(model, CONFIGS["torch"]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = copy.deepcopy(model)
        assert torch.isnan(twin(x)).all()
        assert torch.isfinite(step(model, x)[0])
