"""Reload ahead: which regions backward visits next are brought back while the current one runs.

One rule, used by the offload session at run time and by the ``auto`` planner's peak model: starting from
the nearest region before the current one (backward order) that holds anything, take it; take a further one
only while the bytes already taken are smaller than it, at most :data:`PREFETCH_DEPTH` regions. A region's
bytes stand for its compute (both grow with its tokens), so a reload is issued early enough to hide behind
the regions before it, and no earlier: on a stack of equal blocks that is one region ahead.

Equal regions two ahead.  Bytes stand for compute only while a region's copy is shorter than its backward.
A block parked whole copies nearly everything it saves: its reload takes about as long as its backward, and
where streamed weights share the link it takes longer, so one region ahead leaves each such reload partly in
the open. With ``equal_too`` a further region is taken also where the bytes already taken equal it (two equal
parked blocks reloaded at once), so the link runs ahead through the recomputing blocks between them. The ``auto``
planner asks for it per plan, where it shortens the backward's waits and its peak still fits
(:mod:`memfit.auto.backward_link`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

# Two, for a region whose backward is short (a double-stream block's text FFN runs just before its image FFN
# in backward) and cannot hide the next reload on its own.
PREFETCH_DEPTH = 2


def regions_ahead(
    sizes: Iterable[int], depth: int = PREFETCH_DEPTH, *, equal_too: bool = False
) -> Iterator[int]:
    """Positions in ``sizes`` (the regions backward visits next, nearest first; 0 = holds nothing) of those
    to reload ahead, by the rule above (``equal_too``: a further one also where the bytes taken equal it)."""
    ahead = taken = 0
    for position, size in enumerate(sizes):
        if not size:
            continue
        if taken == depth or (taken and (ahead > size if equal_too else ahead >= size)):
            return
        yield position
        ahead += size
        taken += 1


def bytes_ahead(sizes: list[int], depth: int = PREFETCH_DEPTH, *, equal_too: bool = False) -> int:
    """Bytes :func:`regions_ahead` brings back for these regions."""
    return sum(sizes[i] for i in regions_ahead(sizes, depth, equal_too=equal_too))
