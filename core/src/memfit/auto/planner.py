"""The cheapest per-block plan whose predicted peak fits a memory budget.

Design notes
------------
Peak model.  Memory is highest while some block's backward runs. Then the blocks before it in forward
order still hold what they keep, the blocks after it have released theirs, and the block itself has all
its activations back (kept, recomputed or reloaded). So block *b* under a plan needs ::

    static + outside + Σ_{j<b} kept(j) + own(b) + grads after b + reloaded ahead

where ``outside`` is what is saved before the blocks, after the last one, or shared between them,
``kept(j)`` includes what the layers between block *j* and the next one save (freed as backward passes
them, before the blocks before them; see "Head" for the layers after the last block), and ``own(b)`` is
the peak of one forward+backward of the block alone, measured in the profile with everything it saves
held (so it carries the backward's gradient buffers and the attention kernel's own temporaries), plus its
inputs, adjusted by what the policy keeps or brings back beyond what the block saves.
``grads after b``: the trainable weights of the blocks after it (and outside every block) have their
gradients by then. ``reloaded ahead``: what the copy engine brings back for the blocks backward visits
next, by its own rule (the next block that copies, a second when the first is the smaller); a block whose
only parked regions are its attention calls issues that reload when its attention's backward begins, so
there the term is ``max(own(b), own from then on + reloaded ahead)``. The forward's
end adds one more bound, ``Σ kept + the working memory outside the blocks``. Off CUDA the budget counts the
bytes held when backward begins: ``outside + Σ kept``.

Forward's start.  Where weights stream, uploads kept from one step's backward for the next forward are alive
as the forward starts, before the activations are (:mod:`memfit.auto.streaming`, "Turnarounds"). Each kept
block's start, what it holds above the activations kept before it, becomes a term of that block's own, beside
its backward's: the search weighs it like the rest, and a set whose kept uploads cannot fit whatever the
activations do is refused before any search.

Head.  What the layers after the last block save (an output norm saving the last block's output) is freed
before any block's backward runs, yet the planner holds it throughout: their own backward, not measured,
can need more than their forward's working memory (docs/cost-model.md, "Head").

Cost model.  Extra seconds per block: recomputed FLOPs at the profiled rate, plus copy time not hidden
behind compute (a device→host copy overlaps the block's forward, as long with gradients as the isolated
block runs measured, the reload its backward, taken as
``backward_to_forward`` times as long: timed on the isolated block runs on CUDA; elsewhere the FLOP ratio, a
lower bound, so exposure is overcharged rather than hidden; where weights stream, only what the uploads on the
same host-to-device link leave of it: :mod:`memfit.auto.streaming`, "Link"),
plus host-side bookkeeping: a fixed cost per region and, for attention offload, per tensor saved inside
the attention call (each goes through Python pack and fetch hooks), the constants of
:mod:`memfit.auto.cost` (docs/cost-model.md). FFN recompute is priced at the FFN
regions' own FLOP rate where one was timed (CUDA), block recompute at the blocks'. The fixed costs are
converted to FLOPs at a nominal rate of the device kind, so that without copies or an FFN rate every cost
is FLOPs over one measured rate and the plan does not depend on that measurement at all; otherwise it
depends on the measured rates only through their snapped values (:func:`memfit.auto.profile.round_rate`).

Queue.  A block's device-to-host copies may run on over the forwards of the blocks after it: the link copies one
at a time, and compute waits for it only where the bytes in flight would pass what the plan allows. So on CUDA
the search runs the forward's copies as one queue (:class:`memfit.auto.search.Queue`): each block's forward drains
``its forward seconds × bandwidth`` bytes of it; the bytes still queued as a block starts are on the device during
its forward, a term ``Σ_{j<b} kept(j) + its inputs + its forward's peak + queued`` beside its backward's; what is
queued as the forward ends is held at the forward's end and its copy time is charged as exposed (the last blocks'
reloads wait for it). The queue holds at most :data:`QUEUE_CAP_COPIES` of the largest copy a block may make; the
plan's copies in flight at most (:attr:`Plan.copies_in_flight_bytes`) bound the copy engine's in-flight bytes, so
a link slower than planned costs time, never memory.

Reloads.  A block's reload is charged against a backward (its own, standing for the block's after it, or what
weight uploads leave of that). The copy engine issues it as the backward of the block after it starts, which runs
that block's recompute first: where that block recomputes (whole or its FFN, its attention not offloaded), its
recompute hides more of the reload, up to what the uploads in that window leave (:class:`memfit.auto.search.
Reloads`, a pair of neighbours' term in the search).

Equal regions two ahead.  Those per-block charges miss a reload that cannot start early enough: a block parked
whole reloads nearly all it saves, about as long as its backward (longer beside a weight upload), and the bytes
rule reloads one of two equal blocks ahead. So the plan picked is run once more through the backward's link
(:mod:`memfit.auto.backward_link`) under the bytes rule and with equal regions two ahead; the second is taken
where it waits less and the peak with two reloads in flight still fits (:attr:`Plan.reload_equal_ahead`). The
picks stay; their predicted seconds, which took those reloads as hidden, too.

Search.  :mod:`memfit.auto.search`: a dynamic programme over the blocks in forward order whose state is
the kept bytes so far (in units of 1/1024 of the total, rounded up: never optimistic) and the two nearest
copies before the block (what is reloaded ahead of it), exact under this model up to the units. It answers
the cheapest plan within the budget and the smallest peak any plan reaches. Ties go to the less intrusive
policy (``BlockPolicy`` order): the same profile and budget always give the same plan.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import memfit.auto.search as search
from memfit.auto.allocator import expandable_segments
from memfit.auto.backward_link import backward_waits, choose_reload_ahead
from memfit.auto.cost import (
    HOOKED_TENSOR_SECONDS,
    Choice,
    block_choices,
    forward_with_grad_seconds,
    own_reload_cover,
)
from memfit.auto.profile import BlockProfile, ModelProfile
from memfit.auto.streaming import StreamedSet
from memfit.errors import BudgetError
from memfit.offload.ahead import PREFETCH_DEPTH, bytes_ahead
from memfit.plan import BlockPolicy
from memfit.units import format_bytes

_UNITS = 1024  # kept bytes are counted in units of 1/_UNITS of the total (search granularity)
# the budget a BudgetError suggests sits this share and these bytes above the smallest peak: a later profile sees
# what earlier steps left allocated (cuBLAS workspaces: +65 MB on a Flux full fine-tune, +70 MB on the synthetic
# stack, whose 2.6 GiB floor 0.5% alone did not cover), and the suggestion must still plan
FLOOR_ALLOWANCE = 0.005
WORKSPACE_ALLOWANCE = 128 << 20
# bytes the caching allocator reserves per byte a step copies to host memory, with its default segments and with
# expandable ones, and the share of what the process can hold that a plan's peak and that reserve may reach together
# (docs/cost-model.md, "Copy reserve")
COPY_RESERVE = 1.0
EXPANDABLE_COPY_RESERVE = 0.0
CARD_FIT = 0.92
# the forward's copy queue holds at most this many of the largest copy a block may make, counted in this many
# levels (rounded up each block: the search's view of the backlog is never optimistic; 0: no queue, each block's
# copies charged against its own forward, as the benchmarks compare); see "Queue"
QUEUE_CAP_COPIES = 2
QUEUE_LEVELS = 64
# a block's reload also hides behind the recompute of the block after it (False: behind a backward alone, as the
# benchmarks compare); see "Reloads"
RELOAD_CREDIT = True
# reload equal regions two ahead where the backward's link then waits less and the peak still fits (False: the
# bytes rule alone, as the benchmarks compare); see "Equal regions two ahead"
RELOAD_EQUAL_AHEAD = True


def reserve_per_copied_byte() -> float:
    """:data:`COPY_RESERVE`, or :data:`EXPANDABLE_COPY_RESERVE` where the allocator grows expandable segments."""
    return EXPANDABLE_COPY_RESERVE if expandable_segments() else COPY_RESERVE


def suggested_budget(smallest_peak_bytes: int, *, copied_bytes: int | None = None) -> int:
    """The budget a :class:`BudgetError` suggests for a smallest plan of ``smallest_peak_bytes``: the allowances
    above it, whole MiB. With ``copied_bytes`` (its copies per step; CUDA, where the budget is a card's size) at
    least the card on which that plan fits (see "Copy reserve")."""
    least = int(smallest_peak_bytes * (1 + FLOOR_ALLOWANCE)) + WORKSPACE_ALLOWANCE
    if copied_bytes is not None:  # the card holds the allowances too (workspaces allocated after the profile)
        least = max(least, int(card_need(least, copied_bytes) / CARD_FIT))
    return -(-least // (1 << 20)) << 20


def card_need(peak_bytes: int, copied_bytes: int) -> int:
    """What a plan needs of what the process can hold: its peak allocated and the reserve its copies leave the
    caching allocator, none with expandable segments (see "Copy reserve")."""
    return peak_bytes + int(reserve_per_copied_byte() * copied_bytes)


@dataclass(frozen=True)
class Plan:
    """One policy per block, with the predictions that chose it."""

    blocks: tuple[tuple[str, BlockPolicy], ...]  # (block name "path.index", policy), in call order
    budget_bytes: int
    predicted_peak_bytes: int
    predicted_extra_seconds: float
    no_checkpoint_peak_bytes: int
    smallest_peak_bytes: int
    copied_bytes: int
    metric: str  # "peak allocated" (CUDA) or "held activations" (elsewhere)
    streamed: tuple[str, ...] = ()  # blocks whose frozen weights stream from host memory
    streamed_bytes: int = 0
    streamed_forward_ahead: int = 1  # streamed blocks the forward's uploads are issued ahead of their block
    # the first streamed blocks whose last recompute's upload serves the next forward, and their weights (held
    # between steps)
    streamed_kept_first: int = 0
    streamed_kept_bytes: int = 0
    # the most device-to-host bytes its forward has in flight (the copy queue, see "Queue"); 0: none planned
    copies_in_flight_bytes: int = 0
    # backward reloads equal regions two ahead (see "Equal regions two ahead"), and what its backward waits for the
    # host-to-device link as memfit.auto.backward_link runs it (reported: the search's charges are per block)
    reload_equal_ahead: bool = False
    backward_link_waits: float = 0.0

    @property
    def needed(self) -> bool:
        """False when every block keeps everything and no weight streams (the budget needs no checkpointing)."""
        return bool(self.streamed) or any(p is not BlockPolicy.KEEP for _, p in self.blocks)

    def policy(self, name: str) -> BlockPolicy:
        return dict(self.blocks)[name]

    def runs_like(self, other: Plan) -> bool:
        """Whether ``other`` installs the same regions, streaming and copy queue (its predictions aside)."""
        return (
            self.blocks,
            self.streamed,
            self.streamed_forward_ahead,
            self.streamed_kept_first,
            self.copies_in_flight_bytes,
            self.reload_equal_ahead,
        ) == (
            other.blocks,
            other.streamed,
            other.streamed_forward_ahead,
            other.streamed_kept_first,
            other.copies_in_flight_bytes,
            other.reload_equal_ahead,
        )

    def counts(self) -> dict[str, int]:
        c = Counter(p.value for _, p in self.blocks)
        return {p.value: c[p.value] for p in BlockPolicy if c[p.value]}

    def to_json(self) -> dict[str, Any]:
        return {
            "policies": {name: p.value for name, p in self.blocks},
            "counts": self.counts(),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "predicted_extra_seconds": self.predicted_extra_seconds,
            "no_checkpoint_peak_bytes": self.no_checkpoint_peak_bytes,
            "smallest_peak_bytes": self.smallest_peak_bytes,
            "copied_bytes_per_step": self.copied_bytes,
            "metric": self.metric,
            "streamed_blocks": list(self.streamed),
            "streamed_bytes": self.streamed_bytes,
            "streamed_forward_ahead": self.streamed_forward_ahead,
            "streamed_kept_first": self.streamed_kept_first,
            "streamed_kept_bytes": self.streamed_kept_bytes,
            "copies_in_flight_bytes": self.copies_in_flight_bytes,
            "reload_equal_ahead": self.reload_equal_ahead,
            "backward_link_waits_seconds": self.backward_link_waits,
        }

    def describe(self) -> str:
        """Runs of equal policies, e.g. ``transformer_blocks.0-12: ffn``."""
        lines = [
            f"auto plan ({self.metric}): predicted {format_bytes(self.predicted_peak_bytes)} within "
            f"{format_bytes(self.budget_bytes)} (no checkpointing: {format_bytes(self.no_checkpoint_peak_bytes)}"
            f"), +{self.predicted_extra_seconds * 1e3:.1f} ms/step, {format_bytes(self.copied_bytes)} "
            f"copied/step"
        ]
        if self.reload_equal_ahead:
            lines.append("  backward reloads equal regions two ahead")
        if self.streamed:
            lines.append(
                f"  weights streamed from host memory: {len(self.streamed)} block(s), "
                f"{format_bytes(self.streamed_bytes)} ({', '.join(self.streamed)}), uploaded "
                f"{self.streamed_forward_ahead} ahead in forward, the first {self.streamed_kept_first} kept from "
                f"backward for the next forward ({format_bytes(self.streamed_kept_bytes)})"
            )
        run: list[Any] = []
        for name, policy in [*self.blocks, ("", None)]:
            path, _, index = name.rpartition(".")
            if run and (policy is not run[2] or path != run[0]):
                span = run[1] if run[1] == run[3] else f"{run[1]}-{run[3]}"
                lines.append(f"  {run[0]}.{span}: {run[2].value}")
                run = []
            if policy is not None:
                run = [path, index, policy, index] if not run else [run[0], run[1], policy, index]
        return "\n".join(lines)


def plan_policies(
    profile: ModelProfile,
    budget_bytes: int,
    *,
    allowed: Callable[[BlockProfile], tuple[BlockPolicy, ...]],
    streamed: StreamedSet | None = None,
    memo: dict[Any, Any] | None = None,
    copy_reserve: float = 0.0,
    copy_price: float = 0.0,
) -> Plan:
    """The fastest plan (by the cost model) whose predicted peak is within ``budget_bytes``.

    ``streamed``: blocks whose frozen weights stream from host memory (:mod:`memfit.auto.streaming`): the static
    bytes drop by their weights, their uploads count where they are alive, and one not recomputed whole pays what
    "Saved weights" there says.
    ``memo``: a dict the caller keeps across calls with the same profile, ``allowed`` and ``copy_reserve``: the
    least peak of each streamed set does not depend on the budget, and is searched once (the closed loop re-plans
    every step).
    ``copy_reserve``: bytes counted against ``budget_bytes`` per byte a block copies to host memory (the caching
    allocator's reserve, :func:`card_need`); the plan's predicted peak stays the allocated bytes alone.
    ``copy_price``: seconds the search charges per byte a block copies to host memory (host RAM's price, where a
    plan's copies must fit in it); the plan's predicted seconds leave it out.

    Raises:
        BudgetError: no plan reaches the budget (the message and ``smallest_peak_bytes`` give the smallest).
    """
    options = block_options(profile, allowed=allowed, streamed=streamed)
    if options and profile.blocks[-1].attention_calls < 2:
        # the step's last two regions keep their tensors on the device: before a last block whose attention
        # is one region, the block before it is never reloaded, its tensors stay through the whole backward
        options[-1] = [dataclasses.replace(c, own_late=None) for c in options[-1]]
    head = profile.blocks[-1].saved_after_bytes if profile.blocks else 0  # held throughout (see "Head")
    base = profile.static_bytes + profile.outside_bytes + head
    metric = "peak allocated" if profile.static_bytes or profile.workspace_bytes else "held activations"
    depth = PREFETCH_DEPTH if profile.counts_transient else 0

    queue: search.Queue | None = None

    def peak(picks: list[Choice], base: int, forward: int = 0, *, equal_ahead: bool = False) -> int:
        starts, end = (queue.run(picks)[:2]) if queue is not None else ([0] * len(picks), 0)
        prefix = worst = 0
        for b, c in enumerate(picks):
            if profile.counts_transient:
                ahead = bytes_ahead([p.copied for p in reversed(picks[:b])], depth, equal_too=equal_ahead)
                worst = max(worst, prefix + c.need(ahead))
                if starts[b]:
                    assert queue is not None
                    worst = max(worst, prefix + queue.forward_need[b] + starts[b])
            prefix += c.kept
        return base + max(worst, prefix + profile.workspace_bytes + forward + end)

    keep_all = [next(c for c in opts if c.policy is BlockPolicy.KEEP) for opts in options]
    no_checkpoint = peak(keep_all, base)
    forward = 0
    if streamed is not None:
        options = _streaming_options(options, streamed, profile)
        base -= streamed.total_bytes
        forward = streamed.forward_bytes
        _check_forward_start(options, base, budget_bytes, streamed)
    queue = _copy_queue(profile, options, forward)
    reloads = _reloads(profile, options, streamed)
    allocated = options
    if copy_reserve or copy_price:  # the search weighs each copy's reserve as if kept, and its price
        options = [
            [
                dataclasses.replace(
                    c, kept=c.kept + int(copy_reserve * c.copied), seconds=c.seconds + copy_price * c.copied
                )
                for c in opts
            ]
            for opts in options
        ]
    unit = max(1, -(-sum(b.saved_bytes for b in profile.blocks) // _UNITS))
    problem = search.Problem(
        options, unit, depth, own_counts=profile.counts_transient, queue=queue, reloads=reloads
    )
    # the least peak any plan reaches: exact under the model up to the units, recomputed in bytes
    key = (
        "smallest",
        (streamed.indices, streamed.forward_ahead, streamed.kept_first) if streamed is not None else None,
        copy_reserve,
    )
    # held as each block's choice's position: the same at any copy price
    floor_at = memo.get(key) if memo is not None else None
    floor_picks = None if floor_at is None else [opts[i] for opts, i in zip(options, floor_at, strict=True)]
    if floor_picks is None:
        # a plan keeping more than the leanest plan's peak is not the smallest: the search's width stops there
        # (its units round up by less than one per block)
        leanest = peak([min(opts, key=lambda c: c.kept) for opts in options], 0, forward)
        # the reload flag weighs seconds only: the least peak's search needs no states for it
        peak_only = dataclasses.replace(problem, reloads=None)
        floor_picks = search.smallest(
            peak_only,
            min(
                sum(max(problem.units(c) for c in opts) for opts in options),
                (leanest - profile.workspace_bytes - forward) // unit + len(options),
            ),
            profile.workspace_bytes + forward,
        )
        if memo is not None:
            memo[key] = [opts.index(c) for opts, c in zip(options, floor_picks, strict=True)]
    smallest = peak(floor_picks, base, forward)
    if streamed is None:
        smallest = min(smallest, no_checkpoint)

    def make(picks: list[Choice]) -> Plan:
        held = [kept[opts.index(c)] for c, opts, kept in zip(picks, options, allocated, strict=True)]
        seconds, in_flight = sum(c.seconds for c in held), 0
        if queue is not None:
            _, _, waited, in_flight = queue.run(held)
            seconds += waited - sum(c.forward_exposed for c in held)
        if reloads is not None:
            seconds -= reloads.total(held)
        equal_ahead, waits = False, 0.0
        if depth and any(c.copied for c in held):
            if RELOAD_EQUAL_AHEAD:
                equal_ahead, waits = choose_reload_ahead(
                    profile,
                    held,
                    streamed,
                    fits=lambda: peak(picks, base, forward, equal_ahead=True) <= budget_bytes,
                    depth=depth,
                )
            else:
                waits = backward_waits(profile, held, streamed, equal_ahead=False, depth=depth)
        return Plan(
            blocks=tuple((b.name, c.policy) for b, c in zip(profile.blocks, picks, strict=True)),
            budget_bytes=budget_bytes,
            predicted_peak_bytes=peak(held, base, forward, equal_ahead=equal_ahead),
            predicted_extra_seconds=seconds + (streamed.seconds if streamed else 0.0),
            no_checkpoint_peak_bytes=no_checkpoint,
            smallest_peak_bytes=smallest,
            copied_bytes=sum(c.copied for c in picks),
            metric=metric,
            streamed=streamed.names if streamed is not None else (),
            streamed_bytes=streamed.total_bytes if streamed is not None else 0,
            streamed_forward_ahead=streamed.forward_ahead if streamed is not None else 1,
            streamed_kept_first=streamed.kept_first if streamed is not None else 0,
            streamed_kept_bytes=streamed.kept_bytes if streamed is not None else 0,
            copies_in_flight_bytes=in_flight,
            reload_equal_ahead=equal_ahead,
            backward_link_waits=waits,
        )

    if streamed is None and no_checkpoint <= budget_bytes:
        return make(keep_all)
    if smallest > budget_bytes:
        streaming = (
            f" with the frozen weights of {len(streamed.names)} block(s) ({format_bytes(streamed.total_bytes)}) "
            f"streamed from host memory"
            if streamed is not None
            else ""
        )
        copied = sum(c.copied for c in floor_picks) if profile.counts_transient else None
        suggested = suggested_budget(smallest, copied_bytes=copied)
        raise BudgetError(
            f"memory budget {format_bytes(budget_bytes)} is below what any plan reaches: the smallest predicted "
            f"{metric} is {format_bytes(smallest)}{streaming} (no checkpointing: {format_bytes(no_checkpoint)}). "
            f"Raise gradient_checkpointing_memory_budget to at least {format_bytes(suggested)}, "
            f"or shrink the step (batch, resolution).",
            smallest_peak_bytes=smallest,
            suggested_budget_bytes=suggested,
        )
    room = budget_bytes - base  # for kept bytes, and each block's own peak on top of those before it
    picks = search.cheapest(problem, (room - profile.workspace_bytes - forward) // unit, room)
    if (
        picks is None or peak(picks, base, forward) > budget_bytes
    ):  # only the units' rounding stood in the way
        picks = floor_picks  # the smallest plan, which fits exactly
    return make(picks)


def _copy_queue(profile: ModelProfile, options: list[list[Choice]], uploads: int) -> search.Queue | None:
    """The forward's device-to-host copies as one queue (see "Queue"), where a block may copy and the peak counts
    each block's own (CUDA); ``uploads``: weight uploads alive during the forward, held beside a backlog."""
    largest = max((c.copied for opts in options for c in opts), default=0)
    bandwidth = profile.copy_bytes_per_second
    if not (QUEUE_LEVELS and largest and bandwidth and profile.counts_transient):
        return None
    unit = -(-QUEUE_CAP_COPIES * largest // QUEUE_LEVELS)
    return search.Queue(
        drain=tuple(int(forward_with_grad_seconds(b, profile) * bandwidth) for b in profile.blocks),
        forward_need=tuple(b.input_bytes + b.forward_peak_bytes + uploads for b in profile.blocks),
        unit=unit,
        levels=QUEUE_LEVELS,
        bandwidth=bandwidth,
    )


def _reloads(
    profile: ModelProfile, options: list[list[Choice]], streamed: StreamedSet | None
) -> search.Reloads | None:
    """What each block's reload hides behind where the block after it recomputes first (see "Reloads"); None where
    no reload is exposed that a recompute after it could hide (or off CUDA: nothing is reloaded ahead)."""
    bandwidth = profile.copy_bytes_per_second
    if not (RELOAD_CREDIT and bandwidth and profile.counts_transient):
        return None
    covers = streamed.reload_cover if streamed is not None else ()
    rooms = streamed.reload_room if streamed is not None else ()
    reloads = search.Reloads(
        cover=tuple(
            own_reload_cover(b, profile) if not covers or covers[i] is None else covers[i]
            for i, b in enumerate(profile.blocks)
        ),
        room=tuple(
            float("inf") if not rooms or rooms[i] is None else rooms[i] for i in range(len(profile.blocks))
        ),
        bandwidth=bandwidth,
    )
    pending = any(reloads.pending(b, c) for b, opts in enumerate(options[:-1]) for c in opts)
    recomputes = any(c.recompute_window for opts in options[1:] for c in opts)
    return reloads if pending and recomputes else None


def _check_forward_start(
    options: list[list[Choice]], base: int, budget_bytes: int, streamed: StreamedSet
) -> None:
    """Raise the BudgetError of a set whose kept uploads break the budget as the forward starts whatever the
    activation plan (each block before them keeping the least it can): found without a search."""
    if not streamed.start_holds:
        return
    starts, least, prefix = dict(streamed.start_holds), 0, 0
    for b, opts in enumerate(options[: max(starts) + 1]):
        if b in starts:
            least = max(least, prefix + min(c.own for c in opts))  # each own carries its start
        prefix += min(c.kept for c in opts)
    if base + least <= budget_bytes:
        return
    raise BudgetError(
        f"memory budget {format_bytes(budget_bytes)} cannot hold the {streamed.kept_first} upload(s) kept for the "
        f"next forward ({format_bytes(streamed.kept_bytes)}) as the forward starts: that needs at least "
        f"{format_bytes(base + least)}.",
        smallest_peak_bytes=base + least,
        suggested_budget_bytes=suggested_budget(base + least),
    )


def block_options(
    profile: ModelProfile,
    *,
    allowed: Callable[[BlockProfile], tuple[BlockPolicy, ...]],
    streamed: StreamedSet | None = None,
) -> list[list[Choice]]:
    """Per block (forward order), what each allowed policy keeps, copies and costs there, as the search weighs it
    before the streamed set's own terms: its gradients and the bytes saved after it counted, its reloads hidden
    behind what the weight uploads leave of its backward, and parking's terms (see "Parking a block whole" in
    docs/cost-model.md)."""
    grads_after = _gradients_after(profile)
    last = len(profile.blocks) - 1
    # where weights stream, the reloads share the link with the uploads (memfit.auto.streaming, "Link")
    covers = streamed.reload_cover if streamed is not None else ()
    options = [
        block_choices(
            b,
            profile,
            allowed(b),
            grads_after=g,
            saved_after=b.saved_after_bytes if i < last else 0,
            reload_cover=covers[i] if covers else None,
        )
        for i, (b, g) in enumerate(zip(profile.blocks, grads_after, strict=True))
    ]
    return _parking_terms(options, profile)


def priced_options(
    profile: ModelProfile,
    *,
    allowed: Callable[[BlockProfile], tuple[BlockPolicy, ...]],
    streamed: StreamedSet | None = None,
) -> list[list[Choice]]:
    """Per block, each allowed policy as the search prices it: :func:`block_options` with ``streamed``'s own terms
    (a streamed block not recomputed whole pays the upload its recompute hid, and its saves' hooks)."""
    options = block_options(profile, allowed=allowed, streamed=streamed)
    return options if streamed is None else _streaming_options(options, streamed, profile)


def _streaming_options(
    options: list[list[Choice]], streamed: StreamedSet, profile: ModelProfile
) -> list[list[Choice]]:
    """The choices with ``streamed`` in place: a streamed block not recomputed whole pays what
    :mod:`memfit.auto.streaming` says ("Saved weights"), every block's own term carries the uploads alive during
    its backward, and a block whose forward starts with kept uploads alive has that start as a term of its own (see
    "Forward's start")."""
    starts = dict(streamed.start_holds)
    out = []
    for i, opts in enumerate(options):
        if i in streamed.indices:
            opts = [
                c
                if c.policy.recompute == "block"
                else dataclasses.replace(
                    c, seconds=c.seconds + _referencing_seconds(profile.blocks[i], c, streamed, i)
                )
                for c in opts
            ]
        extra = streamed.backward_bytes[i]
        if extra:
            opts = [
                dataclasses.replace(
                    c, own=c.own + extra, own_late=None if c.own_late is None else c.own_late + extra
                )
                for c in opts
            ]
        if i in starts:  # need() becomes max(start, what it was)
            start = starts[i] + profile.workspace_bytes
            opts = [
                dataclasses.replace(
                    c, own=max(c.own, start), own_late=c.own if c.own_late is None else c.own_late
                )
                for c in opts
            ]
        out.append(opts)
    return out


def _referencing_seconds(block: BlockProfile, choice: Choice, streamed: StreamedSet, index: int) -> float:
    """What a streamed block not recomputed whole adds to ``choice``'s seconds (:mod:`memfit.auto.streaming`, "Saved
    weights"): the upload its recompute no longer hides, and the hooks of its forward's saves (a parked block's and
    an offloaded attention's are priced already)."""
    hooked = 0 if choice.policy.parks_block else block.park_hook_calls
    if choice.policy.offloads_attention:
        hooked -= block.attention_hook_calls
    return streamed.unrecomputed_seconds[index] + HOOKED_TENSOR_SECONDS * max(0, hooked)


def _parking_terms(options: list[list[Choice]], profile: ModelProfile) -> list[list[Choice]]:
    """What parking a block whole holds beyond its choice's own terms (see "Parking a block whole" in
    docs/cost-model.md): the step's last two regions never park, so the last two blocks are not offered it (it
    would keep everything, with hooks); and a parked block's tensors are still on the device while the next
    block's forward runs (parked once the region after that starts), so its own term covers that forward."""
    last = len(options) - 1
    out = []
    for i, opts in enumerate(options):
        if i >= last - 1:
            opts = [c for c in opts if not c.policy.parks_block]
        elif profile.counts_transient:
            pending = profile.blocks[i].park_bytes
            after = profile.blocks[i + 1].forward_peak_bytes
            opts = [
                dataclasses.replace(c, own=max(c.own, c.kept + pending + after))
                if c.policy.parks_block
                else c
                for c in opts
            ]
        out.append(opts)
    return out


def _gradients_after(profile: ModelProfile) -> list[int]:
    """Per block: gradient bytes already allocated when backward reaches it (the trainable weights outside
    the blocks and in every later block; a block's own weight gradients are part of its measured peak)."""
    out, pending = [], profile.outside_trainable_bytes
    for b in reversed(profile.blocks):
        out.append(pending)
        pending += b.trainable_bytes
    return out[::-1]
