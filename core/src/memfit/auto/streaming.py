"""Weight streaming in the ``auto`` plan: which blocks stream, what that does to the peak, what it costs.

Design notes (``docs/weight-streaming.md``, "Planning it with auto", has the longer story)
-------------------------------------------------------------------------------------------
A set.  For a count *n*, the streamed blocks are the spread rule's (:func:`memfit.offload.streamable.
choose_streamed_blocks`): with the set fixed, streaming is per-block constants the planner's search takes as
they are (:class:`StreamedSet`). A streamed block may take any policy: one not recomputed whole saves references to
its weights (:mod:`memfit.offload.weights`, "Saved weights"), and costs what "Cost" and "Saved weights" below
say.

Peak.  The static bytes drop by the streamed frozen bytes. While block *i*'s backward runs, the uploads alive
are its own (if it streams: its recomputed saved tensors hold it) and the nearest streamed block before it
(uploaded ahead when the streamed block after *i* began its recompute, or at the forward's end): a constant per
block, added to its own term. The forward adds at most *L* + 1 consecutive uploads (a streamed block's and the
*L* led ahead of it, :attr:`StreamedSet.forward_ahead`) to the forward's-end bound.

Cost.  In backward each upload hides behind the recompute and backward of the streamed block after it and the
backward of the blocks between; what does not hide is exposed. In forward an upload is issued when the streamed
block *L* places before it starts, and the link copies one at a time: the forward's waits come from running
that queue against the blocks' forward times (with *L* = 1 each upload hides behind the forward of the blocks
from the streamed block before up to it). The other blocks' own recompute (more compute to hide behind) is not
counted. The turnarounds' kept uploads cost nothing ("Turnarounds").

Saved weights.  A streamed block that is not recomputed whole takes its recompute's forward out of the window
that hides the upload of the streamed block before it: the extra exposure is charged to its other policies
(:attr:`StreamedSet.unrecomputed_seconds`), with the hooks its forward's saves pass through (every tensor its call
saves, those of an offloaded attention already priced: ``HOOKED_TENSOR_SECONDS`` each).

Turnarounds.  The last streamed block's recompute runs on its forward's upload; the first *K* streamed blocks'
last recompute uploads serve the next forward (:mod:`memfit.offload.weights`, "Turnarounds"), which takes them
out of the forward's queue: where that queue waits on the link, each kept upload moves the rest earlier. They
are held from their backward through the optimizer step into the forward: every block's backward before them
meets them, and as each kept block starts its forward the activations kept before it, the kept uploads not used
yet and those led ahead are alive together (:attr:`StreamedSet.start_holds`, a bound the planner checks with the
others). *K* is 1 where the first block streams (nothing runs before it) and 0 otherwise, unless the search
keeps more.

Link.  In backward the activation reloads travel host to device on the same link as the uploads. A window's
copies take (upload + reloads) / bandwidth, and what exceeds its compute is exposed. The upload's share is
fixed with the set; each block whose reload is due in the window (the streamed block's own and those of the
blocks between it and the next streamed one) hides its reload behind its part of what the upload leaves of the
window, in proportion to its own backward and never more than that backward (:attr:`StreamedSet.reload_cover`), or
its whole share where the block after it recomputes first (:attr:`StreamedSet.reload_room`, the planner's
"Reloads"); the last streamed block's window has no upload (its recompute runs on its forward's).
Summed per block, that charge is never below the window's own exposure (exact where the upload alone fills the
window, where every reload byte is exposed), and it is a per-block constant once the set is fixed, which the
search takes as it is. Forward parks go device to host, the link's other direction: not counted against uploads.

Search.  :func:`choose_streaming`: no streaming if the plan fits and recomputes nothing; otherwise the fewest
blocks whose plan fits (the peak falls as *n* grows: binary search), then a few counts above it, where streaming
more lets cheaper activation policies fit, each with the forward's uploads led one and two blocks ahead (the
forward's-end bound is rarely what binds a checkpointed plan, and a block's forward is a third of its backward:
the forward is where uploads wait; a lead that hides no more than the shorter one is not planned: it only holds
more); the cheapest by the cost model wins (ties: fewer streamed blocks, the shorter lead). Then, for the
cheapest count and each lead, the most first uploads kept that still fit (binary search, from the fewest past
which the forward's queue waits no more): taken where the cost model says it is cheaper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from memfit.auto.cost import OFFLOAD_REGION_SECONDS
from memfit.auto.profile import ModelProfile
from memfit.errors import BudgetError
from memfit.offload.streamable import choose_streamed_blocks

P = TypeVar("P")
WAIT_RESOLUTION_S = 1e-4  # forward waits below this are none: keeping more uploads would hide nothing more
# counts tried above the fewest that fit (or above none), for a cheaper plan, and every block that may stream: where
# streamed blocks need not recompute, streaming more frees room for cheaper policies all the way up
EXTRA_COUNTS = (1, 2, 4, 8, 16, 32)
# streamed blocks the forward's uploads are led ahead, tried for each count (see "Search")
FORWARD_LEADS = (1, 2)


@dataclass(frozen=True)
class StreamedSet:
    """Blocks whose frozen weights stream, as the peak and cost models see them (indices in call order)."""

    indices: tuple[int, ...]
    names: tuple[str, ...]
    total_bytes: int  # taken off the static bytes
    backward_bytes: tuple[int, ...]  # per block: uploads alive while its backward runs
    forward_bytes: int  # uploads alive at most during the forward
    seconds: float  # upload time not hidden behind compute, per step
    forward_ahead: int = 1  # streamed blocks the forward's uploads are issued ahead of their block
    kept_first: int = 0  # the first streamed blocks whose last recompute's upload serves the next forward
    kept_bytes: int = 0  # their weights, held between steps
    # per kept block: (its index, the uploads alive as its forward starts: the kept ones not used yet and those led
    # ahead of it); with the activations kept before it, a bound of the forward's start (see "Turnarounds")
    start_holds: tuple[tuple[int, int], ...] = ()
    # per block: seconds of backward compute its activation reloads may hide behind, what the uploads on the same
    # link leave of their window (see "Link"); None outside every upload's window (its own backward)
    reload_cover: tuple[float | None, ...] = ()
    # per block: the most its reloads may hide behind in that window where the block after it recomputes (its share
    # of what the upload leaves, not capped at its own backward; see "Link"); None outside every upload's window
    reload_room: tuple[float | None, ...] = ()
    # per block: the upload time a streamed block exposes more when it is not recomputed whole (see "Saved weights")
    unrecomputed_seconds: tuple[float, ...] = ()

    @classmethod
    def of(
        cls,
        profile: ModelProfile,
        indices: Sequence[int],
        *,
        forward_ahead: int = 1,
        kept_first: int | None = None,
    ) -> StreamedSet:
        """The set of the blocks at ``indices`` (call order) of ``profile``, the forward's uploads issued
        ``forward_ahead`` streamed blocks ahead, the first ``kept_first`` running the next forward on their last
        recompute's upload (default: the first one where it is the model's first block, else none)."""
        blocks = profile.blocks
        chosen = sorted(indices)
        if kept_first is None:
            kept_first = int(bool(chosen) and chosen[0] == 0)
        kept_first = min(kept_first, len(chosen))
        weight = {i: blocks[i].frozen_bytes for i in chosen}
        sizes = [weight[i] for i in chosen]
        backward, previous = [], None
        for i in range(len(blocks)):
            # its own, the one uploaded ahead of it, and the kept ones backward has passed already
            held = sum(sizes[k] for k in range(kept_first) if chosen[k] > i)
            backward.append(weight.get(i, 0) + (weight[previous] if previous is not None else 0) + held)
            if i in weight:
                previous = i
        forward = max((sum(sizes[k : k + forward_ahead + 1]) for k in range(len(sizes))), default=0)
        starts = tuple(
            (chosen[k], sum(sizes[k : max(kept_first, k + forward_ahead + 1)])) for k in range(kept_first)
        )
        seconds, cover, room, unrecomputed = _uploads(profile, chosen, forward_ahead, kept_first)
        transient = profile.counts_transient
        return cls(
            indices=tuple(chosen),
            names=tuple(blocks[i].name for i in chosen),
            total_bytes=sum(weight.values()),
            backward_bytes=tuple(backward) if transient else (0,) * len(blocks),
            forward_bytes=forward if transient else 0,
            seconds=seconds,
            forward_ahead=forward_ahead,
            kept_first=kept_first,
            kept_bytes=sum(sizes[:kept_first]) if transient else 0,
            start_holds=starts if transient else (),
            reload_cover=cover,
            reload_room=room,
            unrecomputed_seconds=unrecomputed,
        )


def _forward_waits(fwd: list[float], chosen: list[int], copies: list[float], lead: int) -> float:
    """Seconds the forward waits for uploads (see "Cost"): upload *k* is issued when streamed block *k* − ``lead``
    starts (the first ``lead`` when the forward starts) and copied once the link is free; a block waits for its
    own. ``copies``: each upload's seconds (0 for one kept from the step before)."""
    ready: dict[int, float] = {}
    link = 0.0

    def issue(k: int, now: float) -> None:
        nonlocal link
        if k < len(chosen):
            link = max(now, link) + copies[k] if copies[k] else link
            ready[k] = link if copies[k] else now

    for k in range(min(lead, len(chosen))):
        issue(k, 0.0)
    order = {i: k for k, i in enumerate(chosen)}
    now = waited = 0.0
    for j, seconds in enumerate(fwd):
        k = order.get(j)
        if k is not None:
            waited += max(0.0, ready[k] - now)
            now = max(now, ready[k])
            issue(k + lead, now)
        now += seconds
    return waited


def _forward_seconds(profile: ModelProfile) -> list[float]:
    """Each block's forward with gradients, in seconds, at the profile's rate (what the forward's uploads hide
    behind)."""
    return [b.flops / profile.flops_per_second * profile.forward_with_grad for b in profile.blocks]


def _uploads(
    profile: ModelProfile, chosen: list[int], lead: int = 1, kept_first: int = 0
) -> tuple[float, tuple[float | None, ...], tuple[float | None, ...], tuple[float, ...]]:
    """Upload time not hidden behind compute per step, plus the host's bookkeeping per upload (see "Cost"); per
    block, the backward compute its reloads may hide behind, and the most they may where the block after it
    recomputes (see "Link"); and per block, what more a streamed block's window exposes when the streamed block
    after it is not recomputed (see "Saved weights")."""
    bandwidth = profile.copy_bytes_per_second
    cover: list[float | None] = [None] * len(profile.blocks)
    room: list[float | None] = [None] * len(profile.blocks)
    unrecomputed = [0.0] * len(profile.blocks)
    if not chosen:
        return 0.0, tuple(cover), tuple(room), tuple(unrecomputed)
    fwd = _forward_seconds(profile)
    bwd = [f * profile.backward_to_forward for f in fwd]
    # the turnarounds keep uploads: the last block's forward one for its recompute, and the first kept_first
    # blocks' recompute ones for the next forward (memfit.offload.weights, "Turnarounds")
    kept_forward = set(range(kept_first))
    kept_backward = {len(chosen) - 1}
    seconds = (2 * len(chosen) - len(kept_forward) - len(kept_backward)) * OFFLOAD_REGION_SECONDS
    if not bandwidth:
        return seconds, tuple(cover), tuple(room), tuple(unrecomputed)
    copies = [profile.blocks[i].frozen_bytes / bandwidth for i in chosen]
    seconds += _forward_waits(
        fwd, chosen, [0.0 if k in kept_forward else c for k, c in enumerate(copies)], lead
    )
    # backward: an upload is issued when the streamed block after it recomputes
    ends = [*chosen[1:], len(fwd)]
    for k, i in enumerate(chosen):
        backward_copy = 0.0 if k in kept_backward else copies[k]
        after = ends[k]
        backward_hide = sum(bwd[i + 1 : after + 1]) + (fwd[after] if after < len(fwd) else 0.0)
        seconds += max(0.0, backward_copy - backward_hide)
        if after < len(fwd):  # the streamed block after it not recomputed: its forward leaves the window
            without = max(0.0, backward_copy - (backward_hide - fwd[after]))
            unrecomputed[after] = without - max(0.0, backward_copy - backward_hide)
        if not backward_copy:
            continue  # no upload in this window: its reloads hide behind their own backward, as unstreamed
        # reloads due before block i's recompute
        left, due = max(0.0, backward_hide - backward_copy), range(i, after)
        weight = sum(bwd[j] for j in due)
        for j in due:
            room[j] = left * bwd[j] / weight if weight else 0.0
            cover[j] = min(bwd[j], room[j])
    return seconds, tuple(cover), tuple(room), tuple(unrecomputed)


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


def streamed_set(
    profile: ModelProfile, count: int, *, forward_ahead: int = 1, kept_first: int | None = None
) -> StreamedSet | None:
    """The spread rule's ``count`` blocks as a :class:`StreamedSet` (None for 0)."""
    if not count:
        return None
    sizes = [(i, b.frozen_bytes) for i, b in enumerate(profile.blocks)]
    return StreamedSet.of(
        profile,
        choose_streamed_blocks(sizes, count=count),
        forward_ahead=forward_ahead,
        kept_first=kept_first,
    )


def _most_worth_keeping(profile: ModelProfile, streamed: StreamedSet) -> int:
    """How many of ``streamed``'s first uploads are worth keeping for the next forward: the fewest past which the
    forward waits no more (each kept upload leaves the forward's queue; see "Turnarounds")."""
    bandwidth = profile.copy_bytes_per_second
    chosen = list(streamed.indices)
    if not bandwidth or not chosen:
        return streamed.kept_first
    fwd = _forward_seconds(profile)
    copies = [profile.blocks[i].frozen_bytes / bandwidth for i in chosen]

    def waits(kept: int) -> float:
        copied = [0.0 if k < kept else c for k, c in enumerate(copies)]
        return _forward_waits(fwd, chosen, copied, streamed.forward_ahead)

    return next(
        (k for k in range(streamed.kept_first, len(chosen)) if waits(k) <= WAIT_RESOLUTION_S), len(chosen)
    )


def _most_kept(
    profile: ModelProfile, plan: Callable[[StreamedSet], P], indices: Sequence[int], lead: int
) -> P | None:
    """The plan of ``indices`` led ``lead`` ahead that keeps the most first uploads worth keeping and fits (None:
    none fits beyond the turnaround rule's). Binary search: each kept upload holds more memory."""
    rule = StreamedSet.of(profile, indices, forward_ahead=lead)
    lo, hi = rule.kept_first, _most_worth_keeping(profile, rule)  # lo: no more than the rule
    best = None  # the plan of the last count that fitted: lo's
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            best = plan(StreamedSet.of(profile, indices, forward_ahead=lead, kept_first=mid))
            lo = mid
        except BudgetError:
            hi = mid - 1
    return best


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
    tried: dict[tuple, P | BudgetError] = {}

    def plan_once(streamed: StreamedSet | None) -> P:  # the binary search's sets come again in the loop below
        key = None if streamed is None else (streamed.indices, streamed.forward_ahead, streamed.kept_first)
        if key not in tried:
            try:
                tried[key] = plan(streamed)
            except BudgetError as exc:
                tried[key] = exc
        found = tried[key]
        if isinstance(found, BudgetError):
            raise found
        return found

    best_set: StreamedSet | None = None
    try:
        best = plan_once(None)
        first = 0
    except BudgetError:
        if max_count == 0:
            raise
        plan_once(streamed_set(profile, max_count))  # raises the BudgetError with the smallest peak of all
        lo, hi = 1, max_count  # the fewest that fit: the peak falls as the count grows
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                plan_once(streamed_set(profile, mid))
                hi = mid
            except BudgetError:
                lo = mid + 1
        best_set = streamed_set(profile, lo)
        best, first = plan_once(best_set), lo
    if seconds(best) <= 0:
        return best
    for count in sorted({first, *(min(first + extra, max_count) for extra in EXTRA_COUNTS)}):
        shortest = streamed_set(profile, count, forward_ahead=FORWARD_LEADS[0])
        for lead in FORWARD_LEADS:
            led = shortest if lead == FORWARD_LEADS[0] else streamed_set(profile, count, forward_ahead=lead)
            if (count, lead) == (first, FORWARD_LEADS[0]) or led is None:
                continue  # the plan in hand; nothing streams to lead
            if lead != FORWARD_LEADS[0] and shortest is not None and led.seconds >= shortest.seconds:
                continue  # the longer lead hides nothing more and only holds more: never the cheaper plan
            try:
                candidate = plan_once(led)
            except BudgetError:
                continue
            if seconds(candidate) < seconds(best):
                best, best_set = candidate, led
    if best_set is None:
        return best
    for lead in FORWARD_LEADS:  # then, for the cheapest count, keep more of the first uploads where that pays
        kept = _most_kept(profile, plan_once, best_set.indices, lead)
        if kept is not None and seconds(kept) < seconds(best):
            best = kept
    return best
