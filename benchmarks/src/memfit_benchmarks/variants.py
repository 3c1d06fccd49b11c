"""Variants of memfit's modes that isolate one part of a mode's cost (diagnose, interleaved pairs).

A variant is a mode's configuration with ``memfit.apply`` keywords on top, e.g. attention offload's hooks and
regions with nothing parked: stepped in turn against ``offload_attention`` and ``none``, it splits what attention
offload adds into what its hooks cost and what parking costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memfit.config import MemfitConfig
from memfit.offload.copy import CopyEngine, ReloadRelease
from memfit.offload.pool import PinnedBucketPool

Keywords = Callable[[MemfitConfig], dict[str, Any]]


def _untied_reloads(cfg: MemfitConfig) -> dict[str, Any]:
    """Reloads tied to no stream: compute's waits order their memory's reuse (``memfit.offload.copy``, "Reloads'
    memory"), where the default leaves the caching allocator an event to ask at every allocation after a free."""
    engine = CopyEngine(PinnedBucketPool.from_config(cfg), reload_release=ReloadRelease.AFTER_COMPUTE_WAITS)
    return {"copy_engine": engine}


VARIANTS: dict[str, tuple[str, Keywords]] = {
    # name: (mode name, apply() keyword arguments built from the parsed config)
    "unsloth[no-timing]": (
        "unsloth",
        lambda cfg: {"copy_engine": CopyEngine(PinnedBucketPool.from_config(cfg), timing=False)},
    ),
    "unsloth[min 16MiB]": ("unsloth", lambda cfg: {"min_offload_bytes": 16 << 20}),
    # the hooks and regions of attention offload with nothing parked: what the parking itself adds
    "offload_attention[hooks only]": ("offload_attention", lambda cfg: {"min_offload_bytes": 1 << 50}),
    # every tensor copied on its own, as before batches were packed (memfit.offload.copy, "Coalescing")
    "offload_attention[one-by-one]": (
        "offload_attention",
        lambda cfg: {"copy_engine": CopyEngine(PinnedBucketPool.from_config(cfg), coalesce_max_bytes=0)},
    ),
    "unsloth[reloads untied]": ("unsloth", _untied_reloads),
    "unsloth-ffn[reloads untied]": ("unsloth-ffn", _untied_reloads),
    "offload_attention[reloads untied]": ("offload_attention", _untied_reloads),
}
# the variants that only change which tensors are parked: they run on CPU too, through the harness's own engine
CPU_VARIANTS = frozenset({"unsloth[min 16MiB]", "offload_attention[hooks only]"})


def variant_keywords(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """``memfit.apply`` keywords of variant ``name`` for its mode's ``config`` (``{}``: not a variant)."""
    if name not in VARIANTS:
        return {}
    return VARIANTS[name][1](MemfitConfig.from_dict(config))
