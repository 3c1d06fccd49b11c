"""How the CUDA caching allocator is configured, where the planner's copy reserve depends on it.

With its default segments, memory a step frees while copies to host memory are in flight fragments: on an H100, in
processes limited to 1.1x their own allocated peak, ``offload_attention`` and ``unsloth`` ran out of memory at
16384 tokens. With expandable segments the allocator maps freed pages into the segments it grows, and every
offload mode ran within 1.04x its peak (docs/cost-model.md, "Copy reserve"). The setting is read where torch reads
it, from the environment before CUDA starts; one changed at runtime through torch's private setter is not seen.
"""

from __future__ import annotations

import os

# where torch reads the allocator's settings: the first of these that is set (the generic name, then CUDA's own)
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE_HINT = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


def allocator_settings() -> str:
    """The caching allocator's settings as torch reads them from the environment ('' where none is set)."""
    return next((os.environ[v] for v in ALLOC_CONF_VARIABLES if os.environ.get(v)), "")


def allocator_setting(key: str) -> str | None:
    """The value the environment gives the caching allocator's ``key`` (None: not set)."""
    for item in allocator_settings().split(","):
        name, _, value = item.partition(":")
        if name.strip() == key:
            return value.strip()
    return None


def expandable_segments() -> bool:
    """Whether the CUDA caching allocator grows expandable segments (``expandable_segments:True``)."""
    return (allocator_setting("expandable_segments") or "").lower() == "true"
