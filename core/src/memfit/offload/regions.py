"""Parking regions of the step's timeline: frame entries parked by the ``unsloth`` backends, and the blocks of
an ``auto`` plan that keep everything but still count as regions of the step (see
:mod:`memfit.offload.session` for the timeline, the deferral and reload-ahead)."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.engine import state
from memfit.engine.hooks import attached_hook, on_first_gradient
from memfit.engine.stash import DeviceStash, without_history
from memfit.offload.copy import Parked
from memfit.offload.session import OffloadSession


class TimelineRegion:
    """A region of the step's timeline whose tensors are parked: numbered as it starts (the deferral of
    :meth:`OffloadSession.region_started`) and registered for reload-ahead (:meth:`OffloadSession.needed`).
    Subclasses say how one of their items is parked (``tensor_of``, ``park``) or kept (``keep``)."""

    def __init__(self, session: OffloadSession) -> None:
        self.session = session
        self.parked: list[Parked] = []
        self.parked_bytes = 0  # of ``parked``, summed as they are added (reload-ahead reads it per region)
        self.kept_bytes = 0  # worth parking, but stays on the device (the step's last two regions)
        self.number = session.region_started()
        self.timeline = session.snapshot_timeline()
        self.index = session.register(self)
        self.started = False  # its backward has begun (see first_backward_use)

    def add_parked(self, parked: Parked) -> None:
        self.parked.append(parked)
        self.parked_bytes += parked.nbytes

    def prefetch(self) -> None:
        self.session.copy.reload_many(self.parked)

    def backward_starts(self) -> None:
        """Its backward begins: bring back what it parked, and reload the regions backward visits next."""
        self.prefetch()
        self.session.needed(self.index, self.timeline)

    def first_backward_use(self) -> None:
        """One of its tensors (or its outputs' gradients) reached backward: the first starts its backward."""
        if not self.started:
            self.started = True
            self.backward_starts()


class EntryHandle:
    """What a frame keeps for one entry under the ``unsloth`` backends.

    ``state`` is ``"device"`` (``value`` is the tensor without its autograd history, kept on its device),
    ``"pending"`` (``value`` is a detached alias, ``source`` a weak reference to the tensor; parked once two later
    regions have started) or ``"parked"`` (``value`` is the :class:`Parked` copy). Never a tensor with autograd
    history: see "What autograd keeps" in docs/architecture.md.
    """

    __slots__ = ("state", "value", "source")

    def __init__(self, state: str, value: Any, source: weakref.ref[torch.Tensor] | None = None) -> None:
        self.state = state
        self.value = value
        self.source = source


class OffloadStash(TimelineRegion):
    """A frame's stash for the ``unsloth`` backends: entries are parked in host memory (:class:`EntryHandle`)."""

    def put(self, tensor: torch.Tensor) -> EntryHandle:
        if not self.session.worth_parking(tensor):
            return EntryHandle("device", without_history(tensor))
        handle = EntryHandle("pending", tensor.detach(), weakref.ref(tensor))
        self.session.defer(self, handle)
        return handle

    @staticmethod
    def tensor_of(handle: EntryHandle) -> torch.Tensor:
        """The entry to park: the tensor itself while something else still holds it (the parked copy then holds it
        weakly, and the recompute takes it back instead of copying), else the handle's alias."""
        assert handle.source is not None
        source = handle.source()
        return source if source is not None else handle.value

    def park(self, handle: EntryHandle, parked: Parked) -> None:
        self.add_parked(parked)
        handle.state, handle.value, handle.source = "parked", parked, None

    def keep(self, handle: EntryHandle) -> None:
        """The entry stays on the device (a last region's)."""
        handle.state, handle.source = "device", None
        self.kept_bytes += handle.value.untyped_storage().nbytes()
        state.note_held(handle.value)

    def get(self, handle: EntryHandle) -> torch.Tensor:
        return self.session.copy.fetch(handle.value) if handle.state == "parked" else handle.value

    def resident(self, handle: EntryHandle) -> torch.Tensor | None:
        return handle.value if handle.state == "device" else None

    def version(self, handle: EntryHandle) -> int:
        if handle.state != "parked":
            return handle.value._version
        parked = handle.value
        source = parked.source() if parked.source is not None else None
        return source._version if source is not None else parked.version

    def on_recompute(self) -> None:
        self.backward_starts()

    def release_all(self) -> None:
        parked, self.parked, self.parked_bytes = self.parked, [], 0
        for p in parked:
            self.session.unpark(p)


class _KeepingRegion(TimelineRegion):
    """A call of a block that keeps everything on the device, in a plan that also parks (``auto``): it parks
    nothing, its kept bytes stand for its backward's compute in the reload-ahead rule, and when its backward
    starts (the gradient of its output arrives) it reloads the parked regions before it ahead of need."""

    def __init__(self, session: OffloadSession, kept_bytes: int) -> None:
        super().__init__(session)
        self.kept_bytes = kept_bytes


def device_stash_after_parking(session: OffloadSession) -> Callable[[], DeviceStash]:
    """Stashes for regions that keep their entries on the device in a plan that also parks (``auto``).

    Such a region still counts towards the deferral of the parked regions before it (see
    :meth:`OffloadSession.end_step`): only the step's last two regions keep their entries, whatever kind the
    regions after them are.
    """

    def make() -> DeviceStash:
        session.region_started()
        return DeviceStash()

    return make


def mark_keeping_blocks(session: OffloadSession, blocks: list[tuple[nn.Module, int]]) -> list[Any]:
    """Hooks (returned, for removal) that make each call of these blocks a :class:`_KeepingRegion` of the step.

    For ``auto``'s blocks that keep everything in a plan that also parks; ``blocks`` pairs each with the bytes it
    keeps (its profile's). Without a region of their own, the parked regions before a run of them would stay
    deferred (on the device) through it, and those blocks' backward peaks would carry two parked regions'
    tensors instead of the one reloaded ahead; without a backward start of their own, the first parked region
    after them in backward would be reloaded only when needed, in the open.
    """
    calls: dict[int, list[_KeepingRegion]] = {}

    def started(module: nn.Module, args: tuple) -> None:
        if state.regions_may_open():
            calls.setdefault(id(module), []).append(_KeepingRegion(session, kept[id(module)]))

    def returned(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        pending = calls.get(id(module))
        if not pending:
            return
        # the first gradient to reach its outputs starts its backward
        on_first_gradient(output, pending.pop().first_backward_use, passed_through=(args, kwargs))

    kept = {id(block): nbytes for block, nbytes in blocks}
    handles = []
    for block, _ in blocks:
        handles.append(block.register_forward_pre_hook(attached_hook(started)))
        handles.append(
            block.register_forward_hook(attached_hook(returned), with_kwargs=True, always_call=True)
        )
    return handles
