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
Columns stop at the most kept units the blocks so far can reach. Which pair won a cell is found only for the cells
the best plan passes through, on the way back (see "Ties"). It gives the pair-by-pair loop's picks exactly
(``core/tests/search_reference.py``); ``auto`` re-plans inside a training step while it calibrates. The queue's
levels and the reload flag multiply the states (the least peak's search leaves the flag out: it weighs no
seconds). Planning Flux at 16 GiB from its H100 profile runs 12 cheapest searches (~0.4 s each on one CPU core)
and 15 least-peak ones (~0.15 s): one per streamed set the streaming search tries
(:func:`memfit.auto.streaming.choose_streaming`).

Queue.  A block's device-to-host copies need not finish within its own forward: the link copies one at a time,
and a block that copies little leaves link time to the blocks before it (:class:`Queue`). Where the planner
runs the forward's copies as one queue, the state also holds the bytes still queued as the block starts (in
levels, rounded up: never optimistic), which the block's forward holds on the device on top of what the blocks
before it keep (its ``forward_need``); compute waits only where the queue would exceed its cap, and what is
still queued when the forward ends is held at the forward's end and charged as exposed. A choice's own
``forward_exposed`` (its copy charged against its own forward alone) is then left out of its seconds.

Reload credit.  The copy engine reloads a block's copies as the backward of the block after it (in forward order)
starts, and a block that recomputes runs that recompute first: the reload hides behind both, where each block's
own charge counts its reload against a backward alone (:class:`Reloads`). The state then also says whether the
block before carries such a reload not hidden by that charge, and a choice that recomputes (``recompute_window``)
takes back what its recompute hides of it. Only such reloads add the flag's states.

Ties.  Within a cell the earlier pair wins: the lower state, then the earlier choice (choices come in
``BlockPolicy`` order, least intrusive first); among the cheapest end cells, the fewest kept bytes, then the lowest
state: the same inputs always give the same plan. The way back keeps each block's states, values and moves, and
makes that block's moves into the one cell again: the same operations on the same values give the same bits, so
the first pair equal to the cell's least is the one that set it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from memfit.auto.cost import Choice

_INF = float("inf")


@dataclass(frozen=True)
class Queue:
    """The forward's device-to-host copies as one queue across blocks (see "Queue")."""

    drain: tuple[int, ...]  # per block: bytes the link copies while its forward runs
    forward_need: tuple[int, ...]  # per block: its forward's peak above what the blocks before it keep
    unit: int  # bytes per backlog level
    levels: int  # levels above an empty queue: the most it holds is unit * levels
    bandwidth: float  # bytes per second

    @property
    def cap(self) -> int:
        return self.unit * self.levels

    def advance(self, backlog: int, block: int, c: Choice) -> tuple[int, float, int]:
        """(bytes queued after ``block``, seconds compute waits for the link, the most bytes in flight meanwhile)
        for ``block`` taking ``c`` with ``backlog`` bytes queued as it starts. A parked block's tensors are
        copied once the next region starts: its copy joins the queue after its forward."""
        drain = self.drain[block]
        if c.policy.parks_block:
            queued = max(0, backlog - drain) + c.copied
            peak = max(backlog, queued)
        else:
            queued = max(0, backlog + c.copied - drain)
            peak = backlog + c.copied
        wait = max(0, queued - self.cap) / self.bandwidth
        return min(queued, self.cap), wait, peak

    def run(self, picks: list[Choice]) -> tuple[list[int], int, float, int]:
        """Exact in bytes: the backlog as each block starts, what is queued as the forward ends, the seconds
        compute waits (the end's backlog included) and the most bytes in flight."""
        backlog, waited, in_flight, starts = 0, 0.0, 0, []
        for b, c in enumerate(picks):
            starts.append(backlog)
            backlog, wait, peak = self.advance(backlog, b, c)
            waited += wait
            in_flight = max(in_flight, peak)
        return starts, backlog, waited + backlog / self.bandwidth, in_flight


@dataclass(frozen=True)
class Reloads:
    """What a block's reload hides behind where the block after it recomputes first (see "Reload credit")."""

    cover: tuple[float, ...]  # per block: seconds its reload hides behind in its choices' own charge
    # per block: the most its reload may hide behind (inf: no weight upload shares its window)
    room: tuple[float, ...]
    bandwidth: float  # bytes per second

    def exposed(self, block: int, copied: int, window: float = 0.0) -> float:
        """Seconds the reload of ``block``'s ``copied`` bytes is exposed, with ``window`` seconds of recompute
        before it (the block after it's)."""
        return max(0.0, copied / self.bandwidth - min(self.room[block], self.cover[block] + window))

    def pending(self, block: int, c: Choice) -> bool:
        """``block`` taking ``c`` leaves a reload the block after it may hide more of."""
        return bool(c.copied) and self.exposed(block, c.copied) > 0.0

    def credit(self, block: int, copied: int, window: float) -> float:
        """Seconds the recompute after ``block`` takes back from its reload's charge."""
        return self.exposed(block, copied) - self.exposed(block, copied, window)

    def total(self, picks: list[Choice]) -> float:
        """Seconds the picks' recomputes take back from the reloads of the blocks before them."""
        return sum(
            self.credit(b, c.copied, after.recompute_window)
            for b, (c, after) in enumerate(zip(picks, picks[1:], strict=False))
            if c.copied and after.recompute_window
        )


@dataclass(frozen=True)
class Problem:
    """The choices per block (forward order) and how the peak model weighs them."""

    options: list[list[Choice]]
    unit: int  # bytes per unit of kept bytes
    depth: int  # copies reloaded ahead of a block's backward (0: none, off CUDA)
    own_counts: bool  # each block's own peak counts (CUDA); else only Σ kept does
    queue: Queue | None = None  # the forward's copies as one queue (None: each against its own forward)
    # reloads hidden behind the next block's recompute (None: each behind a backward alone)
    reloads: Reloads | None = None

    def units(self, c: Choice) -> int:
        return -(-c.kept // self.unit)


class _States:
    """States: the nearest two copy sizes before a block (index 0 = none), what they reload ahead, with a queue the
    bytes queued as the block starts (levels), and with reload credit whether the block before left a reload to
    take back from. Tables per state, moves per batch of states."""

    def __init__(self, problem: Problem) -> None:
        if problem.depth > 2:
            raise NotImplementedError(
                "the search follows at most two copies reloaded ahead (PREFETCH_DEPTH <= 2)"
            )
        sizes = (
            sorted({c.copied for opts in problem.options for c in opts if c.copied}) if problem.depth else []
        )
        self.index = {s: i for i, s in enumerate([0, *sizes])}
        self.n = n = len(sizes) + 1
        self.depth = problem.depth
        self.queue = problem.queue
        self.reloads = problem.reloads if problem.depth else None
        self.levels = problem.queue.levels + 1 if problem.queue is not None else 1
        self.flags = 2 if self.reloads is not None else 1
        pairs = n * n if problem.depth > 1 else n
        self.count = pairs * self.levels * self.flags
        state = torch.arange(self.count)
        pair = state // (self.levels * self.flags)
        self.size = torch.tensor([0, *sizes], dtype=torch.int64)
        self.nearest = pair // n if problem.depth > 1 else pair  # index of the nearest copy before the block
        nearest = self.size[self.nearest]
        before = self.size[pair % n] if problem.depth > 1 else torch.zeros_like(nearest)
        # what the copy engine reloads ahead (memfit.offload.ahead): the nearest, and the one before when larger
        self.ahead = torch.where(before > nearest, nearest + before, nearest) if self.depth else 0 * nearest
        unit = problem.queue.unit if problem.queue is not None else 0
        self.backlog = (state // self.flags % self.levels) * unit  # bytes queued as the block starts
        # 1: the nearest copy is the block before's, its reload partly exposed
        self.pending = state % self.flags

    def moves(
        self, states: torch.Tensor, block: int, c: Choice
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per state in ``states`` (as ``block`` takes ``c``): the next block's state, what ``c`` costs in seconds
        from it, and the bytes the block needs above what the blocks before it keep (its backward's, or its
        forward's with a backlog)."""
        ahead = self.ahead[states]
        need = c.own + ahead if c.own_late is None else torch.clamp(c.own_late + ahead, min=c.own)
        pair = states // (self.levels * self.flags)
        if self.depth and c.copied:
            i = self.index[c.copied]
            pair = i * self.n + self.nearest[states] if self.depth > 1 else torch.full_like(pair, i)
        seconds = torch.full(states.shape, c.seconds, dtype=torch.float64)
        level = torch.zeros_like(pair)
        if self.queue is not None:
            q = self.queue
            backlog = self.backlog[states]
            need = torch.where(backlog > 0, torch.maximum(need, q.forward_need[block] + backlog), need)
            if c.policy.parks_block:  # as Queue.advance
                queued = (backlog - q.drain[block]).clamp(min=0) + c.copied
            else:
                queued = (backlog + c.copied - q.drain[block]).clamp(min=0)
            wait = (queued - q.cap).clamp(min=0).to(torch.float64) / q.bandwidth
            level = (queued.clamp(max=q.cap) + q.unit - 1) // q.unit
            seconds = seconds - c.forward_exposed + wait
        to = pair * self.levels + level
        if self.reloads is None:
            return to, seconds, need
        r = self.reloads
        # per copy size: where pending, the nearest copy is the block before's
        if block and c.recompute_window:
            credits = torch.tensor(
                [r.credit(block - 1, int(size), c.recompute_window) for size in self.size],
                dtype=torch.float64,
            )
            seconds = seconds - torch.where(self.pending[states] == 1, credits[self.nearest[states]], 0.0)
        return to * 2 + int(r.pending(block, c)), seconds, need

    def end(self, state: int) -> tuple[int, float]:
        """(bytes still queued as the forward ends, seconds backward waits for them)."""
        backlog = int(self.backlog[state])
        return backlog, backlog / self.queue.bandwidth if self.queue is not None else 0.0


def cheapest(problem: Problem, capacity: int, room: int) -> list[Choice] | None:
    """The least-seconds picks with Σ kept ≤ ``capacity`` units and, where own peaks count, every block's
    ``need`` on top of the kept bytes before it within ``room`` bytes (None: no such plan)."""

    def step(
        values: torch.Tensor, needs: torch.Tensor, seconds: torch.Tensor, w: int, _start: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        last = None
        if problem.own_counts:
            last = torch.clamp(torch.div(room - needs, problem.unit, rounding_mode="floor"), max=capacity - w)
        return values + seconds[:, None], last

    def final(value: torch.Tensor, backlog: int, wait: float) -> torch.Tensor:
        # what is still queued is held as the forward ends, beside the kept bytes
        fits = torch.arange(value.shape[0]) <= capacity - -(-backlog // problem.unit)
        return torch.where(fits, value + wait, _INF)

    return _run(problem, capacity, step, final)


def smallest(problem: Problem, capacity: int, workspace: int) -> list[Choice]:
    """The picks whose largest term (a block's own peak above the kept bytes before it, or Σ kept plus the
    ``workspace``) is least, with Σ kept ≤ ``capacity`` units (enough for every choice)."""
    prefix = torch.arange(capacity + 1, dtype=torch.float64) * problem.unit

    def step(
        values: torch.Tensor, needs: torch.Tensor, _seconds: torch.Tensor, _w: int, start: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if problem.own_counts:
            kept = prefix[start : start + values.shape[1]]
            values = torch.maximum(values, kept + needs.to(torch.float64)[:, None])
        return values, None

    def final(value: torch.Tensor, backlog: int, _wait: float) -> torch.Tensor:
        return torch.maximum(value, prefix[: value.shape[0]] + workspace + backlog)

    picks = _run(problem, capacity, step, final)
    assert picks is not None  # every block has a choice and the capacity fits the largest
    return picks


Step = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor | None]
]
Final = Callable[[torch.Tensor, int, float], torch.Tensor]


def _run(problem: Problem, capacity: int, step: Step, final: Final) -> list[Choice] | None:
    """The programme (see "Batches"): ``step`` gives a choice's values over the prefixes of every reachable state
    at once (one row each, with that state's need and seconds for the choice; its columns from kept units
    ``start`` on) and, per row, the last prefix it may follow (None: any within the capacity); cells keep the
    least; ``final`` scores the end cells (with what is still queued, and its wait). Only reachable states have
    rows."""
    if capacity < 0:
        return None
    space = _States(problem)
    states = torch.zeros(1, dtype=torch.int64)  # the reachable states, ascending: one row of ``value`` each
    value = torch.zeros((1, 1), dtype=torch.float64)  # one column per kept unit reachable so far
    trail: list[_Start] = []
    for block, opts in enumerate(problem.options):
        moves = [space.moves(states, block, c) for c in opts]
        # the states reached, and per (row, choice) pair its target's row among them
        reached_states, inverse = torch.unique(
            torch.stack([to for to, _, _ in moves], dim=1), return_inverse=True
        )
        new = _moved(problem, step, capacity, block, moves, value, inverse, len(reached_states))
        live = torch.isfinite(new).any(dim=1)
        if not live.any():  # no plan reaches past this block
            return None
        trail.append(_Start(states, value, moves))
        states, value = reached_states[live], new[live]
    return _picks(problem, space, step, states, value, trail, final)


@dataclass(frozen=True)
class _Start:
    """A block's start in the programme: the reachable states, their values, and per choice the moves from them
    (:meth:`_States.moves`: target states, seconds, needs)."""

    states: torch.Tensor
    value: torch.Tensor
    moves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def _moved(
    problem: Problem,
    step: Step,
    capacity: int,
    block: int,
    moves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    value: torch.Tensor,
    inverse: torch.Tensor,
    reached: int,
) -> torch.Tensor:
    """The values after ``block``: one row per reached state (``inverse``: each (row of ``value``, choice) pair's
    target row among the ``reached``), one column per kept unit reachable after the block, each cell the least over
    the pairs that move into it (inf where none may)."""
    opts = problem.options[block]
    rows = value.shape[0]
    grown = min(capacity + 1, value.shape[1] + max(problem.units(c) for c in opts))
    new = torch.full((reached, grown), _INF, dtype=torch.float64)
    for i, (c, (_, seconds, needs)) in enumerate(zip(opts, moves, strict=True)):
        w = problem.units(c)
        if w >= grown:
            continue
        moved, last = step(value, needs, seconds, w, 0)
        # column j moves into column j + w, up to the capacity
        width = min(moved.shape[1], grown - w)
        moved = moved[:, :width]
        if last is not None:
            moved = moved.masked_fill(torch.arange(width)[None, :] > last[:, None], _INF)
        # a cell's least does not depend on the order of the pairs (see "Ties" for which pair set it)
        new[:, w : w + width].scatter_reduce_(0, inverse[:, i, None].expand(rows, width), moved, "amin")
    return new


def _moved_into(
    problem: Problem, step: Step, block: int, start: _Start, column: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`_moved`'s values in ``column`` alone (with each row's target state): the same operations on the
    same values, so the same bits."""
    out, value = [], start.value
    for c, (to, seconds, needs) in zip(problem.options[block], start.moves, strict=True):
        w = problem.units(c)
        first = column - w
        if not 0 <= first < value.shape[1]:
            out.append((torch.full((len(start.states),), _INF, dtype=torch.float64), to))
            continue
        moved, last = step(value[:, first : first + 1], needs, seconds, w, first)
        moved = moved[:, 0]
        if last is not None:
            moved = moved.masked_fill(column > last + w, _INF)
        out.append((moved, to))
    return out


def _picks(
    problem: Problem,
    space: _States,
    step: Step,
    states: torch.Tensor,
    value: torch.Tensor,
    trail: list[_Start],
    final: Final,
) -> list[Choice] | None:
    """The choices back from the best end cell: ``value`` holds the end cells of the reachable ``states``,
    ``trail`` each block's start. Each block's moves into the cell are made again to find the first pair that
    reached it at its value (see "Ties")."""
    scores = torch.stack([final(value[r], *space.end(s)) for r, s in enumerate(states.tolist())])
    if not torch.isfinite(scores).any():
        return None
    best = scores.min()
    # the fewest kept units among the best, then the lowest state (rows are in state order)
    hits = (scores == best).nonzero().tolist()
    row, w = min(hits, key=lambda rw: (rw[1], rw[0]))
    state, least = int(states[row]), value[row, w]
    picks: list[Choice] = []
    for block in reversed(range(len(problem.options))):
        start = trail[block]
        moved = _moved_into(problem, step, block, start, w)
        # the first (row, choice) pair at the cell's value: the lowest row, then the earliest choice
        row, i = min(
            (int(rows[0]), i)
            for i, (m, to) in enumerate(moved)
            if len(rows := ((to == state) & (m == least)).nonzero()) > 0
        )
        c = problem.options[block][i]
        picks.append(c)
        w -= problem.units(c)
        state, least = int(start.states[row]), start.value[row, w]
    return picks[::-1]
