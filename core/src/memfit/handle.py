"""The object ``memfit.apply`` returns: inspect what was installed, read counters, remove it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from memfit.auto.controller import AutoController
from memfit.auto.planner import Plan
from memfit.auto.profile import ModelProfile
from memfit.config import MemfitConfig
from memfit.engine.install import RegionEngine


class MemfitHandle:
    """What memfit installed on one model.

    Use :meth:`remove` (or a ``with`` block) to restore the model exactly as it was.
    """

    def __init__(
        self,
        model: nn.Module,
        config: MemfitConfig,
        family: str | None,
        engine: RegionEngine | None,
        on_remove: Callable[[], None],
        session: Any = None,
        offloader: Any = None,
        auto: AutoController | None = None,
    ) -> None:
        self.model = model
        self._session = session
        self._fixed_offloader = offloader
        self.config = config
        self.family = family
        self._fixed_engine = engine
        self._auto = auto
        self._on_remove = on_remove
        self.removed = False

    # The ``auto`` backend swaps engines when it re-plans; the handle always reads the current one.
    @property
    def _engine(self) -> RegionEngine:
        if self._auto is not None:
            return self._auto.engine
        assert self._fixed_engine is not None
        return self._fixed_engine

    @property
    def _offloader(self) -> Any:
        return self._auto.offloader if self._auto is not None else self._fixed_offloader

    @property
    def plan(self) -> Plan | None:
        """The ``auto`` backend's plan for the latest input shape (None before its first forward, or for a
        fixed backend)."""
        return self._auto.plan if self._auto is not None else None

    @property
    def profile(self) -> ModelProfile | None:
        """The profile behind :attr:`plan` (per-block bytes, FLOPs, measured peaks; None as for ``plan``)."""
        return self._auto.profile if self._auto is not None else None

    def stats(self) -> dict[str, Any]:
        """Counters since :meth:`apply` (or the last :meth:`reset_stats`): frames, calls, recomputes, entries."""
        s = self._engine.stats
        return {
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
            "undeclared_block_calls": self._engine.undeclared_block_calls,
            **({"replans": self._auto.replans} if self._auto is not None else {}),
            **self._offload_stats(),
        }

    def _offload_stats(self) -> dict[str, Any]:
        if self._session is None:
            return {}
        copy = self._session.copy
        pool = copy.pool.stats()
        out = {
            "bytes_offloaded": copy.stats.bytes_offloaded,
            "bytes_reloaded": copy.stats.bytes_reloaded,
            "reloads_skipped": copy.stats.reloads_skipped,
            "bytes_kept_on_device": copy.stats.bytes_kept_on_device,
            "dedup_hits": copy.stats.dedup_hits,
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
        }
        if self._offloader is not None:
            out["attention_calls_offloaded"] = self._offloader.calls
            out["attention_tensors_parked"] = self._offloader.tensors_parked
        return out

    def reset_stats(self) -> None:
        self._engine.stats.reset()
        self._engine.undeclared_block_calls = 0
        if self._session is not None:
            self._session.copy.reset_stats()
            self._session.copy.pool.reset_counters()
        if self._offloader is not None:
            self._offloader.calls = self._offloader.tensors_parked = 0

    def describe(self) -> str:
        """One line per region site kind: what is checkpointed where."""
        e = self._engine
        chunks = {site.key for site in e.block_sites.values()}
        ffn = {site.key for site in e.hook_sites.values()}
        who = self.family or f"{type(self.model).__name__} (generic diffusers path)"
        parts = [f"family: {who}", f"config: {self.config.to_dict()}"]
        if e.block_sites:
            parts.append(
                f"whole-block regions: {len(chunks)} chunk(s) over {len(e.block_sites)} block(s), "
                f"entered through {e.block_entry}"
            )
        elif e.block_entry == "diffusers":
            parts.append("whole-block regions: every block the model checkpoints (diffusers path)")
        if ffn:
            parts.append(f"FFN regions: {len(ffn)}")
        if self._auto is not None:
            parts.append(self._auto.describe())
        return "\n".join(parts)

    def remove(self) -> None:
        """Remove every hook and restore every attribute memfit touched. Idempotent."""
        if self.removed:
            return
        if self._auto is not None:
            self._auto.remove()
        else:
            self._engine.remove()
            if self._offloader is not None:
                self._offloader.remove()
        if self._session is not None:
            self._session.close()
            self._session.copy.pool.clear()  # give idle pinned buffers back to the host
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
