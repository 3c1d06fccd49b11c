"""``auto``'s closed loop: each step of a new input shape is measured, and a plan whose step ran over the budget
is replaced with the measured error folded in; from then on every step is within the budget. On CPU the step's
peak comes from a stand-in meter that reports the installed plan's prediction plus a chosen error."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import memfit
from memfit import MemfitWarning
from memfit.auto import budget_planner

from helpers import auto_config

memfit_flux = pytest.importorskip("memfit_flux")
ADAPTER = memfit_flux.ADAPTER


class StandInMeter:
    """Reports ``prediction() + error`` as the step's peak (allocated and reserved), counting resets; ``readings``
    are the steps' (at the next forward), ``so_far`` those at each backward's end."""

    def __init__(self, error: int) -> None:
        self.error = error
        self.prediction = lambda: 0
        self.resets = 0
        self.readings: list[int] = []
        self.so_far: list[int] = []

    def read(self) -> tuple[int, int]:
        peak = self.prediction() + self.error
        self.readings.append(peak)
        return peak, peak

    def read_so_far(self) -> tuple[int, int]:
        peak = self.prediction() + self.error
        self.so_far.append(peak)
        return peak, peak

    def reset(self) -> None:
        self.resets += 1

    def current(self) -> int:
        return 0

    def at_limit(self) -> bool:
        return False


@pytest.fixture
def model():
    return ADAPTER.presets["tiny"].build()


def inputs(model, tokens=64):
    return ADAPTER.presets["tiny"].inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))


def open_loop_plan(model, batch, budget):
    """The plan made without a meter (no closed loop) for ``budget``."""
    with memfit.apply(model, auto_config(budget)) as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        ADAPTER.loss(model(**batch)).backward()
        plan = handle.plan
    model.zero_grad(set_to_none=True)
    return plan


def no_checkpoint_peak(model, batch) -> tuple[int, int]:
    plan = open_loop_plan(model, batch, 1 << 30)
    return plan.no_checkpoint_peak_bytes, plan.smallest_peak_bytes


def budget_just_above_a_plan(model, batch) -> int:
    """A budget whose first plan (made with the margin) is leaner than what the budget allows: a plan's
    predicted peak sits 2% under it."""
    none, smallest = no_checkpoint_peak(model, batch)
    plan = open_loop_plan(model, batch, (none + smallest) // 2)
    return int(plan.predicted_peak_bytes / 0.98)


def train(model, batch, budget, meter, steps):
    """``steps`` training steps under ``auto`` with the stand-in meter; the plan that ran each step and the
    handle's budget report."""
    cfg = {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_memory_budget": budget,
    }
    ran = []
    with memfit.apply(model, cfg) as handle:
        meter.prediction = lambda: handle.plan.predicted_peak_bytes
        for _ in range(steps):
            ADAPTER.loss(model(**batch)).backward()
            model.zero_grad(set_to_none=True)
            ran.append(handle.plan)
        ADAPTER.loss(model(**batch)).backward()  # the last step is measured when the next forward starts
        model.zero_grad(set_to_none=True)
        return ran, handle.stats()


def train_saying(model, batch, budget, meter, monkeypatch, steps):
    """:func:`train` with ``meter`` as the closed loop's meter; also every MemfitWarning's message."""
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemfitWarning)
        ran, stats = train(model, batch, budget, meter, steps=steps)
    return ran, stats, [str(w.message) for w in caught]


@pytest.mark.parametrize("error_share", [0.03, 0.08])
def test_steps_stay_within_the_budget_after_at_most_one_correction(model, monkeypatch, error_share):
    """An under-prediction smaller than the first plan's margin never reaches the budget; a larger one makes
    the first step run over once, is said once, and every later step is within the budget."""
    batch = inputs(model)
    none, smallest = no_checkpoint_peak(model, batch)
    budget = (none + smallest) // 2
    meter = StandInMeter(int(error_share * budget))
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MemfitWarning)
        ran, stats = train(model, batch, budget, meter, steps=6)
    over = [m for m in meter.readings if m > budget]
    said = [w for w in caught if "over the budget" in str(w.message)]
    within_margin = error_share < budget_planner.FIRST_PLAN_MARGIN
    assert over == ([] if within_margin else meter.readings[:1]), (meter.readings, budget)
    assert len(said) == (0 if within_margin else 1)
    assert stats["shapes"][0]["corrections"] == (0 if within_margin else 1)
    assert stats["shapes"][0]["measured_peak_bytes"] == meter.readings[-1]
    assert stats["budget_bytes"] == budget


def test_the_first_plan_keeps_a_margin_and_then_uses_what_was_measured(model, monkeypatch):
    batch = inputs(model)
    budget = budget_just_above_a_plan(model, batch)
    meter = StandInMeter(error=0)  # the model is exact: the margin can be given back
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    ran, stats = train(model, batch, budget, meter, steps=6)
    margin = int(budget_planner.FIRST_PLAN_MARGIN * budget)
    assert ran[0].budget_bytes <= budget - margin
    assert ran[-1].budget_bytes > ran[0].budget_bytes  # a plan for the measured room replaced it
    assert all(m <= budget for m in meter.readings)
    assert stats["shapes"][0]["corrections"] == 0 and stats["shapes"][0]["settled"]


def test_a_faster_plan_that_runs_over_falls_back_to_the_measured_one_for_good(model, monkeypatch):
    batch = inputs(model)
    budget = budget_just_above_a_plan(model, batch)
    meter = StandInMeter(error=0)
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    cfg = {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_memory_budget": budget,
    }
    with memfit.apply(model, cfg) as handle, warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        first = None

        def prediction():  # the first plan is exact; any other plan runs a tenth of the budget over
            return handle.plan.predicted_peak_bytes + (0 if handle.plan is first else budget // 10)

        meter.prediction = prediction
        plans = []
        for _ in range(7):
            ADAPTER.loss(model(**batch)).backward()
            model.zero_grad(set_to_none=True)
            first = first or handle.plan
            plans.append(handle.plan)
        stats = handle.stats()
    assert plans[1] is not first  # a faster plan was tried
    assert plans[-1] is first and stats["shapes"][0]["settled"]  # and the measured one came back for good
    over = [m for m in meter.readings if m > budget]
    assert len(over) == 1  # the one step of the plan that was tried


class ResetByTheTrainer(StandInMeter):
    """A trainer that resets the peak statistics after each backward, before the optimizer's step (to log its own
    peak, as a step-begin callback does): every reading at the next forward is what was allocated at that reset,
    below what the forward's end had allocated; the backward's end read the step's peak before it."""

    def read(self) -> tuple[int, int]:
        peak = self.prediction() // 4
        self.readings.append(peak)
        return peak, peak

    def current(self) -> int:
        return self.prediction() // 2


class ResetBeforeBackward(ResetByTheTrainer):
    """A trainer that resets the statistics between the forward and the backward: the backward's end reads no
    more than that reset left either."""

    def read_so_far(self) -> tuple[int, int]:
        peak = self.prediction() // 4
        self.so_far.append(peak)
        return peak, peak


def test_a_reset_after_the_backward_is_measured_at_the_backward_s_end(model, monkeypatch):
    """With an exact meter this budget lets the closed loop give the first plan's margin back (the test above); a
    trainer that resets the statistics after each backward spoils every reading at the next forward, and the
    backward's end, read before the reset, measures the steps instead: the margin comes back as with the exact
    meter, and nothing is said."""
    batch = inputs(model)
    budget = budget_just_above_a_plan(model, batch)
    meter = ResetByTheTrainer(error=0)
    ran, stats, said = train_saying(model, batch, budget, meter, monkeypatch, steps=6)
    assert not any("peak statistics are reset" in m for m in said)
    shape = stats["shapes"][0]
    assert (
        shape["unreadable_steps"] == 0 and shape["steps_read_at_backward_end"] == shape["steps_measured"] > 0
    )
    margin = int(budget_planner.FIRST_PLAN_MARGIN * budget)
    assert ran[0].budget_bytes <= budget - margin < ran[-1].budget_bytes
    assert all(m <= budget for m in meter.so_far) and shape["corrections"] == 0 and shape["settled"]


@pytest.mark.parametrize("spoilt", ["reset before the backward", "the optimizer's step binds"])
def test_a_reading_below_the_forward_end_is_no_peak_and_tries_no_faster_plan(model, monkeypatch, spoilt):
    """When the backward's end cannot stand in for the step either (the statistics were reset before it, or the
    optimizer's step, which comes after it, is where the plan peaks), the readings say nothing about the peak: the
    first, leaner plan stays, the steps are reported unreadable and that is said once."""
    batch = inputs(model)
    budget = budget_just_above_a_plan(model, batch)
    if spoilt == "reset before the backward":
        meter = ResetBeforeBackward(error=0)
    else:
        meter = ResetByTheTrainer(error=0)
        monkeypatch.setattr(budget_planner.BudgetPlanner, "_optimizer_step_binds", lambda self, shape: True)
    ran, stats, said = train_saying(model, batch, budget, meter, monkeypatch, steps=6)
    assert sum("peak statistics are reset" in m for m in said) == 1
    shape = stats["shapes"][0]
    assert all(plan is ran[0] for plan in ran)
    assert shape["unreadable_steps"] == len(meter.readings) and shape["corrections"] == 0
    assert shape["steps_measured"] == 0 and not shape["settled"] and shape["steps_read_at_backward_end"] == 0


def test_settled_shapes_are_not_measured_any_more(model, monkeypatch):
    batch = inputs(model)
    none, smallest = no_checkpoint_peak(model, batch)
    meter = StandInMeter(error=0)
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    train(model, batch, (none + smallest) // 2, meter, steps=12)
    assert len(meter.readings) <= budget_planner.CALIBRATION_STEPS + 3  # calibration only, then no resets


def test_a_card_too_small_for_the_leanest_plan_is_a_budget_error_that_names_a_card_that_holds_it(
    model, monkeypatch
):
    """On a card of the budget's size the caching allocator needs room above the allocated peak (its headroom,
    and a reserve about as large as what a step copies): a plan within the budget but not within that room runs
    out of memory (a full fine-tune at 1.01x its peak: every mode did, on an H200 limited to it). That is a
    BudgetError before any step, naming the device's size; the size it suggests runs, its steps within budget."""
    batch = inputs(model)
    _, smallest = no_checkpoint_peak(model, batch)
    budget = int(smallest * 1.05)
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: budget)
    meter = StandInMeter(error=0)
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    with (
        warnings.catch_warnings(),
        pytest.raises(memfit.BudgetError, match="this process can hold") as raised,
    ):
        warnings.simplefilter("ignore", MemfitWarning)
        train(model, batch, budget, meter, steps=1)
    assert not meter.readings  # before any step
    card = raised.value.suggested_budget_bytes
    assert card > budget
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: card)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        ran, _ = train(model, batch, card, meter, steps=3)
    assert all(
        budget_planner.card_need(p.predicted_peak_bytes, p.copied_bytes) <= budget_planner.CARD_FIT * card
        for p in ran
    )
    assert meter.readings and all(m <= card for m in meter.readings)


def test_the_optimizer_state_the_first_step_adds_is_planned_before_any_step(model, monkeypatch):
    """Full fine-tune: the first optimizer.step() allocates AdamW's state after the first backward, so the profile of
    the first shape cannot see it. auto plans it as static bytes: a budget that holds forward and backward but not
    that state is a BudgetError before any step, naming the state and the key; a declared optimizer without state
    plans within the same budget."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    static = trainable  # the stand-in profile counts the weights as CUDA's would

    def device_like(profile_model):
        def profile(*args, **kwargs):
            prof = profile_model(*args, **kwargs)
            return dataclasses.replace(prof, static_bytes=static, counts_transient=True)

        return profile

    monkeypatch.setattr(budget_planner, "profile_model", device_like(budget_planner.profile_model))
    batch = inputs(model)

    def first_plan(budget, **extra):
        with warnings.catch_warnings(), memfit.apply(model, {**auto_config(budget), **extra}) as handle:
            warnings.simplefilter("ignore", MemfitWarning)
            ADAPTER.loss(model(**batch)).backward()
            model.zero_grad(set_to_none=True)
            return handle.plan

    roomy = first_plan(static + 20 * trainable)
    bare = first_plan(static + 20 * trainable, gradient_checkpointing_optimizer_state="none")
    assert (
        roomy.no_checkpoint_peak_bytes - bare.no_checkpoint_peak_bytes == 2 * trainable
    )  # AdamW: 2 per byte
    eight_bit = first_plan(static + 20 * trainable, gradient_checkpointing_optimizer_state="adamw8bit")
    assert eight_bit.no_checkpoint_peak_bytes - bare.no_checkpoint_peak_bytes == trainable // 2

    tight = bare.smallest_peak_bytes + trainable  # holds the step without the state, not with it
    with pytest.raises(memfit.BudgetError, match="optimizer state.*gradient_checkpointing_optimizer_state"):
        first_plan(tight)
    assert first_plan(tight, gradient_checkpointing_optimizer_state=0).predicted_peak_bytes <= tight


def test_on_a_card_of_the_budget_s_size_no_plan_targets_past_the_allocator_headroom(model, monkeypatch):
    """The allocator's reserve measured in one step does not bound the next's (a full fine-tune at 24 GiB on an
    H200 limited to it: 0.5 GiB over its allocated peak in the first step, 2.5 GiB in the second, out of memory
    from fragmentation in the third): where the process can hold no more than the budget, the closed loop gives
    back the first plan's margin only up to the headroom kept for the allocator."""
    batch = inputs(model)
    none, smallest = no_checkpoint_peak(model, batch)
    budget = int(none / 0.9)  # everything kept would fit in 0.99 of it, not in the headroom
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: budget)
    meter = StandInMeter(error=0)
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        ran, stats = train(model, batch, budget, meter, steps=6)
    headroom = int(budget * budget_planner.ALLOCATOR_HEADROOM)
    assert smallest < headroom < none
    assert max(plan.budget_bytes for plan in ran) <= headroom
    assert all(plan.predicted_peak_bytes <= headroom for plan in ran)
    assert ran[-1].budget_bytes > ran[0].budget_bytes  # the first plan's own margin was given back


def test_the_optimizer_step_s_own_peak_is_planned_and_a_budget_below_it_refused(model, monkeypatch):
    """Full fine-tune with torch's foreach AdamW: its step holds the weights, the state, every gradient and a
    copy of the second moments at once, whatever the activations did (the synthetic stack at 16384 tokens: 21.2
    GiB, above the 19.2 GiB its smallest activation plan peaks at). Every plan's predicted peak counts it; a
    budget below it is a BudgetError naming the optimizer step; an optimizer without temporaries plans under it."""
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    static = trainable
    monkeypatch.setattr(budget_planner, "profile_model", _device_like(budget_planner.profile_model, static))
    batch = inputs(model)
    step_peak = static + 2 * trainable + trainable + trainable  # weights, AdamW state, gradients, temporaries
    roomy = _first_plan(model, batch, 100 * trainable)
    assert roomy.predicted_peak_bytes >= step_peak
    bare = _first_plan(model, batch, 100 * trainable, gradient_checkpointing_optimizer_state="none")
    assert bare.smallest_peak_bytes + 2 * trainable < step_peak  # the activations alone would fit under it
    with pytest.raises(memfit.BudgetError, match="optimizer step's own peak") as raised:
        _first_plan(model, batch, step_peak - 1)
    assert raised.value.smallest_peak_bytes == step_peak
    assert raised.value.suggested_budget_bytes >= step_peak
    assert _first_plan(model, batch, step_peak).predicted_peak_bytes <= step_peak
    # a state of two bytes per byte given as a number: no temporaries counted
    assert _first_plan(
        model, batch, step_peak - 1, gradient_checkpointing_optimizer_state=2
    ).predicted_peak_bytes < (step_peak)


def _device_like(profile_model, static):
    """``profile_model`` as on CUDA: ``static`` allocated before the forward, the peak model's transients counted."""

    def profile(*args, **kwargs):
        prof = profile_model(*args, **kwargs)
        return dataclasses.replace(prof, static_bytes=static, counts_transient=True)

    return profile


def _first_plan(model, batch, budget, **extra):
    with warnings.catch_warnings(), memfit.apply(model, {**auto_config(budget), **extra}) as handle:
        warnings.simplefilter("ignore", MemfitWarning)
        ADAPTER.loss(model(**batch)).backward()
        model.zero_grad(set_to_none=True)
        return handle.plan


class LimitMeter(StandInMeter):
    """Exact peaks; a step whose plan predicts more than ``limit`` bytes reached the process's limit (the caching
    allocator freed its cache and retried), as in a process capped near its budget."""

    def __init__(self, limit: int) -> None:
        super().__init__(error=0)
        self.limit = limit
        self.at_limit_readings: list[bool] = []

    def at_limit(self) -> bool:
        reached = self.prediction() > self.limit
        self.at_limit_readings.append(reached)
        return reached


def test_a_step_at_the_process_s_limit_is_re_planned_leaner_and_nothing_above_is_tried_again(
    model, monkeypatch
):
    """On the H200 capped at the budget, steps within the budget whose allocator had to free its cache and retry
    ran out of memory a few steps later (the synthetic stack, LoRA on every linear, 24 GiB). Such a step counts
    as a correction: the plan is made LIMIT_STEP_BACK of the budget leaner, said once, and no faster plan is tried
    above it afterwards."""
    batch = inputs(model)
    budget = budget_just_above_a_plan(model, batch)
    first = open_loop_plan(model, batch, budget - int(budget_planner.FIRST_PLAN_MARGIN * budget))
    meter = LimitMeter(limit=first.predicted_peak_bytes - 1)  # the first plan's steps reach the limit
    ran, stats, said = train_saying(model, batch, budget, meter, monkeypatch, steps=8)
    assert sum("reached what this process may hold" in m for m in said) == 1
    shape = stats["shapes"][0]
    assert shape["steps_at_limit"] >= 1 and shape["corrections"] >= 1
    assert ran[0].predicted_peak_bytes == first.predicted_peak_bytes
    assert all(plan.predicted_peak_bytes <= meter.limit for plan in ran[1:])  # never back above it
    assert meter.at_limit_readings.count(True) == shape["steps_at_limit"]


def test_steps_at_the_limit_step_back_to_the_smallest_plan_and_then_settle(model, monkeypatch):
    """Every plan reaches the limit (the optimizer step alone does, say): the loop steps back to the smallest plan
    and then stays there, settled, instead of re-planning at every step."""
    batch = inputs(model)
    none, smallest = no_checkpoint_peak(model, batch)
    meter = LimitMeter(limit=0)
    monkeypatch.setattr(budget_planner, "default_peak_meter", lambda device: meter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        ran, stats = train(model, batch, (none + smallest) // 2, meter, steps=40)
    assert ran[-1].predicted_peak_bytes == smallest
    assert stats["shapes"][0]["settled"]
    assert len(meter.readings) < 40  # measuring stopped once nothing leaner was left


def _lora(model):
    peft = pytest.importorskip("peft")
    model.requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=1, target_modules=["to_q", "to_v"]))
    return model


def test_a_lora_plan_that_copies_nothing_may_go_past_the_allocator_headroom(model, monkeypatch):
    """A plan that parks nothing and streams nothing in a job that trains few weights (LoRA) left the allocator's
    reserve within ~1 GiB (Flux with LoRA at 48 GiB: `torch-ffn` at 0.934 of the process allocated, 0.955
    reserved, never out of memory): on a card of the budget's size such plans may go up to LEAN_HEADROOM, where
    the rest keep to ALLOCATOR_HEADROOM. The first plan keeps its margin below that; the closed loop gives it back."""
    lora = _lora(model)
    weights = sum(p.numel() * p.element_size() for p in lora.parameters())
    trainable = sum(p.numel() * p.element_size() for p in lora.parameters() if p.requires_grad)
    assert trainable <= budget_planner.FEW_TRAINABLE_SHARE * weights
    monkeypatch.setattr(budget_planner, "profile_model", _device_like(budget_planner.profile_model, weights))
    batch = inputs(lora)
    none, smallest = no_checkpoint_peak(lora, batch)
    budget = int(
        none / 0.9
    )  # nothing recomputed fits within LEAN_HEADROOM of it, not within ALLOCATOR_HEADROOM
    assert budget_planner.ALLOCATOR_HEADROOM * budget < none < budget_planner.LEAN_HEADROOM * budget
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: budget)
    ran, _, said = train_saying(lora, batch, budget, StandInMeter(error=0), monkeypatch, steps=6)
    lean = int(budget * budget_planner.LEAN_HEADROOM)
    assert all(p.predicted_peak_bytes <= p.budget_bytes <= lean for p in ran)
    last = ran[-1]
    assert last.budget_bytes > budget * budget_planner.ALLOCATOR_HEADROOM  # past the headroom: a quiet plan
    assert not last.needed or not (last.copied_bytes or last.streamed)
    assert last.predicted_extra_seconds < ran[0].predicted_extra_seconds  # the first plan kept its margin
    assert any("for a plan that copies nothing" in m for m in said)


def test_a_full_fine_tune_keeps_to_the_allocator_headroom_however_quiet_its_plan(model, monkeypatch):
    """Where most weights train, LEAN_HEADROOM does not apply (a full fine-tune's gradients and optimizer state
    fragmented the allocator into running out of memory at 24 GiB with 4 GiB reserved but free)."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setattr(budget_planner, "profile_model", _device_like(budget_planner.profile_model, weights))
    batch = inputs(model)
    none, _ = no_checkpoint_peak(model, batch)
    budget = int(none / 0.9)
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: budget)
    ran, _, said = train_saying(model, batch, budget, StandInMeter(error=0), monkeypatch, steps=6)
    headroom = int(budget * budget_planner.ALLOCATOR_HEADROOM)
    assert all(
        p.budget_bytes <= headroom for p in ran
    )  # (its optimizer step may peak above: below the floor)
    assert ran[-1].budget_bytes == headroom  # the margin given back, up to the headroom and no further
    assert not any("for a plan that copies nothing" in m for m in said)


class FirstStepReserveMeter(StandInMeter):
    """Exact allocated peaks; the first step's reserved peak ``excess`` above it, none after."""

    def __init__(self, excess: int) -> None:
        super().__init__(error=0)
        self.excess = excess

    def read(self) -> tuple[int, int]:
        allocated, _ = super().read()
        return allocated, allocated + (self.excess if len(self.readings) == 1 else 0)


def _tried(ran):
    """The plans a run tried, in order (each one once, where it started)."""
    return [p for k, p in enumerate(ran) if k == 0 or not p.runs_like(ran[k - 1])]


def _fine_grained(model, monkeypatch):
    """``model``'s inputs, with static bytes that make each of its 7 blocks' activations about 1% of a budget
    near its unmodified peak (plans a step apart then differ), and that peak."""
    batch = inputs(model)
    profile_model = budget_planner.profile_model
    monkeypatch.setattr(budget_planner, "profile_model", _device_like(profile_model, 0))
    activations, _ = no_checkpoint_peak(model, batch)
    monkeypatch.setattr(budget_planner, "profile_model", _device_like(profile_model, 14 * activations))
    none, _ = no_checkpoint_peak(model, batch)
    return batch, none


def test_a_plan_without_copies_is_tried_again_once_a_step_measured_the_room_for_the_lean_target(
    model, monkeypatch
):
    """Flux with LoRA on every linear at 32 GiB: the first step's reserve (its plan copied) left little room, and
    the plan given back for it reserved little. The lean target's plan is tried after that one too."""
    lora = _lora(model)
    batch, none = _fine_grained(lora, monkeypatch)
    budget = int(none / 0.93)  # nothing recomputed fits the lean target once a step measured little reserve
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: budget)
    meter = FirstStepReserveMeter(excess=int(0.09 * budget))
    ran, _, _ = train_saying(lora, batch, budget, meter, monkeypatch, steps=6)
    tried = _tried(ran)
    assert len(tried) == 3, [
        p.counts() for p in tried
    ]  # the first plan, one a step's reserve allowed, the fastest
    assert (
        tried[0].predicted_extra_seconds > tried[1].predicted_extra_seconds > tried[2].predicted_extra_seconds
    )
    assert not tried[2].needed or tried[2].predicted_extra_seconds == 0
    assert all(m <= budget for m in meter.readings)


def test_other_plans_give_the_first_plan_s_margin_back_once(model, monkeypatch):
    """Where the lean target does not apply (here a full fine-tune), one faster plan is tried per shape: every try
    runs near the process's limit (at Flux's LoRA floors more tries stepped back at the limit and ran slower)."""
    batch, none = _fine_grained(model, monkeypatch)
    budget = int(none / 0.835)  # nothing recomputed fits the headroom, not the first plan
    monkeypatch.setattr(budget_planner, "device_capacity", lambda device: budget)
    meter = FirstStepReserveMeter(excess=int(0.17 * budget))
    ran, _, _ = train_saying(model, batch, budget, meter, monkeypatch, steps=6)
    tried = _tried(ran)
    assert len(tried) == 2, [p.counts() for p in tried]
    assert tried[1].predicted_extra_seconds < tried[0].predicted_extra_seconds
