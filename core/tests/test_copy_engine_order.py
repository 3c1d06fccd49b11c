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
from memfit_conformance.streams import order_checking_copy_engine

from test_engine import assert_same, step
from toy import TOY


def recorded_on(streams, name: str) -> list[int]:
    return [entry[2] for entry in streams.log if entry[0] == "record" and entry[1] == name]


def test_a_device_to_host_copy_waits_for_its_producer_and_ties_the_source_to_its_stream():
    eng = order_checking_copy_engine(landed=True)
    streams = eng.streams
    a, b = torch.randn(4, 8), torch.randn(8, 4).t()  # b: a dense transpose, parked with its strides
    c = torch.randn(4, 8)[:, ::2]  # not dense: copied through a contiguous temporary
    parked = eng.offload_many([a, b, c])
    (produced,) = recorded_on(streams, "compute")
    assert streams.waits("d2h") == [produced]
    assert streams.log.index(("wait", "d2h", produced)) < streams.log.index(("use", "d2h"))  # before any copy
    done = {p.d2h_done for p in parked}
    assert len(done) == 1 and next(iter(done)).stream == "d2h"  # one completion event for the batch
    assert parked[1].stride == b.stride()
    tied = {ptr for ptr, s in streams.tied if s == "d2h"}
    assert {t.untyped_storage().data_ptr() for t in (a, b, c)} <= tied  # each source (c's original too)
    assert len(tied) == 4  # and c's contiguous temporary
    for p, t in zip(parked, (a, b, c), strict=True):
        assert torch.equal(p.buffer.strided_view(p.dtype, p.shape, p.stride), t.contiguous() if t is c else t)


def test_a_reload_waits_for_compute_and_for_each_host_copy_once():
    eng = order_checking_copy_engine(landed=True)
    streams = eng.streams
    first, second = eng.offload_many([torch.randn(4, 8), torch.randn(3, 5)]), eng.offload_many([torch.randn(6)])
    for p in (*first, *second):
        p.source = None  # the device tensors are gone: only the host copies remain
    streams.log.clear()
    eng.reload_many([*first, *second, first[0]])  # a tensor listed twice is reloaded once
    (ready,) = recorded_on(streams, "compute")
    assert streams.log[0] == ("record", "compute", ready)
    assert streams.waits("h2d") == [ready, first[0].d2h_done.id, second[0].d2h_done.id]
    outs = [p.reloaded for p in (*first, *second)]
    assert {p.h2d_done for p in (*first, *second)} == {first[0].h2d_done} and first[0].h2d_done.stream == "h2d"
    assert {t.untyped_storage().data_ptr() for t in outs} <= {ptr for ptr, s in streams.tied if s == "h2d"}
    assert eng.stats.bytes_reloaded == sum(p.nbytes for p in (*first, *second))


def test_compute_waits_for_a_reload_only_while_it_is_in_flight():
    eng = order_checking_copy_engine()
    streams = eng.streams
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
    assert eng.streams.waits("compute") == [parked[0].d2h_done.id, parked[1].d2h_done.id]
    assert eng.stats.copies_inflight_waits == 2
    for p in parked:
        p.d2h_done.done = True
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


@pytest.mark.parametrize("config", [
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth"},
    {"gradient_checkpointing": True, "gradient_checkpointing_backend": "unsloth-ffn"},
    {"gradient_checkpointing_offload_attention": True},
], ids=["unsloth", "unsloth-ffn", "offload_attention"])
@pytest.mark.parametrize("landed", [True, False], ids=["landed", "in-flight"])
def test_backends_through_the_asynchronous_engine_keep_gradients_and_order(model, x, config, landed):
    """The engine checks its own ordering as it runs; gradients as without memfit; every reload waited on
    while in flight, none once landed; every host buffer back in the pool."""
    ref = step(model, x)
    eng = order_checking_copy_engine(landed=landed)
    with memfit.apply(model, config, adapter=TOY, copy_engine=eng, min_offload_bytes=0) as handle:
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    assert stats["bytes_offloaded"] > 0 and stats["bytes_reloaded"] > 0
    reloads, compute_waits = set(recorded_on(eng.streams, "h2d")), set(eng.streams.waits("compute"))
    assert (reloads <= compute_waits) if not landed else not (reloads & compute_waits)
    gc.collect()
    assert eng.pool.stats().buffers_in_use == 0
