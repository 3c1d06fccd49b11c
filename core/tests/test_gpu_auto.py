"""The ``auto`` backend on a GPU: the real peak stays within the budget, gradients match, offload is used.

Run by ``nox -s gpu`` (skips on CPU machines). Flux at the tiny preset's structure but wide enough that
activations dominate: fp32 (bitwise comparisons need a deterministic attention; fp32 math SDPA is).
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit.auto import BlockPolicy

from helpers import auto_config

memfit_flux = pytest.importorskip("memfit_flux")
pytestmark = pytest.mark.gpu
ADAPTER = memfit_flux.ADAPTER


def build():
    from diffusers import FluxTransformer2DModel

    from memfit.adapters.building import build_model

    config = dict(
        patch_size=1,
        in_channels=16,
        num_layers=3,
        num_single_layers=6,
        attention_head_dim=64,
        num_attention_heads=4,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        axes_dims_rope=[16, 24, 24],
        guidance_embeds=True,
    )
    return build_model(FluxTransformer2DModel, config, dtype=torch.float32, device="cuda", seed=0)


def train_steps(model, batch, steps: int, after_each) -> tuple[list, dict]:
    """``steps`` training steps on ``model`` (math SDPA); ``after_each()`` once each step has synchronized; the last
    step's gradients."""
    seen = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            ADAPTER.loss(model(**batch)).backward()
        torch.cuda.synchronize()
        seen.append(after_each())
    return seen, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def forced_plan_steps(model, batch, stat: str) -> tuple[list, dict, dict, int]:
    """Three steps of ``auto`` under a forced plan (``helpers.force_auto_plan``, installed by the caller), the
    handle's ``stat`` after each: what each step recorded, the last step's gradients, the stats and the peak."""
    handle = memfit.apply(model, auto_config("100GiB"), adapter=ADAPTER)
    try:
        recorded, grads = train_steps(model, batch, 3, lambda: handle.stats()[stat])
        return recorded, grads, handle.stats(), torch.cuda.max_memory_allocated()
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)


def assert_within_noise(grads: dict, ref: dict, noise: float) -> None:
    """The same gradients as ``ref``, each within twice the unmodified model's own run-to-run difference."""
    assert grads.keys() == ref.keys()
    assert max(float((grads[n] - g).abs().max()) for n, g in ref.items()) <= 2 * noise


def run(model, batch, config):
    handle = memfit.apply(model, config, adapter=ADAPTER) if config else None
    try:
        # the first step plans; the second runs the installed plan only
        _, grads = train_steps(model, batch, 2, lambda: None)
        return (
            torch.cuda.max_memory_allocated(),
            grads,
            handle.plan if handle else None,
            handle.stats() if handle else {},
        )
    finally:
        if handle is not None:
            handle.remove()
        model.zero_grad(set_to_none=True)


def reference(model):
    """The inputs at 4096 tokens on the GPU, and the unmodified model's peak, gradients and own run-to-run
    difference (0 where the kernels are deterministic)."""
    batch = ADAPTER.presets["tiny"].inputs(model, tokens=4096, generator=torch.Generator().manual_seed(0))
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    none_peak, ref, _, _ = run(model, batch, None)
    _, again, _, _ = run(model, batch, None)
    noise = max(float((again[n] - g).abs().max()) for n, g in ref.items())
    return batch, none_peak, ref, noise


def test_auto_peaks_stay_within_budgets_with_exact_gradients():
    model = build()
    batch, none_peak, ref, noise = reference(model)
    static = torch.cuda.memory_allocated()
    for fraction in (0.35, 0.55, 0.8):
        budget = int(static + (none_peak - static) * fraction)
        cfg = auto_config(budget)
        try:
            peak, grads, plan, stats = run(model, batch, cfg)
        except memfit.BudgetError as exc:
            assert fraction == 0.35, exc  # only the tightest budget may be out of reach
            continue
        assert peak <= budget, (fraction, peak, budget, plan.describe())
        # and close: the peak model (each block's own measured peak on what the blocks before it keep) over-
        # predicts by at most a tenth of the activations (summing every term overshot Flux by ~0.8 GiB)
        assert plan.predicted_peak_bytes - peak <= 0.1 * (none_peak - static), (
            fraction,
            plan.predicted_peak_bytes,
            peak,
            none_peak - static,
        )
        assert grads.keys() == ref.keys()
        worst = max(float((grads[n] - g).abs().max()) for n, g in ref.items())
        assert worst <= 2 * noise, (fraction, worst, noise)
        floor = plan.smallest_peak_bytes
    # At the planner's own smallest peak only parking block inputs in pinned memory gets there: the copy
    # engine runs for real, and the tightest budget still holds.
    try:
        peak, grads, plan, stats = run(model, batch, {**cfg, "gradient_checkpointing_memory_budget": floor})
    except (
        memfit.BudgetError
    ) as exc:  # the floor moved with what was allocated before this profile: take the new one
        floor = exc.smallest_peak_bytes
        peak, grads, plan, stats = run(model, batch, {**cfg, "gradient_checkpointing_memory_budget": floor})
    assert peak <= floor, (peak, floor, plan.describe())
    assert any(BlockPolicy(p).copies for p in plan.counts()) and stats["bytes_offloaded"] > 0, plan.counts()
    assert max(float((grads[n] - g).abs().max()) for n, g in ref.items()) <= 2 * noise


def test_a_loop_that_resets_the_peak_statistics_each_step_is_measured_where_each_backward_ends():
    """A training loop that resets CUDA's peak statistics at each step's start (to log its own peak, as
    memory-logging callbacks do) spoils every reading auto takes at the next forward; the backward's end, read
    before that reset, measures the steps instead: the shape settles on those readings, none is unreadable, every
    step is within the budget and the gradients are the unmodified model's."""
    model = build()
    batch, none_peak, ref, noise = reference(model)
    static = torch.cuda.memory_allocated()
    budget = int(static + (none_peak - static) * 0.55)
    handle = memfit.apply(model, auto_config(budget), adapter=ADAPTER)
    try:
        peaks, grads = train_steps(
            model, batch, 8, torch.cuda.max_memory_allocated
        )  # resets before each step
        (shape,) = handle.stats()["shapes"]
    finally:
        handle.remove()
        model.zero_grad(set_to_none=True)
    assert shape["unreadable_steps"] == 0, shape
    assert shape["steps_read_at_backward_end"] == shape["steps_measured"] >= 3 and shape["settled"], shape
    assert max(peaks) <= budget, (peaks, budget, shape)
    assert_within_noise(grads, ref, noise)


def test_blocks_parked_whole_on_the_copy_engine_give_exact_gradients_and_hold_less(monkeypatch):
    """``BlockPolicy.PARK`` on CUDA's copy engine (side streams, events, the pinned pool): every other block
    parked whole, the rest kept. Gradients within the unmodified model's own run-to-run difference, the peak
    below keeping everything, nothing recomputed, and no pinned allocation after the first step."""
    from helpers import force_auto_plan

    force_auto_plan(
        monkeypatch,
        lambda names: [BlockPolicy.PARK if i % 2 else BlockPolicy.KEEP for i in range(len(names))],
    )
    model = build()
    batch, none_peak, ref, noise = reference(model)
    allocations, grads, stats, peak = forced_plan_steps(model, batch, "pinned_allocations")
    assert_within_noise(grads, ref, noise)
    assert stats["recomputes"] == 0 and stats["block_calls_parked"] > 0 and stats["bytes_offloaded"] > 0
    assert peak < none_peak, (peak, none_peak)
    assert allocations[1] == allocations[2], allocations  # the pool reuses its buffers from the second step


def test_the_bandwidth_probe_measures_a_pinned_copy_rate():
    """A PCIe or NVLink-C2C host link: between 1 GB/s and 1 TB/s, and near a plain timed pinned copy."""
    from memfit.auto.budget_planner import _probe_bandwidth

    rate = _probe_bandwidth(torch.device("cuda"))
    assert 1e9 < rate < 1e12, rate
    src = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    plain = (64 << 20) / (start.elapsed_time(end) / 1e3)
    assert rate >= 0.9 * plain, (rate, plain)  # the fastest of several is at least about one plain copy's


def test_the_meter_tells_a_step_that_reached_the_process_s_limit():
    """``CudaPeakMeter.at_limit``: the caching allocator had to free its cache to allocate (the process's cap was
    reached), and only since the last reset."""
    from memfit.auto.budget_planner import CudaPeakMeter

    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    meter = CudaPeakMeter(device)
    meter.reset()
    held = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    assert not meter.at_limit()
    cap = torch.cuda.memory_reserved(device) + (320 << 20)
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    try:
        cached = torch.empty(192 << 20, dtype=torch.uint8, device=device)
        del cached  # cached, too small for the next allocation, and in the way of the cap
        larger = torch.empty(288 << 20, dtype=torch.uint8, device=device)
        assert meter.at_limit()
        meter.reset()
        assert not meter.at_limit()
        del larger
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        del held
        torch.cuda.empty_cache()


def test_on_a_card_of_the_budget_s_size_auto_keeps_its_copies_reserve_and_runs_clear_of_the_limit(
    monkeypatch,
):
    """What a plan copies to host memory grows the caching allocator's reserve (docs/cost-model.md, "Copy
    reserve"): in a process that holds the budget over ``ALLOCATOR_HEADROOM`` but not the cheapest plan's peak and
    copies within ``CARD_FIT`` of it, auto runs a plan that fits both, within the budget, and its steps after
    the first need no cache flush of the allocator.

    On this model recompute is cheaper than copies at the real link's rate, so the cheapest plan would copy
    (almost) nothing (the H200: at most 36 MiB at every share below): the bandwidth probe reports 100x the link
    and the fixed costs of a parked region and of a hooked tensor are taken off (a tiny block's recompute takes
    about as long as that bookkeeping), so copies look nearly free and the cheapest plan copies. What is checked
    is memory (the reserve real copies leave), which the price does not change."""
    from memfit.auto import budget_planner, cost
    from memfit.auto.allocator import expandable_segments
    from memfit.auto.budget_planner import ALLOCATOR_HEADROOM, CARD_FIT, card_need

    if (
        expandable_segments()
    ):  # read by the allocator as the process started; the planner then counts no reserve
        pytest.skip("this process's allocator grows expandable segments: copies need no reserve on the card")

    real_probe = budget_planner._probe_bandwidth
    monkeypatch.setattr(budget_planner, "_probe_bandwidth", lambda *a, **kw: 100 * real_probe(*a, **kw))
    monkeypatch.setattr(cost, "OFFLOAD_REGION_SECONDS", 0.0)
    monkeypatch.setattr(cost, "HOOKED_TENSOR_SECONDS", 0.0)

    model = build()
    batch = ADAPTER.presets["tiny"].inputs(model, tokens=4096, generator=torch.Generator().manual_seed(0))
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    none_peak, _, _, _ = run(model, batch, None)
    static = torch.cuda.memory_allocated()

    seen = []

    def scenario(share):
        budget = int(static + (none_peak - static) * share)
        cfg = auto_config(budget)
        try:
            _, _, roomy, _ = run(model, batch, cfg)  # the whole device: the cheapest plan
        except memfit.BudgetError:
            seen.append((share, "below the floor"))
            return None
        capacity = int(budget / ALLOCATOR_HEADROOM)
        need = card_need(roomy.predicted_peak_bytes, roomy.copied_bytes)
        seen.append((share, roomy.copied_bytes >> 20, need >> 20, int(CARD_FIT * capacity) >> 20))
        return (budget, cfg, roomy, capacity) if roomy.copied_bytes and need > CARD_FIT * capacity else None

    # the planner's choice between copies and recompute moves with its cost model: the first budget between the
    # static bytes and the unmodified peak whose cheapest plan copies more than the card's room
    shares = (0.45, 0.35, 0.55, 0.25, 0.65, 0.3, 0.4, 0.5, 0.2, 0.75)
    found = next(filter(None, map(scenario, shares)), None)
    assert found, (
        f"no budget's cheapest plan copies more than the card holds (share, MiB copied, needed, room): {seen}"
    )
    budget, cfg, roomy, capacity = found
    device = torch.device("cuda", torch.cuda.current_device())
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(capacity / total, device)
    handle = memfit.apply(model, cfg, adapter=ADAPTER)
    try:
        retries = []
        for _ in range(6):
            model.zero_grad(set_to_none=True)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
                ADAPTER.loss(model(**batch)).backward()
            torch.cuda.synchronize()
            retries.append(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))
        plan = handle.plan
        assert card_need(plan.predicted_peak_bytes, plan.copied_bytes) <= CARD_FIT * capacity
        assert plan.copied_bytes < roomy.copied_bytes and plan.predicted_peak_bytes <= budget
        assert retries[-1] == retries[1], retries  # no flush once planned
        assert all(
            s["measured_peak_bytes"] is None or s["measured_peak_bytes"] <= budget
            for s in handle.stats()["shapes"]
        )
    finally:
        handle.remove()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()


def test_streamed_blocks_take_every_policy_on_cuda_with_the_unmodified_gradients(monkeypatch):
    """Every block's frozen weights stream (CUDA's upload stream and events) and the blocks cycle through every
    policy ``auto`` may give a streamed block: those not recomputed whole save references to their weights, freed
    after the forward and uploaded again for backward. Gradients within the unmodified model's own run-to-run
    difference; no forward upload held; none issued on demand after the first step."""
    peft = pytest.importorskip("peft")
    from helpers import every_streamed_policy, force_auto_plan

    model = build().requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    batch, _, ref, noise = reference(model)
    force_auto_plan(monkeypatch, every_streamed_policy, lambda names: names)
    on_demand, grads, stats, _ = forced_plan_steps(model, batch, "weight_uploads_on_demand")
    assert_within_noise(grads, ref, noise)
    assert stats["streamed_blocks"] == 9 and stats["weight_held_after_forward"] == 0
    assert stats["block_calls_parked"] > 0
    assert on_demand[1] == on_demand[2], on_demand  # the uploads run ahead from the second step on
