"""The offload backends' logic on CPU tensors (SyncCopyEngine): same gradients, parking, dedup, pool return.

The CUDA copy engine's stream and event ordering is checked on CPU with recording fakes
(``test_copy_engine_order``), its real streams and pinned memory by the GPU tests; everything above it —
which tensors are parked, shared, reloaded ahead and returned — is the same code here.
"""

from __future__ import annotations

import gc

import pytest
import torch

import memfit
from memfit import UnsupportedBoundaryError
from memfit.offload.copy import SyncCopyEngine
from memfit.offload.pool import PinnedBucketPool

from helpers import assert_same, force_auto_plan, step
from toy import TOY

ON = {"gradient_checkpointing": True}


def pageable(nbytes: int, pinned: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


def make_engine(**kw) -> SyncCopyEngine:
    return SyncCopyEngine(
        PinnedBucketPool(allocate=pageable, available_host_bytes=lambda: 1 << 40, host_reserve_bytes=0, **kw)
    )


def offload_apply(model, config, **kw):
    return memfit.apply(
        model,
        config,
        adapter=TOY,
        copy_engine=kw.pop("engine", None) or make_engine(),
        min_offload_bytes=kw.pop("min_offload_bytes", 0),
        **kw,
    )


CONFIGS = [
    {**ON, "gradient_checkpointing_backend": "unsloth"},
    {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_interval": 2},
    {
        **ON,
        "gradient_checkpointing_backend": "unsloth",
        "gradient_checkpointing_interval": 2,
        "gradient_checkpointing_segment_stride": 4,
    },
    {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_segment_stride": 2},
    {**ON, "gradient_checkpointing_backend": "unsloth-ffn"},
    {"gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "torch-ffn", "gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "torch", "gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True},
    {**ON, "gradient_checkpointing_backend": "unsloth-ffn", "gradient_checkpointing_offload_attention": True},
]


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: "+".join(f"{k.split('_')[-1]}={v}" for k, v in c.items())
)
def test_offload_modes_match_reference_and_return_buffers(model, x, config):
    ref = step(model, x)
    engine = make_engine()
    with offload_apply(model, config, engine=engine) as handle:
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    every_block_recomputed = config.get("gradient_checkpointing_backend") == "torch"
    # with every block recomputed, attention offload has nothing to do (never copy twice); the step's last two
    # regions keep their entries (interval 2 on six blocks has three frames; with stride 4 only two, but the
    # blocks the stride leaves out are regions of the step too)
    parks = not every_block_recomputed and (
        stats["frames"] > 2
        or "gradient_checkpointing_segment_stride" in config
        or "gradient_checkpointing_offload_attention" in config
    )
    assert (stats["bytes_offloaded"] > 0) == parks, stats
    gc.collect()
    assert engine.pool.stats().buffers_in_use == 0, "host buffers were not returned after backward"


def test_unsloth_parks_entries_and_holds_less_on_device(model, x):
    with memfit.apply(model, ON, adapter=TOY) as h:
        step(model, x)
        torch_stats = h.stats()
    with offload_apply(model, {**ON, "gradient_checkpointing_backend": "unsloth"}) as h:
        step(model, x)
        stats = h.stats()
    # Every entry is parked but the last two frames' (backward needs the last first and reloads the one before
    # it as that one's backward begins: a round trip would free nothing at the peak); the shared `scale` is
    # parked once and shared by the frames 2..4.
    assert stats["frames"] == torch_stats["frames"] == 6
    assert stats["dedup_hits"] == 3
    n, d = 2 * 8, 16
    assert stats["bytes_offloaded"] == 4 * n * d * 4 + 4
    assert stats["bytes_reloaded"] <= stats["bytes_offloaded"]


def test_attention_offload_does_nothing_inside_recomputed_regions(model, x):
    with offload_apply(model, {**ON, "gradient_checkpointing_offload_attention": True}) as h:
        step(model, x)
        assert h.stats()["attention_calls_offloaded"] == 0  # every block is recomputed: never copy twice
    with offload_apply(
        model,
        {**ON, "gradient_checkpointing_segment_stride": 3, "gradient_checkpointing_offload_attention": True},
    ) as h:
        step(model, x)
        stats = h.stats()
    assert (
        stats["attention_calls_offloaded"] == 4
    )  # blocks 1, 2, 4, 5 run normally: their attention is parked
    assert stats["attention_tensors_parked"] >= 4


def test_attention_offload_alone_parks_every_attention_call(model, x):
    with offload_apply(model, {"gradient_checkpointing_offload_attention": True}) as h:
        step(model, x)
        stats = h.stats()
    assert stats["frames"] == 0 and stats["attention_calls_offloaded"] == 6


def test_small_tensors_stay_on_the_device(model, x):
    with offload_apply(
        model, {**ON, "gradient_checkpointing_backend": "unsloth"}, min_offload_bytes=1 << 20
    ) as h:
        step(model, x)
        assert h.stats()["bytes_offloaded"] == 0


def test_steady_state_allocates_no_new_host_buffers(model):
    engine = make_engine()
    with offload_apply(
        model,
        {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True},
        engine=engine,
    ):
        shapes = [(2, 8, 16), (2, 12, 16)]  # alternating "aspect-ratio buckets"
        for i in range(6):
            if i == 2:
                first = engine.pool.stats().pinned_allocations + engine.pool.stats().misses
            step(model, torch.randn(*shapes[i % 2]))
            gc.collect()
        steady = engine.pool.stats()
    assert steady.pinned_allocations + steady.misses == first, "new host buffers in the steady state"
    assert steady.buffers_in_use == 0 and steady.hits > 0


def test_exception_mid_forward_returns_every_buffer(model, x):
    engine = make_engine()
    with offload_apply(
        model,
        {**ON, "gradient_checkpointing_backend": "unsloth", "gradient_checkpointing_offload_attention": True},
        engine=engine,
    ):
        model.blocks[4].fail = True
        with pytest.raises(RuntimeError, match="planted failure"):
            step(model, x)
        model.blocks[4].fail = False
        assert engine.pool.stats().buffers_in_use == 0
        ref_engine_ok = step(model, x)
    assert ref_engine_ok[0].isfinite()


def test_attention_offload_without_declared_attention_is_refused(model):
    import dataclasses

    no_attn = dataclasses.replace(
        TOY, blocks={"ToyBlock": dataclasses.replace(TOY.blocks["ToyBlock"], attention=())}
    )
    with pytest.raises(UnsupportedBoundaryError, match="attention regions"):
        memfit.apply(
            model,
            {"gradient_checkpointing_offload_attention": True},
            adapter=no_attn,
            copy_engine=make_engine(),
        )


def test_no_grad_parks_nothing(model, x):
    with (
        offload_apply(
            model,
            {
                **ON,
                "gradient_checkpointing_backend": "unsloth",
                "gradient_checkpointing_offload_attention": True,
            },
        ) as h,
        torch.no_grad(),
    ):
        model(x)
        assert h.stats()["bytes_offloaded"] == 0


def test_parked_tensors_come_back_with_their_strides():
    engine = make_engine()
    for make in (
        lambda: torch.randn(2, 5, 3, 4),
        lambda: torch.randn(3, 4, 5).transpose(0, 2),
        lambda: torch.randn(2, 3, 4, 5).permute(0, 2, 3, 1),
    ):
        t = make()
        expected_stride, expected = t.stride(), t.clone()
        parked = engine.offload(t)
        del t  # drop the source: the reload must come from host memory
        back = engine.fetch(parked)
        assert back.stride() == expected_stride and torch.equal(back, expected)
    gappy = torch.randn(4, 6)[:, ::2]  # not dense: comes back contiguous, same values
    expected = gappy.clone()
    parked = engine.offload(gappy)
    del gappy
    back = engine.fetch(parked)
    assert back.is_contiguous() and torch.equal(back, expected)


def test_views_of_the_same_data_are_parked_once():
    """Autograd saves a fresh view object per op (a LoRA input reshaped for q, k and v): one copy serves all,
    while different data (another slice, or the same view after an in-place change) is copied again."""
    from memfit.offload.session import OffloadSession

    engine = make_engine()
    session = OffloadSession(engine, torch.nn.Linear(1, 1), min_offload_bytes=0)
    session.new_step()
    x = torch.randn(2, 8, 16)
    q_in, k_in, v_in = x.view(-1, 16), x.view(-1, 16), x.view(-1, 16)
    first = session.park_many([q_in, k_in])  # one batch: one copy
    later = session.park(v_in)  # a later region: shared, not copied
    assert first[0] is first[1] is later and later.users == 3
    assert engine.stats.bytes_offloaded == x.numel() * 4 and engine.stats.dedup_hits == 2
    session.park(x[1:].reshape(-1, 16))  # other data of the same storage
    assert engine.stats.bytes_offloaded == x.numel() * 4 + 8 * 16 * 4
    x.mul_(2)  # same view, new contents
    again = session.park(x.view(-1, 16))
    assert again is not later and engine.stats.bytes_offloaded == 2 * x.numel() * 4 + 8 * 16 * 4
    for parked in (later, again):
        assert torch.equal(engine.fetch(parked), x.view(-1, 16) if parked is again else x.view(-1, 16) / 2)


def test_parameters_are_listed_once_and_relisted_when_one_is_registered(model, x):
    """The never-park set is built from a cached list of the model's tensors (walking every module each step
    is slow on big models); registering a parameter anywhere (PEFT adding an adapter) drops the list, and
    remove() takes the global registration hooks away again."""
    from torch.nn.modules import module as module_mod

    hooks_before = len(module_mod._global_parameter_registration_hooks)
    with offload_apply(model, {**ON, "gradient_checkpointing_backend": "unsloth"}) as handle:
        session = handle.session
        step(model, x)
        listed = session.static_tensors
        assert listed is not None and len(module_mod._global_parameter_registration_hooks) == hooks_before + 1
        step(model, x)
        assert session.static_tensors is listed  # not walked again
        model.blocks[0].extra = torch.nn.Parameter(torch.zeros(4))
        assert session.static_tensors is None
        step(model, x)
        assert any(t is model.blocks[0].extra for t in session.static_tensors)
    assert len(module_mod._global_parameter_registration_hooks) == hooks_before


def test_only_parameters_big_enough_to_matter_are_reread_every_step():
    """A tensor below ``min_offload_bytes`` is never parked, so a parameter whose storage is smaller (a LoRA
    weight, a bias) cannot share a storage with one that is: only the big ones are re-read each step. A view of a
    big parameter saved for backward is still refused."""
    from memfit.offload.session import OffloadSession

    model = torch.nn.Sequential(torch.nn.Linear(1024, 512, bias=False), torch.nn.Linear(4, 4))  # 2 MiB, 80 B
    model.register_buffer("table", torch.zeros(64, 1024))  # 256 KiB: within the 8x margin below 1 MiB
    session = OffloadSession(make_engine(), model, min_offload_bytes=1 << 20)
    session.new_step()
    assert not session.worth_parking(model[0].weight.t())
    assert {id(t) for t in session.static_tensors} == {id(model[0].weight), id(model.table)}
    assert session.worth_parking(torch.randn(512, 1024))


def test_the_parameters_are_read_when_the_step_first_parks_not_as_it_starts(monkeypatch):
    """At a forward's start nothing is queued on the device, so host work there is time the device waits: the
    step's parameter storages are read at its first ``worth_parking``, once; a parameter registered after the step
    began (a model that registers one inside its forward) is read with them."""
    from memfit.offload.session import OffloadSession

    model = torch.nn.Sequential(torch.nn.Linear(1024, 512, bias=False))
    session = OffloadSession(make_engine(), model, min_offload_bytes=1 << 20)
    reads = []
    read = session._read_param_storages
    monkeypatch.setattr(session, "_read_param_storages", lambda: reads.append(1) or read())
    session.new_step()
    assert reads == []
    model.late = torch.nn.Parameter(torch.zeros(512, 1024))  # registered after the step began
    assert not session.worth_parking(model.late.t())
    assert not session.worth_parking(model[0].weight)
    assert session.worth_parking(torch.randn(512, 1024))
    assert reads == [1]
    session.new_step()
    assert session.worth_parking(torch.randn(512, 1024)) and reads == [1, 1]


def test_a_model_dropped_without_remove_is_not_kept_alive_by_the_registration_hooks(x):
    import weakref

    from torch.nn.modules import module as module_mod

    from toy import build

    hooks_before = len(module_mod._global_parameter_registration_hooks)
    model = build()
    handle = offload_apply(model, {**ON, "gradient_checkpointing_backend": "unsloth"})
    step(model, x)
    assert len(module_mod._global_parameter_registration_hooks) == hooks_before + 1
    alive = weakref.ref(model)
    del model, handle
    gc.collect()
    assert alive() is None
    assert len(module_mod._global_parameter_registration_hooks) == hooks_before


class _ReloadLog(SyncCopyEngine):
    """Records every reload attempt in order with the regions' backward starts: ``reload`` (copied back) or
    ``alive`` (nothing to copy: the tensor is still on its device, another op keeps it)."""

    def __init__(self) -> None:
        super().__init__(make_engine().pool)
        self.events: list[tuple[str, int]] = []

    def reload(self, parked) -> None:
        if parked.reloaded is None:
            self.events.append(("alive" if parked.alive_source() is not None else "reload", id(parked)))
        super().reload(parked)


def _log_backward_reloads(monkeypatch, model, adapter, batch, loss_fn, backend, *, config=None):
    """Run one step; return the regions' parked bytes (forward order) and, in backward order, each region's
    backward start (``start``) and each reload attempt of a parked tensor (``reload``/``alive``) with its region.
    ``config`` replaces the backend's (attention offload: a region's backward starts at its first unpack)."""
    from memfit.offload.regions import TimelineRegion

    engine = _ReloadLog()
    real_backward_starts = TimelineRegion.backward_starts

    def backward_starts(self):  # a region's backward starts: logged before it reloads anything
        engine.events.append(("start", self.index))
        real_backward_starts(self)

    monkeypatch.setattr(TimelineRegion, "backward_starts", backward_starts)
    config = config if config is not None else {**ON, "gradient_checkpointing_backend": backend}
    with memfit.apply(model, config, adapter=adapter, copy_engine=engine, min_offload_bytes=0) as handle:
        loss = loss_fn(model(**batch))
        regions = [ref() for ref in handle.session.snapshot_timeline()]
        # (a region nothing holds any more parked nothing; backward empties the lists)
        region_of = {
            id(p): i for i, region in enumerate(regions) if region is not None for p in region.parked
        }
        sizes = [sum(p.nbytes for p in region.parked) if region is not None else 0 for region in regions]
        engine.events.clear()
        loss.backward()
    started = {i: n for n, (kind, i) in enumerate(engine.events) if kind == "start"}
    attempts = [(n, kind, region_of[pid]) for n, (kind, pid) in enumerate(engine.events) if kind != "start"]
    assert any(kind == "reload" for _, kind, _ in attempts)
    for n, kind, r in attempts:
        assert kind == "alive" or r not in started or n < started[r], f"region {r} reloaded on demand"
    first = {r: min(n for n, _, of in attempts if of == r) for r in {of for _, _, of in attempts}}
    return sizes, started, first


@pytest.mark.parametrize("backend", ["unsloth", "unsloth-ffn"])
def test_a_region_after_a_smaller_one_is_reloaded_two_regions_ahead(monkeypatch, backend):
    """Reload ahead of need, early enough: a region whose next one in backward is smaller (a Flux double
    block's text-stream FFN, 512 tokens, runs just before the image FFN in backward, far too briefly to hide a
    reload of the image FFN's input) is reloaded before that smaller region's backward begins."""
    flux = pytest.importorskip("memfit_flux").ADAPTER
    torch.manual_seed(0)
    model = flux.presets["tiny"].build(dtype=torch.float32, device="cpu")
    batch = flux.presets["tiny"].inputs(model, tokens=64, generator=torch.Generator().manual_seed(1))
    sizes, started, first = _log_backward_reloads(monkeypatch, model, flux, batch, flux.loss, backend)
    checked = 0
    for r in first:
        if r + 1 in started and 0 < sizes[r + 1] < sizes[r] and r + 2 in started:
            assert first[r] < started[r + 1], f"region {r} was first reloaded after region {r + 1} began"
            checked += 1
    assert checked or backend == "unsloth"  # unsloth-ffn has the small text-stream FFNs


def test_on_equal_regions_one_region_is_reloaded_ahead(monkeypatch):
    """Equal regions reload one ahead, not two: a second region reloaded early would sit on the device at the
    backward peak (issue 3's peak target: ``unsloth`` ≤ ``torch`` − 0.9 × the bytes offloaded)."""
    from toy import build, inputs

    model = build(blocks=6, dim=16)
    batch = inputs(model, tokens=8, generator=torch.Generator().manual_seed(1))
    sizes, started, first = _log_backward_reloads(
        monkeypatch, model, TOY, batch, lambda out: out.square().mean(), "unsloth"
    )
    assert len(set(s for s in sizes if s)) == 1 and len(first) >= 4
    for r in first:
        if r + 1 in started:
            assert started[r + 1] < first[r] < started[r], (
                f"region {r} was not reloaded exactly one region ahead"
            )


def test_a_plan_asking_for_it_reloads_equal_regions_two_ahead(monkeypatch):
    """``auto``'s plan may reload equal regions two ahead (where its backward then waits less and the peak fits):
    installed, each parked block is reloaded as the backward of the block two after it starts, and the gradients
    do not change."""
    from memfit.auto import BlockPolicy

    from toy import build, inputs

    force_auto_plan(monkeypatch, lambda names: [BlockPolicy.PARK] * len(names), reload_equal_ahead=True)
    model = build(blocks=6, dim=16)
    batch = inputs(model, tokens=8, generator=torch.Generator().manual_seed(1))
    model(**batch).square().mean().backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    config = {**ON, "gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": "1GiB"}
    sizes, started, first = _log_backward_reloads(
        monkeypatch, model, TOY, batch, lambda out: out.square().mean(), None, config=config
    )
    assert len(set(s for s in sizes if s)) == 1
    checked = [r for r in first if r + 2 in started]
    assert len(checked) >= 3
    for r in checked:
        assert started[r + 2] < first[r] < started[r + 1], f"region {r} was not reloaded two regions ahead"
    assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters())


def test_attention_offload_reloads_every_parked_call_before_its_backward(monkeypatch):
    """The step's last two attention calls keep theirs on the device; their backward still reloads the calls
    before them ahead of need, so no attention call of the step waits for its own reload (it did for the
    first parked one, right after the kept ones: on Wan a 1.4 GB copy in the open)."""
    from toy import build, inputs

    model = build(blocks=6, dim=16)
    batch = inputs(model, tokens=8, generator=torch.Generator().manual_seed(1))
    config = {"gradient_checkpointing": False, "gradient_checkpointing_offload_attention": True}
    sizes, started, first = _log_backward_reloads(
        monkeypatch, model, TOY, batch, lambda out: out.square().mean(), None, config=config
    )
    parked = [r for r, size in enumerate(sizes) if size]
    assert len(parked) == len(sizes) - 2 and set(parked) <= set(first)  # (on demand fails inside the helper)


def test_a_source_held_by_reload_ahead_is_checked_again_when_fetched():
    """Reload ahead holds a parked tensor that is still on its device instead of copying it back; if it is
    modified in place before its region needs it, the fetch returns the parked (host) copy, not the change."""
    engine = make_engine()
    x = torch.arange(6.0)
    parked = engine.offload(x)
    engine.reload(parked)  # alive: held, nothing copied
    assert parked.reloaded is x and engine.stats.bytes_reloaded == 0
    assert (
        engine.fetch(parked) is x and engine.stats.reloads_skipped == 1
    )  # unchanged: the held tensor itself
    engine.reload(parked)
    x.mul_(2)
    got = engine.fetch(parked)
    assert (
        got is not x and torch.equal(got, torch.arange(6.0)) and engine.stats.bytes_reloaded == x.numel() * 4
    )
    assert engine.stats.reloads_skipped == 1


def test_an_attention_activation_edited_in_place_after_the_call_is_an_error(model, x):
    """Attention activations are parked two regions after their call: one edited in place in between would be
    parked (and given to backward) changed. Autograd rejects such an edit too; memfit says so at parking."""
    edit = model.blocks[1].attn.register_forward_hook(lambda module, args, out: args[0].mul_(1.0))
    try:
        with (
            offload_apply(model, {"gradient_checkpointing_offload_attention": True}) as handle,
            pytest.raises(memfit.MemfitError, match="modified in place after the call"),
        ):
            step(model, x)
        assert (
            handle.session.copy.pool.stats().buffers_in_use == 0
        )  # the failed forward gave its buffers back
    finally:
        edit.remove()


def test_auto_blocks_that_keep_everything_reload_the_parked_block_before_them_ahead(monkeypatch):
    """An ``auto`` plan whose last blocks keep everything: their backward has no region to start, so the
    parked block before them was fetched only when its own backward began. Each such block's backward start
    now reloads the parked regions before it (``mark_keeping_blocks``): none waits, gradients unchanged."""
    flux = pytest.importorskip("memfit_flux").ADAPTER
    from memfit.auto import BlockPolicy

    # block offload everywhere but the last two blocks
    force_auto_plan(
        monkeypatch,
        lambda names: [
            BlockPolicy.KEEP if i >= len(names) - 2 else BlockPolicy.BLOCK_OFFLOAD for i in range(len(names))
        ],
    )
    torch.manual_seed(0)
    model = flux.presets["tiny"].build(dtype=torch.float32, device="cpu")
    batch = flux.presets["tiny"].inputs(model, tokens=64, generator=torch.Generator().manual_seed(1))
    flux.loss(model(**batch)).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    config = {**ON, "gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": "1GiB"}
    sizes, started, first = _log_backward_reloads(
        monkeypatch, model, flux, batch, flux.loss, None, config=config
    )
    last_parked = max(r for r, size in enumerate(sizes) if size)
    assert sizes[last_parked + 1 :] == [0, 0]  # the two keeping blocks' regions, after it
    assert last_parked in first  # reloaded, and not on demand (the helper checks every region's reloads)
    assert reference.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("backend", ["unsloth", "unsloth-ffn"])
def test_parking_keeps_no_graph_alive_across_steps(backend):
    """A parked block input requires grad; copied into a pooled host buffer under autograd, each step's graph
    chained onto the buffer's kept views and was never freed (the step's inputs and block inputs leaked, two
    tensors a step). Live tensors stay flat over steps."""
    from toy import build

    def live_tensors() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    model = build(dim=64)
    model.requires_grad_(False)
    for block in model.blocks:
        block.norm1.requires_grad_(True)
    x = torch.randn(1, 32, 64)
    with offload_apply(model, {**ON, "gradient_checkpointing_backend": backend}) as handle:
        for _ in range(3):
            step(model, x)
        before = live_tensors()
        for _ in range(5):
            step(model, x)
        assert handle.stats()["bytes_offloaded"] > 0
        assert live_tensors() == before


def test_auto_blocks_parked_whole_give_the_same_gradients_and_are_reloaded_ahead(monkeypatch):
    """``BlockPolicy.PARK``: everything a block saves waits in host memory, nothing is recomputed. Mixed with
    whole-block recompute, input offload and keeping, on Flux (double- and single-stream blocks, LoRA): every
    gradient bitwise equal to the unmodified model's, each parked block a region of the timeline whose tensors
    come back before its backward starts (never on demand), and only the recomputed blocks recompute."""
    flux = pytest.importorskip("memfit_flux").ADAPTER
    peft = pytest.importorskip("peft")
    from memfit.auto import BlockPolicy

    mix = (BlockPolicy.PARK, BlockPolicy.BLOCK, BlockPolicy.PARK, BlockPolicy.BLOCK_OFFLOAD, BlockPolicy.KEEP)
    force_auto_plan(monkeypatch, lambda names: [mix[i % len(mix)] for i in range(len(names))])
    torch.manual_seed(0)
    model = flux.presets["tiny"].build(dtype=torch.float32, device="cpu").requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"]))
    batch = flux.presets["tiny"].inputs(model, tokens=64, generator=torch.Generator().manual_seed(1))
    flux.loss(model(**batch)).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert reference
    model.zero_grad(set_to_none=True)
    config = {**ON, "gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": "1GiB"}
    sizes, started, first = _log_backward_reloads(
        monkeypatch, model, flux, batch, flux.loss, None, config=config
    )
    assert (
        sum(1 for size in sizes if size) >= 2
    )  # parked and input-offloaded blocks (the last two keep theirs)
    assert first  # reloads happened, each before its region's backward started (the helper checks)
    assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters() if p.grad is not None)
    assert reference.keys() == {n for n, p in model.named_parameters() if p.grad is not None}

    with memfit.apply(model, config, adapter=flux, copy_engine=make_engine(), min_offload_bytes=0) as handle:
        flux.loss(model(**batch)).backward()
        stats = handle.stats()
        plan = handle.region_plan
    model.zero_grad(set_to_none=True)
    policies = [b.policy for b in plan.blocks]
    recomputed = sum(1 for p in policies if p.recompute == "block")
    assert stats["recomputes"] == recomputed  # parked blocks never recompute
    assert stats["block_calls_parked"] == policies.count(BlockPolicy.PARK)  # one parked call each
    assert stats["attention_calls_offloaded"] == 0
    assert stats["attention_tensors_parked"] > 0 and stats["bytes_offloaded"] > 0


@pytest.mark.parametrize("family", sorted(memfit.available_adapters()))
def test_every_family_parked_whole_gives_the_same_gradients(monkeypatch, family):
    """Every installed family's tiny preset, full fine-tune, its blocks alternately parked whole and kept:
    outputs and every gradient bitwise those of the unmodified model, and something parked."""
    from memfit.auto import BlockPolicy

    adapter = memfit.get_adapter(family)
    preset = adapter.presets["tiny"]
    force_auto_plan(
        monkeypatch,
        lambda names: [BlockPolicy.PARK if i % 2 == 0 else BlockPolicy.KEEP for i in range(len(names))],
    )
    torch.manual_seed(0)
    model = preset.build(dtype=torch.float32, device="cpu")
    batch = preset.inputs(model, generator=torch.Generator().manual_seed(1))
    out = adapter.loss(model(**batch))
    out.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    config = {**ON, "gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": "1GiB"}
    with memfit.apply(
        model, config, adapter=adapter, copy_engine=make_engine(), min_offload_bytes=0
    ) as handle:
        loss = adapter.loss(model(**batch))
        loss.backward()
        stats = handle.stats()
    assert torch.equal(loss, out)
    assert reference.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.equal(p.grad, reference[n]) for n, p in model.named_parameters() if p.grad is not None)
    assert stats["recomputes"] == 0 and stats["attention_tensors_parked"] > 0
    assert stats["block_calls_parked"] == sum(1 for _ in range(0, len(handle.region_plan.blocks), 2))
    if stats["block_calls_parked"] > 2:  # the step's last two regions keep theirs
        assert stats["bytes_offloaded"] > 0


def test_an_auto_plan_sets_the_copy_engines_in_flight_bound_and_a_fixed_backend_restores_it(
    monkeypatch, model, x
):
    """``auto`` counts the forward's copies queued across blocks in its peak (planner, "Queue") and lets the copy
    engine hold that many bytes in flight; never less than the engine's own bound, which the next installation
    without a queue puts back."""
    from memfit.auto import BlockPolicy

    engine = make_engine()
    own = engine.max_inflight_bytes
    engine.allow_in_flight(own // 2)
    assert engine.max_inflight_bytes == own  # never below its own bound
    force_auto_plan(
        monkeypatch, lambda names: [BlockPolicy.BLOCK_OFFLOAD] * len(names), copies_in_flight=3 * own
    )
    config = {**ON, "gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": "1GiB"}
    handle = offload_apply(model, config, engine=engine)
    step(model, x)
    assert engine.max_inflight_bytes == 3 * own
    handle.remove()
    handle = offload_apply(model, {**ON, "gradient_checkpointing_backend": "unsloth"}, engine=engine)
    step(model, x)
    assert engine.max_inflight_bytes == own
    handle.remove()
