"""The CUDA copy engine's ordering, on CPU tensors: streams and events are a recording fake.

The copies themselves are synchronous here (CPU tensors), so these tests check what makes them safe on a
GPU: the side stream waits for the producer before a device→host copy, a reload waits for compute and for
its host copy, compute waits for a reload still in flight (and only then), the bound on copies in flight,
which memory is tied to which stream, and which copy a released host buffer waits for.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
from collections.abc import Iterator

import pytest
import torch

import memfit
from memfit.offload.copy import CopyEngine, StreamApi
from memfit.offload.pool import PinnedBucketPool

from test_engine import assert_same, step
from toy import TOY


class FakeEvent:
    _ids = itertools.count()

    def __init__(self, streams: FakeStreams, timing: bool) -> None:
        self.streams, self.timing, self.id = streams, timing, next(self._ids)
        self.done = False
        self.stream: str | None = None

    def record(self, stream: FakeStream) -> None:
        self.stream, self.done = stream.name, self.streams.complete
        self.streams.log.append(("record", stream.name, self.id))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, other: FakeEvent) -> float:
        return 1.0


class FakeStream:
    def __init__(self, streams: FakeStreams, name: str) -> None:
        self.streams, self.name = streams, name

    def wait_event(self, event: FakeEvent) -> None:
        self.streams.log.append(("wait", self.name, event.id))


class FakeStreams(StreamApi):
    """Streams named compute, d2h, h2d; events complete when recorded unless ``complete`` is False."""

    def __init__(self, *, complete: bool = True) -> None:
        self.complete = complete
        self.log: list[tuple] = []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self._names = iter(["d2h", "h2d"])
        self.tied: list[tuple[int, str]] = []  # (storage address, stream): record_stream calls

    def new_stream(self) -> FakeStream:
        return FakeStream(self, next(self._names))

    def current_stream(self, device: torch.device) -> FakeStream:
        return self.current

    def new_event(self, *, timing: bool = False) -> FakeEvent:
        return FakeEvent(self, timing)

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[None]:
        before, self.current = self.current, stream
        self.log.append(("use", stream.name))
        try:
            yield
        finally:
            self.current = before
            self.log.append(("leave", stream.name))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.tied.append((tensor.untyped_storage().data_ptr(), stream.name))

    def waits(self, stream: str) -> list[int]:
        return [e for kind, s, *rest in self.log if kind == "wait" and s == stream for e in rest]


class CpuAsyncEngine(CopyEngine):
    """The CUDA engine's logic on CPU tensors (which it would otherwise leave on their device)."""

    parks_cpu_tensors = True


def engine(streams: FakeStreams, **kw) -> CpuAsyncEngine:
    pool = PinnedBucketPool(allocate=lambda n, pinned: torch.empty(n, dtype=torch.uint8),
                            available_host_bytes=lambda: 1 << 40, host_reserve_bytes=0)
    return CpuAsyncEngine(pool, streams=streams, **kw)


def test_a_device_to_host_copy_waits_for_its_producer_and_ties_the_source_to_its_stream():
    streams = FakeStreams()
    eng = engine(streams)
    a, b = torch.randn(4, 8), torch.randn(8, 4).t()  # b: a dense transpose, parked with its strides
    c = torch.randn(4, 8)[:, ::2]  # not dense: copied through a contiguous temporary
    parked = eng.offload_many([a, b, c])
    produced = next(e for kind, s, e in (x for x in streams.log if x[0] == "record") if s == "compute")
    assert streams.waits("d2h") == [produced]  # before any copy: the use of d2h comes after the wait
    assert streams.log.index(("wait", "d2h", produced)) < streams.log.index(("use", "d2h"))
    done = {p.d2h_done for p in parked}
    assert len(done) == 1 and next(iter(done)).stream == "d2h"  # one completion event for the batch
    assert parked[1].stride == b.stride()
    tied = {ptr for ptr, s in streams.tied if s == "d2h"}
    assert {t.untyped_storage().data_ptr() for t in (a, b, c)} <= tied  # each source (c's original too)
    assert len(tied) == 4  # and c's contiguous temporary
    for p, t in zip(parked, (a, b, c), strict=True):
        assert torch.equal(p.buffer.strided_view(p.dtype, p.shape, p.stride), t.contiguous() if t is c else t)


def test_a_reload_waits_for_compute_and_for_each_host_copy_once():
    streams = FakeStreams()
    eng = engine(streams)
    first, second = eng.offload_many([torch.randn(4, 8), torch.randn(3, 5)]), eng.offload_many([torch.randn(6)])
    for p in (*first, *second):
        p.source = None  # the device tensors are gone: only the host copies remain
    streams.log.clear()
    eng.reload_many([*first, *second, first[0]])  # a tensor listed twice is reloaded once
    ready = streams.log[0][2]
    assert streams.log[0] == ("record", "compute", ready)
    assert streams.waits("h2d") == [ready, first[0].d2h_done.id, second[0].d2h_done.id]
    outs = [p.reloaded for p in (*first, *second)]
    assert {p.h2d_done for p in (*first, *second)} == {first[0].h2d_done} and first[0].h2d_done.stream == "h2d"
    assert {t.untyped_storage().data_ptr() for t in outs} <= {ptr for ptr, s in streams.tied if s == "h2d"}
    assert eng.stats.bytes_reloaded == sum(p.nbytes for p in (*first, *second))


def test_compute_waits_for_a_reload_only_while_it_is_in_flight():
    streams = FakeStreams(complete=False)
    eng = engine(streams)
    (p,) = eng.offload_many([torch.randn(4, 8)])
    p.source = None
    eng.reload(p)
    streams.log.clear()
    eng.fetch(p)
    assert streams.waits("compute") == [p.h2d_done.id]
    assert len(eng.stats.stall_events) == 1  # timed: the exposed copy time
    (q,) = eng.offload_many([torch.randn(4, 8)])
    q.source = None
    eng.reload(q)
    q.h2d_done.done = True  # landed before it is needed: nothing to wait for
    streams.log.clear()
    eng.fetch(q)
    assert streams.waits("compute") == [] and len(eng.stats.stall_events) == 1


def test_a_tensor_still_alive_is_handed_back_without_a_copy_unless_modified():
    streams = FakeStreams()
    eng = engine(streams)
    t = torch.randn(4, 8)
    saved = t.clone()
    (p,) = eng.offload_many([t])
    p.users = 2
    streams.log.clear()
    assert eng.fetch(p) is t and eng.stats.reloads_skipped == 1 and streams.log == []
    t.add_(1)  # modified in place since it was parked: the host copy is the data
    got = eng.fetch(p)
    assert got is not t and torch.equal(got, saved) and eng.stats.bytes_reloaded == p.nbytes


def test_copies_in_flight_are_bounded_by_making_compute_wait_for_the_oldest():
    streams = FakeStreams(complete=False)
    t = torch.randn(64)  # 256 bytes
    eng = engine(streams, max_inflight_bytes=600)
    parked = [eng.offload_many([t.clone()])[0] for _ in range(4)]
    # the third copy would put 768 bytes in flight: compute waits for the first, the fourth for the second
    assert streams.waits("compute") == [parked[0].d2h_done.id, parked[1].d2h_done.id]
    assert eng.stats.copies_inflight_waits == 2
    for p in parked:
        p.d2h_done.done = True
    eng.offload_many([t.clone()])  # finished copies leave the count without a wait
    assert eng.stats.copies_inflight_waits == 2 and eng._inflight_bytes == 256


def test_a_released_host_buffer_waits_for_the_last_copy_that_used_it():
    streams = FakeStreams(complete=False)
    eng = engine(streams)
    kept, reloaded = eng.offload_many([torch.randn(8)]), eng.offload_many([torch.randn(8)])
    reloaded[0].source = None
    eng.reload(reloaded[0])
    buffers = [kept[0].buffer, reloaded[0].buffer]
    eng.release(kept[0])
    eng.release(reloaded[0])
    assert [b._ready for b in buffers] == [kept[0].d2h_done, reloaded[0].h2d_done]


@pytest.mark.parametrize("config", [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"},
    {"gradient_checkpointing_offload_attention": True},
], ids=["unsloth", "unsloth-ffn", "offload_attention"])
@pytest.mark.parametrize("complete", [True, False], ids=["landed", "in-flight"])
def test_backends_through_the_asynchronous_engine_keep_gradients_and_order(model, x, config, complete):
    """Every reload waits for its own host copy; every tensor fetched while its reload was in flight made
    compute wait for it; gradients as without memfit; every host buffer back in the pool."""
    ref = step(model, x)
    streams = FakeStreams(complete=complete)
    eng = engine(streams)
    with memfit.apply(model, config, adapter=TOY, copy_engine=eng, min_offload_bytes=0) as handle:
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0
    h2d_waits, compute_waits = set(streams.waits("h2d")), set(streams.waits("compute"))
    d2h_done = {e for kind, s, e in (x for x in streams.log if x[0] == "record") if s == "d2h"}
    h2d_done = {e for kind, s, e in (x for x in streams.log if x[0] == "record") if s == "h2d"}
    assert d2h_done and d2h_done <= h2d_waits  # no reload before its host copy
    # events that never complete: every reload was waited for before use; completed ones: none was
    assert (h2d_done <= compute_waits) if not complete else not (h2d_done & compute_waits)
    gc.collect()
    assert eng.pool.stats().buffers_in_use == 0
