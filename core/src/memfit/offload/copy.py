"""The copy engine: device→host parking and host→device reloads, hidden behind compute.

Design notes
------------
Streams.  Device→host copies run on one side stream, host→device reloads on another,
so both PCIe directions work at once (≈55 GB/s each way on an H200, ≈101 GB/s both).
Ordering is by CUDA events only: the side stream waits for an event recorded on the
compute stream where the tensor was produced; the compute stream waits for the event
recorded after a reload before it uses the tensor. Nothing calls
``torch.cuda.synchronize()``.

GPU memory reuse.  After issuing a device→host copy the source is marked with
``record_stream(d2h_stream)``: the caching allocator then does not hand its memory to
anybody else before the copy has finished, yet the caller may drop its reference at
once (that is where the saving comes from).

Bounded in-flight copies.  If the bytes of issued-but-unfinished device→host copies
exceed ``max_inflight_bytes``, the compute stream is made to wait for the oldest copy
(a GPU-side wait, still no host sync). Without that bound a copy queue that falls
behind compute would keep every source alive and the saving would vanish.

Reloads' memory.  A reload's device tensor is allocated on compute and written by the host-to-device stream.
By default it is tied to that stream with ``record_stream`` (``ReloadRelease.RECORD_STREAM``): once freed, the
caching allocator keeps its block until the copy stream's work queued by then has finished, and until then asks
that event at every allocation, which every op of a host-bound step pays while reloads are queued ahead.
``ReloadRelease.AFTER_COMPUTE_WAITS`` ties nothing: compute waits for a reload before using it (:meth:`fetch`, or
the copy was seen landed), so its memory, freed on compute afterwards, is reused after the write; a reload dropped
without a fetch makes its allocation stream wait for it as it is released (:meth:`release`). On an H100 it bought
nothing measurable: at 1024 tokens, stepped in turn against the default, `unsloth-ffn` 1.003x and
`offload_attention` 0.989x (interquartile ranges over 1); at 16384 tokens the same allocator reserve (within
0.3 GiB). So the default stays.

Reload ahead.  :meth:`CopyEngine.reload` only *issues* a reload; :meth:`fetch` makes the
compute stream wait for it. The session reloads the next regions in backward order while
the current one recomputes (``OffloadSession.needed``).

Coalescing.  A step of a small model is bound by host time: every tensor parked costs a pool lookup, a
host view, a copy launch and stream bookkeeping (~0.1 ms of Python each on the H200's host), which a
1024-token step cannot hide. So a batch of several tensors totalling at most ``coalesce_max_bytes``
(a region's attention activations, 36 MiB at 1024 tokens) is packed on the compute stream into one
device buffer (one ``torch.cat``, stream-ordered: its sources need no ``record_stream``), copied to one
host buffer and back in one copy each way; the reloaded tensors are views of one device buffer, freed
when the last of them is. The price: the packed buffer exists next to its sources until they are dropped
(at most ``coalesce_max_bytes`` more for an instant), and a region's reloaded tensors are freed together.
Larger batches copy tensor by tensor, so a big region never needs that extra memory.

Shared storages.  Attention saves views of one storage: q, k and v of a fused projection (each strided,
none dense on its own), the output and the output reshaped for the projection after it. Copied one by one,
each non-dense view first needs a ``.contiguous()`` copy and every view of the same bytes is copied again. In a
batch, views that together cover their storage (their distinct extents add up to it: :func:`covers_storage`) go in
as the storage's bytes, once; each comes back as a view of those bytes with its own offset and strides. The
planner's profile prices a copy by the same rule (:attr:`CopyEngine.parks_storages_once`).

Stream switches.  ``torch.cuda.stream()`` looks up the device and the current stream again; the
engine already holds the stream to go back to, so it sets streams directly (:meth:`StreamApi.use`).

Generic streams and events.  The engine's streams and events are ``torch.Stream`` and ``torch.Event``,
whose ``record``, ``wait_event`` and ``query`` are C calls; ``torch.cuda.Stream``/``Event`` put two or three
Python frames in front of each (``torch.cuda.current_stream`` five, with a lazy-init check), and a step bound
by host time pays every frame: a region parks and reloads with about twenty such calls.

Fewer event calls.  Each CUDA event call costs host time (~5 us), and a region's tensors would otherwise
ask the same events one by one. A copy's completion event is wrapped in a :class:`CopyDone` that remembers it
has completed once a query said so: a region's fetches, the bound on copies in flight and the pool's reuse
ask the event itself until then, and the wrapper after. It also remembers the stream made to wait for it: the
other tensors of a reload still in flight are fetched without another query, wait and pair of timing events
(a stream's later work waits for what it waited for): an attention call's group of 6-9 tensors paid them per
tensor. A reload whose parking copy is known complete does not
wait for it. The events that only order a side stream after compute (recorded, waited for at once, never
queried) are one per device, recorded again each time: a stream's wait is for the event's latest record
before the wait was issued, so a later record does not affect it, and no event is created per batch.

Telemetry.  Waits of the compute stream on copy events are bracketed by timing events;
their durations (stall = copy time not hidden behind compute) are read lazily in
:meth:`stats`, when the events have long completed, or once ``STALL_PAIRS_HELD`` pairs are waiting to be
read: then the completed ones are summed and their events recorded again for later stalls, so a run that never
reads its stats holds a bounded number of events and stops creating new ones.

Streams and events come from a :class:`StreamApi` (``torch.cuda`` by default). Tests pass a
recording fake instead and run the engine on CPU tensors: its ordering (who waits on which event,
which memory is tied to which stream) is then checked without a GPU.

``SyncCopyEngine`` does the same bookkeeping with plain synchronous copies: it runs on
CPU tensors, so the parking, dedup and pool logic is testable without a GPU.

Copies outside autograd.  A parked tensor is usually part of the graph (a block's input requires grad), and
``host_view.copy_(tensor)`` or ``torch.cat`` of such tensors would record graph nodes; into a pooled host
buffer, whose view objects are kept and reused, each step's graph would chain onto the last one's and never be
freed (every step's block inputs and the step's leaf inputs leaked). Parking runs under ``torch.no_grad()``.
"""

from __future__ import annotations

import enum
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.engine.stash import without_history
from memfit.offload.pool import HostBuffer, PinnedBucketPool, contiguous_stride


def dense_layout(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` covers its ``numel`` elements without gaps or overlap, in any dimension order
    (contiguous, or a permutation such as a transposed attention layout): then it is parked with its
    strides, and comes back with exactly the layout autograd saved (some attention backward kernels
    expect ``out`` and ``grad_out`` to share a layout)."""
    return tensor.is_contiguous() or _in_memory_order(tensor).is_contiguous()


def _in_memory_order(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` with its dimensions permuted from the largest stride to the smallest (a view)."""
    stride, shape = tensor.stride(), tensor.shape
    return tensor.permute(sorted(range(len(stride)), key=lambda d: (-stride[d], -shape[d])))


def _flat_in_memory_order(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``tensor``'s elements as a 1-D contiguous tensor in memory order, and the strides to view them as
    ``tensor`` again: a view of a dense tensor (any dimension order), a contiguous copy of any other."""
    if tensor.is_contiguous():
        return tensor.reshape(-1), tensor.stride()
    permuted = _in_memory_order(tensor)
    if permuted.is_contiguous():
        return permuted.reshape(-1), tensor.stride()
    dense = tensor.contiguous()
    return dense.view(-1), dense.stride()


class ReloadRelease(enum.Enum):
    """When a reloaded tensor's device memory may be reused (see "Reloads' memory")."""

    RECORD_STREAM = "record_stream"  # tied to the copy stream: the allocator waits for its event
    AFTER_COMPUTE_WAITS = "after_compute_waits"  # compute waits for the reload before the memory goes back


class CopyDone:
    """A copy's completion event that remembers once it has been seen complete (see "Fewer event calls").

    Passes as a pool's ``ready`` event (``query``, ``synchronize``)."""

    __slots__ = ("event", "landed", "waited_by", "allocated_on")

    def __init__(self, event: Any) -> None:
        self.event = event
        self.landed = False  # a query (or a synchronize) said the copy has completed
        self.waited_by: Any = None  # the stream made to wait for it (its later work waits too)
        # an untied reload's: the stream its device memory was allocated on (None: tied with ``record_stream``)
        self.allocated_on: Any = None

    def query(self) -> bool:
        if not self.landed:
            self.landed = self.event.query()
        return self.landed

    def synchronize(self) -> None:
        self.event.synchronize()
        self.landed = True


@dataclass(slots=True, weakref_slot=True)  # slots: one is made, read and released per tensor parked
class Parked:
    """One tensor parked in host memory (with the strides it is given back with)."""

    buffer: HostBuffer | None
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    source: weakref.ref | None  # the device tensor, while it lives (then no reload is needed)
    version: int
    d2h_done: CopyDone | None = None  # host copy complete
    h2d_done: CopyDone | None = None  # reload complete
    reloaded: torch.Tensor | None = None
    stride: tuple[int, ...] | None = None  # None: contiguous
    users: int = 1
    fetches_left: int = 0  # fetches this reload still serves (a shared tensor is reloaded once per backward)
    copied_back: bool = False  # ``reloaded`` came through a host→device copy (else: the source, held)
    storage: weakref.ref | None = None  # the device storage copied from, while any tensor uses it
    group: _Coalesced | None = None  # parked with others in one host buffer (see "Coalescing")
    offset: int = 0  # bytes into the group's buffer

    def alive_source(self) -> torch.Tensor | None:
        t = self.source() if self.source is not None else None
        if t is not None and t._version == self.version:
            return t
        return None


@dataclass(eq=False, slots=True)
class _Coalesced:
    """Tensors parked together in one host buffer: copied there in one copy, reloaded in one."""

    buffer: HostBuffer
    nbytes: int
    payload: int  # the bytes of its tensors' data (padding aside; a storage shared by several views once)
    members: int  # not released yet; the last release returns the buffer
    last_read: (
        CopyDone  # the latest copy that reads or writes the host buffer (a reload, else the parking copy)
    )


_ALIGN = 512  # bytes: where each coalesced tensor starts (the caching allocator's own alignment)


@dataclass
class CopyStats:
    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    reloads_skipped: int = 0  # source still alive on the device: no copy back needed
    bytes_kept_on_device: int = 0  # worth parking, but in the step's last two regions: never copied
    dedup_hits: int = 0
    # bytes saved holding and parking proven up-casts as narrow copies (memfit.offload.narrow)
    bytes_narrowed: int = 0
    coalesced_batches: int = 0  # batches parked through one packed buffer
    copies_inflight_waits: int = 0
    stall_events: list[tuple[Any, Any]] = field(default_factory=list)
    stall_ms_resolved: float = 0.0


class StreamApi:
    """The stream and event calls of :class:`CopyEngine`, on CUDA (a test passes a recording fake).

    Streams and events are the generic ``torch.Stream`` and ``torch.Event`` (see "Generic streams and events").
    """

    def new_stream(self) -> Any:
        return torch.Stream(torch.device("cuda", torch.cuda.current_device()))

    def current_stream(self, device: torch.device) -> Any:
        index = device.index
        return torch.accelerator.current_stream(torch.cuda.current_device() if index is None else index)

    def new_event(self, *, timing: bool = False) -> Any:
        return torch.Event(enable_timing=timing)

    def use(self, stream: Any, *, restore: Any) -> Any:
        """Context manager: work issued inside runs on ``stream``; ``restore`` (the current stream, which the
        caller holds) is current again after it."""
        return _StreamSwitch(stream, restore)

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """``tensor``'s memory is not handed out again before ``stream``'s work issued so far has finished."""
        tensor.record_stream(stream)


class _StreamSwitch:
    """``with``: ``stream`` is current inside, ``restore`` after (``torch.accelerator.set_stream`` both ways)."""

    __slots__ = ("stream", "restore")

    def __init__(self, stream: Any, restore: Any) -> None:
        self.stream, self.restore = stream, restore

    def __enter__(self) -> None:
        torch.accelerator.set_stream(self.stream)

    def __exit__(self, *exc: object) -> None:
        torch.accelerator.set_stream(self.restore)


COALESCE_MAX_BYTES = 64 << 20
STALL_PAIRS_HELD = 64  # stall-timing pairs held unresolved before the completed ones are summed (and reused)
MAX_INFLIGHT_BYTES = 2 << 30  # device→host bytes in flight before compute waits, unless a plan allows more


class CopyEngine:
    """Asynchronous parking on CUDA (see the module notes).

    Args:
        pool: where host buffers come from.
        max_inflight_bytes: bound on device→host bytes issued and not yet finished.
        timing: record stall-timing events (cheap; a few events per fetch).
        streams: the stream and event calls (default: ``torch.cuda``'s).
        coalesce_max_bytes: a batch of several tensors up to this many bytes in all is copied through one
            packed buffer each way (see "Coalescing"); 0 copies every tensor on its own.
        reload_release: when a reloaded tensor's memory may be reused (see "Reloads' memory").
    """

    parks_cpu_tensors = False  # CPU tensors stay where they are: there is no device memory to free
    parks_storages_once = True  # views covering their storage go as its bytes, once ("Shared storages")

    def __init__(
        self,
        pool: PinnedBucketPool,
        *,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        timing: bool = True,
        streams: StreamApi | None = None,
        coalesce_max_bytes: int = COALESCE_MAX_BYTES,
        reload_release: ReloadRelease = ReloadRelease.RECORD_STREAM,
    ) -> None:
        if coalesce_max_bytes < 0:
            raise ValueError(
                f"coalesce_max_bytes must be 0 (never coalesce) or more, not {coalesce_max_bytes}"
            )
        self.pool = pool
        self.max_inflight_bytes = self._own_inflight_bytes = max_inflight_bytes
        self.coalesce_max_bytes = coalesce_max_bytes
        self.reload_release = ReloadRelease(reload_release)
        self._pads: dict[Any, torch.Tensor] = {}  # device -> _ALIGN zero bytes; (device, n) -> its first n
        self.timing = timing
        self.stats = CopyStats()
        self.streams = StreamApi() if streams is None else streams
        self._d2h = self.streams.new_stream()
        self._h2d = self.streams.new_stream()
        self._inflight: deque[tuple[CopyDone, int]] = deque()
        self._after_compute: dict[
            torch.device, Any
        ] = {}  # device -> its ordering event (see "Fewer event calls")
        self._inflight_bytes = 0
        self._spare_timing: list[tuple[Any, Any]] = []  # resolved stall-timing pairs, recorded again

    # -- device -> host ------------------------------------------------------------------------------------------

    def offload(self, tensor: torch.Tensor) -> Parked:
        """Start copying ``tensor`` to a host buffer; the caller may drop ``tensor`` right away."""
        return self.offload_many([tensor])[0]

    def offload_many(self, tensors: list[torch.Tensor]) -> list[Parked]:
        """Park several tensors produced on the same stream: one ordering event, one completion event."""
        if not tensors:
            return []
        # a batch that fails part way (out of device memory packing or making a source contiguous, out of host
        # memory) gives back the host buffers it took: its caller never gets their Parked copies to release
        with torch.no_grad(), self.pool.release_on_error():  # see "Copies outside autograd"
            return self._offload_many(tensors)

    def _offload_many(self, tensors: list[torch.Tensor]) -> list[Parked]:
        api = self.streams
        compute = api.current_stream(tensors[0].device)
        if len(tensors) > 1:
            if sum([t.nbytes for t in tensors]) <= self.coalesce_max_bytes:
                return self._offload_coalesced(tensors, compute)
            shared = [
                m
                for storage, m in _by_storage(tensors)
                if len(m) > 1 and _whole_storage_bytes(storage, [tensors[i] for i in m]) is not None
            ]
            if shared:  # each such storage once, straight from the source (a lone piece is not packed)
                out: list[Parked | None] = [None] * len(tensors)
                for members in shared:
                    for i, p in zip(
                        members, self._offload_coalesced([tensors[i] for i in members], compute), strict=True
                    ):
                        out[i] = p
                rest = [i for i, p in enumerate(out) if p is None]
                for i, p in zip(
                    rest, self._offload_separately([tensors[i] for i in rest], compute), strict=True
                ):
                    out[i] = p
                return out  # type: ignore[return-value]
        return self._offload_separately(tensors, compute)

    def _offload_separately(self, tensors: list[torch.Tensor], compute: Any) -> list[Parked]:
        """Each tensor to a host buffer of its own (one ordering event, one completion event for all)."""
        if not tensors:
            return []
        api = self.streams
        self._d2h.wait_event(self._compute_so_far(compute, tensors[0].device))
        staged = []
        with api.use(self._d2h, restore=compute):
            for tensor in tensors:
                src = tensor if dense_layout(tensor) else tensor.contiguous()
                nbytes = src.numel() * src.element_size()
                buf = self.pool.acquire(nbytes)
                buf.strided_view(src.dtype, src.shape, src.stride()).copy_(src, non_blocking=buf.pinned)
                staged.append((tensor, src, buf, nbytes))
            done = self._record_done(self._d2h)
        out = []
        total = 0
        for tensor, src, buf, nbytes in staged:
            api.record_stream(src, self._d2h)
            if src is not tensor:
                api.record_stream(tensor, self._d2h)
            total += nbytes
            out.append(
                Parked(
                    buf,
                    src.shape,
                    src.dtype,
                    tensor.device,
                    nbytes,
                    weakref.ref(tensor),
                    tensor._version,
                    d2h_done=done,
                    stride=src.stride(),
                    storage=weakref.ref(tensor.untyped_storage()),
                )
            )
        self.stats.bytes_offloaded += total
        self._track_inflight(done, total, compute)
        return out

    def _offload_coalesced(self, tensors: list[torch.Tensor], compute: Any) -> list[Parked]:
        """Pack ``tensors`` into one device buffer on ``compute``, then one copy to one host buffer.

        Views that together cover their storage go in as that storage's bytes, once (see "Shared storages")."""
        api = self.streams
        device = tensors[0].device  # (one batch, one device: its pieces are concatenated)
        pieces: list[torch.Tensor] = []
        placed: list[Any] = [None] * len(tensors)  # index in tensors -> (stride, offset, nbytes, storage)
        offset = copied = 0
        for storage, members in _by_storage(tensors):
            whole = _whole_storage_bytes(storage, [tensors[i] for i in members])
            if whole is not None:
                if offset % _ALIGN:
                    offset += self._pad_to_align(pieces, offset, device)
                pieces.append(whole)
                for i in members:
                    t = tensors[i]
                    placed[i] = (
                        t.stride(),
                        offset + t.storage_offset() * t.element_size(),
                        t.nbytes,
                        storage,
                    )
                offset += whole.numel()
                copied += whole.numel()
                continue
            for i in members:
                flat, stride = _flat_in_memory_order(tensors[i])
                nbytes = flat.nbytes
                if offset % _ALIGN:
                    offset += self._pad_to_align(pieces, offset, device)
                pieces.append(flat.view(torch.uint8))
                placed[i] = (stride, offset, nbytes, storage)
                offset += nbytes
                copied += nbytes
        # on compute, after the producers: the sources may die at once. A lone piece (one storage's bytes) is
        # copied from where it lies, tied to the copy's stream below like any source copied one by one.
        packed = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        self._d2h.wait_event(self._compute_so_far(compute, device))
        buf = self.pool.acquire(offset)
        with api.use(self._d2h, restore=compute):
            buf.tensor[:offset].copy_(packed, non_blocking=buf.pinned)
            done = self._record_done(self._d2h)
        api.record_stream(packed, self._d2h)
        group = _Coalesced(buf, offset, copied, len(tensors), done)
        ref = weakref.ref
        out = []
        for tensor, (stride, at, nbytes, storage) in zip(tensors, placed, strict=True):
            out.append(
                Parked(
                    buf,
                    tensor.shape,
                    tensor.dtype,
                    device,
                    nbytes,
                    ref(tensor),
                    tensor._version,
                    d2h_done=done,
                    stride=stride,
                    storage=ref(storage),
                    group=group,
                    offset=at,
                )
            )
        self.stats.bytes_offloaded += copied
        self.stats.coalesced_batches += 1
        self._track_inflight(done, offset, compute)
        return out

    def _pad_to_align(self, pieces: list[torch.Tensor], offset: int, device: torch.device) -> int:
        """Append the padding that puts the next piece at an ``_ALIGN`` boundary; returns its bytes."""
        pad = -offset % _ALIGN
        if pad:
            pieces.append(self._padding(device, pad))
        return pad

    def _padding(self, device: torch.device, nbytes: int) -> torch.Tensor:
        """``nbytes`` (< ``_ALIGN``) bytes on ``device`` to put between packed tensors (their content is never
        read): slices of one ``_ALIGN``-byte tensor per device, each made once (a slice per tensor parked cost
        ~1.5 us of host time)."""
        pad = self._pads.get((device, nbytes))
        if pad is None:
            whole = self._pads.get(device)
            if whole is None:
                whole = self._pads[device] = torch.zeros(_ALIGN, dtype=torch.uint8, device=device)
            pad = self._pads[(device, nbytes)] = whole[:nbytes]
        return pad

    def _compute_so_far(self, compute: Any, device: torch.device) -> Any:
        """An event recorded on ``compute`` now, for a side stream to wait for at once (see "Fewer event
        calls": one per device, recorded again each time)."""
        event = self._after_compute.get(device)
        if event is None:
            event = self._after_compute[device] = self.streams.new_event()
        event.record(compute)
        return event

    def _record_done(self, stream: Any) -> CopyDone:
        """The completion of the work issued on ``stream`` so far (a new event)."""
        event = self.streams.new_event()
        event.record(stream)
        return CopyDone(event)

    def allow_in_flight(self, nbytes: int) -> None:
        """Let up to ``nbytes`` of device→host copies be in flight before compute waits (a plan that queues the
        forward's copies across blocks counted them in its peak); never below the engine's own bound, to which 0
        returns it."""
        self.max_inflight_bytes = max(self._own_inflight_bytes, nbytes)

    def _track_inflight(self, done: CopyDone, nbytes: int, compute: Any) -> None:
        self._inflight.append((done, nbytes))
        self._inflight_bytes += nbytes
        while self._inflight and self._inflight[0][0].query():
            self._inflight_bytes -= self._inflight.popleft()[1]
        while self._inflight_bytes > self.max_inflight_bytes and len(self._inflight) > 1:
            oldest, n = self._inflight.popleft()
            self._wait(compute, oldest)
            self._inflight_bytes -= n
            self.stats.copies_inflight_waits += 1

    # -- host -> device ------------------------------------------------------------------------------------------

    def reload(self, parked: Parked) -> None:
        """Issue the reload of ``parked`` (idempotent; holds the source instead while it is still alive)."""
        if (
            parked.reloaded is None
        ):  # (every fetch passes here: the usual case returns without building a batch)
            self.reload_many([parked])

    def reload_many(self, parked: list[Parked]) -> None:
        """Issue the reloads of a region's parked tensors as one batch: one ordering event, one completion
        event (per tensor, stream and event calls cost ~10 us of host time each: a launch-bound step feels
        them)."""
        # (a region lists a tensor it saved twice twice: one reload each.) Most calls find everything reloaded
        # already (a region reloaded ahead is asked again as its backward starts): that costs one pass.
        todo: list[Parked] = []
        for p in parked:
            if p.reloaded is None and not self._hold_source(p):
                todo.append(p)
        if not todo:
            return
        if len(todo) > 1 and len(set(map(id, todo))) < len(todo):
            todo = list({id(p): p for p in todo}.values())
        api = self.streams
        device = todo[0].device
        compute = api.current_stream(device)
        singles: list[Parked] = []
        members: list[Parked] = []  # of coalesced groups
        groups: dict[_Coalesced, None] = {}  # (an ordered set)
        parking_copies: dict[CopyDone, None] = {}  # the d2h copies to wait for, each once, in order
        for p in todo:
            group = p.group
            if group is None:
                singles.append(p)
            else:
                members.append(p)
                groups[group] = None
            if not p.d2h_done.landed:  # a parking copy known to be complete needs no wait
                parking_copies[p.d2h_done] = None
        # allocated on compute: the memory is free for us only after compute's earlier work
        outs = [
            torch.empty_strided(
                p.shape, p.stride or contiguous_stride(p.shape), dtype=p.dtype, device=p.device
            )
            for p in singles
        ]
        packed = {g: torch.empty(g.nbytes, dtype=torch.uint8, device=device) for g in groups}
        h2d = self._h2d
        h2d.wait_event(self._compute_so_far(compute, device))
        for d2h_done in parking_copies:
            h2d.wait_event(d2h_done.event)
        with api.use(h2d, restore=compute):
            for p, out in zip(singles, outs, strict=True):
                assert p.buffer is not None
                out.copy_(p.buffer.strided_view(p.dtype, p.shape, out.stride()), non_blocking=p.buffer.pinned)
            for group, out in packed.items():
                out.copy_(group.buffer.tensor[: group.nbytes], non_blocking=group.buffer.pinned)
            done = self._record_done(h2d)
        tie = self.reload_release is ReloadRelease.RECORD_STREAM
        if not tie:
            done.allocated_on = compute
        reloaded_bytes = 0  # copied, as bytes_offloaded counts them
        for p, out in zip(singles, outs, strict=True):
            if tie:
                api.record_stream(out, h2d)
            reloaded_bytes += p.nbytes
            p.fetches_left = p.users
            p.reloaded, p.h2d_done, p.copied_back = out, done, True
        typed: dict[tuple[_Coalesced, torch.dtype], Any] = {}  # a group's buffer viewed as a dtype
        for group, out in packed.items():
            if tie:
                api.record_stream(out, h2d)
            group.last_read = done
            reloaded_bytes += group.payload
        for p in members:  # a view of its group's buffer, with the strides it was parked with
            p.fetches_left = p.users
            p.reloaded, p.h2d_done, p.copied_back = _member_view(packed, p, typed), done, True
        self.stats.bytes_reloaded += reloaded_bytes

    def _hold_source(self, parked: Parked) -> bool:
        """If the tensor parked is still on its device (another op saved it too), hold it until it is fetched.

        Reloading ahead sees such a tensor alive and has nothing to copy; without a reference of its own the
        tensor may die before its region's backward (the other op's backward ran first), and the copy back
        would then be issued on demand, with compute waiting for it. Flux's single blocks do exactly that:
        their FFN input is also their attention's input
        (``test_a_region_after_a_smaller_one_is_reloaded_two_regions_ahead``).
        """
        source = parked.alive_source()
        if source is None:
            return False
        # held without its autograd history: the region holding it may be kept by that history
        parked.reloaded, parked.fetches_left, parked.copied_back = (
            without_history(source),
            parked.users,
            False,
        )
        return True

    def fetch(self, parked: Parked) -> torch.Tensor:
        """The parked tensor on its device, usable on the current stream."""
        if parked.reloaded is None:  # not reloaded ahead: now
            self.reload_many([parked])
        if not parked.copied_back and parked.reloaded._version != parked.version:
            parked.reloaded = None  # the held source was modified in place since: the host copy is the data
            self.reload_many([parked])
        out = parked.reloaded
        assert out is not None
        if parked.copied_back:
            done = parked.h2d_done
            if done is None or not done.landed:  # (a reload seen landed needs no wait)
                self._wait_for_reload(parked)
        else:
            self.stats.reloads_skipped += 1
        # one fetch served; the last user of this reload lets it go (a later fetch reloads again)
        parked.fetches_left -= 1
        if parked.fetches_left <= 0:
            parked.reloaded = None
        return out

    def _wait_for_reload(self, parked: Parked) -> None:
        """Make the current stream wait until ``parked``'s reload has landed: the usual case, a reload issued ahead
        that has landed, costs at most one event query for all the tensors it brought back and no stream lookup;
        one still in flight is waited for once per stream, not once per tensor (see "Fewer event calls")."""
        done = parked.h2d_done
        assert done is not None
        if done.waited_by is not None and done.waited_by == self.streams.current_stream(parked.device):
            return  # this stream already waits for the reload: everything it runs from here on does
        if not done.query():
            stream = self.streams.current_stream(parked.device)
            self._stall(stream, done)
            done.waited_by = stream
            owner = done.allocated_on
            if owner is not None and owner != stream:  # untied memory is reused in its own stream's order
                owner.wait_event(done.event)

    def _wait(self, stream: Any, done: CopyDone) -> None:
        if not done.query():  # already complete (the usual case when reloads run ahead): nothing to wait for
            self._stall(stream, done)

    def _stall(self, stream: Any, done: CopyDone) -> None:
        """``stream`` waits for a copy still in flight (timed: the copy time not hidden)."""
        if self.timing:
            before, after = self._spare_timing.pop() if self._spare_timing else self._new_timing_pair()
            before.record(stream)
            stream.wait_event(done.event)
            after.record(stream)
            self.stats.stall_events.append((before, after))
            if len(self.stats.stall_events) > STALL_PAIRS_HELD:
                self._resolve_stalls()
        else:
            stream.wait_event(done.event)

    def _new_timing_pair(self) -> tuple[Any, Any]:
        return self.streams.new_event(timing=True), self.streams.new_event(timing=True)

    def _resolve_stalls(self) -> None:
        """Add the completed stalls' times to the total; their events become spares (see "Telemetry")."""
        pending = []
        for before, after in self.stats.stall_events:
            if after.query():
                self.stats.stall_ms_resolved += before.elapsed_time(after)
                self._spare_timing.append((before, after))  # (pairs are made only when none is spare)
            else:
                pending.append((before, after))
        self.stats.stall_events = pending

    def release(self, parked: Parked) -> None:
        """Return the host buffer once nothing reads it any more (a coalesced one with its last member)."""
        done = parked.h2d_done
        if parked.reloaded is not None and done is not None and done.allocated_on is not None:
            # reloaded, never fetched, its memory tied to no stream: it goes back only after the copy writing it
            if done.waited_by != done.allocated_on and not done.query():
                done.allocated_on.wait_event(done.event)
                done.waited_by = done.allocated_on
            parked.reloaded = None
        buf, parked.buffer = parked.buffer, None
        if buf is None:
            return
        group = parked.group
        if group is None:
            buf.release(ready=parked.h2d_done or parked.d2h_done)
            return
        group.members -= 1
        if group.members == 0:
            buf.release(ready=group.last_read)

    def reset_stats(self) -> None:
        """Start counting afresh (timing events still in flight are dropped with the old counters)."""
        self.stats = CopyStats()

    def stall_ms(self) -> float:
        """Milliseconds the compute stream waited on copies (resolved from completed timing events)."""
        self._resolve_stalls()
        return self.stats.stall_ms_resolved


class SyncCopyEngine(CopyEngine):
    """Synchronous parking with the same bookkeeping; works on CPU tensors (tests, CPU-only machines)."""

    parks_cpu_tensors = True
    parks_storages_once = False  # each distinct view on its own

    def __init__(self, pool: PinnedBucketPool) -> None:
        self.pool = pool
        self.stats = CopyStats()
        self.timing = False
        # nothing is ever in flight; kept so that a plan's bound reads the same on either engine
        self.max_inflight_bytes = self._own_inflight_bytes = MAX_INFLIGHT_BYTES

    def offload_many(self, tensors: list[torch.Tensor]) -> list[Parked]:
        with self.pool.release_on_error():  # as the CUDA engine's
            return [self.offload(t) for t in tensors]

    @torch.no_grad()  # see "Copies outside autograd"
    def offload(self, tensor: torch.Tensor) -> Parked:
        src = tensor if dense_layout(tensor) else tensor.contiguous()
        nbytes = src.numel() * src.element_size()
        buf = self.pool.acquire(nbytes)
        buf.strided_view(src.dtype, src.shape, src.stride()).copy_(src)
        self.stats.bytes_offloaded += nbytes
        return Parked(
            buf,
            src.shape,
            src.dtype,
            tensor.device,
            nbytes,
            weakref.ref(tensor),
            tensor._version,
            stride=src.stride(),
            storage=weakref.ref(tensor.untyped_storage()),
        )

    def reload_many(self, parked: list[Parked]) -> None:
        for p in parked:
            self.reload(p)

    def reload(self, parked: Parked) -> None:
        if parked.reloaded is not None or self._hold_source(parked):
            return
        assert parked.buffer is not None
        view = parked.buffer.strided_view(parked.dtype, parked.shape, parked.stride or ())
        out = torch.empty_strided(parked.shape, view.stride(), dtype=parked.dtype, device=parked.device)
        parked.reloaded, parked.copied_back = out.copy_(view), True
        parked.fetches_left = parked.users
        self.stats.bytes_reloaded += parked.nbytes

    def _wait_for_reload(self, parked: Parked) -> None:
        return None  # synchronous copies: the reload has landed

    def release(self, parked: Parked) -> None:
        buf, parked.buffer = parked.buffer, None
        if buf is not None:
            buf.release()

    def stall_ms(self) -> float:
        return 0.0


def _by_storage(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, list[int]]]:
    """``tensors`` grouped by the storage they view: (that storage, their indices), in order of first appearance."""
    groups: dict[int, tuple[torch.UntypedStorage, list[int]]] = {}
    for i, t in enumerate(tensors):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        group = groups.get(ptr) if ptr else None  # no memory (empty): each on its own
        if group is None:
            groups[ptr if ptr else -1 - i] = (storage, [i])
        else:
            group[1].append(i)
    return list(groups.values())


def covers_storage(storage_bytes: int, covered_bytes: int, itemsize: int) -> bool:
    """Whether views of one storage whose distinct extents (first byte, byte count) add up to ``covered_bytes`` are
    parked as the storage's bytes, copied once: they cover the storage (see "Shared storages")."""
    return bool(storage_bytes) and not storage_bytes % itemsize and covered_bytes >= storage_bytes


def copied_bytes(views: list[torch.Tensor], *, storages_once: bool) -> int:
    """Bytes parking these distinct views copies: each view's own, or with ``storages_once`` (the CUDA engine's
    rule) a storage's bytes once where its views cover it."""
    if not storages_once:
        return sum(v.nbytes for v in views)
    total = 0
    for storage, members in _by_storage(views):
        shared = [views[i] for i in members]
        whole = _whole_storage_bytes(storage, shared)
        total += whole.numel() if whole is not None else sum(v.nbytes for v in shared)
    return total


def _whole_storage_bytes(storage: torch.UntypedStorage, views: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes of ``storage``, which ``views`` share, as a flat ``uint8`` view, when :func:`covers_storage`
    says they go as those bytes. Else None (each is copied on its own)."""
    first = views[0]
    itemsize = first.element_size()
    if len(views) == 1:  # most storages hold one saved tensor: its extent alone must cover the storage
        covered = first.nbytes
    else:
        covered = sum(n for _, n in {(v.storage_offset() * v.element_size(), v.nbytes) for v in views})
    storage_bytes = storage.nbytes()
    if not covers_storage(storage_bytes, covered, itemsize):
        return None
    return first.as_strided((storage_bytes // itemsize,), (1,), 0).view(torch.uint8)


def _member_view(
    packed: dict[_Coalesced, torch.Tensor], parked: Parked, typed: dict[tuple[_Coalesced, torch.dtype], Any]
) -> torch.Tensor:
    """``parked``'s tensor in its group's packed ``uint8`` buffer (``packed[parked.group]``), with its strides: one
    ``as_strided`` on the buffer viewed as its dtype (made once per group and dtype, in ``typed``), not a slice,
    a view and an ``as_strided`` per tensor (~5 us of host time each). Where the buffer's length is no multiple
    of the dtype's size, the slice is viewed instead (the same tensor: storage, offset, shape and strides)."""
    dtype = parked.dtype
    key = (parked.group, dtype)
    whole = typed.get(key, typed)
    if whole is typed:
        buffer = packed[parked.group]  # type: ignore[index]
        whole = typed[key] = buffer.view(dtype) if buffer.numel() % dtype.itemsize == 0 else None
    if whole is None:
        return (
            packed[parked.group][parked.offset : parked.offset + parked.nbytes]  # type: ignore[index]
            .view(dtype)
            .as_strided(parked.shape, parked.stride)
        )
    return whole.as_strided(parked.shape, parked.stride, parked.offset // dtype.itemsize)
