"""Interval / segment-stride plan semantics (SPEC §1)."""

from hypothesis import given
from hypothesis import strategies as st

from memfit.engine.schedule import chunk_count, plan_blocks


def test_interval_one_is_every_block():
    plan = plan_blocks({"blocks": 5}, interval=1, stride=None)
    assert sorted(i for _, i in plan) == [0, 1, 2, 3, 4]
    assert all(slot.length == 1 for slot in plan.values())


def test_spec_stride_example():
    # SPEC: blocks [0,N) checkpointed, [N,S) run normally, [S,S+N) checkpointed ...
    plan = plan_blocks({"blocks": 10}, interval=2, stride=4)
    assert sorted(i for _, i in plan) == [0, 1, 4, 5, 8, 9]
    assert {slot.chunk_start for slot in plan.values()} == {0, 4, 8}


def test_last_chunk_is_shorter():
    plan = plan_blocks({"a": 5}, interval=3, stride=None)
    assert plan[("a", 4)].length == 2 and plan[("a", 4)].position == 1


@given(
    length=st.integers(min_value=0, max_value=40),
    interval=st.integers(min_value=1, max_value=8),
    extra=st.integers(min_value=0, max_value=8),
    use_stride=st.booleans(),
)
def test_plan_properties(length, interval, extra, use_stride):
    stride = interval + extra if use_stride else None
    step = stride or interval
    plan = plan_blocks({"l": length}, interval=interval, stride=stride)
    for (_, index), slot in plan.items():
        assert (index % step) < interval  # inside the checkpointed head of its segment
        assert slot.chunk_start == index - index % step
        assert 0 <= slot.position < slot.length <= interval
    # every index in a segment head is planned, nothing else
    assert len(plan) == sum(1 for i in range(length) if i % step < interval)
    assert chunk_count({"l": length}, interval=interval, stride=stride) == len(range(0, length, step))
