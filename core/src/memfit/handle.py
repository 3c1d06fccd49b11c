"""The object ``memfit.apply`` returns: inspect what was installed, read counters, remove it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from memfit.config import MemfitConfig
from memfit.engine.install import RegionEngine


class MemfitHandle:
    """What memfit installed on one model.

    Use :meth:`remove` (or a ``with`` block) to restore the model exactly as it was.
    """

    def __init__(self, model: nn.Module, config: MemfitConfig, family: str | None, engine: RegionEngine,
                 on_remove: Callable[[], None]) -> None:
        self.model = model
        self.config = config
        self.family = family
        self._engine = engine
        self._on_remove = on_remove
        self.removed = False

    def stats(self) -> dict[str, Any]:
        """Counters since :meth:`apply` (or the last :meth:`reset_stats`): frames, calls, recomputes, entries."""
        s = self._engine.stats
        return {
            "frames": s.frames,
            "frames_by_scope": dict(s.by_scope),
            "calls": s.calls,
            "recomputes": s.recomputes,
            "entries": s.entries,
            "entry_bytes": s.entry_bytes,
            "saved_tensors_replaced": s.holders,
            "undeclared_block_calls": self._engine.undeclared_block_calls,
        }

    def reset_stats(self) -> None:
        s = self._engine.stats
        s.frames = s.calls = s.recomputes = s.entries = s.entry_bytes = s.holders = 0
        s.by_scope.clear()
        self._engine.undeclared_block_calls = 0

    def describe(self) -> str:
        """One line per region site kind: what is checkpointed where."""
        e = self._engine
        chunks = {site.key for site in e.block_sites.values()}
        ffn = {site.key for site in e.hook_sites.values()}
        who = self.family or f"{type(self.model).__name__} (generic diffusers path)"
        parts = [f"family: {who}", f"config: {self.config.to_dict()}"]
        if e.block_sites:
            parts.append(f"whole-block regions: {len(chunks)} chunk(s) over {len(e.block_sites)} block(s), "
                         f"entered through {e.block_entry}")
        elif e.block_entry == "diffusers":
            parts.append("whole-block regions: every block the model checkpoints (diffusers path)")
        if ffn:
            parts.append(f"FFN regions: {len(ffn)}")
        return "\n".join(parts)

    def remove(self) -> None:
        """Remove every hook and restore every attribute memfit touched. Idempotent."""
        if self.removed:
            return
        self._engine.remove()
        self.removed = True
        self._on_remove()

    def __enter__(self) -> MemfitHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self.removed else "active"
        return f"<MemfitHandle {self.family or type(self.model).__name__} {self.config.backend.value} {state}>"
