"""The ``auto`` backend on CPU: plans that fit the budget, exact gradients, determinism, re-planning, errors.

Off CUDA the budget counts activation bytes held for backward (``SavedBytesMeter``), so "fits" is checked
against a measurement, not against the planner's own prediction.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter

import pytest
import torch

import memfit
from memfit.accounting import SavedBytesMeter
from memfit.auto import BlockPolicy, Plan, plan_policies
from memfit.auto.policy import allowed_policies
from memfit.auto.profile import profile_model
from memfit_conformance.base import cpu_copy_engine
from memfit_conformance.streams import order_checking_copy_engine

from helpers import auto_config

memfit_flux = pytest.importorskip("memfit_flux")
ADAPTER = memfit_flux.ADAPTER
TINY = ADAPTER.presets["tiny"]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return TINY.build(dtype=torch.float32, device="cpu")


def inputs(model, tokens=64):
    return TINY.inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(1))


def step(model, batch):
    """Loss, every gradient, and the activation bytes the model holds between forward and backward (the
    budget's measure off CUDA: the loss's own saved tensors are the trainer's, outside the profiled forward)."""
    model.zero_grad(set_to_none=True)
    with SavedBytesMeter(exclude=[*model.parameters(), *model.buffers()]) as meter:
        out = model(**batch)
    held = meter.device_bytes
    loss = ADAPTER.loss(out)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, held


@pytest.fixture(scope="module")
def reference(model):
    return step(model, inputs(model))


def run_auto(model, budget, **kw):
    handle = memfit.apply(model, auto_config(budget), **kw)
    try:
        out = step(model, inputs(model))
        return (*out, handle.plan, handle.stats())
    finally:
        handle.remove()


@pytest.mark.parametrize("fraction", [0.15, 0.3, 0.5, 0.75, 0.95])
def test_plans_fit_the_budget_and_keep_gradients_exact(model, reference, fraction):
    ref_loss, ref_grads, ref_held = reference
    budget = int(ref_held * fraction)
    loss, grads, held, plan, stats = run_auto(model, budget)
    assert held <= budget, plan.describe()
    assert plan.predicted_peak_bytes <= budget
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name
    assert stats["recomputes"] > 0


def test_a_larger_budget_never_costs_more_and_mixes_policies(model, reference):
    profile = profile_model(
        model, ADAPTER, (), inputs(model), min_offload_bytes=1 << 20, copy_bytes_per_second=None
    )
    plans = [
        plan_policies(
            profile,
            int(reference[2] * f),
            allowed=lambda b: allowed_policies(
                has_ffn=b.has_ffn, has_attention=b.has_attention, can_offload=False
            ),
        )
        for f in (0.2, 0.4, 0.6, 0.8)
    ]
    extra = [p.predicted_extra_seconds for p in plans]
    assert extra == sorted(extra, reverse=True)
    assert any(len(p.counts()) > 1 for p in plans), [p.counts() for p in plans]  # per-block, not one mode


def test_same_model_shape_and_budget_give_the_same_plan(model, reference):
    budget = int(reference[2] * 0.4)
    first, second = run_auto(model, budget)[3], run_auto(model, budget)[3]
    # without copies the choice is FLOPs and bytes only (no measured rate enters it): the policies and byte
    # predictions are reproducible; predicted seconds scale with the measured FLOP rate
    assert first.blocks == second.blocks
    assert first.predicted_peak_bytes == second.predicted_peak_bytes


def test_prediction_tracks_the_measured_held_bytes(model, reference):
    for fraction in (0.3, 0.6):
        _, _, held, plan, _ = run_auto(model, int(reference[2] * fraction))
        assert abs(plan.predicted_peak_bytes - held) <= 0.1 * held, (plan.predicted_peak_bytes, held)


def test_offload_policies_exact_through_a_copy_engine(model, reference):
    ref_loss, ref_grads, _ = reference
    recompute_only = run_auto(model, int(reference[2] * 0.15))[3]
    # below every recompute-only plan: only parking block inputs in host memory gets there
    budget = recompute_only.predicted_peak_bytes - 8 * 1024
    loss, grads, held, plan, stats = run_auto(
        model, budget, copy_engine=cpu_copy_engine(), min_offload_bytes=0
    )
    assert held <= budget
    assert any(BlockPolicy(p).copies for p in plan.counts()), plan.counts()
    assert stats["bytes_offloaded"] > 0 and stats["host_buffers_in_use"] == 0
    assert stats["pool_waits"] == 0 and stats["pool_overflows"] == 0  # synchronous copies: never waited on
    assert torch.equal(loss, ref_loss)
    for name, g in grads.items():
        assert torch.equal(g, ref_grads[name]), name


# the synchronous engine copies each distinct view on its own; the CUDA engine (here over recording streams, on CPU
# tensors) copies views that cover their storage as its bytes, once
COPY_ENGINES = {"sync": cpu_copy_engine, "cuda-engine": order_checking_copy_engine}


def _lora_profiles(lora_model, batch, engine):
    """The profile as the planner makes it for ``engine``, and the one pricing each distinct view on its own."""
    once = engine.parks_storages_once
    return [
        profile_model(
            lora_model, ADAPTER, (), batch, min_offload_bytes=0, copy_bytes_per_second=1e9, storages_once=s
        )
        for s in (once, False)
    ]


@pytest.mark.parametrize("engine_name", COPY_ENGINES)
def test_profiled_attention_copy_bytes_equal_what_offload_attention_copies(engine_name):
    """With PEFT LoRA every q/k/v projection saves its own view of one input; the planner must price the copy
    the session really makes with the engine that makes it (each distinct view once, or a storage its views
    cover once), not each saved tensor."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    lora_model = TINY.build(dtype=torch.float32, device="cpu").requires_grad_(False)
    lora_model.add_adapter(
        peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "add_q_proj", "to_out.0"])
    )
    batch = inputs(lora_model)
    engine = COPY_ENGINES[engine_name]()
    profile, per_view = _lora_profiles(lora_model, batch, engine)
    predicted = sum(b.attention_copy_bytes for b in profile.blocks) + profile.attention_shared_copy_bytes
    # Flux's attention saves views that cover their storage: the CUDA engine copies fewer bytes
    if engine.parks_storages_once:
        assert sum(b.attention_copy_bytes for b in profile.blocks) < sum(
            b.attention_copy_bytes for b in per_view.blocks
        )
    with memfit.apply(
        lora_model,
        {"gradient_checkpointing_offload_attention": True},
        copy_engine=engine,
        min_offload_bytes=0,
    ) as handle:
        ADAPTER.loss(lora_model(**batch)).backward()
        stats = handle.stats()
    assert stats["dedup_hits"] > 0  # the shared views were seen, and copied once
    # (the step's last two attention calls keep theirs on the device: counted once per view, never copied)
    assert stats["bytes_offloaded"] > 0 and stats["bytes_kept_on_device"] > 0
    assert predicted == stats["bytes_offloaded"] + stats["bytes_kept_on_device"]
    # and its host work by every saved tensor the hooks handle (repeated views included)
    saves = sum(b.attention_saves for b in profile.blocks) + profile.attention_shared_saves
    assert saves == stats["attention_tensors_parked"] > len(profile.blocks)
    # the host cost counts every tensor the attention calls save, parked or not (LoRA's small ones too)
    assert sum(b.attention_hook_calls for b in profile.blocks) > saves
    assert sum(b.attention_copy_bytes for b in profile.blocks) >= sum(
        b.attention_bytes for b in profile.blocks
    )


@pytest.mark.parametrize("engine_name", COPY_ENGINES)
def test_what_the_last_attention_calls_keep_is_counted_as_parking_would_have_copied_it(engine_name):
    """Wan's attention saves views that together cover their storage; the step's last two attention calls keep
    theirs on the device, and ``bytes_kept_on_device`` counts them as the engine would have copied them (a
    storage once where the CUDA engine copies it once), so that copied plus kept is what the profile priced."""
    peft = pytest.importorskip("peft")
    memfit_wan = pytest.importorskip("memfit_wan")
    wan_tiny = memfit_wan.ADAPTER.presets["tiny"]
    torch.manual_seed(0)
    wan = wan_tiny.build(dtype=torch.float32, device="cpu").requires_grad_(False)
    wan.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    batch = wan_tiny.inputs(wan, tokens=720, generator=torch.Generator().manual_seed(1))
    engine = COPY_ENGINES[engine_name]()
    profile = profile_model(
        wan,
        memfit_wan.ADAPTER,
        (),
        batch,
        min_offload_bytes=0,
        copy_bytes_per_second=1e9,
        storages_once=engine.parks_storages_once,
    )
    with memfit.apply(
        wan, {"gradient_checkpointing_offload_attention": True}, copy_engine=engine, min_offload_bytes=0
    ) as handle:
        memfit_wan.ADAPTER.loss(wan(**batch)).backward()
        stats = handle.stats()
    wan.zero_grad(set_to_none=True)
    predicted = sum(b.attention_copy_bytes for b in profile.blocks) + profile.attention_shared_copy_bytes
    assert stats["bytes_kept_on_device"] > 0
    assert stats["bytes_offloaded"] + stats["bytes_kept_on_device"] == predicted


@pytest.mark.parametrize("engine_name", COPY_ENGINES)
def test_profiled_park_bytes_are_what_parking_the_blocks_copies(monkeypatch, engine_name):
    """BlockPolicy.PARK copies every view a block saves of its own storages (each once, or a storage its views
    cover once); what a parked block copies beyond that is what it alone saw first of the step's shared tensors
    (copied once for all)."""
    peft = pytest.importorskip("peft")
    from helpers import force_auto_plan

    torch.manual_seed(0)
    lora_model = TINY.build(dtype=torch.float32, device="cpu").requires_grad_(False)
    lora_model.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    batch = inputs(lora_model)
    engine = COPY_ENGINES[engine_name]()
    profile, per_view = _lora_profiles(lora_model, batch, engine)
    if engine.parks_storages_once:
        assert sum(b.park_copy_bytes for b in profile.blocks) < sum(
            b.park_copy_bytes for b in per_view.blocks
        )
    for b in profile.blocks:
        # (a view narrower than its storage copies less than parking frees)
        assert 0 < b.park_bytes <= b.saved_bytes and b.park_copy_bytes > 0
        assert b.park_hook_calls > b.attention_hook_calls > 0  # every save in the block, its attention's too
    force_auto_plan(monkeypatch, lambda names: [BlockPolicy.PARK] * len(names))
    with memfit.apply(lora_model, auto_config("1GiB"), copy_engine=engine, min_offload_bytes=0) as handle:
        ADAPTER.loss(lora_model(**batch)).backward()
        # the planner priced the copies as this engine makes them
        assert [b.park_copy_bytes for b in handle.profile.blocks] == [
            b.park_copy_bytes for b in profile.blocks
        ]
        stats = handle.stats()
    lora_model.zero_grad(set_to_none=True)
    copied = stats["bytes_offloaded"] + stats["bytes_kept_on_device"]  # (the last two blocks keep theirs)
    own = sum(b.park_copy_bytes for b in profile.blocks)
    assert own <= copied <= own + profile.outside_bytes + profile.attention_shared_copy_bytes
    nothing = profile_model(
        lora_model, ADAPTER, (), batch, min_offload_bytes=1 << 40, copy_bytes_per_second=1e9
    )
    assert all(b.park_copy_bytes == b.park_bytes == 0 for b in nothing.blocks)


def test_the_first_block_keeps_no_more_than_the_others():
    """Inputs are judged after the forward: the rotary tables, text context and time embedding reach Wan's
    first block before anything saved them, and are held for every block anyway. Counted as the first
    block's own they made its input offload the step's largest copy, so the planner's floor kept that block
    on the device (160 MB above ``unsloth`` on Wan 14B, 24 MiB on the synthetic stack)."""
    peft = pytest.importorskip("peft")
    memfit_wan = pytest.importorskip("memfit_wan")
    wan_tiny = memfit_wan.ADAPTER.presets["tiny"]
    torch.manual_seed(0)
    wan = wan_tiny.build(dtype=torch.float32, device="cpu").requires_grad_(False)
    wan.add_adapter(
        peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"])
    )
    batch = wan_tiny.inputs(wan, tokens=720, generator=torch.Generator().manual_seed(1))
    profile = profile_model(
        wan, memfit_wan.ADAPTER, (), batch, min_offload_bytes=0, copy_bytes_per_second=1e9
    )
    from memfit_wan.presets import latent_grid

    cfg = wan.config
    hidden = (
        math.prod(latent_grid(720)) * cfg.num_attention_heads * cfg.attention_head_dim * 4
    )  # one block's output
    assert [b.input_bytes for b in profile.blocks] == [hidden] * len(profile.blocks)
    assert [b.input_parkable_bytes for b in profile.blocks] == [hidden] * len(profile.blocks)
    # the time embedding every block takes unsaved is held under every plan: counted once, outside
    assert profile.outside_bytes >= 6 * cfg.num_attention_heads * cfg.attention_head_dim * 4
    # the output norm saves the last block's output: after that block, not held under the blocks' backward
    after = [b.saved_after_bytes for b in profile.blocks]
    assert after[:-1] == [0] * (len(after) - 1) and after[-1] >= hidden
    plan = plan_policies(
        profile,
        profile.outside_bytes + hidden * len(profile.blocks),
        allowed=lambda b: (BlockPolicy.KEEP, BlockPolicy.BLOCK, BlockPolicy.BLOCK_OFFLOAD),
    )
    # every block's input parked, nothing else held (off CUDA: when backward begins, the output norm's too)
    assert plan.smallest_peak_bytes == profile.outside_bytes + after[-1]


def test_an_ffn_input_counts_as_extra_only_where_the_block_does_not_save_it():
    """An FFN region keeps its input through the recompute. When the FFN's first layer trains, that input is
    among what the block saves (and what its recompute saves again: one tensor); when that layer is frozen
    nothing saves it, and the region holds it on top of the block's saved tensors."""
    from toy import TOY, build

    toy = build(blocks=3, dim=16)
    batch = {"hidden_states": torch.randn(2, 8, 16)}
    trained = profile_model(toy, TOY, (), batch, min_offload_bytes=0, copy_bytes_per_second=None)
    assert all(b.ffn_input_bytes > 0 and b.ffn_input_unsaved_bytes == 0 for b in trained.blocks)
    for block in toy.blocks:
        block.ff_in.requires_grad_(False)
    frozen = profile_model(toy, TOY, (), batch, min_offload_bytes=0, copy_bytes_per_second=None)
    assert [b.ffn_input_unsaved_bytes for b in frozen.blocks] == [b.ffn_input_bytes for b in trained.blocks]


def test_backward_to_forward_counts_the_weights_that_train(model):
    """1 + the trainable share of the blocks' weights: ~1 for a frozen base (only input gradients), 2 when
    every weight trains."""
    batch = inputs(model)
    full = profile_model(model, ADAPTER, (), batch, min_offload_bytes=0, copy_bytes_per_second=None)
    assert full.backward_to_forward == 2.0
    try:
        for _, _, block in ADAPTER.iter_blocks(model):
            block.requires_grad_(False)
        frozen = profile_model(model, ADAPTER, (), batch, min_offload_bytes=0, copy_bytes_per_second=None)
    finally:
        model.requires_grad_(True)
    assert frozen.backward_to_forward == 1.0


def test_budget_below_any_plan_names_the_smallest_peak(model, reference):
    handle = memfit.apply(model, auto_config(1000))
    with pytest.raises(memfit.BudgetError, match="smallest predicted held activations") as info:
        model(**inputs(model))
    assert info.value.smallest_peak_bytes > 1000
    handle.remove()
    # the smallest reachable budget itself is accepted and fits
    _, _, held, plan, _ = run_auto(model, info.value.smallest_peak_bytes)
    assert held <= info.value.smallest_peak_bytes


def test_a_budget_beyond_the_allocators_room_is_planned_for_less_and_says_so(model, reference, monkeypatch):
    """Near the device's capacity the caching allocator's reserve (up to 1.19x the allocated peak under
    offload, measured) would not fit: the plan is made for ALLOCATOR_HEADROOM of what the process can hold,
    with one warning that names the figure."""
    from memfit.auto import budget_planner as controller

    assert controller.plannable_budget(100, None) == 100
    assert controller.plannable_budget(100, 1000) == 100
    assert controller.plannable_budget(1000, 1000) == int(1000 * controller.ALLOCATOR_HEADROOM)
    no_checkpoint = run_auto(model, "1GiB")[3].no_checkpoint_peak_bytes
    # a budget that needs no checkpointing, on a device that holds a little more than it
    capacity = int(no_checkpoint / controller.ALLOCATOR_HEADROOM * 0.9)
    monkeypatch.setattr(controller, "device_capacity", lambda device: capacity)
    handle = memfit.apply(model, auto_config(no_checkpoint))
    try:
        with pytest.warns(memfit.MemfitWarning, match="caching allocator too little room"):
            step(model, inputs(model))
        assert handle.plan.needed and handle.plan.budget_bytes == int(
            capacity * controller.ALLOCATOR_HEADROOM
        )
        assert handle.plan.predicted_peak_bytes <= handle.plan.budget_bytes
    finally:
        handle.remove()


def test_budget_that_needs_no_checkpointing_installs_nothing_and_says_so(model, reference):
    handle = memfit.apply(model, auto_config("1GiB"))
    with pytest.warns(memfit.MemfitWarning, match="needs no checkpointing"):
        step(model, inputs(model))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once
        step(model, inputs(model))
    assert not handle.plan.needed and handle.stats()["recomputes"] == 0
    # the profile behind the plan is inspectable: one entry per planned block, off CUDA no measured peaks
    assert [b.name for b in handle.profile.blocks] == [name for name, _ in handle.plan.blocks]
    assert all(b.backward_peak_bytes == 0 for b in handle.profile.blocks)
    handle.remove()


def test_replans_when_the_shape_changes_and_reuses_cached_plans(model):
    handle = memfit.apply(model, auto_config(200_000))
    try:
        planning = []  # seconds spent planning after each step: a cached plan is not searched again
        for tokens in (64, 16, 64, 16):
            batch = inputs(model, tokens)
            with SavedBytesMeter(exclude=[*model.parameters()]) as meter:
                loss = ADAPTER.loss(model(**batch))
            loss.backward()
            assert meter.device_bytes <= 200_000
            planning.append(handle.stats()["planning_seconds"])
        assert handle.stats()["replans"] == 4 and handle.stats()["profiles"] == 2
        assert 0 < planning[0] < planning[1] == planning[2] == planning[3]
        with torch.no_grad():
            model(**inputs(model, 32))  # no gradients: nothing is planned
        assert handle.stats()["profiles"] == 2
    finally:
        model.zero_grad(set_to_none=True)
        handle.remove()


def test_remove_restores_the_model_exactly(model):
    keys = list(model.state_dict())
    batch = inputs(model)
    with torch.no_grad():
        before = ADAPTER.loss(model(**batch))
    handle = memfit.apply(model, auto_config(200_000))
    step(model, batch)
    handle.remove()
    assert list(model.state_dict()) == keys
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with torch.no_grad():
        assert torch.equal(ADAPTER.loss(model(**batch)), before)


def test_describe_lists_the_plan(model):
    handle = memfit.apply(model, auto_config(200_000))
    assert "planned at the first forward" in handle.describe()
    step(model, inputs(model))
    text = handle.describe()
    handle.remove()
    assert "auto plan (held activations)" in text and "transformer_blocks." in text


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"gradient_checkpointing_interval": 2}, "gradient_checkpointing_interval"),
        ({"gradient_checkpointing_segment_stride": 2}, "gradient_checkpointing_segment_stride"),
        ({"gradient_checkpointing_offload_attention": True}, "gradient_checkpointing_offload_attention"),
        ({"gradient_checkpointing_memory_budget": "lots"}, "must be a size such as 24GiB"),
        ({"gradient_checkpointing_memory_budget": -5}, "positive number of bytes"),
    ],
)
def test_config_errors(extra, match):
    with pytest.raises(memfit.ConfigError, match=match):
        memfit.MemfitConfig.from_dict({**auto_config("1GiB"), **extra})


def test_budget_is_required_off_cuda(model):
    cfg = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "auto"}
    with pytest.raises(memfit.ConfigError, match="needs gradient_checkpointing_memory_budget"):
        memfit.apply(model, cfg)


def test_a_model_without_adapter_is_refused():
    with pytest.raises(memfit.UnsupportedBoundaryError, match="needs the blocks and regions an adapter"):
        memfit.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)), auto_config("1GiB"))


def test_fsdp2_models_are_refused_with_the_fix(model, monkeypatch):
    import sys

    # the module, not the function memfit re-exports under the same name
    monkeypatch.setattr(sys.modules["memfit.apply"], "is_fsdp_module", lambda m: m is model)
    with pytest.raises(memfit.NotAvailableError, match="does not support FSDP2"):
        memfit.apply(model, auto_config("1GiB"))


def test_blocks_that_keep_everything_count_as_regions_of_the_step(model):
    """In an ``auto`` plan that parks, a block that keeps everything still starts a region of the step
    (``mark_keeping_blocks``): the attention parked before a run of such blocks leaves the device two
    regions later, as the planner's peak model assumes, instead of staying there through their backward."""
    from memfit.offload.regions import mark_keeping_blocks

    batch = inputs(model)
    blocks = [block for _, _, block in ADAPTER.iter_blocks(model)]

    def offload_attention(marked):
        with memfit.apply(
            model,
            {"gradient_checkpointing_offload_attention": True},
            copy_engine=cpu_copy_engine(),
            min_offload_bytes=0,
        ) as handle:
            marks = mark_keeping_blocks(handle.session, [(b, 0) for b in blocks[-2:]]) if marked else []
            loss = ADAPTER.loss(model(**batch))
            loss.backward()
            for h in marks:
                h.remove()
            stats = handle.stats()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        return stats, loss.detach(), grads

    plain, plain_loss, plain_grads = offload_attention(marked=False)
    marked, marked_loss, marked_grads = offload_attention(marked=True)
    # plain: the last two attention calls keep theirs; marked: the last block's call is the only one of the
    # step's last two regions (the other is the last block itself), the one before it is parked
    assert 0 < marked["bytes_kept_on_device"] < plain["bytes_kept_on_device"]
    assert (
        marked["bytes_offloaded"] + marked["bytes_kept_on_device"]
        == plain["bytes_offloaded"] + plain["bytes_kept_on_device"]
    )
    assert torch.equal(marked_loss, plain_loss)
    assert all(torch.equal(marked_grads[n], g) for n, g in plain_grads.items())


def test_the_bandwidth_probe_takes_the_fastest_of_samples_spread_in_time():
    """Another process's copies slow a burst of samples; spread samples catch the link free, and the plan is
    priced at its own rate (see budget_planner's "Bandwidth probe")."""
    from memfit.auto.budget_planner import fastest_of_spaced

    timings = iter([0.004, 0.0039, 0.0021, 0.0038, 0.0012, 0.004])  # contended, then free once
    slept: list[float] = []
    best = fastest_of_spaced(lambda: next(timings), samples=6, spacing_s=0.01, sleep=slept.append)
    assert best == 0.0012
    assert slept == [0.01] * 5  # between samples, not before the first or after the last


def test_blocks_are_not_parked_whole_past_what_host_ram_can_pin(monkeypatch):
    """Parked blocks hold what they copy in host memory until backward: a plan whose copies (and streamed
    weights) would not fit in host RAM is searched again without parking blocks whole."""
    from memfit.auto import budget_planner
    from memfit.auto.planner import Plan

    def parking_where_allowed(
        profile, budget, *, allowed, streamed=None, memo=None, copy_reserve=0.0, copy_price=0.0
    ):
        def pick(b):
            return (
                BlockPolicy.PARK if BlockPolicy.PARK in allowed(b) and not copy_price else BlockPolicy.BLOCK
            )

        policies = tuple((b.name, pick(b)) for b in profile.blocks)
        copied = 1 << 20 if any(p is BlockPolicy.PARK for _, p in policies) else 0
        return Plan(policies, budget, 0, 0.0, 0, 0, copied_bytes=copied, metric="held activations")

    monkeypatch.setattr(budget_planner, "plan_policies", parking_where_allowed)

    def planned(host_bytes: int) -> set[BlockPolicy]:
        monkeypatch.setattr(budget_planner.hostmem, "available_host_bytes", lambda: host_bytes)
        monkeypatch.setattr(budget_planner.hostmem, "default_host_reserve", lambda: 0)
        with memfit.apply(
            model, auto_config("1GiB"), copy_engine=cpu_copy_engine(), min_offload_bytes=0
        ) as h:
            step(model, inputs(model))
            return {policy for _, policy in h.plan.blocks}

    torch.manual_seed(0)
    model = TINY.build(dtype=torch.float32, device="cpu")
    assert planned(1 << 40) == {BlockPolicy.PARK}
    assert planned(1 << 19) == {BlockPolicy.BLOCK}  # 1 MiB of copies over 512 KiB of host RAM


def test_a_new_plan_counts_what_the_running_plan_pins_as_its_own(monkeypatch):
    """The host RAM a plan may pin includes what the running plan already pins (its pool's buffers, which the next
    plan reuses): with exactly enough for one parking plan, a re-plan for a new shape still parks, although the
    first plan's buffers took that much out of what the host reports available."""
    from memfit.auto import budget_planner
    from memfit.auto.planner import Plan

    def parking_where_allowed(
        profile, budget, *, allowed, streamed=None, memo=None, copy_reserve=0.0, copy_price=0.0
    ):
        policies = tuple(
            (b.name, BlockPolicy.PARK if BlockPolicy.PARK in allowed(b) else BlockPolicy.BLOCK)
            for b in profile.blocks
        )
        copied = 1 << 20 if any(p is BlockPolicy.PARK for _, p in policies) else 0
        return Plan(policies, budget, 0, 0.0, 0, 0, copied_bytes=copied, metric="held activations")

    monkeypatch.setattr(budget_planner, "plan_policies", parking_where_allowed)
    engine = cpu_copy_engine()
    # the host as the kernel reports it: what this process pins is no longer available
    monkeypatch.setattr(
        budget_planner.hostmem,
        "available_host_bytes",
        lambda: (1 << 20) - engine.pool.stats().pinned_bytes_held,
    )
    monkeypatch.setattr(budget_planner.hostmem, "default_host_reserve", lambda: 0)
    torch.manual_seed(0)
    model = TINY.build(dtype=torch.float32, device="cpu")
    with memfit.apply(model, auto_config("1GiB"), copy_engine=engine, min_offload_bytes=0) as h:
        step(model, inputs(model))
        assert {policy for _, policy in h.plan.blocks} == {BlockPolicy.PARK}
        assert engine.pool.stats().pinned_bytes_held > 0
        with warnings.catch_warnings():
            warnings.simplefilter("error", memfit.MemfitWarning)  # no warning that host RAM cut parking
            step(model, inputs(model, tokens=32))  # a new shape: planned again
        assert {policy for _, policy in h.plan.blocks} == {BlockPolicy.PARK}


def parking_plan(profile, budget, parked) -> Plan:
    """A stub plan: the ``parked`` blocks park whole (1 MiB each), the others recompute (a second each)."""
    policies = tuple(
        (b.name, BlockPolicy.PARK if b.name in parked else BlockPolicy.BLOCK) for b in profile.blocks
    )
    extra = float(len(policies) - len(parked))
    return Plan(policies, budget, 0, extra, 0, 0, copied_bytes=len(parked) << 20, metric="held activations")


def test_alike_blocks_that_stop_parking_at_one_price_still_park_what_fits(monkeypatch):
    """Six alike blocks, each parked saving a second: priced, they stop parking all at once, so the price search
    alone would park none within 3.5 MiB of host RAM; parking allowed on n of them, spread, parks 3."""
    from types import SimpleNamespace

    from memfit.auto import budget_planner
    from memfit.auto.planner import Plan

    names = [f"blocks.{i}" for i in range(6)]
    profile = SimpleNamespace(
        copy_bytes_per_second=1e9, blocks=[SimpleNamespace(name=n, index=i) for i, n in enumerate(names)]
    )
    allowed_to_park = []

    def alike(profile, budget, *, allowed, streamed=None, memo=None, copy_reserve=0.0, copy_price=0.0):
        may = [b.name for b in profile.blocks if BlockPolicy.PARK in allowed(b)]
        allowed_to_park.append(may)
        return parking_plan(profile, budget, may if copy_price < 0.5e-9 else [])  # half the link's time: none

    monkeypatch.setattr(budget_planner, "plan_policies", alike)
    everything = Plan(
        tuple((n, BlockPolicy.PARK) for n in names), 0, 0, 0.0, 0, 0, copied_bytes=6 << 20, metric=""
    )

    def fitted(host):
        return budget_planner.fit_host_memory(profile, everything, host, allowed=lambda b: tuple(BlockPolicy))

    plan = fitted((3 << 20) + (1 << 19))
    assert Counter(p for _, p in plan.blocks)[BlockPolicy.PARK] == 3
    assert plan.predicted_extra_seconds == 3.0
    assert [
        "blocks.1",
        "blocks.3",
        "blocks.5",
    ] in allowed_to_park  # spread evenly over the blocks that may park
    lean = fitted(1 << 19)  # not one parked block fits
    assert Counter(p for _, p in lean.blocks) == {BlockPolicy.BLOCK: 6}


def planned_with_host_ram(monkeypatch, stub, host_bytes: int, warning: str) -> Plan:
    """The plan ``auto`` runs on the tiny model with ``stub`` as its planner and ``host_bytes`` of host RAM (no
    reserve), warning ``warning`` as it plans."""
    from memfit.auto import budget_planner

    monkeypatch.setattr(budget_planner, "plan_policies", stub)
    monkeypatch.setattr(budget_planner.hostmem, "available_host_bytes", lambda: host_bytes)
    monkeypatch.setattr(budget_planner.hostmem, "default_host_reserve", lambda: 0)
    torch.manual_seed(0)
    model = TINY.build(dtype=torch.float32, device="cpu")
    with (
        pytest.warns(memfit.MemfitWarning, match=warning),
        memfit.apply(model, auto_config("1GiB"), copy_engine=cpu_copy_engine(), min_offload_bytes=0) as h,
    ):
        step(model, inputs(model))
        return h.plan


def test_past_host_ram_a_budget_that_needs_parked_blocks_parks_what_fits(monkeypatch):
    """A budget no plan reaches with fewer than two parked blocks, and host RAM for two: there is no plan without
    parking, so two blocks park (giving up parking altogether raised)."""

    def needs_two(profile, budget, *, allowed, streamed=None, memo=None, copy_reserve=0.0, copy_price=0.0):
        parked = [b.name for b in profile.blocks if BlockPolicy.PARK in allowed(b)]
        if len(parked) < 2:
            raise memfit.BudgetError("needs two parked blocks", smallest_peak_bytes=budget + 1)
        return parking_plan(profile, budget, parked)

    plan = planned_with_host_ram(
        monkeypatch, needs_two, (2 << 20) + (1 << 19), r"a plan parking 2 block\(s\)"
    )
    assert Counter(policy for _, policy in plan.blocks)[BlockPolicy.PARK] == 2


def test_past_host_ram_a_plan_parks_what_fits_where_parking_is_cheaper_than_recomputing(monkeypatch):
    """Where every block parked would not fit in host RAM, pricing the copies parks as many blocks as fit (each
    parked block saves a second over recomputing it), rather than none."""
    prices = []

    def parks_fewer_at_higher_prices(
        profile, budget, *, allowed, streamed=None, memo=None, copy_reserve=0.0, copy_price=0.0
    ):
        prices.append(copy_price)
        parkable = [b.name for b in profile.blocks if BlockPolicy.PARK in allowed(b)]
        # a price of the link's time per byte makes parking dearer than recomputing, by equal steps below it
        share = copy_price * profile.copy_bytes_per_second
        return parking_plan(profile, budget, set(parkable[: max(0, round(len(parkable) * (1 - share)))]))

    warning = r"parks \d+ block\(s\) whole and pins .* a plan parking 2 block\(s\)"
    plan = planned_with_host_ram(monkeypatch, parks_fewer_at_higher_prices, (2 << 20) + (1 << 19), warning)
    assert (
        Counter(policy for _, policy in plan.blocks)[BlockPolicy.PARK] == 2
    )  # 2 MiB in 2.5 MiB: the most that fit
    assert plan.predicted_extra_seconds == len(plan.blocks) - 2  # reported without the price
    assert max(prices) > 0 and min(prices) == 0
