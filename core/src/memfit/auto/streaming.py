"""Weight streaming in the ``auto`` plan: which blocks stream, what that does to the peak, what it costs.

Design notes (``docs/weight-streaming.md``, "Planning it with auto", has the longer story)
-------------------------------------------------------------------------------------------
A set.  For a count *n*, the streamed blocks are the spread rule's (:func:`memfit.offload.weights.
choose_streamed_blocks`): with the set fixed, streaming is per-block constants the planner's search takes as
they are (:class:`StreamedSet`), and the streamed blocks may only be whole-block recomputed (``block`` or
``block-offload``).

Peak.  The static bytes drop by the streamed frozen bytes. While block *i*'s backward runs, the uploads alive
are its own (if it streams: its recomputed saved tensors hold it) and the nearest streamed block before it
(uploaded ahead when the streamed block after *i* began its recompute, or at the forward's end): a constant per
block, added to its own term. The forward adds at most two uploads (a streamed block's and the next one's) to
the forward's-end bound.

Cost.  Each upload hides behind the compute between two streamed blocks: in forward the forward of the blocks
from the streamed block before up to it, in backward the recompute and backward of the streamed block after it
and the backward of the blocks between; what does not hide is exposed, each way. The other blocks' own
recompute (more compute to hide behind) is not counted.

Link.  In backward the activation reloads travel host to device on the same link as the uploads. A window's
copies take (upload + reloads) / bandwidth, and what exceeds its compute is exposed. The upload's share is
fixed with the set; each block whose reload is due in the window (the streamed block's own and those of the
blocks between it and the next streamed one) hides its reload behind its part of what the upload leaves of the
window, in proportion to its own backward and never more than that backward (:attr:`StreamedSet.reload_cover`).
Summed per block, that charge is never below the window's own exposure (exact where the upload alone fills the
window, where every reload byte is exposed), and it is a per-block constant once the set is fixed, which the
search takes as it is. Forward parks go device to host, the link's other direction: not counted against uploads.

Placement.  The spread rule places blocks by where their bytes sit, so the density of streamed *bytes* grows with
block size: on Flux it streams 11 of the 19 double-stream blocks (each upload ~3x its forward) and block 0 (nothing
before it in forward), while the single-stream blocks' link idles. :func:`hiding_set` gives, for a byte count, the
set with the least exposed upload time under "Cost": each term depends on two consecutive streamed blocks only, so
a table over (last streamed block, streamed bytes in 1/``BYTE_LEVELS`` units) finds it in O(blocks² × levels).

Search.  :func:`choose_streaming`: no streaming if the plan fits and recomputes nothing; otherwise the fewest
blocks whose plan fits (the peak falls as *n* grows: binary search), then a few counts above it, where streaming
more lets cheaper activation policies fit. At each of those counts, the spread rule's set and the hiding set of
as many bytes (more blocks, each forced to whole-block recompute: the plan weighs that) are both planned; the
cheapest by the cost model wins (ties: the earlier).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from memfit.auto.cost import OFFLOAD_REGION_SECONDS
from memfit.auto.profile import ModelProfile
from memfit.errors import BudgetError
from memfit.offload.weights import choose_streamed_blocks

P = TypeVar("P")
EXTRA_COUNTS = (1, 2, 4, 8)  # counts tried above the fewest that fit (or above none), for a cheaper plan
UPLOAD_BOOKKEEPING_SECONDS = (
    2 * OFFLOAD_REGION_SECONDS
)  # per streamed block and step: two uploads' events and hooks
BYTE_LEVELS = 1024  # the hiding search counts streamed bytes in units of this share of the streamable bytes


@dataclass(frozen=True)
class StreamedSet:
    """Blocks whose frozen weights stream, as the peak and cost models see them (indices in call order)."""

    indices: tuple[int, ...]
    names: tuple[str, ...]
    total_bytes: int  # taken off the static bytes
    backward_bytes: tuple[int, ...]  # per block: uploads alive while its backward runs
    forward_bytes: int  # uploads alive at most during the forward
    seconds: float  # upload time not hidden behind compute, per step
    # per block: seconds of backward compute its activation reloads may hide behind, what the uploads on the same
    # link leave of their window (see "Link"); None outside every upload's window (its own backward)
    reload_cover: tuple[float | None, ...] = ()

    @classmethod
    def of(cls, profile: ModelProfile, indices: Sequence[int]) -> StreamedSet:
        """The set of the blocks at ``indices`` (call order) of ``profile``."""
        blocks = profile.blocks
        chosen = sorted(indices)
        weight = {i: blocks[i].frozen_bytes for i in chosen}
        backward, previous = [], None
        for i in range(len(blocks)):
            backward.append(weight.get(i, 0) + (weight[previous] if previous is not None else 0))
            if i in weight:
                previous = i
        pairs = [weight[a] + weight[b] for a, b in zip(chosen, chosen[1:], strict=False)]
        forward = max([*pairs, *weight.values()], default=0)
        seconds, cover = _uploads(profile, chosen)
        return cls(
            indices=tuple(chosen),
            names=tuple(blocks[i].name for i in chosen),
            total_bytes=sum(weight.values()),
            backward_bytes=tuple(backward) if profile.counts_transient else (0,) * len(blocks),
            forward_bytes=forward if profile.counts_transient else 0,
            seconds=seconds,
            reload_cover=cover,
        )


@dataclass(frozen=True)
class _Timeline:
    """What each block's uploads hide behind (see "Cost"): per block, its forward and backward seconds and its
    upload's; the sums of the first two up to each block."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    copy: tuple[float, ...]
    forward_before: tuple[
        float, ...
    ]  # forward seconds of the blocks before each (one more entry: all of them)
    backward_before: tuple[float, ...]

    @classmethod
    def of(cls, profile: ModelProfile) -> _Timeline:
        fwd = [b.flops / profile.flops_per_second * profile.forward_with_grad for b in profile.blocks]
        bwd = [f * profile.backward_to_forward for f in fwd]
        bandwidth = profile.copy_bytes_per_second
        copy = [b.frozen_bytes / bandwidth if bandwidth else 0.0 for b in profile.blocks]
        return cls(tuple(fwd), tuple(bwd), tuple(copy), _sums(fwd), _sums(bwd))

    def forward_exposed(self, before: int | None, i: int) -> float:
        """Block ``i``'s forward upload, issued when the streamed block ``before`` starts (None: the forward's start),
        behind the forward of the blocks from there up to ``i``."""
        cover = self.forward_before[i] - (self.forward_before[before] if before is not None else 0.0)
        return max(0.0, self.copy[i] - cover)

    def backward_cover(self, i: int, after: int | None) -> float:
        """What block ``i``'s backward upload hides behind: issued when the streamed block ``after`` starts its
        recompute (None: at the forward's end), done before ``i``'s recompute starts."""
        n = len(self.forward)
        if after is None:
            return self.backward_before[n] - self.backward_before[i + 1]
        return self.backward_before[after + 1] - self.backward_before[i + 1] + self.forward[after]

    def backward_exposed(self, i: int, after: int | None) -> float:
        return max(0.0, self.copy[i] - self.backward_cover(i, after))


def _sums(xs: list[float]) -> tuple[float, ...]:
    return (0.0, *itertools.accumulate(xs))


def _uploads(profile: ModelProfile, chosen: list[int]) -> tuple[float, tuple[float | None, ...]]:
    """Upload time not hidden behind compute per step, plus the host's bookkeeping per upload (see "Cost"); and per
    block, the backward compute its reloads may hide behind (see "Link")."""
    cover: list[float | None] = [None] * len(profile.blocks)
    if not chosen:
        return 0.0, tuple(cover)
    seconds = len(chosen) * UPLOAD_BOOKKEEPING_SECONDS
    if not profile.copy_bytes_per_second:
        return seconds, tuple(cover)
    t = _Timeline.of(profile)
    for k, i in enumerate(chosen):
        before = chosen[k - 1] if k else None
        after = chosen[k + 1] if k + 1 < len(chosen) else None
        seconds += t.forward_exposed(before, i) + t.backward_exposed(i, after)
        # reloads due before block i's recompute
        left, due = (
            max(0.0, t.backward_cover(i, after) - t.copy[i]),
            range(i, len(t.forward) if after is None else after),
        )
        weight = sum(t.backward[j] for j in due)
        for j in due:
            cover[j] = min(t.backward[j], left * t.backward[j] / weight) if weight else 0.0
    return seconds, tuple(cover)


def streamable_counts(profile: ModelProfile, max_bytes: int) -> int:
    """The most blocks the spread rule can stream within ``max_bytes`` of host memory."""
    sizes = [(i, b.frozen_bytes) for i, b in enumerate(profile.blocks)]
    n = 0
    for count in range(1, sum(1 for _, s in sizes if s) + 1):
        if (
            sum(profile.blocks[i].frozen_bytes for i in choose_streamed_blocks(sizes, count=count))
            > max_bytes
        ):
            break
        n = count
    return n


def streamed_set(profile: ModelProfile, count: int) -> StreamedSet | None:
    """The spread rule's ``count`` blocks as a :class:`StreamedSet` (None for 0)."""
    if not count:
        return None
    sizes = [(i, b.frozen_bytes) for i, b in enumerate(profile.blocks)]
    return StreamedSet.of(profile, choose_streamed_blocks(sizes, count=count))


def hiding_set(profile: ModelProfile, min_bytes: int, max_bytes: int) -> StreamedSet | None:
    """The blocks streaming between ``min_bytes`` and ``max_bytes`` whose uploads hide best: the least upload time
    not hidden behind compute, bookkeeping included (see "Placement"); None if no set streams that much.

    Example:
        >>> hiding_set(profile, 8 << 30, 10 << 30).indices  # doctest: +SKIP
        (3, 6, 9, 12, 15, 18, 20, 22, ...)
    """
    if not profile.copy_bytes_per_second or min_bytes > max_bytes:
        return None
    sizes = tuple(b.frozen_bytes for b in profile.blocks)
    unit = max(1, -(-sum(sizes) // BYTE_LEVELS))
    units = tuple(max(1, round(n / unit)) if n else 0 for n in sizes)
    least, via = _least_exposure(_Timeline.of(profile), units)
    totals, lasts = least.min(0)
    # a set of q units streams within half a unit per block of q units' bytes: start below the least that could do
    lowest = max(1, int(min_bytes / unit) - len(sizes) // 2 - 1)
    levels = [q for q in range(lowest, len(totals)) if totals[q] < float("inf")]
    for q in sorted(levels, key=lambda q: (float(totals[q]), q)):
        chosen, last = [], int(lasts[q])
        while last >= 0:
            chosen.append(last)
            last, q = int(via[last, q]), q - units[last]
        if min_bytes <= sum(sizes[i] for i in chosen) <= max_bytes:
            return StreamedSet.of(profile, chosen)
    return None


@functools.lru_cache(maxsize=8)
def _least_exposure(t: _Timeline, units: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (last streamed block, streamed units): the least exposed upload time of any set ending there, and the
    streamed block before its last (-1: none) to walk the set back. The exposure of a set sums terms that each
    depend on two consecutive streamed blocks (an upload hides behind the compute from the one before it, in forward,
    or after it, in backward), so the table is built block by block over the one before (see "Placement")."""
    n, levels = len(units), sum(units) + 1
    inf = float("inf")
    least = torch.full((n, levels), inf, dtype=torch.float64)
    via = torch.full((n, levels), -1, dtype=torch.long)
    streamable = [i for i in range(n) if units[i]]
    for k, i in enumerate(streamable):
        u, before = units[i], streamable[:k]
        least[i, u] = UPLOAD_BOOKKEEPING_SECONDS + t.forward_exposed(None, i)
        if not before:
            continue
        pair = torch.tensor(
            [UPLOAD_BOOKKEEPING_SECONDS + t.forward_exposed(a, i) + t.backward_exposed(a, i) for a in before],
            dtype=torch.float64,
        )
        candidates = least[before, : levels - u] + pair[:, None]
        best, arg = candidates.min(0)  # the first of equals: the earliest block before
        row = least[i, u:]
        better = best < row
        least[i, u:] = torch.where(better, best, row)
        via[i, u:] = torch.where(better, torch.tensor(before)[arg], via[i, u:])
    last = torch.tensor(
        [t.backward_exposed(i, None) if units[i] else inf for i in range(n)], dtype=torch.float64
    )
    return least + last[:, None], via


def choose_streaming(
    profile: ModelProfile,
    plan: Callable[[StreamedSet | None], P],
    *,
    seconds: Callable[[P], float],
    max_count: int,
) -> P:
    """The cheapest of the plans ``plan(set)`` makes for the candidate sets (see "Search").

    Args:
        profile: the model's profile (each block's ``frozen_bytes``).
        plan: the activation plan for a streamed set (None: nothing streams); raises BudgetError when none fits.
        seconds: a plan's predicted extra seconds per step.
        max_count: the most blocks that may stream (host memory); 0: streaming is not offered.

    Raises:
        BudgetError: no count up to ``max_count`` fits (the error of the largest: the smallest peak reached).
    """
    try:
        best = plan(None)
        first = 0
    except BudgetError:
        if max_count == 0:
            raise
        plan(streamed_set(profile, max_count))  # raises the BudgetError with the smallest peak of all
        lo, hi = 1, max_count  # the fewest that fit: the peak falls as the count grows
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                plan(streamed_set(profile, mid))
                hi = mid
            except BudgetError:
                lo = mid + 1
        best, first = plan(streamed_set(profile, lo)), lo
    if seconds(best) <= 0:
        return best
    sizes = dict(enumerate(b.frozen_bytes for b in profile.blocks))
    most = max(  # host memory: the most the spread rule streams within it
        (
            sum(sizes[i] for i in choose_streamed_blocks(list(sizes.items()), count=c))
            for c in range(1, max_count + 1)
        ),
        default=0,
    )
    seen = {streamed_set(profile, first).names if first else ()}  # the sets planned already
    for count in (first, *(first + extra for extra in EXTRA_COUNTS)):
        spread = streamed_set(profile, count) if 0 < count <= max_count else None
        if spread is None:
            continue
        # the spread rule's blocks, and as many bytes where their uploads hide best (see "Placement")
        for candidate_set in (spread, hiding_set(profile, spread.total_bytes, most)):
            if candidate_set is None or candidate_set.names in seen:
                continue
            seen.add(candidate_set.names)
            try:
                candidate = plan(candidate_set)
            except BudgetError:
                continue
            if seconds(candidate) < seconds(best):
                best = candidate
    return best
