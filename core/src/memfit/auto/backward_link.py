"""The backward's host-to-device link, run as the engine issues its copies: how long compute waits for them.

Design notes (``docs/cost-model.md``, "The backward's link", has the longer story)
---------------------------------------------------------------------------------
What it runs.  One plan's backward, block by block in backward order, on one clock shared by compute and the
link. A block starts with the upload of the streamed block before it (issued first: :mod:`memfit.offload.
weights`, "Ahead of need"), then the reloads its region asks for (its own if not yet back, and those the
reload-ahead rule takes, :mod:`memfit.offload.ahead`); it waits for its own upload and its own reload, then
recomputes and runs its backward. A block that offloads its attention reaches its parked region only after its
FFN's backward: its reloads are issued, and waited for, there.

The link.  Uploads and reloads run on two copy streams, each in issue order; while both copy they share the
link's bandwidth evenly (PCIe splits between two engines about so: the card's measured ``h2d_beside_h2d`` is the
one-stream rate). Forward parks go device to host, the other direction: not on this link.

What it is for.  The search prices each block's reload against windows of its own (:class:`memfit.auto.search.
Reloads`): per block, never the queue. Where reloads nearly fill the link (blocks parked whole beside streamed
weights) that misses the waits of a reload that cannot start early enough; running the queue finds them. The
planner runs it on the plan it picked, under the bytes rule and with equal regions two ahead, and takes the second
where it waits less and the peak still fits (:func:`memfit.auto.planner.plan_policies`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memfit.auto.cost import Choice, forward_with_grad_seconds, recompute_seconds
from memfit.auto.profile import ModelProfile
from memfit.auto.streaming import WAIT_RESOLUTION_S, StreamedSet
from memfit.offload.ahead import PREFETCH_DEPTH, regions_ahead

_UPLOADS, _RELOADS = 0, 1
_ROUNDING_S = 1e-9  # bytes left of a copy below this many seconds of the link: done (float rounding)


class _Link:
    """Two copy streams over one link: each copies in issue order, both together share the bandwidth evenly."""

    def __init__(self, bandwidth: float) -> None:
        self.bandwidth = bandwidth
        self.now = 0.0
        self.lanes: tuple[list[list], list[list]] = ([], [])  # per stream: [bytes left, key], in issue order
        self.done: set[tuple[int, int]] = set()

    def issue(self, lane: int, key: tuple[int, int], nbytes: int) -> None:
        if nbytes > 0:
            self.lanes[lane].append([float(nbytes), key])
        else:
            self.done.add(key)

    def run(self, seconds: float) -> None:
        """Compute runs ``seconds``; the link copies meanwhile."""
        self._advance(self.now + seconds)

    def wait(self, key: tuple[int, int]) -> float:
        """Seconds compute waits for the copy ``key`` (issued before)."""
        start = self.now
        while key not in self.done:
            self._advance(None)
        return self.now - start

    def _advance(self, until: float | None) -> None:
        """Copy until ``until``, or (None) until the next copy finishes."""
        while until is None or self.now < until:
            busy = [lane for lane in self.lanes if lane]
            if not busy:
                if until is None:
                    raise AssertionError("internal error: waiting for a copy that was never issued")
                self.now = until
                return
            rate = self.bandwidth / len(busy)
            step = min(lane[0][0] for lane in busy) / rate
            if until is not None:
                step = min(step, until - self.now)
            self.now += step
            for lane in busy:
                lane[0][0] -= rate * step
                if lane[0][0] <= self.bandwidth * _ROUNDING_S:
                    self.done.add(lane.pop(0)[1])
            if until is None:
                return


def backward_waits(
    profile: ModelProfile,
    picks: Sequence[Choice],
    streamed: StreamedSet | None,
    *,
    equal_ahead: bool,
    depth: int = PREFETCH_DEPTH,
) -> float:
    """Seconds the backward of ``picks`` (one choice per block, forward order) waits for the host-to-device link,
    its reloads ahead taken by the bytes rule or, with ``equal_ahead``, with equal regions two ahead (see the
    module's notes). 0 without a measured bandwidth."""
    bandwidth = profile.copy_bytes_per_second
    if not bandwidth:
        return 0.0
    blocks = profile.blocks
    link = _Link(bandwidth)
    sizes = [c.copied for c in picks]
    streams = list(streamed.indices) if streamed is not None else []
    before = {k: j for j, k in zip(streams, streams[1:], strict=False)}  # streamed block -> the one before it
    if streams:  # the last streamed block's recompute runs on its forward's upload (the turnaround)
        link.done.add((_UPLOADS, streams[-1]))
    issued: set[int] = set()
    waited = 0.0
    for i in reversed(range(len(picks))):
        b, c = blocks[i], picks[i]
        recompute = recompute_seconds(c.policy, b, profile)
        backward = forward_with_grad_seconds(b, profile) * profile.backward_to_forward
        # an offloaded attention is reached after the FFN's recompute and backward
        late = (
            recompute + backward * b.ffn_flops / b.flops if c.policy.offloads_attention and b.flops else 0.0
        )
        if i in before:
            j = before[i]
            link.issue(_UPLOADS, (_UPLOADS, j), blocks[j].frozen_bytes)
        if i in streams:
            waited += link.wait((_UPLOADS, i))
        link.run(min(late, recompute + backward))
        wanted = [i] if sizes[i] else []
        wanted += [
            i - 1 - p for p in regions_ahead(sizes[i - 1 :: -1] if i else [], depth, equal_too=equal_ahead)
        ]
        for j in wanted:
            if j not in issued:
                issued.add(j)
                link.issue(_RELOADS, (_RELOADS, j), sizes[j])
        if sizes[i]:
            waited += link.wait((_RELOADS, i))
        link.run(max(0.0, recompute + backward - late))
    return waited


def choose_reload_ahead(
    profile: ModelProfile,
    picks: Sequence[Choice],
    streamed: StreamedSet | None,
    *,
    fits: Callable[[], bool],
    depth: int = PREFETCH_DEPTH,
) -> tuple[bool, float]:
    """(whether ``picks`` reload equal regions two ahead, what their backward then waits): two ahead where it
    waits less than the bytes rule and ``fits()`` (the peak with two reloads in flight within the budget)."""
    one = backward_waits(profile, picks, streamed, equal_ahead=False, depth=depth)
    if one <= WAIT_RESOLUTION_S:
        return False, one
    two = backward_waits(profile, picks, streamed, equal_ahead=True, depth=depth)
    if two < one - WAIT_RESOLUTION_S and fits():
        return True, two
    return False, one
