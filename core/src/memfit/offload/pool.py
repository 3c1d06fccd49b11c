"""The pinned host-buffer pool: CPU staging memory for offloaded activations, reused across steps.

Design notes
------------
Why a pool.  A device→host copy into pinned memory runs at PCIe speed (≈55 GB/s on
an H200) and can overlap compute; pinning *new* memory runs at ≈2 GB/s and blocks.
So buffers are pinned once, handed back to the pool when backward has reloaded
them, and handed out again next step: in the steady state no pinned memory is
allocated (``stats().pinned_allocations`` stops growing).

Size classes.  A request is rounded up to a class: 8 classes per power of two
(``classes_per_doubling``), so a buffer wastes at most 12.5% and the shapes of a
changing workload (aspect-ratio buckets, variable text length) fall into a few
classes. Classes are multiples of 64 bytes from 512 bytes up. A class is *held*
while it has a buffer, idle or in use; at most ``max_buckets`` classes are held
(SPEC §1 ``gradient_checkpointing_offload_pin_memory_max_buckets``). A request for
a new class beyond that evicts the least-recently-used class that is entirely idle
(all its buffers are freed). If every held class still has buffers in use, the
request is served with a pageable buffer that is not kept (one warning: raise
``max_buckets``); pinning it for one step would cost more than the slower copy.

Limits, checked before anything new is pinned, in this order:

1. the byte cap ``max_bytes`` on pinned bytes held (idle + in use);
2. the host: ``available_host_bytes() - host_reserve_bytes`` must cover the new
   buffer, so a long run never gets the host OOM-killed;
3. the pin itself may fail (no CUDA, ``cudaHostAlloc`` out of memory).

Whenever a limit is hit, idle buffers of *other* classes are freed first, least
recently used first. Then, with ``pageable_fallback=True``, the request gets a
pageable buffer (not kept; one :class:`~memfit.errors.MemfitWarning` per pool);
with ``pageable_fallback=False`` it raises :class:`~memfit.errors.MemfitError`
that says what was needed, what was available and the fixes. Pageable memory is
not page-locked (the kernel can reclaim or swap it), so it need not leave the
reserve free; it must still fit in what is available at all.

Footprint.  The default allocator pins exactly what it is asked for
(:func:`memfit.offload.hostmem.allocate_host`); an injected allocator can say what it
really pins (``footprint=``, e.g. :func:`~memfit.offload.hostmem.torch_pinned_footprint`
for ``pin_memory=True``), and that is what counts against the cap and the host check.

Ownership.  Every buffer handed out is tracked until released; releasing one
twice, or one from another pool, raises. :meth:`PinnedBucketPool.release_all` and
the :meth:`PinnedBucketPool.release_on_error` context manager return buffers whose
owner died mid-forward. ``release(buf, ready=event)`` accepts the CUDA event of the
copy that still reads or writes the buffer: the buffer is not handed out again (nor
freed) before the event has completed, so the copy engine may release as soon as it
has *issued* a reload.

Threads.  Acquire and release may come from autograd's backward thread; one
re-entrant lock guards all state. A new pin happens under the lock (it is rare
by design, and the forward does not run concurrently with the backward).
"""

from __future__ import annotations

import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

import memfit.offload.hostmem as hostmem
from memfit.errors import ConfigError, HostMemoryError, MemfitError, MemfitWarning

CLASSES_PER_DOUBLING = 8
MIN_CLASS_BYTES = 512
MAX_BUCKETS_KEY = "gradient_checkpointing_offload_pin_memory_max_buckets"

_IN_USE, _IDLE, _FREED = "in use", "idle", "freed"


class ReadyEvent(Protocol):
    """What ``release(..., ready=)`` accepts: ``torch.cuda.Event`` (or anything alike)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def size_class(nbytes: int, classes_per_doubling: int = CLASSES_PER_DOUBLING) -> int:
    """The bucket size for a request of ``nbytes``: at least ``nbytes``, at most 1/k larger.

    Between two consecutive powers of two there are ``classes_per_doubling`` (k)
    evenly spaced classes; everything up to :data:`MIN_CLASS_BYTES` is one class.
    """
    if nbytes <= MIN_CLASS_BYTES:
        return MIN_CLASS_BYTES
    half = 1 << ((nbytes - 1).bit_length() - 1)  # largest power of two below nbytes
    step = max(1, half // classes_per_doubling)
    return -(-nbytes // step) * step


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape`` (in elements)."""
    stride, step = [], 1
    for d in reversed(shape):
        stride.append(step)
        step *= max(d, 1)
    return tuple(reversed(stride))


def _fmt(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_FIXES = (
    "Fixes: lower the resolution or the batch size (smaller activations); set "
    f"{MAX_BUCKETS_KEY}=0 to offload into ordinary pageable memory (slower copies, no pinning); "
    "cap the pinned memory with PinnedBucketPool(max_bytes=...); or pass "
    "PinnedBucketPool(pageable_fallback=True) to use pageable buffers where pinning is not possible."
)

_PIN_FIXES = (
    "Pinning needs a working CUDA driver (torch.cuda.is_available()) and enough lockable memory "
    "(`ulimit -l`, container memlock limits). Fixes: set "
    f"{MAX_BUCKETS_KEY}=0 to offload into ordinary pageable memory (slower copies, no pinning); "
    "or pass PinnedBucketPool(pageable_fallback=True) to use pageable buffers where pinning fails."
)


_VIEWS_KEPT = 8  # views a host buffer keeps for reuse


class HostBuffer:
    """One host staging buffer handed out by :meth:`PinnedBucketPool.acquire`.

    Attributes:
        nbytes: the size requested.
        size_class: the bucket it belongs to (its capacity, for pooled buffers).
        pinned: page-locked memory (async copies); False for pageable buffers.
        pooled: returns to its bucket on release (pinned buffers); pageable buffers are freed.
    """

    __slots__ = (
        "_pool",
        "_tensor",
        "_serial",
        "_state",
        "_ready",
        "nbytes",
        "size_class",
        "pinned",
        "pooled",
        "footprint",
        "_views",
    )

    def __init__(
        self,
        pool: PinnedBucketPool,
        tensor: torch.Tensor,
        nbytes: int,
        size_class: int,
        pinned: bool,
        pooled: bool,
        footprint: int,
    ) -> None:
        self._pool = pool
        self._tensor: torch.Tensor | None = tensor
        self._serial = -1
        self._state = _IN_USE
        self._ready: ReadyEvent | None = None
        # (dtype, shape, stride) -> a view made earlier: a pooled buffer parks the same shapes step after step
        self._views: dict[tuple, torch.Tensor] = {}
        self.nbytes = nbytes
        self.size_class = size_class
        self.pinned = pinned
        self.pooled = pooled
        self.footprint = footprint

    @property
    def tensor(self) -> torch.Tensor:
        """The 1-D ``uint8`` storage (at least :attr:`nbytes` long). Only valid while in use."""
        if self._state != _IN_USE or self._tensor is None:
            raise MemfitError(
                f"this host buffer was released ({self._state}); a released buffer belongs to the pool "
                f"and may already hold another tensor. Keep the buffer until you are done with it, "
                f"then release it once."
            )
        return self._tensor

    @property
    def capacity(self) -> int:
        """Bytes of storage (``>= nbytes``)."""
        return 0 if self._tensor is None else self._tensor.numel()

    @property
    def in_use(self) -> bool:
        return self._state == _IN_USE

    def view(self, dtype: torch.dtype, shape: int | Sequence[int] | torch.Size) -> torch.Tensor:
        """A contiguous ``dtype`` tensor of ``shape`` over the first bytes of the buffer (no copy)."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        return self.strided_view(dtype, shape, contiguous_stride(shape))

    def strided_view(self, dtype: torch.dtype, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
        """A ``dtype`` tensor of ``shape`` and ``stride`` from the buffer's first byte (no copy).

        The hot path of parking (one per parked tensor): two tensor ops, however the tensor is laid out, and
        none when this buffer gave out the same view before (a few views are kept, and a later holder of the
        buffer asking for the same view gets the same tensor: use it for copies, do not resize or restride it)."""
        storage = self.tensor  # raises once released
        key = (dtype, tuple(shape), tuple(stride))
        view = self._views.get(key)
        if view is not None:
            return view
        extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True)) if all(shape) else 0
        needed = extent * dtype.itemsize
        capacity = storage.numel()
        if needed > capacity:
            raise MemfitError(
                f"a {dtype} view of shape {tuple(shape)} and strides {tuple(stride)} needs {_fmt(needed)} but this "
                f"buffer holds {_fmt(capacity)}; acquire a buffer of at least {needed} bytes."
            )
        if capacity % dtype.itemsize:
            storage = storage[: capacity - capacity % dtype.itemsize]
        view = storage.view(dtype).as_strided(shape, stride)
        if (
            len(self._views) >= _VIEWS_KEPT
        ):  # shapes that change every step (aspect-ratio buckets): start afresh
            self._views.clear()
        self._views[key] = view
        return view

    def release(self, *, ready: ReadyEvent | None = None) -> None:
        """Same as ``pool.release(self, ready=ready)``."""
        self._pool.release(self, ready=ready)

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return f"HostBuffer({kind}, nbytes={self.nbytes}, class={self.size_class}, {self._state})"


@dataclass
class _Bucket:
    size: int
    footprint: int
    idle: list[HostBuffer] = field(default_factory=list)
    in_use: int = 0

    @property
    def buffers(self) -> int:
        return len(self.idle) + self.in_use


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of a pool's holdings and counters (counters since the last reset)."""

    pinned_bytes_held: int
    pinned_bytes_in_use: int
    pageable_bytes_held: int
    buffers_in_use: int
    idle_buffers: int
    buckets: int
    hits: int
    misses: int
    pinned_allocations: int
    pinned_bytes_allocated: int
    evictions: int
    fallbacks: int
    overflows: int  # requests past max_buckets with nothing idle to evict: served pageable
    waits: int  # times the host blocked until a copy still using a buffer finished (reuse, eviction, free)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


_COUNTERS = (
    "hits",
    "misses",
    "pinned_allocations",
    "pinned_bytes_allocated",
    "evictions",
    "fallbacks",
    "overflows",
    "waits",
)


def _identity(n: int) -> int:
    return n


class _ReleaseOnError:
    """:meth:`PinnedBucketPool.release_on_error` (a class: it wraps every batch of copies, and a generator-based
    context manager costs several Python calls more per use)."""

    __slots__ = ("pool", "start")

    def __init__(self, pool: PinnedBucketPool) -> None:
        self.pool = pool
        self.start = 0

    def __enter__(self) -> PinnedBucketPool:
        with self.pool._lock:
            self.start = self.pool._next_serial
        return self.pool

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: Any) -> bool:
        if kind is not None:
            pool = self.pool
            with pool._lock:
                for serial, buf in list(pool._in_use.items()):
                    if serial >= self.start:
                        pool._release(buf, None)
        return False  # the exception goes on


class PinnedBucketPool:
    """Pinned host buffers in size classes, reused across training steps.

    Args:
        max_buckets: most size classes held at once; ``0`` = never pin, hand out plain
            pageable buffers and keep nothing.
        max_bytes: cap on pinned bytes held (idle + in use); None = no cap.
        pageable_fallback: when pinning is impossible, over the cap or over the host's
            RAM: True = warn once and hand out pageable buffers; False = raise.
        host_reserve_bytes: RAM left free for the rest of the process when pinning;
            default :func:`~memfit.offload.hostmem.default_host_reserve` (10% of the
            host, at least 2 GiB).
        allocate: ``(nbytes, pinned) -> 1-D uint8 CPU tensor``; default
            :func:`~memfit.offload.hostmem.allocate_host` (``cudaHostRegister``, exact size).
        available_host_bytes: ``() -> bytes of RAM available``; default reads
            ``MemAvailable`` (:func:`~memfit.offload.hostmem.available_host_bytes`).
        footprint: ``nbytes -> bytes really pinned``; default: the request itself.
        classes_per_doubling: size classes per power of two (waste ≤ 1/this).
    """

    def __init__(
        self,
        *,
        max_buckets: int = 12,
        max_bytes: int | None = None,
        pageable_fallback: bool = False,
        host_reserve_bytes: int | None = None,
        allocate: Callable[[int, bool], torch.Tensor] | None = None,
        available_host_bytes: Callable[[], int] | None = None,
        footprint: Callable[[int], int] | None = None,
        classes_per_doubling: int = CLASSES_PER_DOUBLING,
    ) -> None:
        if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 0:
            raise ConfigError(
                f"{MAX_BUCKETS_KEY} must be an integer >= 0 (0 = pageable memory only), got {max_buckets!r}"
            )
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0
        ):
            raise ConfigError(f"max_bytes must be None (no cap) or an integer >= 0, got {max_bytes!r}")
        if host_reserve_bytes is not None and (
            not isinstance(host_reserve_bytes, int) or host_reserve_bytes < 0
        ):
            raise ConfigError(f"host_reserve_bytes must be an integer >= 0, got {host_reserve_bytes!r}")
        k = classes_per_doubling
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or k > 64 or k & (k - 1):
            raise ConfigError(f"classes_per_doubling must be a power of two in [1, 64], got {k!r}")

        default_alloc = allocate is None
        self.max_buckets = max_buckets
        self.max_bytes = max_bytes
        self.pageable_fallback = bool(pageable_fallback)
        self.host_reserve_bytes = (
            hostmem.default_host_reserve() if host_reserve_bytes is None else host_reserve_bytes
        )
        self.classes_per_doubling = k
        self._allocate = hostmem.allocate_host if default_alloc else allocate
        self._available = (
            hostmem.available_host_bytes if available_host_bytes is None else available_host_bytes
        )
        self._footprint = _identity if footprint is None else footprint

        self._lock = threading.RLock()
        self._buckets: OrderedDict[int, _Bucket] = OrderedDict()  # least recently used first
        self._in_use: dict[int, HostBuffer] = {}  # serial -> buffer, in acquisition order
        self._next_serial = 0  # serial of the next buffer handed out
        self._pinned_held = 0
        self._pinned_in_use = 0
        self._pageable_held = 0
        self._warned_fallback = False
        self._warned_overflow = False
        self.reset_counters()

    @classmethod
    def from_config(cls, config: Any, **kwargs: Any) -> PinnedBucketPool:
        """A pool for a :class:`~memfit.config.MemfitConfig` (its ``offload_pin_memory_max_buckets``)."""
        kwargs.setdefault("max_buckets", config.offload_pin_memory_max_buckets)
        return cls(**kwargs)

    # -- handing out ---------------------------------------------------------------------------------------------

    def size_class(self, nbytes: int) -> int:
        """The class a request of ``nbytes`` falls into."""
        return size_class(nbytes, self.classes_per_doubling)

    def acquire(self, nbytes: int) -> HostBuffer:
        """A buffer of at least ``nbytes`` bytes, pinned unless the pool is pageable-only or falls back."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an integer >= 0, got {nbytes!r}")
        with self._lock:
            if self.max_buckets == 0:
                self.misses += 1
                return self._pageable(nbytes, problem=None)
            c = self.size_class(nbytes)
            bucket = self._buckets.get(c)
            if bucket is not None:
                self._buckets.move_to_end(c)
                if bucket.idle:
                    self.hits += 1
                    buf = self._take_idle(bucket)
                    buf.nbytes = nbytes
                    return self._hand_out(buf)
            self.misses += 1
            if bucket is None and len(self._buckets) >= self.max_buckets and not self._evict_lru_class():
                return self._overflow(nbytes)
            return self._pin(c, nbytes)

    def release(self, buf: HostBuffer, *, ready: ReadyEvent | None = None) -> None:
        """Give ``buf`` back. ``ready``: the event of a copy still using it (reuse waits for it)."""
        with self._lock:
            self._release(buf, ready)

    def release_all(self) -> int:
        """Release every buffer still in use (after a failed forward); returns how many."""
        with self._lock:
            bufs = list(self._in_use.values())
            for buf in bufs:
                self._release(buf, None)
            return len(bufs)

    def release_on_error(self) -> _ReleaseOnError:
        """Context manager: on an exception inside the block, release every buffer acquired inside it that is still
        in use.

        Buffers acquired before the block (a graph kept from an earlier step) are left
        alone; on normal exit nothing is released (backward still needs the buffers).
        """
        return _ReleaseOnError(self)

    # -- housekeeping --------------------------------------------------------------------------------------------

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                pinned_bytes_held=self._pinned_held,
                pinned_bytes_in_use=self._pinned_in_use,
                pageable_bytes_held=self._pageable_held,
                buffers_in_use=len(self._in_use),
                idle_buffers=sum(len(b.idle) for b in self._buckets.values()),
                buckets=len(self._buckets),
                **{name: getattr(self, name) for name in _COUNTERS},
            )

    def reset_counters(self) -> None:
        """Zero the counters (hits, misses, allocations, …); holdings are unchanged."""
        with self._lock:
            for name in _COUNTERS:
                setattr(self, name, 0)

    def clear(self) -> int:
        """Free every idle buffer (buffers in use stay valid); returns the pinned bytes freed."""
        with self._lock:
            freed = 0
            for c in list(self._buckets):
                freed += self._free_idle_of(c, None, evicted=False)
            return freed

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"PinnedBucketPool(max_buckets={self.max_buckets}, max_bytes={self.max_bytes}, "
            f"buckets={s.buckets}, pinned={_fmt(s.pinned_bytes_held)}, in_use={s.buffers_in_use})"
        )

    # -- internals (lock held) ---------------------------------------------------------------------------------

    def _hand_out(self, buf: HostBuffer) -> HostBuffer:
        buf._serial = self._next_serial
        self._next_serial += 1
        buf._state = _IN_USE
        self._in_use[buf._serial] = buf
        if buf.pooled:
            self._buckets[buf.size_class].in_use += 1
            self._pinned_in_use += buf.footprint
        else:
            self._pageable_held += buf.capacity
        return buf

    def _release(self, buf: HostBuffer, ready: ReadyEvent | None) -> None:
        if not isinstance(buf, HostBuffer) or buf._pool is not self:
            raise MemfitError(
                f"{buf!r} was not handed out by this pool; release it to the pool it came from."
            )
        if buf._state != _IN_USE or self._in_use.pop(buf._serial, None) is not buf:
            raise MemfitError(
                f"{buf!r} was released twice. Each acquire() must be matched by exactly one release(); "
                f"after release_all() or release_on_error() the pool already has it back (check buf.in_use)."
            )
        if buf.pooled:
            bucket = self._buckets[buf.size_class]
            bucket.in_use -= 1
            self._pinned_in_use -= buf.footprint
            buf._state = _IDLE
            buf._ready = ready
            bucket.idle.append(buf)
        else:
            self._pageable_held -= buf.capacity
            if ready is not None:
                self._wait_for(ready)
            buf._state = _FREED
            buf._tensor = None
            buf._views.clear()

    def _take_idle(self, bucket: _Bucket) -> HostBuffer:
        """The most recently released idle buffer whose copy has finished; else wait for the oldest."""
        for i in range(len(bucket.idle) - 1, -1, -1):
            ready = bucket.idle[i]._ready
            if ready is None or ready.query():
                buf = bucket.idle.pop(i)
                buf._ready = None
                return buf
        buf = bucket.idle.pop(0)
        assert buf._ready is not None
        self._wait_for(buf._ready)
        buf._ready = None
        return buf

    def _wait_for(self, ready: ReadyEvent) -> None:
        """Block the host until a copy using a buffer has finished; counted in ``waits`` when it had not."""
        if not ready.query():
            self.waits += 1
            ready.synchronize()

    def _free(self, buf: HostBuffer, evicted: bool = True) -> None:
        if buf._ready is not None:
            self._wait_for(buf._ready)
            buf._ready = None
        buf._state = _FREED
        buf._tensor = None
        buf._views.clear()  # they hold the memory too
        self._pinned_held -= buf.footprint
        if evicted:
            self.evictions += 1

    def _free_idle_of(self, c: int, limit: int | None, evicted: bool = True) -> int:
        """Free idle buffers of class ``c`` (LRU-oldest first) until ``limit`` bytes are freed; drop it if empty."""
        bucket = self._buckets[c]
        freed = 0
        while bucket.idle and (limit is None or freed < limit):
            buf = bucket.idle.pop(0)
            freed += buf.footprint
            self._free(buf, evicted)
        if bucket.buffers == 0:
            del self._buckets[c]
        return freed

    def _free_idle_others(self, target: int, exclude: int) -> int:
        """Free idle buffers of classes other than ``exclude``, least recently used first."""
        freed = 0
        for c in list(self._buckets):
            if freed >= target:
                break
            if c != exclude:
                freed += self._free_idle_of(c, target - freed)
        return freed

    def _evict_lru_class(self) -> bool:
        """Free the least recently used class that has no buffer in use; False if there is none."""
        victim = next((c for c, bucket in self._buckets.items() if bucket.in_use == 0), None)
        if victim is None:
            return False
        self._free_idle_of(victim, None)
        return True

    def _headroom(self) -> int:
        return int(self._available()) - self.host_reserve_bytes

    def _pin(self, c: int, nbytes: int) -> HostBuffer:
        need = int(self._footprint(c))
        if self.max_bytes is not None:
            if need > self.max_bytes:
                return self._fall_back(
                    nbytes,
                    (
                        f"one host buffer of {_fmt(need)} (for a {_fmt(nbytes)} tensor) is larger than the "
                        f"pinned byte cap max_bytes={_fmt(self.max_bytes)}"
                    ),
                    cause=None,
                )
            over = self._pinned_held + need - self.max_bytes
            if over > 0 and self._free_idle_others(over, c) < over:
                return self._fall_back(
                    nbytes,
                    (
                        f"pinning {_fmt(need)} more would exceed the pinned byte cap max_bytes="
                        f"{_fmt(self.max_bytes)}: {_fmt(self._pinned_held)} pinned, {_fmt(self._pinned_in_use)} "
                        f"of it in use by tensors still waiting for backward"
                    ),
                    cause=None,
                )
        headroom = self._headroom()
        if need > headroom:
            self._free_idle_others(need - headroom, c)
            headroom = self._headroom()
            if need > headroom:
                return self._fall_back(
                    nbytes,
                    (
                        f"not enough host RAM to pin {_fmt(need)} for an offloaded tensor of {_fmt(nbytes)}: "
                        f"{_fmt(max(0, headroom + self.host_reserve_bytes))} available, "
                        f"{_fmt(self.host_reserve_bytes)} of it kept in reserve for the rest of the process "
                        f"(host_reserve_bytes), {_fmt(self._pinned_held)} already pinned by this pool"
                    ),
                    cause=None,
                )
        try:
            tensor = self._allocate(c, True)
        except (RuntimeError, MemoryError) as first:
            if not self._free_idle_others(self._pinned_held, c):
                return self._fall_back(
                    nbytes, f"pinning {_fmt(need)} of host memory failed ({first})", cause=first
                )
            try:
                tensor = self._allocate(c, True)
            except (RuntimeError, MemoryError) as second:
                return self._fall_back(
                    nbytes, f"pinning {_fmt(need)} of host memory failed ({second})", cause=second
                )
        self._check_tensor(tensor, c)
        self.pinned_allocations += 1
        self.pinned_bytes_allocated += need
        self._pinned_held += need
        if c not in self._buckets:
            self._buckets[c] = _Bucket(c, need)
        self._buckets.move_to_end(c)
        return self._hand_out(HostBuffer(self, tensor, nbytes, c, pinned=True, pooled=True, footprint=need))

    def _fall_back(self, nbytes: int, problem: str, cause: BaseException | None) -> HostBuffer:
        if not self.pageable_fallback:
            raise HostMemoryError(f"{problem}. {_PIN_FIXES if cause is not None else _FIXES}") from cause
        buf = self._pageable(nbytes, problem)
        self.fallbacks += 1
        if not self._warned_fallback:
            self._warned_fallback = True
            warnings.warn(
                f"memfit offload: {problem}; using pageable host memory for this and later such tensors "
                f"(slower copies that do not overlap compute). This warning is shown once.",
                MemfitWarning,
                stacklevel=4,
            )
        return buf

    def _overflow(self, nbytes: int) -> HostBuffer:
        buf = self._pageable(nbytes, None)
        self.overflows += 1
        if not self._warned_overflow:
            self._warned_overflow = True
            warnings.warn(
                f"memfit offload: tensors of more than {self.max_buckets} size classes are in flight at once, "
                f"so some use pageable host memory (slower copies). Raise {MAX_BUCKETS_KEY} "
                f"(currently {self.max_buckets}) to pool them all. This warning is shown once.",
                MemfitWarning,
                stacklevel=3,
            )
        return buf

    def _pageable(self, nbytes: int, problem: str | None) -> HostBuffer:
        available = int(self._available())
        if nbytes > available:
            why = f"{problem}; " if problem else ""
            raise HostMemoryError(
                f"{why}not enough host RAM even for a pageable buffer: an offloaded tensor needs "
                f"{_fmt(nbytes)}, {_fmt(max(0, available))} is available. Lower the resolution or the batch "
                f"size, offload less (a torch / torch-ffn backend keeps activations on the GPU), or free "
                f"host memory (fewer dataloader workers, smaller caches)."
            )
        tensor = self._allocate(nbytes, False)
        self._check_tensor(tensor, nbytes)
        return self._hand_out(
            HostBuffer(self, tensor, nbytes, nbytes, pinned=False, pooled=False, footprint=0)
        )

    @staticmethod
    def _check_tensor(tensor: Any, nbytes: int) -> None:
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.dtype != torch.uint8
            or tensor.dim() != 1
            or tensor.device.type != "cpu"
            or tensor.numel() < nbytes
        ):
            desc = (
                f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}"
                if isinstance(tensor, torch.Tensor)
                else type(tensor).__name__
            )
            raise MemfitError(
                f"the pool's allocate({nbytes}, ...) returned {desc}; it must return a 1-D torch.uint8 CPU "
                f"tensor of at least {nbytes} elements."
            )
