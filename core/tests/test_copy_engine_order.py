"""The CUDA copy engine's ordering, on CPU tensors: streams and events are the conformance kit's recording
fakes (``memfit_conformance.streams``).

The copies themselves are synchronous here (CPU tensors), so these tests check what makes them safe on a
GPU: the side stream waits for the producer before a device→host copy, a reload waits for compute and for
its host copy, compute waits for a reload still in flight (and only then), the bound on copies in flight,
which memory is tied to which stream, and which copy a released host buffer waits for.
"""

from __future__ import annotations

import gc

import pytest
import torch

import memfit
from memfit.offload.copy import ReloadRelease
from memfit_conformance.streams import order_checking_copy_engine

from helpers import assert_same, step
from toy import TOY


def recorded_on(streams, name: str) -> list[int]:
    return [entry[2] for entry in streams.log if entry[0] == "record" and entry[1] == name]


def test_a_device_to_host_copy_waits_for_its_producer_and_ties_the_source_to_its_stream():
    eng = order_checking_copy_engine(landed=True, coalesce_max_bytes=0)  # tensor by tensor
    streams = eng.streams
    a, b = torch.randn(4, 8), torch.randn(8, 4).t()  # b: a dense transpose, parked with its strides
    c = torch.randn(4, 8)[:, ::2]  # not dense: copied through a contiguous temporary
    parked = eng.offload_many([a, b, c])
    (produced,) = recorded_on(streams, "compute")
    assert streams.waits("d2h") == [produced]
    assert streams.log.index(("wait", "d2h", produced)) < streams.log.index(("use", "d2h"))  # before any copy
    done = {p.d2h_done for p in parked}
    assert len(done) == 1 and next(iter(done)).event.stream == "d2h"  # one completion event for the batch
    assert parked[1].stride == b.stride()
    tied = {ptr for ptr, s in streams.tied if s == "d2h"}
    assert {t.untyped_storage().data_ptr() for t in (a, b, c)} <= tied  # each source (c's original too)
    assert len(tied) == 4  # and c's contiguous temporary
    for p, t in zip(parked, (a, b, c), strict=True):
        assert torch.equal(p.buffer.strided_view(p.dtype, p.shape, p.stride), t.contiguous() if t is c else t)


def test_a_reload_waits_for_compute_and_for_each_host_copy_once():
    eng = order_checking_copy_engine(coalesce_max_bytes=0)  # the host copies are still in flight
    streams = eng.streams
    first, second = (
        eng.offload_many([torch.randn(4, 8), torch.randn(3, 5)]),
        eng.offload_many([torch.randn(6)]),
    )
    for p in (*first, *second):
        p.source = None  # the device tensors are gone: only the host copies remain
    streams.log.clear()
    eng.reload_many([*first, *second, first[0]])  # a tensor listed twice is reloaded once
    (ready,) = recorded_on(streams, "compute")
    assert streams.log[0] == ("record", "compute", ready)
    assert streams.waits("h2d") == [ready, first[0].d2h_done.event.id, second[0].d2h_done.event.id]
    outs = [p.reloaded for p in (*first, *second)]
    assert {p.h2d_done for p in (*first, *second)} == {first[0].h2d_done} and first[
        0
    ].h2d_done.event.stream == "h2d"
    assert {t.untyped_storage().data_ptr() for t in outs} <= {ptr for ptr, s in streams.tied if s == "h2d"}
    assert eng.stats.bytes_reloaded == sum(p.nbytes for p in (*first, *second))


def test_a_small_batch_is_packed_on_compute_and_copied_once_each_way():
    eng = order_checking_copy_engine(landed=True)
    streams = eng.streams
    a = torch.randn(4, 8)
    b = torch.randn(8, 3, dtype=torch.float64).t()  # a dense transpose: packed as it lies in memory
    c = torch.randn(4, 8)[:, ::2]  # not dense: packed from a contiguous copy
    d = torch.arange(7, dtype=torch.int16)  # 14 bytes: the next tensor starts aligned all the same
    e = torch.randn(2, 3, dtype=torch.bfloat16)
    parked = eng.offload_many([a, b, c, d, e])
    (produced,) = recorded_on(streams, "compute")  # after the packing, which ran on compute
    assert streams.waits("d2h") == [produced] and eng.stats.coalesced_batches == 1
    assert len({id(p.buffer) for p in parked}) == 1 and len({p.d2h_done for p in parked}) == 1
    assert [p.offset % 512 for p in parked] == [0] * 5 and parked[1].stride == b.stride()
    (tied,) = streams.tied  # only the packed buffer: the sources were read on compute, in its order
    assert tied[1] == "d2h" and tied[0] not in {t.untyped_storage().data_ptr() for t in (a, b, c, d, e)}
    assert eng.stats.bytes_offloaded == sum(t.numel() * t.element_size() for t in (a, b, c, d, e))
    for p in parked:
        p.source = None
    streams.log.clear()
    streams.tied.clear()
    eng.reload_many(parked)
    (ready,) = recorded_on(streams, "compute")
    assert streams.waits("h2d") == [ready]  # its host copy was seen complete (the bound on copies in flight)
    (packed,) = streams.tied  # one device buffer, one copy
    for p, t in zip(parked, (a, b, c, d, e), strict=True):
        got = eng.fetch(p)
        assert torch.equal(got, t) and got.dtype == t.dtype and got.untyped_storage().data_ptr() == packed[0]
        assert got.stride() == (t.contiguous().stride() if t is c else t.stride())


def test_packed_batches_keep_empty_scalar_bool_complex_and_strided_tensors_exact():
    eng = order_checking_copy_engine()  # events in flight: every wait must be there
    tensors = [
        torch.randn(0, 4),
        torch.tensor(3.5),
        torch.tensor([True, False, True]),
        torch.randn(3, dtype=torch.complex64),
        torch.randn(2, 3, 4).permute(2, 0, 1),
        torch.randn(5, 6)[::2, 1:],
        torch.randn(3, 1).expand(3, 4),
    ]  # a broadcast view: its storage is copied, it comes back broadcast
    parked = eng.offload_many(tensors)
    assert eng.stats.coalesced_batches == 1
    for p in parked:
        p.source = None
    eng.reload_many(parked)
    for p, t in zip(parked, tensors, strict=True):
        got = eng.fetch(p)
        assert got.shape == t.shape and got.dtype == t.dtype and torch.equal(got, t)
    assert got.stride() == (1, 0)


def test_views_that_cover_their_storage_are_packed_as_its_bytes_once():
    """Attention's saved tensors: q, k, v strided views of one fused projection, the output and the output
    reshaped for the next projection. Packed as two storages (no copy of a strided view, no byte twice)."""
    eng = order_checking_copy_engine(landed=True)
    b, n, h, d = 1, 6, 2, 4
    qkv = torch.randn(b, n, 3 * h * d)
    q, k, v = qkv.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4)  # none is dense on its own
    out = torch.randn(b, n, h, d).transpose(1, 2)  # (b, h, n, d), dense in memory order
    flat_out = out.transpose(1, 2).reshape(b, n, h * d)  # the same bytes, another view
    lone = torch.randn(4, 8, dtype=torch.float64)[:, ::2]  # half its storage: copied on its own
    tensors = [q, out, k, v, flat_out, lone]
    parked = eng.offload_many(tensors)
    storage_bytes = qkv.numel() * 4 + out.numel() * 4
    assert eng.stats.bytes_offloaded == storage_bytes + lone.numel() * 8
    assert parked[2].offset - parked[0].offset == h * d * 4 and parked[1].offset == parked[4].offset
    for p in parked:
        p.source = None
    eng.reload_many(parked)
    assert eng.stats.bytes_reloaded == eng.stats.bytes_offloaded  # each storage's bytes once, both ways
    for p, t in zip(parked, tensors, strict=True):
        got = eng.fetch(p)
        assert torch.equal(got, t) and got.dtype == t.dtype
        assert got.stride() == (t.contiguous().stride() if t is lone else t.stride())


def test_above_the_coalescing_size_views_of_one_storage_still_share_one_copy_straight_from_it():
    eng = order_checking_copy_engine(landed=True, coalesce_max_bytes=64)
    qkv = torch.randn(2, 3, 12)
    q, k, v = qkv.view(2, 3, 3, 4).permute(2, 0, 1, 3)
    lone = torch.randn(16)
    tensors = [q, lone, k, v]
    parked = eng.offload_many(tensors)
    assert (
        eng.stats.coalesced_batches == 1 and eng.stats.bytes_offloaded == qkv.numel() * 4 + lone.numel() * 4
    )
    assert parked[1].group is None and len({id(parked[i].group) for i in (0, 2, 3)}) == 1
    # the storage was copied from where it lies (no packed copy of it): its memory is tied to the copy stream
    assert qkv.untyped_storage().data_ptr() in {ptr for ptr, stream in eng.streams.tied if stream == "d2h"}
    for p in parked:
        p.source = None
    eng.reload_many(parked)
    for p, t in zip(parked, tensors, strict=True):
        got = eng.fetch(p)
        assert torch.equal(got, t) and got.stride() == t.stride()


def test_views_of_different_dtypes_over_one_storage_come_back_exact():
    base = torch.randn(16)
    as_ints = base.view(torch.int32)  # all of it, read as integers
    first_half = base[:8]  # half of it again, as floats
    engine = order_checking_copy_engine(landed=True)
    parked = engine.offload_many([first_half, as_ints])
    assert engine.stats.bytes_offloaded == 64  # the storage once, not 64 + 32
    for p in parked:
        p.source = None
    engine.reload_many(parked)
    assert torch.equal(engine.fetch(parked[0]), first_half) and torch.equal(engine.fetch(parked[1]), as_ints)


def test_a_batch_above_the_coalescing_size_and_a_single_tensor_are_copied_one_by_one():
    eng = order_checking_copy_engine(landed=True, coalesce_max_bytes=255)
    parked = eng.offload_many([torch.randn(32), torch.randn(32)])  # 256 bytes: one more than the limit
    parked += eng.offload_many([torch.randn(4)])
    assert eng.stats.coalesced_batches == 0 and all(p.group is None for p in parked)
    assert len({id(p.buffer) for p in parked}) == 3
    with pytest.raises(ValueError, match="coalesce_max_bytes"):
        order_checking_copy_engine(coalesce_max_bytes=-1)


def test_a_coalesced_host_buffer_goes_back_with_its_last_member_after_the_last_reload():
    eng = order_checking_copy_engine()
    parked = eng.offload_many([torch.randn(8), torch.randn(8), torch.randn(8)])
    for p in parked:
        p.source = None
    eng.reload_many(parked[:2])
    first = parked[0].h2d_done
    eng.reload_many(parked[2:])  # a later reload of the same buffer: the one a reuse must wait for
    buf = parked[0].buffer
    eng.release(parked[0])
    eng.release(parked[1])
    assert buf.in_use and parked[2].buffer is buf  # a member still holds it
    eng.release(parked[2])
    assert not buf.in_use and buf._ready is parked[2].h2d_done and buf._ready is not first
    eng.release(parked[2])  # released once: a second release is a no-op
    assert eng.pool.stats().buffers_in_use == 0


def test_compute_waits_for_a_reload_only_while_it_is_in_flight():
    eng = order_checking_copy_engine()
    streams = eng.streams
    (p,) = eng.offload_many([torch.randn(4, 8)])
    p.source = None
    eng.reload(p)
    streams.log.clear()
    eng.fetch(p)
    assert streams.waits("compute") == [p.h2d_done.event.id]
    assert len(eng.stats.stall_events) == 1  # timed: the exposed copy time
    (q,) = eng.offload_many([torch.randn(4, 8)])
    q.source = None
    eng.reload(q)
    q.h2d_done.event.done = True  # landed before it is needed: nothing to wait for
    streams.log.clear()
    eng.fetch(q)
    assert streams.waits("compute") == [] and len(eng.stats.stall_events) == 1


def test_the_order_checks_catch_a_reload_used_before_compute_waited():
    eng = order_checking_copy_engine()
    (p,) = eng.offload_many([torch.randn(4, 8)])
    p.source = None
    eng._wait_for_reload = lambda parked: None  # a broken engine: no wait before use
    with pytest.raises(AssertionError, match="before compute waited for its reload"):
        eng.fetch(p)


def test_a_tensor_still_alive_is_handed_back_without_a_copy_unless_modified():
    eng = order_checking_copy_engine(landed=True)
    t = torch.randn(4, 8)
    saved = t.clone()
    (p,) = eng.offload_many([t])
    p.users = 2
    eng.streams.log.clear()
    assert eng.fetch(p) is t and eng.stats.reloads_skipped == 1 and eng.streams.log == []
    t.add_(1)  # modified in place since it was parked: the host copy is the data
    got = eng.fetch(p)
    assert got is not t and torch.equal(got, saved) and eng.stats.bytes_reloaded == p.nbytes


def test_copies_in_flight_are_bounded_by_making_compute_wait_for_the_oldest():
    t = torch.randn(64)  # 256 bytes
    eng = order_checking_copy_engine(max_inflight_bytes=600)
    parked = [eng.offload_many([t.clone()])[0] for _ in range(4)]
    # the third copy would put 768 bytes in flight: compute waits for the first, the fourth for the second
    assert eng.streams.waits("compute") == [parked[0].d2h_done.event.id, parked[1].d2h_done.event.id]
    assert eng.stats.copies_inflight_waits == 2
    for p in parked:
        p.d2h_done.event.done = True
    eng.offload_many([t.clone()])  # finished copies leave the count without a wait
    assert eng.stats.copies_inflight_waits == 2 and eng._inflight_bytes == 256


def test_a_released_host_buffer_waits_for_the_last_copy_that_used_it():
    eng = order_checking_copy_engine()
    kept, reloaded = eng.offload_many([torch.randn(8)]), eng.offload_many([torch.randn(8)])
    reloaded[0].source = None
    eng.reload(reloaded[0])
    buffers = [kept[0].buffer, reloaded[0].buffer]
    eng.release(kept[0])
    eng.release(reloaded[0])
    assert [b._ready for b in buffers] == [kept[0].d2h_done, reloaded[0].h2d_done]


@pytest.mark.parametrize(
    "config",
    [
        {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
        {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"},
        {"gradient_checkpointing_offload_attention": True},
    ],
    ids=["unsloth", "unsloth-ffn", "offload_attention"],
)
@pytest.mark.parametrize("landed", [True, False], ids=["landed", "in-flight"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["coalesced", "one-by-one"])
@pytest.mark.parametrize("release", list(ReloadRelease), ids=lambda r: r.value)
def test_backends_through_the_asynchronous_engine_keep_gradients_and_order(
    model, x, config, landed, coalesce, release
):
    """The engine checks its own ordering as it runs; gradients as without memfit; every reload waited on
    while in flight, none once landed; every host buffer back in the pool; reloads' memory tied to the copy
    stream only by default."""
    ref = step(model, x)
    eng = order_checking_copy_engine(
        landed=landed, reload_release=release, **({} if coalesce else {"coalesce_max_bytes": 0})
    )
    with memfit.apply(model, config, adapter=TOY, copy_engine=eng, min_offload_bytes=0) as handle:
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0
    if not coalesce:  # (the toy's regions park one tensor each: the kit's families run packed batches)
        assert stats["coalesced_batches"] == 0
    reloads, compute_waits = set(recorded_on(eng.streams, "h2d")), set(eng.streams.waits("compute"))
    assert (reloads <= compute_waits) if not landed else not (reloads & compute_waits)
    assert any(s == "h2d" for _, s in eng.streams.tied) is (release is ReloadRelease.RECORD_STREAM)
    gc.collect()
    assert eng.pool.stats().buffers_in_use == 0


def _count_event_calls(eng) -> dict[str, int]:
    """Counts, from now on, the events ``eng`` creates and the queries they get (CUDA calls on a GPU)."""
    counts = {"created": 0, "queries": 0}
    new_event = eng.streams.new_event

    def counted(**kwargs):
        event = new_event(**kwargs)
        query = event.query

        def counted_query():
            counts["queries"] += 1
            return query()

        event.query = counted_query
        counts["created"] += 1
        return event

    eng.streams.new_event = counted
    return counts


def test_a_batch_asks_its_reload_event_once_for_all_its_fetches():
    eng = order_checking_copy_engine()  # events in flight until said otherwise
    parked = eng.offload_many([torch.randn(8) for _ in range(4)])
    for p in parked:
        p.source = None
        p.d2h_done.event.done = True
    counts = _count_event_calls(eng)
    eng.reload_many(parked)
    assert counts == {"created": 1, "queries": 0}  # its completion event; the ordering one is reused
    parked[0].h2d_done.event.done = True  # landed before backward needs it
    for p in parked:
        eng.fetch(p)
    assert counts["queries"] == 1 and eng.streams.waits("compute") == []


def test_ordering_events_are_reused_and_a_host_copy_seen_complete_is_not_waited_for():
    eng = order_checking_copy_engine()
    counts = _count_event_calls(eng)
    first = eng.offload_many([torch.randn(8), torch.randn(8)])
    second = eng.offload_many(
        [torch.randn(8), torch.randn(8)]
    )  # the bound on copies in flight asks the first
    assert len(set(recorded_on(eng.streams, "compute"))) == 1  # one ordering event, recorded for each batch
    assert counts["created"] == 1 + 2  # it and one completion event per batch
    first[0].d2h_done.event.done = True
    eng.offload_many([torch.randn(8)])  # sees the first batch's copy complete, the second's still in flight
    assert first[0].d2h_done.landed and not second[0].d2h_done.landed
    for p in (*first, *second):
        p.source = None
    since = len(eng.streams.log)
    eng.reload_many([*first, *second])
    (ready,) = set(recorded_on(eng.streams, "compute"))
    assert eng.streams.waits("h2d", since) == [ready, second[0].d2h_done.event.id]


def test_an_attention_offload_step_makes_one_event_per_copy_and_asks_it_once(model, x):
    """Each batch of copies (a region parked, a region reloaded) makes one completion event, asked once
    (events complete when recorded, as when every copy is hidden); nothing else makes events."""
    eng = order_checking_copy_engine(landed=True)
    config = {"gradient_checkpointing_offload_attention": True}
    with memfit.apply(model, config, adapter=TOY, copy_engine=eng, min_offload_bytes=0) as handle:
        step(model, x)  # the ordering events are made in the first step
        counts = _count_event_calls(eng)
        eng.streams.log.clear()
        step(model, x)
        stats = handle.stats()
    batches = {s: eng.streams.log.count(("use", s)) for s in ("d2h", "h2d")}
    assert batches["d2h"] > 1 and batches["h2d"] == batches["d2h"] and stats["bytes_reloaded"] > 0
    assert counts == {"created": sum(batches.values()), "queries": sum(batches.values())}


def test_a_reload_in_flight_is_waited_for_once_per_stream_not_once_per_tensor():
    from memfit_conformance.streams import RecordingStream

    eng = order_checking_copy_engine()  # events in flight until queried complete: never, here
    streams = eng.streams
    tensors = [torch.randn(4, 8), torch.randn(3, 5), torch.randn(6)]
    parked = eng.offload_many(tensors)  # one packed batch: one reload, one completion event
    for p in parked:
        p.source = None
    eng.reload_many(parked)
    (reload,) = {p.h2d_done for p in parked}
    since = len(streams.log)
    for p, t in zip(parked, tensors, strict=True):
        assert torch.equal(eng.fetch(p), t)
    # compute waited for the reload at the first fetch; its later work (the other fetches) waits with it
    assert streams.waits("compute", since) == [reload.event.id]
    assert len(eng.stats.stall_events) == 1  # and it was timed once
    # another stream has not waited: fetching there waits again
    parked2 = eng.offload_many([torch.randn(5, 5), torch.randn(2, 2)])
    for p in parked2:
        p.source = None
    eng.reload_many(parked2)
    eng.fetch(parked2[0])
    other = RecordingStream(streams, "other")
    streams.current = other
    since = len(streams.log)
    eng.fetch(parked2[1])
    assert streams.waits("other", since) == [parked2[1].h2d_done.event.id]
    streams.current = streams.compute


def test_stall_timing_reuses_its_events_and_holds_a_bounded_number_unread():
    from memfit.offload.copy import STALL_PAIRS_HELD, CopyEngine
    from memfit.offload.pool import PinnedBucketPool
    from memfit_conformance.streams import RecordingEvent, RecordingStreams

    class TimedEvent(RecordingEvent):  # a stall's timing event: complete once the GPU passes it, 1 ms apart
        def record(self, stream) -> None:
            super().record(stream)
            self.done = True

        def elapsed_time(self, other) -> float:
            return 1.0

    class Streams(RecordingStreams):  # copies stay in flight; timing events complete
        made = 0

        def new_event(self, *, timing: bool = False):
            if not timing:
                return super().new_event()
            Streams.made += 1
            return TimedEvent(self)

    pool = PinnedBucketPool(
        allocate=lambda n, pinned: torch.empty(n, dtype=torch.uint8),
        available_host_bytes=lambda: 1 << 40,
        host_reserve_bytes=0,
    )
    eng = CopyEngine(pool, streams=Streams())
    eng.parks_cpu_tensors = True
    stalls = 3 * STALL_PAIRS_HELD
    for _ in range(stalls):  # a run that never reads its stats
        (parked,) = eng.offload_many([torch.randn(8)])
        parked.source = None
        eng.reload_many([parked])
        eng.fetch(parked)  # the reload is in flight: compute waits, timed
        eng.release(parked)
    assert len(eng.stats.stall_events) <= STALL_PAIRS_HELD + 1
    assert Streams.made <= 2 * (STALL_PAIRS_HELD + 1)  # events recorded again, not made per stall
    assert eng.stall_ms() == pytest.approx(stalls * 1.0)  # and every stall is counted once


def _reloaded(eng, tensors):
    parked = eng.offload_many(tensors)
    for p in parked:
        p.source = None
    eng.reload_many(parked)
    return parked


@pytest.mark.parametrize("coalesce", [0, 64 << 20], ids=["one by one", "packed"])
def test_untied_reloads_are_waited_for_once_before_use_and_released_without_another_wait(coalesce):
    eng = order_checking_copy_engine(
        coalesce_max_bytes=coalesce, reload_release=ReloadRelease.AFTER_COMPUTE_WAITS
    )
    tensors = [torch.randn(4, 8), torch.randn(6)]
    parked = _reloaded(eng, tensors)
    assert not any(s == "h2d" for _, s in eng.streams.tied)
    since = len(eng.streams.log)
    for p, t in zip(parked, tensors, strict=True):
        assert torch.equal(eng.fetch(p), t)
    assert eng.streams.waits("compute", since) == [parked[0].h2d_done.event.id]  # once, before the first use
    since = len(eng.streams.log)
    for p in parked:
        eng.release(p)  # fetched: compute already waited, nothing more
    assert eng.streams.waits("compute", since) == []


def test_an_untied_reload_released_unfetched_goes_back_only_after_its_stream_waited_for_it():
    eng = order_checking_copy_engine(reload_release=ReloadRelease.AFTER_COMPUTE_WAITS)
    (in_flight,) = _reloaded(eng, [torch.randn(4, 8)])
    since = len(eng.streams.log)
    eng.release(in_flight)  # never fetched (a step that stopped): the allocation stream waits for the copy
    assert eng.streams.waits("compute", since) == [in_flight.h2d_done.event.id]
    assert in_flight.reloaded is None and in_flight.buffer is None
    (landed,) = _reloaded(eng, [torch.randn(4, 8)])
    landed.h2d_done.event.done = True
    since = len(eng.streams.log)
    eng.release(landed)  # its copy is known complete: nothing to wait for
    assert eng.streams.waits("compute", since) == [] and landed.reloaded is None

    broken = order_checking_copy_engine(reload_release=ReloadRelease.AFTER_COMPUTE_WAITS)
    (p,) = _reloaded(broken, [torch.randn(4, 8)])
    broken.streams.compute.wait_event = lambda event: None  # an engine whose release wait does nothing
    with pytest.raises(AssertionError, match="before it waited for its reload"):
        broken.release(p)


def test_an_untied_reload_fetched_on_another_stream_makes_its_allocation_stream_wait_too():
    from memfit_conformance.streams import RecordingStream

    eng = order_checking_copy_engine(reload_release=ReloadRelease.AFTER_COMPUTE_WAITS)
    (p,) = _reloaded(eng, [torch.randn(4, 8)])
    other = RecordingStream(eng.streams, "other")
    eng.streams.current = other
    since = len(eng.streams.log)
    eng.fetch(p)
    eng.streams.current = eng.streams.compute
    # the tensor is used on ``other`` but its memory returns to compute's pool: both wait for the write
    assert eng.streams.waits("other", since) == [p.h2d_done.event.id]
    assert eng.streams.waits("compute", since) == [p.h2d_done.event.id]
