"""The ``auto`` backend on a model: plan at the first forward of each input shape, install, re-plan on change.

Design notes
------------
One pair of model hooks, owned here, drives everything. At a forward with gradients whose input
signature (tensor shapes, dtypes, devices; plain scalar arguments) differs from the last one, the
controller takes the current plan's engine off, profiles the bare model (:func:`profile_model`: one
forward with gradients that holds nothing, one timed forward without), plans
(:func:`plan_policies`) and installs the new plan's engine, then lets the forward proceed. Profiles
and plans are cached per signature: switching back to an earlier aspect-ratio bucket re-installs its
plan without profiling again. Engines are built without model hooks of their own; this controller
forwards the start and end of each forward to the current one (so swapping engines inside a model
hook never adds or removes hooks of the module that is being called).

One :class:`~memfit.engine.frame.FrameStats` and one offload session serve every plan, so
``handle.stats()`` counts across re-plans.
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.auto.planner import Plan, plan_policies
from memfit.auto.policy import BlockPolicy, allowed_policies
from memfit.auto.profile import ModelProfile, profile_model
from memfit.engine.frame import FrameStats
from memfit.engine.install import RegionEngine, RegionSite, chain_sites, diffusers_block_entry
from memfit.errors import MemfitWarning
from memfit.offload.session import (
    AttentionOffloader,
    OffloadSession,
    OffloadStash,
    device_stash_after_parking,
    mark_keeping_blocks,
)
from memfit.units import format_bytes

# Allocator headroom.  The caching allocator reserves more than it hands out: blocks freed while a copy
# stream still reads them wait for its event, and mixed sizes fragment its segments. Under attention offload
# on Wan 14B (H200, 93316be) the peak reserved reached 1.19x the peak allocated (96.0 -> 114.0 GiB), and a
# plan predicted right at a budget of 138.4 GiB on the 140.4 GiB card ran out of memory. A budget is
# therefore planned for at most this share of what the process can hold on its device.
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


class AutoController:
    """Installs and re-plans the ``auto`` backend on one model.

    Args:
        model: the transformer (an adapter must declare its blocks).
        adapter: its family adapter.
        budget_bytes: the memory budget (peak allocated on CUDA; held activation bytes elsewhere).
        session: the offload session, or None (then no policy copies to host memory).
        min_offload_bytes: smaller tensors are never copied.
        copy_bytes_per_second: pinned copy bandwidth for the cost model (None: measured once on CUDA).
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: FamilyAdapter,
        budget_bytes: int,
        *,
        session: OffloadSession | None,
        min_offload_bytes: int,
        copy_bytes_per_second: float | None = None,
    ) -> None:
        self.model = model
        self.adapter = adapter
        self.budget_bytes = budget_bytes
        self.session = session
        self.min_offload_bytes = min_offload_bytes
        self.copy_bytes_per_second = copy_bytes_per_second
        self.stats = FrameStats()
        self.profiles: dict[tuple, ModelProfile] = {}
        self.plans: dict[tuple, Plan] = {}
        self.plan: Plan | None = None
        self.replans = 0
        self.engine = self._new_engine(None)
        self.offloader: AttentionOffloader | None = None
        self._signature: tuple | None = None
        self._handles: list[Any] = []
        self._region_marks: list[Any] = []  # hooks of the blocks that keep everything (see _put_on)
        self._warned_unneeded = False
        self._warned_capacity = False

    # -- installation -------------------------------------------------------------------------------------------

    def install(self) -> None:
        self._handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._post, always_call=True))
        self.engine.install(model_hooks=False)

    def keep_until_removed(self, handle: Any) -> None:
        """Remove ``handle`` (a hook of a helper such as the FSDP2 order guard) together with this controller."""
        self._handles.append(handle)

    def remove(self) -> None:
        self._take_off()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _take_off(self) -> None:
        self.engine.remove()
        for h in self._region_marks:
            h.remove()
        self._region_marks.clear()
        if self.offloader is not None:
            self.offloader.remove()
            self.offloader = None

    def _put_on(self, plan: Plan | None, profile: ModelProfile | None) -> None:
        self.engine = self._new_engine(plan)
        self.engine.install(model_hooks=False)
        if plan is not None and plan.copied_bytes and self.session is not None:
            # blocks that keep everything are regions of the step too: for the deferral of the parked regions
            # before them, and to reload those ahead of their backward
            kept = {b.name: b.saved_bytes for b in profile.blocks} if profile is not None else {}
            self._region_marks = mark_keeping_blocks(
                self.session,
                [
                    (block, kept.get(f"{path}.{index}", 0))
                    for path, index, block in self.adapter.iter_blocks(self.model)
                    if plan.policy(f"{path}.{index}") is BlockPolicy.KEEP
                ],
            )
        attention = self._attention_modules(plan) if plan is not None else []
        if attention:
            assert self.session is not None
            self.offloader = AttentionOffloader(self.session, attention)
            self.offloader.install()

    # -- model hooks --------------------------------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            signature = input_signature(args, kwargs)
            if signature != self._signature:
                self._switch(signature, args, kwargs)
        self.engine.begin_forward()

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.engine.end_forward(failed=output is None and sys.exc_info()[0] is not None)

    def _switch(self, signature: tuple, args: tuple, kwargs: dict) -> None:
        plan = self.plans.get(signature)
        self._take_off()
        try:
            if plan is None:
                plan = self._make_plan(signature, args, kwargs)
        finally:  # a BudgetError leaves the previous plan (or none) installed, never a half-removed one
            if plan is not None:
                self._put_on(plan, self.profiles.get(signature))
            else:
                self._put_on(self.plan, self.profiles.get(self._signature))  # (None before any plan)
        self._signature, self.plan = signature, plan
        self.replans += 1

    def _make_plan(self, signature: tuple, args: tuple, kwargs: dict) -> Plan:
        profile = profile_model(
            self.model,
            self.adapter,
            args,
            kwargs,
            min_offload_bytes=self.min_offload_bytes,
            copy_bytes_per_second=self._bandwidth(),
        )
        self.profiles[signature] = profile
        can_offload = self.session is not None
        capacity = device_capacity(next(self.model.parameters()).device)
        budget = plannable_budget(self.budget_bytes, capacity)
        if budget < self.budget_bytes and not self._warned_capacity:
            self._warned_capacity = True
            warnings.warn(
                f"gradient_checkpointing_backend='auto': the budget of {format_bytes(self.budget_bytes)} leaves the "
                f"CUDA caching allocator too little room on this device ({format_bytes(capacity or 0)} usable by "
                f"this process; its reserve runs up to 1.19x the allocated peak under offload): planning for "
                f"{format_bytes(budget)}. Set gradient_checkpointing_memory_budget at or below that to silence "
                f"this.",
                MemfitWarning,
                stacklevel=4,
            )
        plan = plan_policies(
            profile,
            budget,
            allowed=lambda b: allowed_policies(
                has_ffn=b.has_ffn, has_attention=b.has_attention, can_offload=can_offload
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
                stacklevel=4,
            )
        return plan

    def _bandwidth(self) -> float | None:
        if self.session is None:
            return None
        if self.copy_bytes_per_second is None:
            device = next(self.model.parameters()).device
            # a synchronous engine on CPU tensors (tests) gets a nominal rate: its copies are never hidden anyway
            self.copy_bytes_per_second = _probe_bandwidth(device) if device.type == "cuda" else 10e9
        return self.copy_bytes_per_second

    # -- building one plan's engine -------------------------------------------------------------------------------

    def _new_engine(self, plan: Plan | None) -> RegionEngine:
        engine = RegionEngine(self.model)
        engine.stats = self.stats
        if self.session is not None:
            engine.step_listeners.append(self.session)
        lists = self.adapter.resolve_block_lists(self.model)
        engine.known_blocks = {block for blocks in lists.values() for block in blocks}
        if plan is None or not plan.needed:
            return engine
        session = self.session
        offload = (lambda: OffloadStash(session)) if session is not None else None
        keep = device_stash_after_parking(session) if session is not None else None
        for path, blocks in lists.items():
            for index, block in enumerate(blocks):
                policy = plan.policy(f"{path}.{index}")
                if policy.recompute == "block":
                    engine.block_sites[block] = RegionSite(
                        ("block", path, index),
                        (block,),
                        0,
                        "block",
                        offload if policy.offloads_inputs else keep,
                    )
        engine.block_entry = (
            "diffusers" if engine.block_sites and diffusers_block_entry(self.model, self.adapter) else "hooks"
        )

        def locate() -> dict[nn.Module, RegionSite]:
            sites: dict[nn.Module, RegionSite] = {}
            for path, blocks in lists.items():
                for index, block in enumerate(blocks):
                    policy = plan.policy(f"{path}.{index}")
                    if policy.recompute != "ffn":
                        continue
                    for r, chain in enumerate(self.adapter.ffn_chains(block)):
                        sites.update(
                            chain_sites(
                                ("ffn", path, index, r),
                                chain,
                                "ffn",
                                stash_factory=offload if policy.offloads_inputs else keep,
                            )
                        )
            return sites

        engine.hook_sites = locate()
        engine.watch(locate)  # PEFT may replace FFN modules after apply
        return engine

    def _attention_modules(self, plan: Plan) -> list[nn.Module]:
        return [
            m
            for path, index, block in self.adapter.iter_blocks(self.model)
            if plan.policy(f"{path}.{index}").offloads_attention
            for m in self.adapter.attention_modules(block)
        ]

    @property
    def profile(self) -> ModelProfile | None:
        """The profile the current plan was made from (None before the first forward with gradients)."""
        return self.profiles.get(self._signature) if self._signature is not None else None

    def describe(self) -> str:
        if self.plan is None:
            return (
                f"auto: budget {format_bytes(self.budget_bytes)}; planned at the first forward with gradients"
            )
        return self.plan.describe()


# Bandwidth probe.  The copy bandwidth prices every offload, and plans turn on it: Wan at a 103.8 GiB budget
# is planned as attention offload on 37 blocks at 53 GB/s, as FFN recompute with FFN-input offload at 45 (the
# same profile replanned). Profiled while the host's other GPU ran its own offload sweep, the planner took
# the second branch, measured 7% slower than plain attention offload (the rate it read was not kept: a
# probe caught in the other GPU's copies is the likely cause). Three back-to-back 64 MiB copies (~4 ms) fit
# inside one burst of another process's copies; samples spread over ~0.1 s catch the link between bursts,
# and the fastest is the link's own rate.
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
