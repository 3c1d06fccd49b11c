"""The ``auto`` backend's planner: a per-block plan for each input signature, under a memory budget.

Design notes
------------
At a forward with gradients whose input signature (tensor shapes, dtypes, devices; plain scalar arguments)
differs from the last one, the controller (:mod:`memfit.controller`) takes the current installation off and
asks :meth:`BudgetPlanner.plan_for`: it profiles the bare model (:func:`profile_model`: one forward with
gradients that holds nothing, one timed forward without), plans (:func:`plan_policies`), and returns the plan
the controller installs. Profiles and plans are cached per signature: switching back to an earlier
aspect-ratio bucket re-installs its plan without profiling again.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.auto.planner import Plan, plan_policies
from memfit.auto.policy import allowed_policies
from memfit.auto.profile import ModelProfile, profile_model
from memfit.errors import MemfitWarning
from memfit.plan import RegionPlan
from memfit.units import format_bytes

# a budget is planned for at most this share of what the process can hold (docs/cost-model.md)
ALLOCATOR_HEADROOM = 0.84


def plannable_budget(budget_bytes: int, capacity_bytes: int | None) -> int:
    """The budget the planner works to: ``budget_bytes``, at most :data:`ALLOCATOR_HEADROOM` of
    ``capacity_bytes`` (what the process can hold on its device; None: no cap)."""
    if capacity_bytes is None:
        return budget_bytes
    return min(budget_bytes, int(capacity_bytes * ALLOCATOR_HEADROOM))


def device_capacity(device: torch.device) -> int | None:
    """Bytes this process can hold on ``device``: what is free plus what its allocator reserved (None off
    CUDA)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


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


class BudgetPlanner:
    """Plans the ``auto`` backend for each input signature of one model (a :class:`memfit.controller.Planner`).

    Args:
        model: the transformer (an adapter must declare its blocks).
        adapter: its family adapter.
        budget_bytes: the memory budget (peak allocated on CUDA; held activation bytes elsewhere).
        can_offload: a copy engine is there (the offload policies are offered only then).
        min_offload_bytes: smaller tensors are never copied.
        copy_bytes_per_second: pinned copy bandwidth for the cost model (None: measured once on CUDA).
    """

    adaptive = True

    def __init__(
        self,
        model: nn.Module,
        adapter: FamilyAdapter,
        budget_bytes: int,
        *,
        can_offload: bool,
        min_offload_bytes: int,
        copy_bytes_per_second: float | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.budget_bytes = budget_bytes
        self.can_offload = can_offload
        self.min_offload_bytes = min_offload_bytes
        self.copy_bytes_per_second = copy_bytes_per_second
        self.profiles: dict[Hashable, ModelProfile] = {}
        self.plans: dict[Hashable, Plan] = {}
        self.plan: Plan | None = None  # the latest signature's
        self.profile: ModelProfile | None = None
        self._warned_unneeded = False
        self._warned_capacity = False

    def signature(self, args: tuple, kwargs: dict) -> Hashable:
        return input_signature(args, kwargs)

    def plan_for(self, signature: Hashable, args: tuple, kwargs: dict) -> RegionPlan:
        plan = self.plans.get(signature)
        if plan is None:
            plan = self._make_plan(signature, args, kwargs)
        self.plan, self.profile = plan, self.profiles[signature]
        return RegionPlan.from_policies(plan.blocks)

    def kept_bytes(self) -> Mapping[str, int] | None:
        return {b.name: b.saved_bytes for b in self.profile.blocks} if self.profile is not None else None

    def _make_plan(self, signature: Hashable, args: tuple, kwargs: dict) -> Plan:
        profile = profile_model(
            self.model,
            self.adapter,
            args,
            kwargs,
            min_offload_bytes=self.min_offload_bytes,
            copy_bytes_per_second=self._bandwidth(),
        )
        self.profiles[signature] = profile
        capacity = device_capacity(next(self.model.parameters()).device)
        budget = plannable_budget(self.budget_bytes, capacity)
        if budget < self.budget_bytes and not self._warned_capacity:
            self._warned_capacity = True
            warnings.warn(
                f"gradient_checkpointing_backend='auto': the budget of {format_bytes(self.budget_bytes)} leaves the "
                f"CUDA caching allocator too little room on this device ({format_bytes(capacity or 0)} usable by "
                f"this process; its reserve runs up to {1 / ALLOCATOR_HEADROOM:.2f}x the allocated peak under "
                f"offload): planning for {format_bytes(budget)}. Set gradient_checkpointing_memory_budget at or "
                f"below that to silence this.",
                MemfitWarning,
                stacklevel=5,
            )
        plan = plan_policies(
            profile,
            budget,
            allowed=lambda b: allowed_policies(
                has_ffn=b.has_ffn, has_attention=b.has_attention, can_offload=self.can_offload
            ),
        )
        self.plans[signature] = plan
        if not plan.needed and not self._warned_unneeded:
            self._warned_unneeded = True
            warnings.warn(
                f"gradient_checkpointing_backend='auto': the budget of {format_bytes(plan.budget_bytes)} needs no "
                f"checkpointing at this input shape (predicted {format_bytes(plan.predicted_peak_bytes)}); nothing "
                f"is installed. memfit re-plans if the input shape changes.",
                MemfitWarning,
                stacklevel=5,
            )
        return plan

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
