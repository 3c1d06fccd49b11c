"""The ``auto`` backend's planner: a per-block plan for each input signature, under a memory budget.

Design notes
------------
At a forward with gradients whose input signature (tensor shapes, dtypes, devices; plain scalar arguments)
differs from the last one, the controller (:mod:`memfit.controller`) takes the current installation off and
asks :meth:`BudgetPlanner.plan_for`: it profiles the bare model (:func:`profile_model`: one forward with
gradients that holds nothing, one timed forward without), plans (:func:`plan_policies`), and returns the plan
the controller installs. Profiles and plans are cached per signature: switching back to an earlier
aspect-ratio bucket re-installs its plan without profiling again.

Readings.  The closed loop reads the allocator's peak statistics, which a trainer may reset too (to log its
own per-step peak). A reading is never above the step's true peak, so one over the budget is always acted on;
one below what was allocated when the step's forward ended cannot be the step's peak (the statistics were
reset after that): it is not counted, and no faster plan is tried on it.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

import memfit.offload.hostmem as hostmem
from memfit.adapters.spec import FamilyAdapter
from memfit.auto.allocator import EXPANDABLE_HINT, expandable_segments
from memfit.auto.planner import (
    CARD_FIT,
    EXPANDABLE_COPY_RESERVE,
    Plan,
    card_need,
    plan_policies,
    reserve_per_copied_byte,
    suggested_budget,
)
from memfit.auto.policy import allowed_policies
from memfit.auto.profile import BlockProfile, ModelProfile, profile_model, streamed_allocation
from memfit.auto.streaming import StreamedSet, choose_streaming, streamable_counts
from memfit.config import OPTIMIZER_STATE, OPTIMIZER_STEP_TEMPORARIES
from memfit.errors import BudgetError, MemfitWarning
from memfit.offload.streamable import choose_streamed_blocks, frozen_sizes
from memfit.plan import BlockPolicy, RegionPlan
from memfit.units import format_bytes

# a budget is planned for at most this share of what the process can hold, until a step measured the
# allocator's own reserve (docs/cost-model.md, "Allocator headroom")
ALLOCATOR_HEADROOM = 0.84
# the same for a plan that copies nothing (no parked activations, no streamed weights) in a job that trains few of its
# weights (LoRA): such plans reserved at most ~1 GiB over their allocated peak (docs/cost-model.md)
LEAN_HEADROOM = 0.94
FEW_TRAINABLE_SHARE = 0.05  # of the model's weight bytes: at most this many train for LEAN_HEADROOM to apply
# the first plan of each input shape targets this much less than the budget: its own step must fit too, and
# the peak model has under-predicted by up to 4% (docs/cost-model.md, "The budget is a promise")
FIRST_PLAN_MARGIN = 0.05
# once steps are measured, what is left of the margin on top of the measured prediction error
MEASURED_MARGIN = 0.01
# a step that reached the process's limit (the allocator freed its cache and retried) is re-planned this share of the
# budget leaner: a card of the budget's size had one allocation left before running out (docs/cost-model.md)
LIMIT_STEP_BACK = 0.03
# _plan_at's searches (see "Copy reserve"): every policy, copies weighed with their reserve, no parked activations;
# and the lean target's: nothing parked and nothing streamed
_PLAIN, _RESERVE, _NO_OFFLOAD, _NO_COPY = "plain", "reserve", "no-offload", "no-copy"
# of what the process can hold: the most a model that starts on the host keeps resident while auto profiles it
# (the rest is the profile's own room: one forward's working memory, one block alone forward and backward)
PROFILE_RESIDENT_SHARE = 0.5
CALIBRATION_STEPS = 3  # measured steps without a change after which a shape's plan is settled
MENTIONED_OPTIMIZER_SHARE = 0.05  # a BudgetError names the optimizer state from this share of the peak on


def plannable_budget(
    budget_bytes: int, capacity_bytes: int | None, *, headroom: float = ALLOCATOR_HEADROOM
) -> int:
    """The budget the planner works to: ``budget_bytes``, at most ``headroom`` of ``capacity_bytes`` (what the
    process can hold on its device; None: no cap)."""
    if capacity_bytes is None:
        return budget_bytes
    return min(budget_bytes, int(capacity_bytes * headroom))


def device_capacity(device: torch.device) -> int | None:
    """Bytes this process can hold on ``device``: what is free plus what its allocator reserved, at most the
    per-process limit ``torch.cuda.set_per_process_memory_fraction`` set (None off CUDA)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if fraction is not None:
        capacity = min(capacity, int(total * fraction(device)))
    return capacity


class PeakMeter(Protocol):
    """Reads the peak memory of the step that just ended (allocated and reserved bytes) and starts a new one."""

    def read(self) -> tuple[int, int]: ...

    def read_so_far(self) -> tuple[int, int]:
        """The peaks since the last reset, read inside a step (where its backward ends); nothing starts anew."""
        ...

    def reset(self) -> None: ...

    def current(self) -> int:
        """Bytes allocated now."""
        ...

    def at_limit(self) -> bool:
        """Whether the step since the last reset reached what the process may hold: the allocator had to free its
        cache and retry an allocation."""
        ...


class CudaPeakMeter:
    """The CUDA caching allocator's peak statistics (``max_memory_allocated``/``max_memory_reserved``)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._retries = self._retries_now()

    def read(self) -> tuple[int, int]:
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    read_so_far = read

    def reset(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)
        self._retries = self._retries_now()

    def current(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def at_limit(self) -> bool:
        return self._retries_now() > self._retries

    def _retries_now(self) -> int:
        return int(torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0))


def default_peak_meter(device: torch.device) -> PeakMeter | None:
    """The meter of the closed loop on ``device``: CUDA's allocator statistics; None elsewhere (off CUDA the
    budget counts held activation bytes, which the profile measures exactly)."""
    return CudaPeakMeter(device) if device.type == "cuda" else None


@dataclass
class ShapeBudget:
    """The closed loop of one input shape: the plan it runs, what its steps measured, and the corrections."""

    profile: ModelProfile
    plan: Plan
    target_bytes: int  # what the current plan was made for
    fallback: Plan | None = None  # the last plan measured within the budget, while a faster one is tried
    steps: int = 0  # steps measured
    quiet: int = 0  # measured steps since the plan last changed
    corrections: int = 0  # plans replaced: a step measured over the budget, or at the process's limit
    limit_steps: int = 0  # steps at what the process may hold (the allocator freed its cache and retried)
    ceiling_bytes: int | None = None  # after such a step: no plan is tried for more than this
    measured_bytes: int | None = None  # the latest step's peak allocated
    measured_reserved_bytes: int | None = None
    settled: bool = False  # no more measuring for this shape
    # allocated when the latest forward ended: a step's peak is at least this
    forward_end_bytes: int | None = None
    # (allocated, reserved) peaks read when the latest measured step's backward ended
    backward_reading: tuple[int, int] | None = None
    unreadable: int = 0  # steps whose peak reading was below that (the statistics were reset during the step)
    backward_readings: int = 0  # steps measured at the backward's end instead (the statistics reset after it)

    def report(self) -> dict[str, Any]:
        return {
            "predicted_peak_bytes": self.plan.predicted_peak_bytes,
            "target_bytes": self.target_bytes,
            "measured_peak_bytes": self.measured_bytes,
            "measured_reserved_bytes": self.measured_reserved_bytes,
            "steps_measured": self.steps,
            "corrections": self.corrections,
            "settled": self.settled,
            "unreadable_steps": self.unreadable,
            "steps_read_at_backward_end": self.backward_readings,
            "steps_at_limit": self.limit_steps,
        }


def input_signature(args: tuple, kwargs: dict) -> tuple:
    """What a plan depends on: tensor shapes/dtypes/devices and plain scalar arguments."""

    def sig(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return ("tensor", tuple(x.shape), str(x.dtype), str(x.device))
        if isinstance(x, (bool, int, float, str, type(None))):
            return x
        if isinstance(x, (list, tuple)):
            return tuple(sig(v) for v in x)
        if isinstance(x, dict):
            return tuple(sorted((k, sig(v)) for k, v in x.items()))
        return type(x).__name__

    return sig(args), sig(kwargs)


def _timed(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of :class:`BudgetPlanner` with its wall time added to the planner's ``planning_seconds``."""

    @functools.wraps(method)
    def timed(self: BudgetPlanner, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.planning_seconds += time.perf_counter() - start

    return timed


class BudgetPlanner:
    """Plans the ``auto`` backend for each input signature of one model (a :class:`memfit.controller.Planner`).

    Args:
        model: the transformer (an adapter must declare its blocks).
        adapter: its family adapter.
        budget_bytes: the memory budget (peak allocated on CUDA; held activation bytes elsewhere).
        can_offload: a copy engine is there (the offload policies are offered only then).
        parks_storages_once: that engine copies views covering their storage as its bytes, once
            (:attr:`memfit.offload.copy.CopyEngine.parks_storages_once`): the profile prices copies so.
        min_offload_bytes: smaller tensors are never copied.
        copy_bytes_per_second: pinned copy bandwidth for the cost model (None: measured once on CUDA).
        peak_meter: reads each step's peak for the closed loop (default: CUDA's allocator statistics).
        can_stream: frozen block weights may stream from host memory where activation policies alone do not fit
            the budget, or where streaming is cheaper (:mod:`memfit.auto.streaming`); only where the budget
            counts the device's allocated bytes (CUDA).
        host_bytes: host RAM a plan's copies and streamed weights may pin (default: what is available less the
            reserve kept for the rest of the process, :func:`host_bytes_for_plans`; ``memfit.apply`` adds what the
            running plan pins, which the next plan reuses).
        optimizer_state_per_byte: optimizer-state bytes the trainer keeps per trainable byte (AdamW: 2), which
            the first ``optimizer.step()`` allocates: planned as static bytes from the first input shape on (see
            "Optimizer state" in docs/cost-model.md).
        optimizer_temporaries_per_byte: bytes per trainable byte the optimizer's step allocates while it runs
            (foreach AdamW: 1): with every gradient and the state, a peak no plan goes below.
    """

    adaptive = True

    def __init__(
        self,
        model: nn.Module,
        adapter: FamilyAdapter,
        budget_bytes: int,
        *,
        can_offload: bool,
        parks_storages_once: bool = False,
        min_offload_bytes: int,
        copy_bytes_per_second: float | None = None,
        peak_meter: PeakMeter | None = None,
        can_stream: bool = True,
        host_bytes: Callable[[], int] | None = None,
        optimizer_state_per_byte: float = OPTIMIZER_STATE["adamw"],
        optimizer_temporaries_per_byte: float = OPTIMIZER_STEP_TEMPORARIES["adamw"],
        device: torch.device | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.budget_bytes = budget_bytes
        self.can_offload = can_offload
        self.parks_storages_once = parks_storages_once
        self.min_offload_bytes = min_offload_bytes
        self.copy_bytes_per_second = copy_bytes_per_second
        self.can_stream = can_stream
        self.optimizer_state_per_byte = optimizer_state_per_byte
        self.optimizer_temporaries_per_byte = optimizer_temporaries_per_byte
        self._host_bytes = host_bytes or host_bytes_for_plans
        device = device if device is not None else next(model.parameters()).device
        # the closed loop runs where a step's peak can be read: CUDA (or a meter given, in tests)
        self.meter = peak_meter if peak_meter is not None else default_peak_meter(device)
        self.shapes: dict[Hashable, ShapeBudget] = {}
        self.plan: Plan | None = None  # the latest signature's
        self.profile: ModelProfile | None = None
        # per profile (by id, held with it): plan_policies' budget-free searches
        self._memos: dict[int, tuple[ModelProfile, dict[Any, Any]]] = {}
        self._installed: dict[Hashable, Plan] = {}  # the plan last handed to the controller per signature
        # spent in the searches (first plans and re-plans; profiling not included)
        self.planning_seconds = 0.0
        self._warned_unneeded = False
        self._warned_capacity = False
        self._warned_copy_reserve = False
        self._warned_host_ram = False
        self._warned_over = False
        self._warned_unreadable = False
        self._warned_limit = False

    @property
    def profiles(self) -> dict[Hashable, ModelProfile]:
        return {sig: shape.profile for sig, shape in self.shapes.items()}

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        return input_signature(args, kwargs)

    def plan_for(self, signature: Hashable, args: tuple, kwargs: dict) -> RegionPlan:
        shape = self.shapes.get(signature)
        if shape is None:
            shape = self._new_shape(signature, args, kwargs)
        self.plan, self.profile = shape.plan, shape.profile
        self._installed[signature] = shape.plan
        return RegionPlan.from_policies(
            shape.plan.blocks,
            streamed=shape.plan.streamed,
            forward_uploads_ahead=shape.plan.streamed_forward_ahead,
            kept_uploads=shape.plan.streamed_kept_first,
            copies_in_flight=shape.plan.copies_in_flight_bytes,
            reload_equal_ahead=shape.plan.reload_equal_ahead,
        )

    def needs_bare_model(self, signature: Hashable) -> bool:
        return signature not in self.shapes  # a new signature is profiled

    def profiling_plan(self, device: torch.device) -> RegionPlan | None:
        """For a model on the host that trains on ``device``: None where every weight fits on it with room for
        the profile (:data:`PROFILE_RESIDENT_SHARE`), else the fewest blocks, spread over the frozen bytes, whose
        frozen weights must stream for the rest to fit in that share, each recomputed whole (nothing runs under
        this plan: the first forward is profiled with them streaming, then planned).

        Raises:
            NotAvailableError: a frozen weight that would have to stream is quantized (a tensor subclass).
        """
        capacity = device_capacity(device)
        if not self.can_stream or capacity is None:
            return None
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        room = int(PROFILE_RESIDENT_SHARE * capacity)
        if weights <= room:
            return None
        sizes = [
            (f"{path}.{i}", n) for (path, i), n in frozen_sizes(self.adapter.resolve_block_lists(self.model))
        ]
        streamable = sum(n for _, n in sizes)
        if not streamable:
            return None
        chosen = choose_streamed_blocks(sizes, min_bytes=min(weights - room, streamable))
        return RegionPlan.from_policies([(name, BlockPolicy.BLOCK) for name in chosen], streamed=chosen)

    def installed(self, signature: Hashable) -> None:
        """The next step is measured on its own: from here, after profiling and after the installation took
        streamed weights off the device."""
        shape = self.shapes.get(signature)
        if self.meter is not None and shape is not None and not shape.settled:
            self.meter.reset()

    def kept_bytes(self) -> Mapping[str, int] | None:
        return {b.name: b.saved_bytes for b in self.profile.blocks} if self.profile is not None else None

    # -- the closed loop (docs/cost-model.md, "The budget is a promise") ----------------------------------------

    def step_finished(self, signature: Hashable) -> None:
        """The step of ``signature``'s latest forward ended (the next forward with gradients begins): measure
        its peak and, while the shape calibrates, correct its plan (:meth:`replan_wanted` then says so)."""
        shape = self.shapes.get(signature)
        if (
            self.meter is None
            or shape is None
            or shape.settled
            or self._installed.get(signature) is not shape.plan
        ):
            return
        allocated, reserved = self.meter.read()
        at_limit = self.meter.at_limit()
        self.meter.reset()
        ended, shape.forward_end_bytes = shape.forward_end_bytes, None
        backward, shape.backward_reading = shape.backward_reading, None
        spoilt = ended is not None and allocated < ended and allocated <= self.budget_bytes
        if spoilt and backward is not None and backward[0] >= ended and not self._optimizer_step_binds(shape):
            # see "Readings": the statistics were reset after the backward, which read them: the step's peak but
            # for the optimizer's step, which is not what binds this plan
            (allocated, reserved), spoilt = backward, False
            shape.backward_readings += 1
        if spoilt:
            # see "Readings": the peak statistics were reset during the step, so this reading is no peak
            shape.unreadable += 1
            if shape.unreadable == CALIBRATION_STEPS and not self._warned_unreadable:
                self._warned_unreadable = True
                warnings.warn(
                    f"gradient_checkpointing_backend='auto': {CALIBRATION_STEPS} steps of one input shape read a "
                    f"peak below what their forward had allocated: CUDA's peak statistics are reset during the step "
                    f"(torch.cuda.reset_peak_memory_stats in the training loop?), before its backward ended or where "
                    f"the optimizer's step is this plan's peak. auto cannot measure its steps, so it keeps its first "
                    f"plan, made {FIRST_PLAN_MARGIN:.0%} under the budget, and does not give that margin back. Leave "
                    f"the statistics alone for the first steps of each input shape (auto resets them itself at each "
                    f"forward while it measures), or reset them only after the backward, to let it measure.",
                    MemfitWarning,
                    stacklevel=6,
                )
            return
        shape.steps += 1
        shape.quiet += 1
        shape.measured_bytes, shape.measured_reserved_bytes = allocated, reserved
        error = max(0, allocated - shape.plan.predicted_peak_bytes)
        target = self._measured_target(error, allocated, reserved)
        lean = None
        if self._few_trainable(shape.profile):
            lean = self._measured_target(error, allocated, reserved, headroom=LEAN_HEADROOM)
        if shape.ceiling_bytes is not None:
            target = min(target, shape.ceiling_bytes)
            lean = None if lean is None else min(lean, shape.ceiling_bytes)
        if at_limit:
            shape.limit_steps += 1
        if allocated > self.budget_bytes or at_limit:
            self._correct(signature, shape, target, allocated, at_limit=at_limit)
        else:
            # within the budget with room to spare: a faster plan may fit; the measured one is kept to fall back to.
            # One such plan is tried; a plan without copies for the lean target also after it, once a step measured
            # the room (each for a higher target than the last, so the tries end)
            faster, made_for = None, target
            if shape.fallback is None and target > shape.target_bytes:
                faster = self._plan_at(shape.profile, target)
            if lean is not None and lean > max(target, shape.target_bytes):
                quieter = self._quieter(shape.profile, faster or shape.plan, lean)
                if quieter is not None:
                    faster, made_for = quieter, lean
            if faster is not None and not faster.runs_like(shape.plan):
                shape.fallback, shape.plan, shape.target_bytes, shape.quiet = shape.plan, faster, made_for, 0
        if shape.quiet >= CALIBRATION_STEPS:
            shape.settled = True

    def _optimizer_step_binds(self, shape: ShapeBudget) -> bool:
        """Whether the optimizer's step is where ``shape``'s plan is predicted to peak (not its forward or
        backward)."""
        return _optimizer_step_peak(shape.profile, shape.plan) >= shape.plan.predicted_peak_bytes

    def forward_ended(self, signature: Hashable) -> bool:
        """The forward of a measured step ended: what is allocated now is a lower bound of the step's peak. True:
        the backward's end is read too (see "Readings" in docs/cost-model.md)."""
        shape = self.shapes.get(signature)
        if self.meter is None or shape is None or shape.settled:
            return False
        shape.forward_end_bytes = self.meter.current()
        shape.backward_reading = None
        return True

    def backward_ended(self, signature: Hashable) -> None:
        """The backward of a measured step ended: the peak so far, kept for a step whose next reading the trainer's
        own reset of the statistics spoils."""
        shape = self.shapes.get(signature)
        if self.meter is not None and shape is not None and not shape.settled:
            shape.backward_reading = self.meter.read_so_far()

    def replan_wanted(self, signature: Hashable) -> bool:
        """The shape's plan changed since it was installed (a correction or a faster plan to try)."""
        shape = self.shapes.get(signature)
        return shape is not None and self._installed.get(signature) is not shape.plan

    def budget_report(self) -> list[dict[str, Any]]:
        """Per input shape: the plan's predicted peak, what the steps measured, the corrections."""
        return [shape.report() for shape in self.shapes.values()]

    def _correct(
        self, signature: Hashable, shape: ShapeBudget, target: int, allocated: int, *, at_limit: bool = False
    ) -> None:
        """A step measured over the budget, or at the process's limit: fall back to the last plan measured within
        it, or plan again with the measured error (or, at the limit, :data:`LIMIT_STEP_BACK` of the budget) taken
        off; say so once."""
        predicted = shape.plan.predicted_peak_bytes
        shape.quiet = 0
        if shape.fallback is not None:  # the faster plan tried did not fit: the measured one stays for good
            shape.corrections += 1
            shape.plan, shape.fallback, shape.settled = shape.fallback, None, True
        else:
            target = min(target, shape.target_bytes - (allocated - self.budget_bytes))
            if at_limit:  # a plan that peaks that much lower than this one
                target = min(
                    target, shape.plan.predicted_peak_bytes - int(LIMIT_STEP_BACK * self.budget_bytes)
                )
                shape.ceiling_bytes = target
            leaner = self._plan_at(shape.profile, target)
            if leaner.runs_like(shape.plan) and at_limit:
                shape.settled = True  # nothing leaner to run: the step at the limit is this plan's own
                return
            shape.corrections += 1
            shape.plan, shape.target_bytes = leaner, target
        if at_limit and allocated <= self.budget_bytes:
            if not self._warned_limit:
                self._warned_limit = True
                warnings.warn(
                    f"gradient_checkpointing_backend='auto': a step of the plan for this input shape (predicted peak "
                    f"{format_bytes(predicted)}, measured {format_bytes(allocated)} allocated) reached what this "
                    f"process may hold on its device: the CUDA caching allocator had to free its cache to find "
                    f"memory (one step from running out, and slow). memfit re-planned "
                    f"{LIMIT_STEP_BACK:.0%} of the budget leaner (predicted now "
                    f"{format_bytes(shape.plan.predicted_peak_bytes)}). With PYTORCH_CUDA_ALLOC_CONF="
                    f"expandable_segments:True the allocator fragments less.",
                    MemfitWarning,
                    stacklevel=6,
                )
            return
        if not self._warned_over:
            self._warned_over = True
            warnings.warn(
                f"gradient_checkpointing_backend='auto': the plan for this input shape predicted a peak of "
                f"{format_bytes(predicted)}, and its step measured {format_bytes(allocated)}, over the budget of "
                f"{format_bytes(self.budget_bytes)}. memfit re-planned with the difference folded in (predicted now "
                f"{format_bytes(shape.plan.predicted_peak_bytes)}); the next steps stay within the budget.",
                MemfitWarning,
                stacklevel=6,
            )

    def _measured_target(
        self, error: int, allocated: int, reserved: int, *, headroom: float = ALLOCATOR_HEADROOM
    ) -> int:
        """What to plan for once a step was measured: the budget less the measured under-prediction and a small
        margin, and within the device's capacity less the allocator's measured reserve above the allocated."""
        target = self.budget_bytes - error - int(MEASURED_MARGIN * self.budget_bytes)
        capacity = device_capacity(next(self.model.parameters()).device)
        # the reserve measured in one step does not bound the next's ("Allocator headroom"): never past the headroom
        if capacity is not None:
            target = min(
                target,
                capacity - max(0, reserved - allocated),
                plannable_budget(target, capacity, headroom=headroom),
            )
        return target

    def _new_shape(self, signature: Hashable, args: tuple, kwargs: dict) -> ShapeBudget:
        measured = self._profile(args, kwargs)
        try:
            profile, plan, target = self._first_plan(measured)
        except BudgetError as exc:
            raise _with_profiling_floor(exc, measured) from None
        shape = self.shapes[signature] = ShapeBudget(profile, plan, target)
        if not plan.needed and not self._warned_unneeded:
            self._warned_unneeded = True
            warnings.warn(
                f"gradient_checkpointing_backend='auto': the budget of {format_bytes(self.budget_bytes)} needs no "
                f"checkpointing at this input shape (predicted {format_bytes(plan.predicted_peak_bytes)}); nothing "
                f"is installed. memfit re-plans if the input shape changes.",
                MemfitWarning,
                stacklevel=6,
            )
        return shape

    def _profile(self, args: tuple, kwargs: dict) -> ModelProfile:
        """:func:`profile_model`; running out of memory in it is a BudgetError (see "Profiling" in
        docs/cost-model.md)."""
        device = next(self.model.parameters()).device
        try:
            return profile_model(
                self.model,
                self.adapter,
                args,
                kwargs,
                min_offload_bytes=self.min_offload_bytes,
                copy_bytes_per_second=self._bandwidth(),
                storages_once=self.parks_storages_once,
            )
        except torch.OutOfMemoryError:
            pass  # raised below, outside the handler: its traceback holds the failed forward's tensors
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        capacity = device_capacity(device)
        room = f" of the {format_bytes(capacity)} this process can hold" if capacity is not None else ""
        streamed = streamed_allocation(self.model) if device.type == "cuda" else 0
        weights = (
            f"with {format_bytes(streamed)} of frozen weights streaming from host memory and the rest on the device"
            if streamed
            else "with every weight on the device"
        )
        error = BudgetError(
            f"gradient_checkpointing_backend='auto' ran out of memory in its profiling forward, which runs the model "
            f"once per new input shape {weights} ({format_bytes(resident)}{room} allocated before it), before any "
            f"plan applies. The process needs room for those weights and one forward's working memory: free memory "
            f"on the device, use a larger one, or shrink the step (batch, resolution).",
            smallest_peak_bytes=resident,
            suggested_budget_bytes=suggested_budget(resident, copied_bytes=0),
        )
        raise error

    def _first_plan(self, profile: ModelProfile) -> tuple[ModelProfile, Plan, int]:
        """The first plan of a new input shape: the profile with the optimizer's bytes, the plan, its target."""
        capacity = device_capacity(next(self.model.parameters()).device)
        budget = plannable_budget(self.budget_bytes, capacity)
        lean_budget = None
        if self._few_trainable(profile):
            lean_budget = plannable_budget(self.budget_bytes, capacity, headroom=LEAN_HEADROOM)
        if budget < self.budget_bytes and not self._warned_capacity:
            self._warned_capacity = True
            lean_note = (
                f" ({format_bytes(lean_budget)} for a plan that copies nothing to host memory)"
                if lean_budget is not None and lean_budget > budget
                else ""
            )
            warnings.warn(
                f"gradient_checkpointing_backend='auto': the budget of {format_bytes(self.budget_bytes)} leaves the "
                f"CUDA caching allocator too little room on this device ({format_bytes(capacity or 0)} usable by "
                f"this process; its reserve runs up to {1 / ALLOCATOR_HEADROOM:.2f}x the allocated peak under "
                f"offload): planning for {format_bytes(budget)}{lean_note}. Set gradient_checkpointing_memory_budget at "
                f"or below that to silence this.",
                MemfitWarning,
                stacklevel=6,
            )
        optimizer_bytes = 0
        if profile.counts_transient:
            trainable = profile.outside_trainable_bytes + sum(b.trainable_bytes for b in profile.blocks)
            if not self.shapes:
                # the first optimizer.step() has not run yet: its state is planned as static bytes (see "Optimizer
                # state")
                optimizer_bytes = int(self.optimizer_state_per_byte * trainable)
            profile = dataclasses.replace(
                profile,
                static_bytes=profile.static_bytes + optimizer_bytes,
                optimizer_step_bytes=trainable + int(self.optimizer_temporaries_per_byte * trainable),
            )
        step_least = self._optimizer_step_least(profile)
        # with a closed loop the first plan is made with a margin (its own step must fit too)
        margin = int(FIRST_PLAN_MARGIN * self.budget_bytes) if self.meter is not None else 0
        target = budget - margin
        lean = None if lean_budget is None else lean_budget - margin
        # below what any plan reaches, the smallest plan is still tried if it is within the user's own budget: the
        # closed loop measures it (the allocator's headroom above is a guess until a step was measured)
        try:
            plan = self._plan_at(profile, target, at_least=self.budget_bytes)
        except BudgetError as exc:
            if step_least > exc.smallest_peak_bytes:
                raise self._optimizer_step_error(step_least) from None
            if optimizer_bytes < MENTIONED_OPTIMIZER_SHARE * exc.smallest_peak_bytes:
                raise
            raise BudgetError(
                f"{exc} That counts {format_bytes(optimizer_bytes)} of optimizer state the first optimizer.step() "
                f"allocates ({self.optimizer_state_per_byte:g} bytes per trainable byte, "
                f"gradient_checkpointing_optimizer_state): with an optimizer that keeps less (8-bit AdamW: "
                f"'adamw8bit'; plain SGD: 'none') set that key, or train fewer weights (LoRA).",
                smallest_peak_bytes=exc.smallest_peak_bytes,
                suggested_budget_bytes=exc.suggested_budget_bytes,
            ) from None
        if step_least > self.budget_bytes:
            raise self._optimizer_step_error(max(step_least, plan.smallest_peak_bytes))
        card = self._card_bytes()
        if card is not None and _card_need(plan) > card:  # not even the leanest plan fits the device
            raise self._card_error(plan, card)
        # a plan without copies may go to the lean target (above CARD_FIT too: "Allocator headroom")
        quieter = self._quieter(profile, plan, lean) if lean is not None and lean > target else None
        return (profile, quieter, lean) if quieter is not None else (profile, plan, target)

    @_timed
    def _plan_at(self, profile: ModelProfile, target: int, *, at_least: int | None = None) -> Plan:
        """The cheapest plan for ``target``; below what any plan reaches, the smallest plan if that is within
        ``at_least`` (default: the budget), else the BudgetError for the user's budget. Where the process can hold
        less than that plan and the reserve its copies leave the caching allocator (see "Copy reserve" in
        docs/cost-model.md), the cheapest of the plans that copy less or nothing and fit both."""
        chosen = self._cheapest(profile, target, at_least=at_least)
        card = self._card_bytes()
        if card is None or _card_need(chosen) <= card:
            return chosen
        most = max(target, chosen.predicted_peak_bytes)  # never a higher peak than the cheapest plan's
        candidates = [chosen]
        # where the card is below the target the two reserve searches are one
        searches = dict.fromkeys(((min(target, card), _RESERVE), (card, _RESERVE), (target, _NO_OFFLOAD)))
        for bytes_, variant in searches:
            try:
                candidates.append(self._cheapest(profile, bytes_, at_least=most, variant=variant))
            except BudgetError:
                continue
        within = [p for p in candidates if p.predicted_peak_bytes <= most]  # the cheapest plan is
        fitting = [p for p in within if _card_need(p) <= card]
        best = (
            min(fitting, key=lambda p: p.predicted_extra_seconds) if fitting else min(within, key=_card_need)
        )
        expandable_need = chosen.predicted_peak_bytes + int(EXPANDABLE_COPY_RESERVE * chosen.copied_bytes)
        if best.predicted_extra_seconds > chosen.predicted_extra_seconds and expandable_need <= card:
            self._warn_copy_reserve(chosen, best)
        return dataclasses.replace(best, budget_bytes=target, smallest_peak_bytes=chosen.smallest_peak_bytes)

    def _warn_copy_reserve(self, cheapest: Plan, chosen: Plan) -> None:
        """Once: the allocator's reserve for copies kept ``cheapest`` off this card, where it would fit with expandable
        segments, and ``chosen`` is slower (:mod:`memfit.auto.allocator`)."""
        if self._warned_copy_reserve or expandable_segments():
            return
        self._warned_copy_reserve = True
        warnings.warn(
            f"gradient_checkpointing_backend='auto': the cheapest plan copies {format_bytes(cheapest.copied_bytes)} "
            f"per step to host memory, and with its default segments the CUDA caching allocator needs about that "
            f"much room again on the device, which this process does not have; a plan predicted "
            f"{chosen.predicted_extra_seconds - cheapest.predicted_extra_seconds:.2f} s per step slower runs instead. "
            f"Set {EXPANDABLE_HINT} in the environment before CUDA starts: with expandable segments copies need "
            f"no such room.",
            MemfitWarning,
            stacklevel=6,
        )

    def _warn_host_ram(self, cheapest: Plan, chosen: Plan) -> None:
        """Once: host RAM could not pin what ``cheapest`` parks, and ``chosen`` (parking less) is slower."""
        if self._warned_host_ram:
            return
        self._warned_host_ram = True
        parked = sum(policy.parks_block for _, policy in chosen.blocks)
        warnings.warn(
            f"gradient_checkpointing_backend='auto': the cheapest plan parks "
            f"{sum(policy.parks_block for _, policy in cheapest.blocks)} block(s) whole and pins "
            f"{format_bytes(cheapest.copied_bytes + cheapest.streamed_bytes)} of host memory per step (activations "
            f"and streamed weights), more than the {format_bytes(self._host_bytes())} available less the reserve kept "
            f"for the process; a plan parking {parked} block(s) and pinning "
            f"{format_bytes(chosen.copied_bytes + chosen.streamed_bytes)}, predicted "
            f"{chosen.predicted_extra_seconds - cheapest.predicted_extra_seconds:.2f} s per step slower, runs "
            f"instead. More free host RAM lets it park more.",
            MemfitWarning,
            stacklevel=6,
        )

    @_timed
    def _quieter(self, profile: ModelProfile, than: Plan, lean: int | None) -> Plan | None:
        """The cheapest plan that copies nothing (no parked activations, no streamed weights) for ``lean``, the
        target :data:`LEAN_HEADROOM` gives such plans, where it is cheaper than ``than`` (else None)."""
        if lean is None:
            return None
        try:
            quiet = self._cheapest(profile, lean, at_least=lean, variant=_NO_COPY)
        except BudgetError:
            return None
        if quiet.predicted_peak_bytes > lean or quiet.predicted_extra_seconds >= than.predicted_extra_seconds:
            return None
        return dataclasses.replace(quiet, budget_bytes=lean, smallest_peak_bytes=than.smallest_peak_bytes)

    def _cheapest(
        self,
        profile: ModelProfile,
        target: int,
        *,
        at_least: int | None = None,
        variant: str = _PLAIN,
        park: bool = True,
    ) -> Plan:
        """:meth:`_plan_at`'s search for one ``variant``: every policy (plain), copies weighed with their reserve
        (the budget counts :func:`reserve_per_copied_byte` per byte copied), no parked activations, or no copies at
        all (nor streamed weights). A plan that parks blocks whole where its copies and streamed weights would not fit in
        host RAM gives way to the cheaper of the same search without parking blocks (``park=False``) and the same
        streamed set planned to fit (:func:`fit_host_memory`)."""
        can_offload = self.can_offload and variant not in (_NO_OFFLOAD, _NO_COPY)

        def allowed(b: BlockProfile) -> tuple[BlockPolicy, ...]:
            policies = allowed_policies(
                has_ffn=b.has_ffn, has_attention=b.has_attention, can_offload=can_offload
            )
            return policies if park else tuple(p for p in policies if not p.parks_block)

        # once: the fallback below plans with the same host RAM
        max_count = 0 if variant == _NO_COPY else self._streamable(profile)
        held = self._memos.get(id(profile))
        if held is None or held[0] is not profile:  # held with its profile: an id is never reused under it
            held = self._memos[id(profile)] = (profile, {})
        memo = held[1].setdefault((variant, park), {})
        copy_reserve = reserve_per_copied_byte() if variant == _RESERVE else 0.0

        def plan(bytes_: int) -> Plan:
            return choose_streaming(
                profile,
                lambda streamed: plan_policies(
                    profile, bytes_, allowed=allowed, streamed=streamed, memo=memo, copy_reserve=copy_reserve
                ),
                seconds=lambda p: p.predicted_extra_seconds,
                max_count=max_count,
            )

        try:
            chosen = plan(target)
        except BudgetError as exc:
            limit = self.budget_bytes if at_least is None else at_least
            if exc.smallest_peak_bytes > limit and limit == target:
                raise
            # below what any plan reaches: the smallest plan, or the BudgetError that names the user's budget
            chosen = plan(exc.smallest_peak_bytes if exc.smallest_peak_bytes <= limit else limit)
        if park and self._parks_past_host_memory(chosen):
            lean: Plan | None = None
            try:
                lean = self._cheapest(profile, target, at_least=at_least, variant=variant, park=False)
            except BudgetError as exc:  # the budget needs parked blocks: some may still fit
                lean_error = exc
            fitting = fit_host_memory(
                profile, chosen, self._host_bytes(), allowed=allowed, memo=memo, copy_reserve=copy_reserve
            )
            candidates = [p for p in (lean, fitting) if p is not None]  # ties: parking nothing
            if not candidates:
                raise lean_error
            fallback = min(candidates, key=lambda p: p.predicted_extra_seconds)
            self._warn_host_ram(chosen, fallback)
            if fallback is lean:
                return fallback
            chosen = fallback
        step = _optimizer_step_peak(profile, chosen)
        return (
            dataclasses.replace(chosen, predicted_peak_bytes=step)
            if step > chosen.predicted_peak_bytes
            else chosen
        )

    def _parks_past_host_memory(self, plan: Plan) -> bool:
        """``plan`` parks blocks whole, and what it copies in a step (parked until backward) with the weights it
        streams is more than host RAM can pin."""
        if not any(policy.parks_block for _, policy in plan.blocks):
            return False
        return plan.copied_bytes + plan.streamed_bytes > self._host_bytes()

    def _card_bytes(self) -> int | None:
        """What a plan's peak and its copies' reserve may reach on this process's device (None: no cap)."""
        capacity = device_capacity(next(self.model.parameters()).device)
        return None if capacity is None else int(CARD_FIT * capacity)

    def _card_error(self, plan: Plan, card: int) -> BudgetError:
        need = _card_need(plan)
        suggested = suggested_budget(plan.predicted_peak_bytes, copied_bytes=plan.copied_bytes)
        expandable = expandable_segments()
        copies = "" if expandable else ", and about what a step copies"
        hint = (
            ""
            if expandable or not plan.copied_bytes
            else f", or set {EXPANDABLE_HINT} in the environment before CUDA starts (copies then need no reserve)"
        )
        return BudgetError(
            f"this process can hold {format_bytes(int(card / CARD_FIT))} on its device, and the leanest plan for "
            f"a budget of {format_bytes(self.budget_bytes)} peaks at {format_bytes(plan.predicted_peak_bytes)} "
            f"allocated, copying {format_bytes(plan.copied_bytes)} per step to host memory: with the reserve the "
            f"CUDA caching allocator keeps (up to {1 / ALLOCATOR_HEADROOM:.2f}x the allocated peak{copies}) that "
            f"needs {format_bytes(need)}, over the {CARD_FIT:.0%} of it a step can use without running out of "
            f"memory. It needs a device (or a per-process memory fraction) of at least {format_bytes(suggested)}: "
            f"free memory on the device, or shrink the step (batch, resolution){hint}.",
            smallest_peak_bytes=plan.predicted_peak_bytes,
            suggested_budget_bytes=suggested,
        )

    def _optimizer_step_least(self, profile: ModelProfile) -> int:
        """The least peak of the optimizer's step (weights, state, every gradient, its temporaries; less every
        frozen weight that may stream): no activation plan goes below it (0: not counted here)."""
        if not profile.optimizer_step_bytes:
            return 0
        frozen = sorted(b.frozen_bytes for b in profile.blocks)
        count = self._streamable(profile)
        return profile.static_bytes + profile.optimizer_step_bytes - (sum(frozen[-count:]) if count else 0)

    def _optimizer_step_error(self, least: int) -> BudgetError:
        suggested = suggested_budget(least, copied_bytes=0)  # a full fine-tune's step: CUDA only
        temporaries = f"{self.optimizer_temporaries_per_byte:g} per trainable byte"
        if self.optimizer_temporaries_per_byte:
            temporaries += ": torch's foreach AdamW"
        return BudgetError(
            f"memory budget {format_bytes(self.budget_bytes)} is below the optimizer step's own peak: "
            f"{format_bytes(least)} of weights, optimizer state ({self.optimizer_state_per_byte:g} bytes per "
            f"trainable byte), every gradient and the step's temporaries ({temporaries}), whatever the activations "
            f"do. Raise "
            f"gradient_checkpointing_memory_budget to at least {format_bytes(suggested)}; with an optimizer that "
            f"keeps less (8-bit AdamW: 'adamw8bit'; plain SGD: 'none') set gradient_checkpointing_optimizer_state, "
            f"or train fewer weights (LoRA).",
            smallest_peak_bytes=least,
            suggested_budget_bytes=suggested,
        )

    def _few_trainable(self, profile: ModelProfile) -> bool:
        """Whether :data:`LEAN_HEADROOM` may apply: on CUDA, at most :data:`FEW_TRAINABLE_SHARE` of the model's
        weight bytes train (a full fine-tune's gradients and optimizer state fragment the allocator)."""
        if not profile.counts_transient:
            return False
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        trainable = profile.outside_trainable_bytes + sum(b.trainable_bytes for b in profile.blocks)
        return trainable <= FEW_TRAINABLE_SHARE * weights

    def _streamable(self, profile: ModelProfile) -> int:
        """How many blocks may stream their weights at this profile (0: none)."""
        # off CUDA the budget counts held activations, which streaming does not change
        if not self.can_stream or not profile.counts_transient or not profile.static_bytes:
            return 0
        if not any(b.frozen_bytes for b in profile.blocks) or not profile.copy_bytes_per_second:
            return 0
        return streamable_counts(profile, self._host_bytes())

    def _bandwidth(self) -> float | None:
        if not self.can_offload:
            return None
        if self.copy_bytes_per_second is None:
            device = next(self.model.parameters()).device
            # a synchronous engine on CPU tensors (tests) gets a nominal rate: its copies are never hidden anyway
            self.copy_bytes_per_second = _probe_bandwidth(device) if device.type == "cuda" else 10e9
        return self.copy_bytes_per_second

    def describe(self) -> str:
        if self.plan is None:
            return (
                f"auto: budget {format_bytes(self.budget_bytes)}; planned at the first forward with gradients"
            )
        return self.plan.describe()


# Host RAM's price on copies (a plan that parks more than host RAM can pin, fit_host_memory): bisection steps, and
# the highest price tried in multiples of the link's own time per byte (where copying anything is dearer than
# recomputing it)
HOST_PRICE_STEPS = 8
HOST_PRICE_CEILING = 8.0


def fit_host_memory(
    profile: ModelProfile,
    plan: Plan,
    host_bytes: int,
    *,
    allowed: Callable[[BlockProfile], tuple[BlockPolicy, ...]],
    memo: dict[Any, Any] | None = None,
    copy_reserve: float = 0.0,
) -> Plan | None:
    """``plan``'s streamed set planned again at its budget so that its copies and streamed weights fit in
    ``host_bytes``: the cheaper of two searches, None where neither fits (see "The forward's copy queue" in
    docs/cost-model.md). ``allowed``, ``memo`` and ``copy_reserve`` are those ``plan`` was searched with.

    * Each copied byte charged a price (bisection, :data:`HOST_PRICE_STEPS`, up to :data:`HOST_PRICE_CEILING` times
      the link's time per byte): the least price that fits. Where blocks are alike they stop parking together at one
      price, so this can keep far fewer parked than would fit.
    * Parking allowed on ``n`` of the blocks that may park, spread evenly over them (bisection on ``n``): the most
      that fit.
    """

    def planned(price: float, may_park: frozenset[str] | None, streamed: StreamedSet | None) -> Plan:
        def allowed_here(b: BlockProfile) -> tuple[BlockPolicy, ...]:
            policies = allowed(b)
            if may_park is None or b.name in may_park:
                return policies
            return tuple(p for p in policies if not p.parks_block)

        return plan_policies(
            profile,
            plan.budget_bytes,
            allowed=allowed_here,
            streamed=streamed,
            memo=memo if may_park is None else None,  # the memo holds the full menu's searches
            copy_reserve=copy_reserve,
            copy_price=price,
        )

    parkable = [b.name for b in profile.blocks if any(p.parks_block for p in allowed(b))]
    if not profile.copy_bytes_per_second:
        return None
    names = {b.name: i for i, b in enumerate(profile.blocks)}
    streamed = (
        StreamedSet.of(
            profile,
            [names[n] for n in plan.streamed],
            forward_ahead=plan.streamed_forward_ahead,
            kept_first=plan.streamed_kept_first,
        )
        if plan.streamed
        else None
    )

    def fits(candidate: Plan) -> bool:
        return candidate.copied_bytes + candidate.streamed_bytes <= host_bytes

    found: list[Plan] = []
    low, high, fitting = 0.0, HOST_PRICE_CEILING / profile.copy_bytes_per_second, None
    for _ in range(HOST_PRICE_STEPS):
        price = high if fitting is None else (low + high) / 2
        try:
            candidate = planned(price, None, streamed)
        except BudgetError:  # not expected: a price leaves the menu as it was
            break
        if fits(candidate):
            fitting, high = candidate, price
        elif fitting is None:
            break  # copying too much even at the highest price
        else:
            low = price
    found += [fitting] if fitting is not None else []
    # ``more`` parked blocks allowed do not fit in host RAM (the plan's own did not); fewer may not reach the budget
    fewer, more = 0, len(parkable)
    fitting = None
    while more - fewer > 1:
        n = (fewer + more) // 2
        try:
            candidate = planned(
                0.0, frozenset(parkable[int((k + 0.5) * len(parkable) / n)] for k in range(n)), streamed
            )
        except BudgetError:  # the budget needs more parked blocks
            fewer = n
            continue
        if fits(candidate):
            fitting, fewer = candidate, n
        else:
            more = n
    found += [fitting] if fitting is not None else []
    return min(found, key=lambda p: p.predicted_extra_seconds, default=None)


def _card_need(plan: Plan) -> int:
    return card_need(plan.predicted_peak_bytes, plan.copied_bytes)


def _with_profiling_floor(exc: BudgetError, profile: ModelProfile) -> BudgetError:
    """``exc``, suggesting at least a card on which the profiling forward that made ``profile`` runs again: with
    every weight on the device, or where it streamed some (a model placed from the host), those it kept there and
    the running block's upload (a plan may stream more: its peak can be lower than the profile's, see
    "Profiling")."""
    if not profile.counts_transient:
        return exc
    own = max((b.backward_peak_bytes for b in profile.blocks), default=0)
    streamed = profile.streamed_while_profiled_bytes
    # the running block's upload, where the profile streamed
    upload = max((b.frozen_bytes for b in profile.blocks), default=0) if streamed else 0
    need = profile.static_bytes - streamed + upload + profile.outside_bytes + profile.workspace_bytes + own
    card = suggested_budget(need, copied_bytes=0)
    if exc.suggested_budget_bytes >= card:
        return exc
    weights = "with some weights streaming as it did here" if streamed else "with every weight on the device"
    return BudgetError(
        f"{exc} On a card of that size auto's profiling forward, which runs {weights} "
        f"(~{format_bytes(need)}), would not fit: a card needs at least {format_bytes(card)}.",
        smallest_peak_bytes=exc.smallest_peak_bytes,
        suggested_budget_bytes=card,
    )


def _optimizer_step_peak(profile: ModelProfile, plan: Plan) -> int:
    """The optimizer step's peak under ``plan``: the static bytes (its state included) and what the step holds,
    less the frozen weights the plan streams (on the host while the step runs) but the uploads it keeps for the next
    forward."""
    if not profile.optimizer_step_bytes:
        return 0
    return (
        profile.static_bytes + profile.optimizer_step_bytes - plan.streamed_bytes + plan.streamed_kept_bytes
    )


def host_bytes_for_plans(pinned: int = 0) -> int:
    """Host RAM a plan's copies and streamed weights may pin: what is available, with the ``pinned`` bytes the plan
    running now holds (its pool's buffers and its weights' host masters, which the next plan reuses), less the
    reserve kept for the rest of the process."""
    return max(0, hostmem.available_host_bytes() + pinned - hostmem.default_host_reserve())


# Bandwidth probe: the fastest of samples spread over ~0.1 s is the link's own rate, not another
# process's copy burst (docs/cost-model.md).
PROBE_SAMPLES = 8
PROBE_SPACING_S = 0.012


def _probe_bandwidth(device: torch.device, nbytes: int = 64 << 20) -> float:
    """Pinned device→host bytes per second of ``nbytes`` copies (see "Bandwidth probe")."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # warm-up

    def one_copy() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    return nbytes / fastest_of_spaced(one_copy)


def fastest_of_spaced(
    sample: Callable[[], float],
    *,
    samples: int = PROBE_SAMPLES,
    spacing_s: float = PROBE_SPACING_S,
    sleep: Callable[[float], None] = time.sleep,
) -> float:
    """The shortest of ``samples`` timings of ``sample()`` (seconds), ``spacing_s`` apart."""
    best = float("inf")
    for i in range(samples):
        if i:
            sleep(spacing_s)
        best = min(best, sample())
    return best
