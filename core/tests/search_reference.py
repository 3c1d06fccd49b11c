"""The planner's search as it was written first, pair by pair (each state, each choice): the reference the batched
programme in :mod:`memfit.auto.search` must agree with, pick for pick (test_auto_search.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.auto.cost import Choice
from memfit.auto.search import _INF, Problem


class ReferenceStates:
    """The search's states one at a time: the two nearest copies before a block (what the copy engine reloads
    ahead, by :func:`memfit.offload.ahead.bytes_ahead`'s rule), the queue's backlog level, and whether the block
    before left a reload its next recompute may hide more of (``Reloads``)."""

    def __init__(self, problem: Problem) -> None:
        sizes = (
            sorted({c.copied for opts in problem.options for c in opts if c.copied}) if problem.depth else []
        )
        self.sizes = [0, *sizes]
        self.n = len(self.sizes)
        self.depth = problem.depth
        self.queue = problem.queue
        self.levels = problem.queue.levels + 1 if problem.queue is not None else 1
        self.reloads = problem.reloads if problem.depth else None
        self.flags = 2 if self.reloads is not None else 1
        self.count = (self.n * self.n if problem.depth > 1 else self.n) * self.levels * self.flags

    def split(self, state: int) -> tuple[int, int, int, int]:
        rest, pending = divmod(state, self.flags)
        pair, level = divmod(rest, self.levels)
        nearest, before = divmod(pair, self.n) if self.depth > 1 else (pair, 0)
        return nearest, before, level, pending

    def backlog(self, state: int) -> int:
        return self.split(state)[2] * self.queue.unit if self.queue is not None else 0

    def need(self, state: int, block: int, c: Choice) -> int:
        nearest, before, _, _ = self.split(state)
        nearest, before = self.sizes[nearest], self.sizes[before]
        ahead = 0
        if self.depth and nearest:
            ahead = nearest + (before if self.depth > 1 and before > nearest else 0)
        need = c.need(ahead)
        backlog = self.backlog(state)
        if backlog:
            need = max(need, self.queue.forward_need[block] + backlog)
        return need

    def after(self, state: int, block: int, c: Choice) -> tuple[int, float]:
        nearest, before, level, pending = self.split(state)
        previous = self.sizes[nearest]  # the block before's copy, where pending
        if self.depth and c.copied:
            nearest, before = self.sizes.index(c.copied), nearest
        pair = nearest * self.n + before if self.depth > 1 else nearest
        to, seconds = pair, c.seconds
        if self.queue is not None:
            queued, wait, _ = self.queue.advance(self.backlog(state), block, c)
            to, seconds = (
                pair * self.levels + -(-queued // self.queue.unit),
                c.seconds - c.forward_exposed + wait,
            )
        if self.reloads is None:
            return to, seconds
        if pending and c.recompute_window:
            seconds -= self.reloads.credit(block - 1, previous, c.recompute_window)
        return to * 2 + int(self.reloads.pending(block, c)), seconds

    def end(self, state: int) -> tuple[int, float]:
        backlog = self.backlog(state)
        return backlog, backlog / self.queue.bandwidth if self.queue is not None else 0.0


def reference_cheapest(problem: Problem, capacity: int, room: int) -> list[Choice] | None:
    """The least-seconds picks with Σ kept ≤ ``capacity`` units and, where own peaks count, every block's
    ``need`` on top of the kept bytes before it within ``room`` bytes (None: no such plan)."""

    def step(value: torch.Tensor, need: int, seconds: float, w: int) -> tuple[torch.Tensor, int]:
        last = capacity - w
        if problem.own_counts:
            last = min(last, (room - need) // problem.unit)
        return value[: max(last + 1, 0)] + seconds, last

    def final(value: torch.Tensor, backlog: int, wait: float) -> torch.Tensor:
        out = value + wait
        out[max(0, capacity - -(-backlog // problem.unit) + 1) :] = _INF
        return out

    return _reference_run(problem, capacity, step, final)


def reference_smallest(problem: Problem, capacity: int, workspace: int) -> list[Choice]:
    """The picks whose largest term (a block's own peak above the kept bytes before it, or Σ kept plus the
    ``workspace``) is least, with Σ kept ≤ ``capacity`` units (enough for every choice)."""
    prefix = torch.arange(capacity + 1, dtype=torch.float64) * problem.unit

    def step(value: torch.Tensor, need: int, _seconds: float, w: int) -> tuple[torch.Tensor, int]:
        last = capacity - w
        worst = value[: last + 1]
        if problem.own_counts:
            worst = torch.maximum(worst, prefix[: last + 1] + need)
        return worst, last

    def final(value: torch.Tensor, backlog: int, _wait: float) -> torch.Tensor:
        return torch.maximum(value, prefix + workspace + backlog)

    picks = _reference_run(problem, capacity, step, final)
    assert picks is not None  # every block has a choice and the capacity fits the largest
    return picks


def _reference_run(
    problem: Problem,
    capacity: int,
    step: Callable[[torch.Tensor, int, float, int], tuple[torch.Tensor, int]],
    final: Callable[[torch.Tensor, int, float], torch.Tensor],
) -> list[Choice] | None:
    """The programme: ``step`` gives a choice's values over the reachable prefixes (and the last prefix it may
    follow), cells keep the least; ``final`` scores the end cells."""
    if capacity < 0:
        return None
    space = ReferenceStates(problem)
    value = torch.full((space.count, capacity + 1), _INF, dtype=torch.float64)
    value[0, 0] = 0.0
    trail: list[tuple[torch.Tensor, torch.Tensor]] = []
    for block, opts in enumerate(problem.options):
        new = torch.full_like(value, _INF)
        which = torch.full(new.shape, -1, dtype=torch.int32)
        origin = torch.full(new.shape, -1, dtype=torch.int32)
        for state in range(space.count):
            if not torch.isfinite(value[state]).any():
                continue
            for k, c in enumerate(opts):
                w = problem.units(c)
                to, seconds = space.after(state, block, c)
                candidate, last = step(value[state], space.need(state, block, c), seconds, w)
                if last < 0:
                    continue
                span = slice(w, w + last + 1)
                better = candidate < new[to, span]  # strict: earlier (less intrusive) choices win ties
                new[to, span] = torch.where(better, candidate, new[to, span])
                which[to, span] = torch.where(better, k, which[to, span])
                origin[to, span] = torch.where(better, state, origin[to, span])
        value = new
        trail.append((which, origin))
    return _reference_picks(problem, space, value, trail, final)


def _reference_picks(
    problem: Problem,
    space: ReferenceStates,
    value: torch.Tensor,
    trail: list[tuple[torch.Tensor, torch.Tensor]],
    final: Callable[[torch.Tensor, int, float], torch.Tensor],
) -> list[Choice] | None:
    """Back from the best end cell: the least score, then the fewest kept units, then the lowest state."""
    scores = torch.stack([final(value[s].clone(), *space.end(s)) for s in range(space.count)])
    if not torch.isfinite(scores).any():
        return None
    hits = (scores == scores.min()).nonzero().tolist()
    state, w = min(hits, key=lambda sw: (sw[1], sw[0]))
    picks: list[Choice] = []
    for opts, (which, origin) in zip(reversed(problem.options), reversed(trail), strict=True):
        c = opts[int(which[state, w])]
        picks.append(c)
        state, w = int(origin[state, w]), w - problem.units(c)
    return picks[::-1]
