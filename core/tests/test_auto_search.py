"""The planner's search batches each block's (state, choice) pairs into tensor operations: it must pick exactly
what the pair-by-pair programme picks (``search_reference``), ties included, on any problem, the forward's copy
queue included."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from search_reference import reference_cheapest, reference_smallest

from memfit.auto import search
from memfit.auto.cost import Choice
from memfit.plan import BlockPolicy

MiB = 1 << 20
POLICIES = list(BlockPolicy)

choice = st.builds(
    lambda p, kept, seconds, copied, own, late, exposed, window: Choice(
        POLICIES[p],
        kept * MiB,
        (seconds + exposed) / 8,
        copied * MiB,
        own * MiB,
        None if late < 0 else late * MiB,
        exposed / 8 if copied else 0.0,
        window / 8,
    ),
    st.integers(0, len(POLICIES) - 1),  # parked blocks join the copy queue after their forward
    st.integers(0, 40),
    st.integers(0, 6),  # eighths of a second: ties between choices happen
    st.sampled_from([0, 0, 3, 8, 24]),  # few copy sizes, as real profiles have
    st.integers(0, 60),
    st.integers(-1, 40),
    st.integers(0, 2),
    st.sampled_from([0, 0, 1, 4, 16]),  # eighths of a second its recompute hides of the block before's reload
)


QUEUED = st.booleans()
RELOADED = st.booleans()


@st.composite
def problems(draw, queued=QUEUED, reloaded=RELOADED):
    """Problems with and without the forward's copies as one queue (search, "Queue"), and with and without reloads
    hidden behind the next block's recompute (search, "Reload credit")."""
    options = draw(st.lists(st.lists(choice, min_size=1, max_size=5), min_size=1, max_size=7))
    queue = None
    if draw(queued):
        blocks = len(options)
        queue = search.Queue(
            drain=tuple(draw(st.lists(st.integers(0, 30), min_size=blocks, max_size=blocks))),
            forward_need=tuple(draw(st.lists(st.integers(0, 60), min_size=blocks, max_size=blocks))),
            unit=draw(st.sampled_from([1, 3, 8])),
            levels=draw(st.integers(1, 6)),
            bandwidth=4.0,  # bytes per second, with the sizes above in bytes: waits of whole seconds
        )
        queue = search.Queue(
            tuple(d * MiB for d in queue.drain),
            tuple(f * MiB for f in queue.forward_need),
            queue.unit * MiB,
            queue.levels,
            queue.bandwidth * MiB,
        )
    reloads = None
    if draw(reloaded):
        blocks = len(options)
        cover = draw(st.lists(st.sampled_from([0, 1, 2, 4]), min_size=blocks, max_size=blocks))
        slack = draw(st.lists(st.sampled_from([0, 1, 3, None]), min_size=blocks, max_size=blocks))
        reloads = search.Reloads(  # at 8 MiB/s the copy sizes above take 0-3 s: eighths where covers are
            cover=tuple(c / 8 for c in cover),
            room=tuple(float("inf") if r is None else (c + r) / 8 for c, r in zip(cover, slack, strict=True)),
            bandwidth=8.0 * MiB,
        )
    return search.Problem(
        options,
        draw(st.sampled_from([MiB, 2 * MiB, 5 * MiB])),
        draw(st.integers(0, 2)),
        draw(st.booleans()),
        queue=queue,
        reloads=reloads,
    )


@settings(max_examples=300, deadline=None)
@given(problem=problems(), capacity=st.integers(-1, 120), room=st.integers(0, 400))
def test_cheapest_picks_what_the_pair_by_pair_programme_picks(problem, capacity, room):
    assert search.cheapest(problem, capacity, room * MiB) == reference_cheapest(problem, capacity, room * MiB)


@settings(max_examples=300, deadline=None)
@given(problem=problems(), workspace=st.integers(0, 50))
def test_smallest_picks_what_the_pair_by_pair_programme_picks(problem, workspace):
    capacity = sum(max(problem.units(c) for c in opts) for opts in problem.options)
    assert search.smallest(problem, capacity, workspace * MiB) == reference_smallest(
        problem, capacity, workspace * MiB
    )


@settings(max_examples=200, deadline=None)
@given(problem=problems(queued=st.just(True)), capacity=st.integers(0, 120), room=st.integers(0, 400))
def test_with_a_copy_queue_cheapest_picks_what_the_pair_by_pair_programme_picks(problem, capacity, room):
    assert search.cheapest(problem, capacity, room * MiB) == reference_cheapest(problem, capacity, room * MiB)


@settings(max_examples=200, deadline=None)
@given(
    problem=problems(reloaded=st.just(True)).filter(lambda p: p.depth > 0),
    capacity=st.integers(0, 120),
    room=st.integers(0, 400),
)
def test_with_reload_credit_cheapest_picks_what_the_pair_by_pair_programme_picks(problem, capacity, room):
    assert search.cheapest(problem, capacity, room * MiB) == reference_cheapest(problem, capacity, room * MiB)


def test_the_queue_carries_copies_over_to_the_blocks_after_and_waits_only_past_its_cap():
    """Three blocks copying 3, 0 and 2 MiB, each forward draining 2: the first block's extra MiB runs over the
    second's forward; a cap of 1 MiB makes compute wait for what exceeds it; a parked block's copy starts after its
    forward, so it is still queued as the next block starts."""
    pick = [Choice(BlockPolicy.ATTENTION_OFFLOAD, 0, 0.0, n * MiB) for n in (3, 0, 2)]
    queue = search.Queue((2 * MiB,) * 3, (0,) * 3, MiB, 4, float(MiB))
    starts, end, waited, in_flight = queue.run(pick)
    assert starts == [0, MiB, 0] and end == 0 and waited == 0.0 and in_flight == 3 * MiB
    tight = search.Queue((2 * MiB,) * 3, (0,) * 3, MiB, 1, float(MiB))
    assert tight.run(pick)[:3] == ([0, MiB, 0], 0, 0.0)
    assert (
        tight.run([Choice(BlockPolicy.ATTENTION_OFFLOAD, 0, 0.0, 4 * MiB)])[2] == 1.0 + 1.0
    )  # waits 1 s, ends 1
    parked = [Choice(BlockPolicy.PARK, 0, 0.0, 3 * MiB), Choice(BlockPolicy.KEEP, 0, 0.0, 0)]
    starts, end, waited, _ = queue.run(parked)
    assert starts == [0, 3 * MiB] and end == MiB and waited == 1.0  # the last MiB waits for backward
