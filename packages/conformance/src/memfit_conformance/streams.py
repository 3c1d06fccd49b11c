"""The CUDA copy engine on CPU tensors, with recording streams and events that check its ordering.

:class:`RecordingStreams` stands in for ``torch.cuda``'s streams and events (named ``compute``, ``d2h`` and
``h2d``) and logs every record, wait and stream switch. :class:`OrderCheckingEngine` is the real
:class:`~memfit.offload.copy.CopyEngine` over those, on CPU tensors, asserting as it runs what makes its
copies safe on a GPU: a reload waits for the host copy it reads, and compute waits for a reload still in
flight before using it. The copies themselves are synchronous CPU copies, so results are exact whatever the
events say; with events that never complete by themselves (``landed=False``) every wait must be there.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import torch

from memfit.offload.copy import CopyEngine, Parked, StreamApi
from memfit.offload.pool import PinnedBucketPool


class RecordingEvent:
    _ids = itertools.count()

    def __init__(self, streams: RecordingStreams) -> None:
        self.streams, self.id = streams, next(self._ids)
        self.done = False
        self.stream: str | None = None  # where it was recorded

    def record(self, stream: RecordingStream) -> None:
        self.stream, self.done = stream.name, self.streams.landed
        self.streams.log.append(("record", stream.name, self.id))

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:  # the host waited: complete from now on
        self.done = True

    def elapsed_time(self, other: RecordingEvent) -> float:
        return 0.0


class RecordingStream:
    def __init__(self, streams: RecordingStreams, name: str) -> None:
        self.streams, self.name = streams, name

    def wait_event(self, event: RecordingEvent) -> None:
        self.streams.log.append(("wait", self.name, event.id))
        self.streams.waited.setdefault(self.name, set()).add(event.id)


class RecordingStreams(StreamApi):
    """Streams ``compute`` (current), ``d2h`` and ``h2d``; events complete when recorded if ``landed``."""

    def __init__(self, *, landed: bool = False) -> None:
        self.landed = landed
        self.log: list[tuple] = []  # ("record"|"wait", stream, event id), ("use"|"leave", stream)
        self.tied: list[tuple[int, str]] = []  # (storage address, stream) of each record_stream
        self.waited: dict[str, set[int]] = {}  # stream -> ids of the events it was made to wait for
        self.compute = RecordingStream(self, "compute")
        self.current = self.compute
        self._names = iter(["d2h", "h2d"])

    def new_stream(self) -> RecordingStream:
        return RecordingStream(self, next(self._names))

    def current_stream(self, device: torch.device) -> RecordingStream:
        return self.current

    def new_event(self, *, timing: bool = False) -> RecordingEvent:
        return RecordingEvent(self)

    @contextlib.contextmanager
    def use(self, stream: RecordingStream, *, restore: RecordingStream) -> Iterator[None]:
        assert restore is self.current, (
            f"a switch to {stream.name} would restore {restore.name}, not the current"
        )
        self.current = stream
        self.log.append(("use", stream.name))
        try:
            yield
        finally:
            self.current = restore
            self.log.append(("leave", stream.name))

    def record_stream(self, tensor: torch.Tensor, stream: RecordingStream) -> None:
        self.tied.append((tensor.untyped_storage().data_ptr(), stream.name))

    def waits(self, stream: str, since: int = 0) -> list[int]:
        """Ids of the events ``stream`` was made to wait for (from log entry ``since`` on)."""
        return [entry[2] for entry in self.log[since:] if entry[0] == "wait" and entry[1] == stream]


class OrderCheckingEngine(CopyEngine):
    """:class:`CopyEngine` on CPU tensors over :class:`RecordingStreams`, checking its ordering as it runs.

    Raises:
        AssertionError: a reload did not wait for the host copy it reads, a tensor whose reload was still
            in flight was handed to compute without compute waiting for it, or (``ReloadRelease.AFTER_COMPUTE_WAITS``)
            one released unfetched went back to its stream before that stream waited for it.
    """

    parks_cpu_tensors = True  # the CUDA engine leaves CPU tensors alone; here they stand for device tensors

    def __init__(self, pool: PinnedBucketPool, *, landed: bool = False, **kwargs) -> None:
        super().__init__(pool, streams=RecordingStreams(landed=landed), **kwargs)

    def reload_many(self, parked: list[Parked]) -> None:
        since = len(self.streams.log)
        pending = [p for p in parked if p.reloaded is None]
        super().reload_many(parked)
        waited = set(self.streams.waits("h2d", since))
        for p in pending:
            if p.copied_back:
                # (or the engine saw it complete: then nothing later on h2d can overtake it)
                assert p.d2h_done.event.id in waited or (p.d2h_done.landed and p.d2h_done.event.done), (
                    f"a reload of {tuple(p.shape)} did not wait for the device-to-host copy it reads"
                )

    def release(self, parked: Parked) -> None:
        done = parked.h2d_done
        owner = done.allocated_on if done is not None else None
        in_flight = parked.reloaded is not None and owner is not None and not done.event.done
        super().release(parked)
        if in_flight:  # reloaded, never fetched, its memory tied to no stream
            assert done.event.id in self.streams.waited.get(owner.name, ()), (
                f"a reloaded {tuple(parked.shape)} went back to {owner.name} before it waited for its reload"
            )

    def fetch(self, parked: Parked) -> torch.Tensor:
        out = super().fetch(parked)
        if parked.copied_back and not parked.h2d_done.query():
            assert parked.h2d_done.event.id in self.streams.waited.get("compute", ()), (
                f"a reloaded {tuple(parked.shape)} was used before compute waited for its reload"
            )
        return out


def order_checking_copy_engine(*, landed: bool = False, **kwargs) -> OrderCheckingEngine:
    """An :class:`OrderCheckingEngine` parking into pageable CPU buffers (no CUDA needed); ``kwargs`` go to
    :class:`CopyEngine` (``max_inflight_bytes``, ``timing``, ``coalesce_max_bytes``, ``reload_release``)."""
    pool = PinnedBucketPool(
        allocate=lambda n, pinned: torch.empty(n, dtype=torch.uint8),
        available_host_bytes=lambda: 1 << 40,
        host_reserve_bytes=0,
    )
    return OrderCheckingEngine(pool, landed=landed, **kwargs)
