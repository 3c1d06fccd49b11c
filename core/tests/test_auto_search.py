"""The planner's search batches each block's (state, choice) pairs into tensor operations: it must pick exactly
what the pair-by-pair programme picks (``search_reference``), ties included, on any problem."""

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
    lambda p, kept, seconds, copied, own, late: Choice(
        POLICIES[p], kept * MiB, seconds / 8, copied * MiB, own * MiB, None if late < 0 else late * MiB
    ),
    st.integers(0, len(POLICIES) - 1),
    st.integers(0, 40),
    st.integers(0, 6),  # eighths of a second: ties between choices happen
    st.sampled_from([0, 0, 3, 8, 24]),  # few copy sizes, as real profiles have
    st.integers(0, 60),
    st.integers(-1, 40),
)
problems = st.builds(
    search.Problem,
    st.lists(st.lists(choice, min_size=1, max_size=5), min_size=1, max_size=7),
    st.sampled_from([MiB, 2 * MiB, 5 * MiB]),
    st.integers(0, 2),
    st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(problem=problems, capacity=st.integers(-1, 120), room=st.integers(0, 400))
def test_cheapest_picks_what_the_pair_by_pair_programme_picks(problem, capacity, room):
    assert search.cheapest(problem, capacity, room * MiB) == reference_cheapest(problem, capacity, room * MiB)


@settings(max_examples=300, deadline=None)
@given(problem=problems, workspace=st.integers(0, 50))
def test_smallest_picks_what_the_pair_by_pair_programme_picks(problem, workspace):
    capacity = sum(max(problem.units(c) for c in opts) for opts in problem.options)
    assert search.smallest(problem, capacity, workspace * MiB) == reference_smallest(
        problem, capacity, workspace * MiB
    )
