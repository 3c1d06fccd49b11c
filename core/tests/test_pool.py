"""PinnedBucketPool on CPU: an injected allocator and RAM probe stand in for CUDA and the host."""

from __future__ import annotations

import random
import threading
import warnings
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memfit.errors import ConfigError, MemfitError, MemfitWarning
from memfit.offload import HostBuffer, PinnedBucketPool, hostmem, size_class
from memfit.offload.pool import MIN_CLASS_BYTES

MiB = 1 << 20
GiB = 1 << 30


class FakeHost:
    """Records every allocation; tracks live pinned bytes through finalizers (so frees are observed)."""

    def __init__(self, available: int = 1 << 50, fail_pinned: bool = False) -> None:
        self.calls: list[tuple[int, bool]] = []
        self.available = available
        self.fail_pinned = fail_pinned
        self.live_pinned = 0

    def allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if pinned and self.fail_pinned:
            raise RuntimeError("cudaHostAlloc: out of memory")
        self.calls.append((nbytes, pinned))
        t = torch.empty(nbytes, dtype=torch.uint8)
        if pinned:
            self.live_pinned += nbytes
            weakref.finalize(t, self._freed, nbytes)
        return t

    def _freed(self, nbytes: int) -> None:
        self.live_pinned -= nbytes

    def avail(self) -> int:
        return self.available

    @property
    def pinned_calls(self) -> int:
        return sum(1 for _, p in self.calls if p)


def make_pool(host: FakeHost | None = None, **kwargs) -> tuple[PinnedBucketPool, FakeHost]:
    host = host or FakeHost()
    kwargs.setdefault("host_reserve_bytes", 0)
    return PinnedBucketPool(allocate=host.allocate, available_host_bytes=host.avail, **kwargs), host


# -- size classes --------------------------------------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=1 << 40))
def test_size_class_bounds_waste(n):
    c = size_class(n)
    assert c >= n
    assert c >= MIN_CLASS_BYTES
    if n > MIN_CLASS_BYTES:
        assert (c - n) * 8 < n  # < 12.5% waste
        assert c % 64 == 0
    assert size_class(c) == c  # a class is its own class


def test_size_classes_per_doubling():
    classes = {size_class(n) for n in range(MiB + 1, 2 * MiB + 1, 97)} | {size_class(2 * MiB)}
    assert sorted(classes) == [MiB + i * MiB // 8 for i in range(1, 9)]
    assert size_class(1 << 20, 1) == 1 << 20 and size_class((1 << 20) + 1, 1) == 1 << 21


# -- reuse ---------------------------------------------------------------------------------------------------------


def _step(pool: PinnedBucketPool, sizes: list[int]) -> None:
    """One training step: forward offloads every tensor, backward reloads them in reverse order."""
    bufs = [pool.acquire(n) for n in sizes]
    for buf, n in zip(bufs, sizes, strict=True):
        assert buf.pinned and buf.capacity >= n
    for buf in reversed(bufs):
        pool.release(buf)


def test_steady_state_allocates_nothing():
    pool, host = make_pool()
    block = [3072 * 4096 * 2, 3072 * 4096 * 8, 3072 * 4096 * 2, 4096 * 2]  # hidden, ffn, attn, modulation
    sizes = block * 6
    _step(pool, sizes)
    first = pool.stats()
    assert first.pinned_allocations == host.pinned_calls == len(sizes)
    assert first.misses == len(sizes) and first.hits == 0
    for _ in range(5):
        _step(pool, sizes)
    s = pool.stats()
    assert host.pinned_calls == first.pinned_allocations  # nothing new pinned
    assert s.hits == 5 * len(sizes)
    assert s.buffers_in_use == 0 and s.idle_buffers == len(sizes)
    assert s.buckets == 3
    assert s.pinned_bytes_held == sum(size_class(n) for n in sizes)


def test_changing_shapes_map_to_few_classes():
    """Variable text length: tokens 1000..1100 at width 3072 in bf16 land in one or two classes."""
    pool, host = make_pool()
    rng = random.Random(0)
    for _ in range(20):
        tokens = rng.randint(1000, 1100)
        _step(pool, [tokens * 3072 * 2] * 4)
    s = pool.stats()
    assert s.buckets <= 2
    assert host.pinned_calls <= 8
    assert s.hit_rate > 0.85


def test_reset_counters_and_clear():
    pool, host = make_pool()
    _step(pool, [MiB, 2 * MiB])
    pool.reset_counters()
    s = pool.stats()
    assert (s.hits, s.misses, s.pinned_allocations, s.evictions) == (0, 0, 0, 0)
    assert s.idle_buffers == 2
    held = pool.acquire(MiB)
    assert pool.clear() == size_class(2 * MiB)
    s = pool.stats()
    assert s.idle_buffers == 0 and s.buckets == 1 and s.evictions == 0
    assert s.pinned_bytes_held == host.live_pinned == MiB
    held.release()
    assert pool.clear() == MiB and pool.stats().buckets == 0 and host.live_pinned == 0


# -- max_buckets -----------------------------------------------------------------------------------------------------


def test_max_buckets_evicts_least_recently_used_class():
    pool, host = make_pool(max_buckets=2)
    a, b, c = MiB, 2 * MiB, 4 * MiB
    _step(pool, [a, a])
    _step(pool, [b])
    _step(pool, [a])  # a is now more recent than b
    assert pool.stats().buckets == 2
    _step(pool, [c])  # evicts b (least recently used), not a
    s = pool.stats()
    assert s.buckets == 2 and s.evictions == 1
    assert host.live_pinned == 2 * a + c
    calls = host.pinned_calls
    _step(pool, [a, a])
    assert host.pinned_calls == calls  # a was kept
    _step(pool, [b])
    assert host.pinned_calls == calls + 1  # b was not


def test_max_buckets_overflow_in_flight_is_pageable_and_warns_once():
    pool, host = make_pool(max_buckets=1)
    held = pool.acquire(MiB)
    with pytest.warns(MemfitWarning, match="max_buckets"):
        other = pool.acquire(2 * MiB)
    assert not other.pinned and not other.pooled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        third = pool.acquire(3 * MiB)
    s = pool.stats()
    assert s.overflows == 2 and s.buckets == 1 and s.pageable_bytes_held == 5 * MiB
    for buf in (other, third, held):
        pool.release(buf)
    s = pool.stats()
    assert s.pageable_bytes_held == 0 and s.idle_buffers == 1


def test_max_buckets_zero_is_pageable_only():
    pool, host = make_pool(max_buckets=0)
    for _ in range(3):
        bufs = [pool.acquire(n) for n in (1000, 5000, 5000)]
        assert all(not b.pinned and not b.pooled for b in bufs)
        assert [b.capacity for b in bufs] == [1000, 5000, 5000]
        assert pool.stats().pageable_bytes_held == 11000
        for b in bufs:
            pool.release(b)
    s = pool.stats()
    assert host.calls == [(1000, False), (5000, False), (5000, False)] * 3
    assert s.pinned_bytes_held == 0 and s.buckets == 0 and s.idle_buffers == 0 and s.pageable_bytes_held == 0
    assert s.hits == 0 and s.misses == 9 and s.pinned_allocations == 0


# -- byte cap --------------------------------------------------------------------------------------------------------


def test_byte_cap_frees_idle_buffers_of_other_classes_first():
    pool, host = make_pool(max_bytes=4 * MiB)
    _step(pool, [MiB, MiB, 2 * MiB])  # 4 MiB held, all idle
    buf = pool.acquire(3 * MiB)  # needs 3 MiB: frees the LRU class (1 MiB ×2) and then the 2 MiB one
    s = pool.stats()
    assert buf.pinned
    assert s.pinned_bytes_held == host.live_pinned <= 4 * MiB
    assert s.evictions >= 2


def test_byte_cap_raises_when_everything_is_in_use():
    pool, host = make_pool(max_bytes=4 * MiB)
    held = [pool.acquire(2 * MiB), pool.acquire(2 * MiB)]
    with pytest.raises(MemfitError, match="max_bytes") as e:
        pool.acquire(MiB)
    assert "pageable_fallback=True" in str(e.value)
    with pytest.raises(MemfitError, match="larger than the pinned byte cap"):
        pool.acquire(8 * MiB)
    assert pool.stats().pinned_bytes_held == 4 * MiB and len(held) == 2


def test_byte_cap_with_pageable_fallback():
    pool, host = make_pool(max_bytes=2 * MiB, pageable_fallback=True)
    held = pool.acquire(2 * MiB)
    with pytest.warns(MemfitWarning, match="pageable"):
        extra = [pool.acquire(MiB) for _ in range(3)]
    assert all(not b.pinned for b in extra)
    s = pool.stats()
    assert s.fallbacks == 3 and s.pinned_bytes_held == 2 * MiB
    for b in [*extra, held]:
        b.release()
    assert pool.stats().pageable_bytes_held == 0


def test_footprint_is_counted():
    """With PyTorch's host allocator a pinned request really costs the next power of two."""
    pool, host = make_pool(footprint=hostmem.torch_pinned_footprint, max_bytes=4 * MiB)
    buf = pool.acquire(MiB + 1)  # class 1.125 MiB, footprint 2 MiB
    assert buf.capacity == size_class(MiB + 1)
    assert pool.stats().pinned_bytes_held == 2 * MiB
    pool.acquire(MiB + 1)
    with pytest.raises(MemfitError, match="max_bytes"):
        pool.acquire(MiB + 1)


# -- host RAM --------------------------------------------------------------------------------------------------------


def test_host_ram_check_refuses_with_a_useful_message():
    host = FakeHost(available=GiB)
    pool, _ = make_pool(host, host_reserve_bytes=256 * MiB)
    pool.acquire(512 * MiB)  # fits: 1 GiB - 256 MiB reserve
    host.available -= 512 * MiB
    with pytest.raises(MemfitError) as e:
        pool.acquire(300 * MiB)
    msg = str(e.value)
    assert (
        "320.00 MiB" in msg and "300.00 MiB" in msg and "512.00 MiB available" in msg and "256.00 MiB" in msg
    )
    for fix in (
        "resolution",
        "gradient_checkpointing_offload_pin_memory_max_buckets=0",
        "max_bytes",
        "pageable_fallback=True",
    ):
        assert fix in msg
    assert host.pinned_calls == 1  # the refused buffer was never pinned


def test_host_ram_check_frees_idle_buffers_before_refusing():
    base = 64 * MiB
    holder: dict[str, PinnedBucketPool] = {}
    host = FakeHost()
    pool = PinnedBucketPool(
        allocate=host.allocate,
        host_reserve_bytes=0,
        available_host_bytes=lambda: base - holder["pool"].stats().pinned_bytes_held,
    )
    holder["pool"] = pool
    _step(pool, [16 * MiB, 16 * MiB, 16 * MiB])  # 48 MiB idle, 16 MiB left
    buf = pool.acquire(40 * MiB)
    assert buf.pinned and host.live_pinned <= base
    assert pool.stats().evictions >= 2


def test_host_ram_short_with_fallback_uses_pageable_but_never_past_available():
    host = FakeHost(available=100 * MiB)
    pool, _ = make_pool(host, host_reserve_bytes=80 * MiB, pageable_fallback=True)
    with pytest.warns(MemfitWarning, match="not enough host RAM"):
        buf = pool.acquire(50 * MiB)  # over the pinning reserve, still fits in RAM
    assert not buf.pinned
    with pytest.raises(MemfitError, match="even for a pageable buffer"):
        pool.acquire(200 * MiB)
    assert host.pinned_calls == 0


def test_hostmem_readers(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24684092 kB\nMemAvailable:   21173684 kB\nHugePages_Total:       0\n")
    assert hostmem._read_meminfo("MemAvailable", str(f)) == 21173684 * 1024
    assert hostmem._read_meminfo("HugePages_Total", str(f)) == 0
    assert hostmem._read_meminfo("Nope", str(f)) is None
    assert hostmem._read_meminfo("MemTotal", str(tmp_path / "missing")) is None
    assert hostmem.available_host_bytes() > 0
    assert hostmem.default_host_reserve(100 * GiB) == 10 * GiB
    assert hostmem.default_host_reserve(8 * GiB) == 2 * GiB
    assert hostmem.default_host_reserve(2 * GiB) == GiB
    assert [hostmem.torch_pinned_footprint(n) for n in (0, 1, 3, 1024, 1025)] == [0, 1, 4, 1024, 2048]


# -- pin failures and fallback ------------------------------------------------------------------------------------


def test_pin_failure_without_fallback_raises_with_cause():
    pool, _ = make_pool(FakeHost(fail_pinned=True))
    with pytest.raises(MemfitError, match="pinning .* failed") as e:
        pool.acquire(MiB)
    assert isinstance(e.value.__cause__, RuntimeError)
    assert pool.stats().buffers_in_use == 0


def test_pageable_fallback_warns_exactly_once():
    pool, host = make_pool(FakeHost(fail_pinned=True), pageable_fallback=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bufs = [pool.acquire(n) for n in (MiB, 2 * MiB, MiB, 5 * MiB)]
        for b in bufs:
            b.release()
        bufs = [pool.acquire(MiB)]
    ours = [w for w in caught if issubclass(w.category, MemfitWarning)]
    assert len(ours) == 1 and "pageable" in str(ours[0].message)
    assert pool.stats().fallbacks == 5 and not bufs[0].pinned


def test_pin_failure_retries_after_freeing_idle_buffers():
    host = FakeHost()
    pool, _ = make_pool(host)
    _step(pool, [MiB, MiB])
    real = host.allocate
    failures = []

    def flaky(n: int, pinned: bool) -> torch.Tensor:
        if pinned and host.live_pinned > 0:
            failures.append(n)
            raise RuntimeError("CUDA error: out of memory")
        return real(n, pinned)

    pool._allocate = flaky
    buf = pool.acquire(4 * MiB)
    assert buf.pinned and failures == [4 * MiB] and host.live_pinned == 4 * MiB


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the default allocator without CUDA")
def test_default_allocator_without_cuda():
    pool = PinnedBucketPool()
    with pytest.raises(MemfitError, match="pinning"):
        pool.acquire(4096)
    pool = PinnedBucketPool(pageable_fallback=True)
    with pytest.warns(MemfitWarning):
        buf = pool.acquire(4096)
    assert not buf.pinned and buf.capacity == 4096


# -- ownership -------------------------------------------------------------------------------------------------------


def test_release_on_error_returns_buffers_of_the_failed_forward():
    pool, host = make_pool()
    earlier = pool.acquire(MiB)  # a graph from before, still waiting for its backward
    with pytest.raises(ZeroDivisionError), pool.release_on_error():
        bufs = [pool.acquire(n) for n in (MiB, 2 * MiB, 3 * MiB)]
        bufs[1].release()
        _ = 1 / 0
    s = pool.stats()
    assert s.buffers_in_use == 1 and earlier.in_use
    assert not any(b.in_use for b in bufs)
    assert s.idle_buffers == 3
    with pool.release_on_error():
        ok = pool.acquire(MiB)
    assert ok.in_use  # no exception: nothing released
    assert pool.release_all() == 2
    s = pool.stats()
    assert s.buffers_in_use == 0 and s.idle_buffers == 4 and s.pinned_bytes_in_use == 0  # `ok` was a hit


def test_double_release_and_foreign_release_raise():
    pool, _ = make_pool()
    other, _ = make_pool()
    buf = pool.acquire(1000)
    pool.release(buf)
    with pytest.raises(MemfitError, match="released twice"):
        pool.release(buf)
    with pytest.raises(MemfitError, match="released"):
        _ = buf.tensor
    again = pool.acquire(1000)
    assert again is buf  # the same buffer handed out again, now valid
    with pytest.raises(MemfitError, match="not handed out by this pool"):
        other.release(again)
    pool.release_all()
    with pytest.raises(MemfitError, match="released twice"):
        again.release()


def test_view_dtype_and_shape():
    pool, _ = make_pool()
    buf = pool.acquire(3 * 4 * 4)
    v = buf.view(torch.float32, (3, 4))
    assert v.dtype == torch.float32 and v.shape == (3, 4) and v.is_contiguous()
    assert v.data_ptr() == buf.tensor.data_ptr()
    src = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    v.copy_(src)
    assert torch.equal(buf.tensor[:48], src.view(torch.uint8).flatten())
    assert torch.equal(buf.view(torch.float32, torch.Size([12])), src.flatten())
    h = buf.view(torch.bfloat16, 24)
    assert h.shape == (24,) and h.dtype == torch.bfloat16
    assert buf.view(torch.bool, (2, 0)).shape == (2, 0)
    assert buf.view(torch.int64, []).shape == ()
    with pytest.raises(MemfitError, match="acquire a buffer of at least"):
        buf.view(torch.float64, (buf.capacity,))


def test_strided_view_keeps_the_layout_it_is_given():
    """Parking copies a tensor into a view with the tensor's own strides (a transposed attention output
    comes back transposed); the view starts at the buffer's first byte and may not run past its end."""
    pool, _ = make_pool()
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).transpose(1, 2)  # dense, not contiguous
    buf = pool.acquire(src.numel() * 4)
    v = buf.strided_view(src.dtype, src.shape, src.stride())
    assert v.stride() == src.stride() and v.data_ptr() == buf.tensor.data_ptr()
    v.copy_(src)
    assert torch.equal(v, src) and torch.equal(buf.view(torch.float32, 24), src.transpose(1, 2).flatten())
    assert buf.strided_view(torch.bfloat16, (), ()).shape == ()
    assert buf.strided_view(torch.float32, (0, 5), (5, 1)).numel() == 0
    with pytest.raises(MemfitError, match=f"acquire a buffer of at least {buf.capacity * 4} bytes"):
        buf.strided_view(torch.float32, (buf.capacity,), (1,))
    odd = pool.acquire(3)  # a capacity that is not a multiple of the item size
    assert odd.strided_view(torch.uint8, (3,), (1,)).shape == (3,)
    if odd.capacity % 8:
        assert odd.strided_view(torch.float64, (odd.capacity // 8,), (1,)).numel() == odd.capacity // 8


def test_a_pooled_buffer_gives_the_same_view_again_and_a_freed_one_lets_its_views_go():
    """Steady state: the same buffer parks the same shapes step after step, so its views are made once."""
    pool, _ = make_pool()
    buf = pool.acquire(1024)
    v = buf.strided_view(torch.float32, torch.Size([4, 8]), (1, 4))
    buf.release()
    again = pool.acquire(1024)
    assert again is buf and again.strided_view(torch.float32, (4, 8), (1, 4)) is v
    assert again.strided_view(torch.float16, (4, 8), (1, 4)) is not v  # another dtype: another view
    for n in range(20):  # shapes that keep changing: a few views are kept, not one per shape ever seen
        again.strided_view(torch.uint8, (n,), (1,))
    assert len(again._views) <= 8
    with pytest.raises(MemfitError, match="released"):
        again.release()
        again.strided_view(torch.float32, (4, 8), (1, 4))  # a released buffer's views are not handed out
    pool.clear()
    assert buf._views == {} and buf._tensor is None


def test_ready_event_delays_reuse():
    class Event:
        def __init__(self, done: bool) -> None:
            self.done, self.synced = done, 0

        def query(self) -> bool:
            return self.done

        def synchronize(self) -> None:
            self.synced += 1
            self.done = True

    pool, _ = make_pool()
    a, b = pool.acquire(MiB), pool.acquire(MiB)
    busy, done = Event(False), Event(True)
    pool.release(a, ready=done)
    pool.release(b, ready=busy)
    assert pool.acquire(MiB) is a  # the finished one first, though b was released last
    assert busy.synced == 0
    assert pool.acquire(MiB) is b and busy.synced == 1
    assert pool.stats().waits == 1
    c = pool.acquire(MiB)
    late = Event(False)
    pool.release(c, ready=late)
    pool.clear()  # never frees memory a copy still uses
    assert late.synced == 1 and pool.stats().waits == 2  # a host wait too
    pool.clear()  # finished copies: no wait counted
    d = pool.acquire(MiB)
    pool.release(d, ready=Event(True))
    pool.clear()
    assert pool.stats().waits == 2


def test_bad_arguments():
    with pytest.raises(ConfigError, match="gradient_checkpointing_offload_pin_memory_max_buckets"):
        PinnedBucketPool(max_buckets=-1)
    with pytest.raises(ConfigError, match="max_bytes"):
        PinnedBucketPool(max_bytes=-5)
    with pytest.raises(ConfigError, match="classes_per_doubling"):
        PinnedBucketPool(classes_per_doubling=3)
    pool, _ = make_pool()
    with pytest.raises(ValueError):
        pool.acquire(-1)
    bad = PinnedBucketPool(
        allocate=lambda n, p: torch.empty(n, dtype=torch.float32),
        host_reserve_bytes=0,
        available_host_bytes=lambda: 1 << 40,
    )
    with pytest.raises(MemfitError, match="uint8"):
        bad.acquire(100)


def test_from_config():
    from memfit.config import MemfitConfig

    pool = PinnedBucketPool.from_config(MemfitConfig(offload_pin_memory_max_buckets=0), host_reserve_bytes=0)
    assert pool.max_buckets == 0
    assert PinnedBucketPool.from_config(MemfitConfig(), host_reserve_bytes=0).max_buckets == 12


# -- threads -------------------------------------------------------------------------------------------------------


def test_concurrent_acquire_release():
    KiB = 1024
    pool, host = make_pool(max_buckets=4, max_bytes=64 * KiB, pageable_fallback=True)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                bufs = [
                    pool.acquire(rng.choice((KiB, 2 * KiB, 3 * KiB, 5 * KiB, 7 * KiB, 30 * KiB)))
                    for _ in range(3)
                ]
                for b in bufs:
                    b.view(torch.int32, (b.nbytes // 4,)).fill_(seed)
                for b in bufs:
                    assert int(b.view(torch.int32, (1,))[0]) == seed  # nobody else wrote into it
                    b.release()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    s = pool.stats()
    assert s.buffers_in_use == 0 and s.pageable_bytes_held == 0
    assert s.buckets <= 4 and s.pinned_bytes_held == host.live_pinned <= 64 * KiB


# -- property ------------------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    max_buckets=st.integers(min_value=1, max_value=6),
    cap_kib=st.one_of(st.none(), st.integers(min_value=1, max_value=256)),
    ops=st.lists(
        st.one_of(st.integers(min_value=0, max_value=96 * 1024), st.just(-1)), min_size=1, max_size=60
    ),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_random_workload_respects_limits(max_buckets, cap_kib, ops, seed):
    """Random acquire sizes / releases never exceed max_buckets or the cap, and every buffer is big enough."""
    max_bytes = None if cap_kib is None else cap_kib * 1024
    pool, host = make_pool(max_buckets=max_buckets, max_bytes=max_bytes, pageable_fallback=True)
    rng = random.Random(seed)
    live: list[HostBuffer] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MemfitWarning)
        for op in ops:
            if op < 0:
                if live:
                    live.pop(rng.randrange(len(live))).release()
            else:
                buf = pool.acquire(op)
                assert buf.in_use and buf.capacity >= op and buf.tensor.numel() >= op
                live.append(buf)
            s = pool.stats()
            assert s.buckets <= max_buckets
            if max_bytes is not None:
                assert s.pinned_bytes_held <= max_bytes
            assert s.pinned_bytes_held == host.live_pinned  # evicted buffers really are freed
            assert s.buffers_in_use == len(live)
            assert s.pageable_bytes_held == sum(b.capacity for b in live if not b.pinned)
            assert len({b.tensor.data_ptr() for b in live if b.capacity}) == sum(
                1 for b in live if b.capacity
            )
    pool.release_all()
    assert pool.stats().buffers_in_use == 0
