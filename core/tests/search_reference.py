"""The planner's search as it was written first, pair by pair (each state, each choice): the reference the batched
programme in :mod:`memfit.auto.search` must agree with, pick for pick (test_auto_search.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.auto.cost import Choice
from memfit.auto.search import _INF, Problem, _Copies, _picks


def reference_cheapest(problem: Problem, capacity: int, room: int) -> list[Choice] | None:
    """The least-seconds picks with Σ kept ≤ ``capacity`` units and, where own peaks count, every block's
    ``need`` on top of the kept bytes before it within ``room`` bytes (None: no such plan)."""

    def step(value: torch.Tensor, c: Choice, ahead: int, w: int) -> tuple[torch.Tensor, int]:
        last = capacity - w
        if problem.own_counts:
            last = min(last, (room - c.need(ahead)) // problem.unit)
        return value[: max(last + 1, 0)] + c.seconds, last

    return _reference_run(problem, capacity, step, lambda value, _state: value)


def reference_smallest(problem: Problem, capacity: int, workspace: int) -> list[Choice]:
    """The picks whose largest term (a block's own peak above the kept bytes before it, or Σ kept plus the
    ``workspace``) is least, with Σ kept ≤ ``capacity`` units (enough for every choice)."""
    prefix = torch.arange(capacity + 1, dtype=torch.float64) * problem.unit

    def step(value: torch.Tensor, c: Choice, ahead: int, w: int) -> tuple[torch.Tensor, int]:
        last = capacity - w
        worst = value[: last + 1]
        if problem.own_counts:
            worst = torch.maximum(worst, prefix[: last + 1] + c.need(ahead))
        return worst, last

    def final(value: torch.Tensor, _: int) -> torch.Tensor:
        return torch.maximum(value, prefix + workspace)

    picks = _reference_run(problem, capacity, step, final)
    assert picks is not None  # every block has a choice and the capacity fits the largest
    return picks


def _reference_run(
    problem: Problem,
    capacity: int,
    step: Callable[[torch.Tensor, Choice, int, int], tuple[torch.Tensor, int]],
    final: Callable[[torch.Tensor, int], torch.Tensor],
) -> list[Choice] | None:
    """The programme: ``step`` gives a choice's values over the reachable prefixes (and the last prefix it may
    follow), cells keep the least; ``final`` scores the end cells."""
    if capacity < 0:
        return None
    copies = _Copies(problem)
    value = torch.full((copies.count, capacity + 1), _INF, dtype=torch.float64)
    value[0, 0] = 0.0
    trail: list[tuple[torch.Tensor, torch.Tensor]] = []
    for opts in problem.options:
        new = torch.full_like(value, _INF)
        which = torch.full(new.shape, -1, dtype=torch.int32)
        origin = torch.full(new.shape, -1, dtype=torch.int32)
        for state in range(copies.count):
            if not torch.isfinite(value[state]).any():
                continue
            ahead = copies.ahead(state)
            for k, c in enumerate(opts):
                w = problem.units(c)
                candidate, last = step(value[state], c, ahead, w)
                if last < 0:
                    continue
                to = copies.after(state, c.copied)
                span = slice(w, w + last + 1)
                better = candidate < new[to, span]  # strict: earlier (less intrusive) choices win ties
                new[to, span] = torch.where(better, candidate, new[to, span])
                which[to, span] = torch.where(better, k, which[to, span])
                origin[to, span] = torch.where(better, state, origin[to, span])
        value = new
        trail.append((which, origin))
    return _picks(problem, value, trail, final)
