"""The object ``memfit.apply`` returns: inspect what was installed, read counters, remove it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from memfit.config import MemfitConfig
from memfit.plan import RegionPlan
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.auto.planner import Plan
    from memfit.auto.profile import ModelProfile
    from memfit.controller import Controller
    from memfit.offload.session import OffloadSession


class MemfitHandle:
    """What memfit installed on one model.

    Use :meth:`remove` (or a ``with`` block) to restore the model exactly as it was.

    Attributes:
        model: the model.
        config: the effective configuration (after the interaction rules of SPEC §1).
        family: the adapter's family name (None on the generic diffusers path).
    """

    def __init__(
        self,
        model: nn.Module,
        config: MemfitConfig,
        family: str | None,
        controller: Controller,
        on_remove: Callable[[], None],
    ) -> None:
        self.model = model
        self.config = config
        self.family = family
        self._controller = controller
        self._on_remove = on_remove
        self.removed = False

    @property
    def region_plan(self) -> RegionPlan:
        """What each block does now (every backend; ``auto``: the plan of the latest input shape)."""
        return self._controller.installation.plan

    @property
    def session(self) -> OffloadSession | None:
        """The offload session (None when nothing is offloaded): its step timeline and copy engine, for tools
        that inspect what was parked."""
        return self._controller.session

    @property
    def plan(self) -> Plan | None:
        """The ``auto`` backend's plan for the latest input shape, with its predictions (None before its first
        forward, or for a fixed backend)."""
        return getattr(self._controller.planner, "plan", None) if self._controller.planner.adaptive else None

    @property
    def profile(self) -> ModelProfile | None:
        """The profile behind :attr:`plan` (per-block bytes, FLOPs, measured peaks; None as for ``plan``)."""
        return getattr(self._controller.planner, "profile", None)

    def stats(self) -> dict[str, Any]:
        """Counters since :meth:`apply` (or the last :meth:`reset_stats`): frames, calls, recomputes, entries,
        and for the offload backends bytes parked and reloaded, pool and copy counters."""
        installation = self._controller.installation
        s = self._controller.stats
        out = {
            "frames": s.frames,
            "frames_by_scope": dict(s.by_scope),
            "calls": s.calls,
            "recomputes": s.recomputes,
            "unused": s.unused,
            "chain_breaks": s.chain_breaks,
            "calls_skipped_early_stop": s.calls_skipped_early_stop,
            "calls_cut_early_stop": s.calls_cut_early_stop,
            "entries": s.entries,
            "entry_bytes": s.entry_bytes,
            "saved_tensors_replaced": s.holders,
            "undeclared_block_calls": installation.engine.undeclared_block_calls,
            "replans": self._controller.replans,
            "profiles": len(getattr(self._controller.planner, "profiles", ())),  # auto: input shapes profiled
            "ffn_resyncs": installation.engine.resyncs,  # FFN sites re-resolved (PEFT replaced modules)
        } | installation.weight_stats()  # weight streaming: blocks streamed/resident, bytes uploaded, waits
        report = getattr(self._controller.planner, "budget_report", None)
        if report is not None:  # auto: per input shape, predicted and measured peaks, corrections
            out["budget_bytes"] = self._controller.planner.budget_bytes
            # the searches for every shape since apply (as the shapes' report, not reset with the counters)
            out["planning_seconds"] = self._controller.planner.planning_seconds
            out["shapes"] = report()
        session = self._controller.session
        if session is None:
            return out
        copy = session.copy
        pool = copy.pool.stats()
        out |= {
            "bytes_offloaded": copy.stats.bytes_offloaded,
            "bytes_reloaded": copy.stats.bytes_reloaded,
            "reloads_skipped": copy.stats.reloads_skipped,
            "bytes_kept_on_device": copy.stats.bytes_kept_on_device,
            "dedup_hits": copy.stats.dedup_hits,
            "bytes_narrowed": copy.stats.bytes_narrowed,  # saved bytes: up-casts held and parked narrow
            "coalesced_batches": copy.stats.coalesced_batches,  # batches copied through one packed buffer
            "inflight_waits": copy.stats.copies_inflight_waits,
            "stall_ms": copy.stall_ms(),
            "pinned_bytes_held": pool.pinned_bytes_held,
            "pool_hits": pool.hits,
            "pool_misses": pool.misses,
            "pinned_allocations": pool.pinned_allocations,
            # the host blocked on a copy still using a buffer (reuse before its copy finished, an eviction)
            "pool_waits": pool.waits,
            "pool_overflows": pool.overflows,  # past max_buckets with nothing to evict: pageable, synchronous
            "host_buffers_in_use": pool.buffers_in_use,
            # regions of the latest step's timeline (the last two of them never park)
            "step_regions": session.regions_started,
        }
        offloader = installation.offloader  # None when no block offloads attention or parks whole
        out["attention_calls_offloaded"] = offloader.calls if offloader is not None else 0
        out["block_calls_parked"] = offloader.block_calls if offloader is not None else 0  # BlockPolicy.PARK
        # saved tensors parked by either (attention calls, blocks parked whole)
        out["attention_tensors_parked"] = offloader.tensors_parked if offloader is not None else 0
        return out

    def reset_stats(self) -> None:
        installation = self._controller.installation
        self._controller.stats.reset()
        installation.engine.undeclared_block_calls = 0
        if installation.streamer is not None:
            installation.streamer.reset_stats()
        session = self._controller.session
        if session is not None:
            session.copy.reset_stats()
            session.copy.pool.reset_counters()
        if installation.offloader is not None:
            offloader = installation.offloader
            offloader.calls = offloader.block_calls = offloader.tensors_parked = 0

    def describe(self) -> str:
        """What is checkpointed or offloaded where: one line per kind of region, and ``auto``'s plan."""
        plan = self.region_plan
        engine = self._controller.installation.engine
        who = self.family or f"{type(self.model).__name__} (generic diffusers path)"
        parts = [f"family: {who}", f"config: {self.config.to_dict()}"]
        if plan.checkpoint_routed:
            parts.append("whole-block regions: every block the model checkpoints (diffusers path)")
        elif engine.block_sites:
            chunks = {site.key for site in engine.block_sites.values()}
            parts.append(
                f"whole-block regions: {len(chunks)} chunk(s) over {len(engine.block_sites)} block(s), "
                f"entered through {engine.block_entry.value}"
            )
        ffn = {site.key for site in engine.hook_sites.values()}
        if ffn:
            parts.append(f"FFN regions: {len(ffn)}")
        policies = Counter(b.policy.value for b in plan.blocks if b.policy.value != "keep")
        if policies:
            parts.append("policies: " + ", ".join(f"{p} × {n}" for p, n in sorted(policies.items())))
        placement = self._controller.placement
        if placement is not None:
            homes = sorted(
                {str(home) for _, home in placement.parameters} | {str(h) for *_, h in placement.buffers}
            )
            parts.append(
                f"placed on {placement.device} by apply (from {', '.join(homes) or 'there already'}; remove() moves "
                f"it back)"
                + ("; auto profiles with weights streaming" if self._controller.profiles_streaming else "")
            )
        streamer = self._controller.streamer
        if streamer is not None and streamer.blocks:
            parts.append(
                f"weights streamed from host memory: {len(streamer.blocks)} block(s), "
                f"{format_bytes(streamer.streamed_bytes)}"
            )
        if self._controller.planner.adaptive:
            parts.append(self._controller.planner.describe())
        return "\n".join(parts)

    def remove(self) -> None:
        """Remove every hook and restore every attribute memfit touched. Idempotent."""
        if self.removed:
            return
        self._controller.remove()
        session = self._controller.session
        if session is not None:
            session.close()
            session.copy.pool.clear()  # give idle pinned buffers back to the host
        self.removed = True
        self._on_remove()

    def __enter__(self) -> MemfitHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return (
            f"<MemfitHandle {self.family or type(self.model).__name__} {self.config.backend.value} {state}>"
        )
