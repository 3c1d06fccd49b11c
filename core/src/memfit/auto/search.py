"""The planner's search: one choice per block, exact under the peak model up to the byte granularity.

Design notes
------------
State.  What a block's backward meets besides its own peak depends on the blocks before it: the bytes they
keep (a prefix sum) and what the copy engine reloads ahead of it — the nearest earlier block that copies,
and the one before that when it copies more (:mod:`memfit.offload.ahead`).
So the dynamic programme runs in forward order over (kept bytes, the two nearest copy sizes). Copies take
few distinct sizes (one per kind of block and policy), so there are few states; kept bytes are counted in
units rounded up per block, never optimistic (the caller recomputes the exact peak of what it picks).

Two questions.  :func:`cheapest`: the least extra seconds with Σ kept, and each block's own term on top of
the blocks before it, within the budget. :func:`smallest`: the least peak any plan reaches — the same
programme, minimising the largest term instead of summing seconds.

Batches.  Each block is one batch of tensor operations over every reachable state at once (a row each): per
choice, the moved values of all rows; per target state, the least over the (state, choice) pairs that reach it.
It gives the pair-by-pair loop's picks exactly (``core/tests/search_reference.py``) in half its time (57 blocks:
0.15 against 0.28 s on a CPU core); ``auto`` re-plans inside a training step while it calibrates.

Ties.  Within a cell the earlier pair wins: the lower state, then the earlier choice (choices come in
``BlockPolicy`` order, least intrusive first); among the cheapest end cells, the fewest kept bytes, then the lowest state: the same inputs always
give the same plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.auto.cost import Choice

_INF = float("inf")


@dataclass(frozen=True)
class Problem:
    """The choices per block (forward order) and how the peak model weighs them."""

    options: list[list[Choice]]
    unit: int  # bytes per unit of kept bytes
    depth: int  # copies reloaded ahead of a block's backward (0: none, off CUDA)
    own_counts: bool  # each block's own peak counts (CUDA); else only Σ kept does

    def units(self, c: Choice) -> int:
        return -(-c.kept // self.unit)


class _Copies:
    """States: the nearest two copy sizes before a block (index 0 = none), and what they reload ahead."""

    def __init__(self, problem: Problem) -> None:
        if problem.depth > 2:
            raise NotImplementedError(
                "the search follows at most two copies reloaded ahead (PREFETCH_DEPTH <= 2)"
            )
        sizes = (
            sorted({c.copied for opts in problem.options for c in opts if c.copied}) if problem.depth else []
        )
        self.sizes = [0, *sizes]
        self.index = {s: i for i, s in enumerate(self.sizes)}
        self.n = len(self.sizes)
        self.count = self.n * self.n if problem.depth > 1 else self.n
        self.depth = problem.depth

    def split(self, state: int) -> tuple[int, int]:
        return (state // self.n, state % self.n) if self.depth > 1 else (state, 0)

    def ahead(self, state: int) -> int:
        nearest, before = (self.sizes[i] for i in self.split(state))
        if not self.depth or not nearest:
            return 0
        return nearest + (before if self.depth > 1 and before > nearest else 0)

    def after(self, state: int, copied: int) -> int:
        """The state of the next block once a block that copies ``copied`` bytes is passed."""
        if not self.depth or not copied:
            return state
        nearest, _ = self.split(state)
        i = self.index[copied]
        return i * self.n + nearest if self.depth > 1 else i


def cheapest(problem: Problem, capacity: int, room: int) -> list[Choice] | None:
    """The least-seconds picks with Σ kept ≤ ``capacity`` units and, where own peaks count, every block's
    ``need`` on top of the kept bytes before it within ``room`` bytes (None: no such plan)."""

    def step(values: torch.Tensor, c: Choice, aheads: list[int], w: int) -> tuple[torch.Tensor, list[int]]:
        last = [capacity - w] * len(aheads)
        if problem.own_counts:
            last = [min(capacity - w, (room - c.need(a)) // problem.unit) for a in aheads]
        return values + c.seconds, last

    return _run(problem, capacity, step, lambda value, _state: value)


def smallest(problem: Problem, capacity: int, workspace: int) -> list[Choice]:
    """The picks whose largest term (a block's own peak above the kept bytes before it, or Σ kept plus the
    ``workspace``) is least, with Σ kept ≤ ``capacity`` units (enough for every choice)."""
    prefix = torch.arange(capacity + 1, dtype=torch.float64) * problem.unit

    def step(values: torch.Tensor, c: Choice, aheads: list[int], w: int) -> tuple[torch.Tensor, list[int]]:
        if problem.own_counts:
            need = torch.tensor([c.need(a) for a in aheads], dtype=torch.float64)
            values = torch.maximum(values, prefix + need[:, None])
        return values, [capacity - w] * len(aheads)

    def final(value: torch.Tensor, _: int) -> torch.Tensor:
        return torch.maximum(value, prefix + workspace)

    picks = _run(problem, capacity, step, final)
    assert picks is not None  # every block has a choice and the capacity fits the largest
    return picks


def _run(
    problem: Problem,
    capacity: int,
    step: Callable[[torch.Tensor, Choice, list[int], int], tuple[torch.Tensor, list[int]]],
    final: Callable[[torch.Tensor, int], torch.Tensor],
) -> list[Choice] | None:
    """The programme (see "Batches"): ``step`` gives a choice's values over the prefixes of every reachable state
    at once (one row each) and, per row, the last prefix it may follow; cells keep the least; ``final`` scores the
    end cells."""
    if capacity < 0:
        return None
    copies = _Copies(problem)
    width = capacity + 1
    columns = torch.arange(width)
    value = torch.full((copies.count, width), _INF, dtype=torch.float64)
    value[0, 0] = 0.0
    trail: list[tuple[torch.Tensor, torch.Tensor]] = []
    for opts in problem.options:
        states = torch.isfinite(value).any(dim=1).nonzero().flatten().tolist()  # ascending
        if not states:  # no plan reaches this block
            return None
        rows = value[states]
        aheads = [copies.ahead(state) for state in states]
        candidates, targets = [], []  # per (state, choice) pair, in the order the ties are broken
        for c in opts:
            w = problem.units(c)
            moved, last = step(rows, c, aheads, w)
            shifted = torch.full_like(rows, _INF)
            if w < width:
                shifted[:, w:] = moved[:, : width - w]
            limit = torch.tensor(last)[:, None] + w  # columns past a row's last prefix stay out
            candidates.append(shifted.masked_fill(columns[None, :] > limit, _INF))
            targets.append([copies.after(state, c.copied) for state in states])
        k, count = len(opts), len(states) * len(opts)
        pairs = torch.stack(candidates, dim=1).reshape(count, width)  # pair p = (states[p // k], p % k)
        target = torch.tensor([targets[p % k][p // k] for p in range(count)])[:, None].expand(count, width)
        new = torch.full_like(value, _INF).scatter_reduce(0, target, pairs, "amin")
        # the first pair at its target's least value: the earlier state, then the earlier choice, wins ties
        at_least = (pairs == new.gather(0, target)) & torch.isfinite(pairs)
        numbers = torch.where(at_least, torch.arange(count)[:, None], count)
        first = torch.full(value.shape, count).scatter_reduce(0, target, numbers, "amin")
        reached = first < count
        pair = first.clamp(max=count - 1)
        which = torch.where(reached, pair % k, -1).to(torch.int32)
        origin = torch.where(reached, torch.tensor(states)[pair // k], -1).to(torch.int32)
        value = new
        trail.append((which, origin))
    return _picks(problem, value, trail, final)


def _picks(
    problem: Problem,
    value: torch.Tensor,
    trail: list[tuple[torch.Tensor, torch.Tensor]],
    final: Callable[[torch.Tensor, int], torch.Tensor],
) -> list[Choice] | None:
    """The choices back from the best end cell: ``value`` holds the end cells per state, ``trail`` each block's
    chosen choice and origin state per cell (see "Ties")."""
    scores = torch.stack([final(value[s], s) for s in range(value.shape[0])])
    if not torch.isfinite(scores).any():
        return None
    best = scores.min()
    # the fewest kept units among the best, then the lowest state
    hits = (scores == best).nonzero().tolist()
    state, w = min(hits, key=lambda sw: (sw[1], sw[0]))
    picks: list[Choice] = []
    for opts, (which, origin) in zip(reversed(problem.options), reversed(trail), strict=True):
        c = opts[int(which[state, w])]
        picks.append(c)
        state, w = int(origin[state, w]), w - problem.units(c)
    return picks[::-1]
