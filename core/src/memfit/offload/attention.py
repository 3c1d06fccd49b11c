"""Attention offload: every tensor an attention call saves for backward waits in host memory (no recompute).

Each attention call outside a recomputed region is a region of the step's timeline (:class:`SavedGroup`):
its saved tensors are parked with it, two regions later (:mod:`memfit.offload.session`), and come back when
backward unpacks them. Inside a region call or a recompute the hooks do nothing, so nothing is ever copied
twice. A block an ``auto`` plan parks (``BlockPolicy.PARK``) is one such call: everything it saves.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from memfit.engine import state
from memfit.engine.hooks import HookRuns, attached_hook
from memfit.engine.stash import without_history
from memfit.errors import MemfitError
from memfit.offload.copy import Parked
from memfit.offload.narrow import Narrowed, exact_narrow_dtype, widened
from memfit.offload.regions import TimelineRegion
from memfit.offload.session import OffloadSession
from memfit.offload.weights import WeightRef, WeightStreamer

_PARAMETER = nn.Parameter


class SavedGroup(TimelineRegion):
    """The tensors one attention call saved, parked together (a timeline region)."""

    def __init__(self, session: OffloadSession) -> None:
        super().__init__(session)
        # its proven up-casts' narrow copies while the call saves them (made at the first: most calls have none)
        self.narrowed: Narrowed | None = None
        # the session weakly: a finalizer's arguments live as long as the group, and a session whose step still
        # lists this group would otherwise keep it, and so itself, alive for good
        weakref.finalize(self, _release_group, weakref.ref(session), self.parked)

    @staticmethod
    def tensor_of(handle: SavedHandle) -> torch.Tensor:
        """The saved tensor to park: the one autograd saved while something else still holds it (the parked copy
        then holds it weakly, and backward takes it back instead of copying), else the handle's alias; a narrowed
        one's narrow copy (the tensor it was cast from is still watched for edits, while it lives)."""
        tensor = handle.device_tensor
        assert tensor is not None
        source = handle.source() if handle.source is not None else None
        watched = source if handle.dtype is not None else tensor
        if watched is not None and watched._version != handle.version:
            # parked two regions after the call (or kept): what backward would get is not what was saved
            raise MemfitError(
                "a tensor an attention call (or a block parked whole) saved for backward was modified in place "
                "after the call (autograd rejects that too, at backward); make the edit out of place, or do not "
                "offload this attention (gradient_checkpointing_offload_attention: false)."
            )
        if handle.dtype is not None:
            return tensor
        return source if source is not None else tensor

    def park(self, handle: SavedHandle, parked: Parked) -> None:
        handle.parked, handle.device_tensor, handle.source = parked, None, None
        self.add_parked(parked)
        self.narrowed = None  # the call is over: its copies are held by their handles alone

    def keep(self, handle: SavedHandle) -> None:
        """The activation stays on the device (a last region's)."""
        self.narrowed = None
        tensor = self.tensor_of(handle)
        handle.source = None
        state.note_held(tensor)
        self.kept_bytes += tensor.numel() * tensor.element_size()


def _release_group(session_ref: weakref.ref[OffloadSession], parked: list[Parked]) -> None:
    session = session_ref()
    if session is not None:  # (else its copy engine and pool are gone with it)
        for p in parked:
            session.unpark(p)
    parked.clear()


class SavedHandle:
    """What autograd keeps for one tensor an attention call saved.

    ``device_tensor`` is the tensor without its autograd history (see "What autograd keeps" in
    docs/architecture.md), until it is parked (``parked``); ``source`` refers weakly to the tensor autograd saved,
    while it waits to be parked with its ``group`` (None: it stays on the device). ``dtype``:
    the dtype backward gets it back in, where ``device_tensor`` is its narrow copy (:mod:`memfit.offload.narrow`).
    """

    __slots__ = ("group", "parked", "device_tensor", "source", "version", "dtype")

    def __init__(self, group: SavedGroup | None, tensor: torch.Tensor) -> None:
        self.group = group
        self.parked: Parked | None = None
        self.device_tensor: torch.Tensor | None = without_history(tensor)
        self.source = weakref.ref(tensor) if group is not None else None
        self.version = tensor._version
        self.dtype: torch.dtype | None = None

    def narrow_to(self, narrow: torch.Tensor, dtype: torch.dtype) -> None:
        """Hold ``narrow`` (an exact narrow copy) instead of the saved tensor, given back in ``dtype`` (``source``
        and ``version`` still watch the saved tensor for an edit in place)."""
        self.device_tensor, self.dtype = narrow, dtype


class AttentionOffloader:
    """Removable hooks that park everything an attention call (or a parked block's call) saves for backward.

    Args:
        session: the model's :class:`OffloadSession`.
        modules: the attention modules (declared attention regions) and the blocks a plan parks whole.
        blocks: which of ``modules`` are blocks parked whole (their calls are counted apart).
        weights: the weight streamer, if any: a saved tensor over a streamed block's uploaded weights is kept as a
            reference to them, never parked.
    """

    def __init__(
        self,
        session: OffloadSession,
        modules: list[nn.Module],
        *,
        blocks: frozenset[nn.Module] = frozenset(),
        weights: WeightStreamer | None = None,
    ) -> None:
        self.session = session
        self.modules = modules
        self.blocks = blocks
        self.weights = weights
        self.calls = 0  # attention calls parked
        self.block_calls = 0  # calls of blocks parked whole
        self.tensors_parked = 0
        self.hooks = HookRuns("attention")  # runs of the pre-hook, offloading or not
        self._handles: list[Any] = []
        self._active: list[tuple[nn.Module, Any, SavedGroup]] = []

    def install(self) -> None:
        for m in self.modules:
            # eager even inside a compiled block: the hooks manage saved-tensor hooks, never traced
            self._handles.append(m.register_forward_pre_hook(attached_hook(self._pre)))
            self._handles.append(m.register_forward_hook(attached_hook(self._post), always_call=True))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- step boundaries (a step listener of the region engine) ---------------------------------------------------

    def new_step(self) -> None:
        self.hooks.begin()

    def end_step(self) -> None:
        self.hooks.end(len(self.modules))

    def abort_step(self) -> None:
        self.hooks.cancel()

    def _pre(self, module: nn.Module, args: tuple) -> None:
        self.hooks.count += 1
        if not state.regions_may_open():  # inside a checkpointed region or a recompute: nothing to do
            return
        self.session.note_parameters(module)
        group = SavedGroup(self.session)
        # a partial, not a lambda: one Python frame less per saved tensor
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, group), self._unpack)
        hooks.__enter__()
        state.enter_region_call(functools.partial(self._undo, module, hooks))
        self._active.append((module, hooks, group))
        if module in self.blocks:
            self.block_calls += 1
        else:
            self.calls += 1

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active or self._active[-1][0] is not module:
            return
        _, hooks, group = self._active.pop()
        state.exit_region_call()
        hooks.__exit__(None, None, None)

    def _undo(self, module: nn.Module, hooks: Any) -> None:
        """The attention call was interrupted and never ended (:func:`memfit.engine.state.undo_open_calls`)."""
        hooks.__exit__(None, None, None)
        self._active = [a for a in self._active if a[0] is not module]

    def _pack(self, group: SavedGroup, tensor: torch.Tensor) -> SavedHandle | WeightRef | torch.Tensor:
        if self.weights is not None:  # a streamed block's weights: referenced, never parked
            ref = self.weights.reference(tensor)
            if ref is not None:
                return ref
        # a parameter or a view of one (a linear saves its weight transposed): kept as it is, with no handle (half
        # the tensors a LoRA attention call saves; the frames' own packing tells them apart the same way). A
        # parameter is a leaf, with no history to drop; a view of a trainable one has some.
        if type(tensor) is _PARAMETER:
            return tensor
        if type(tensor._base) is _PARAMETER:
            return without_history(tensor)
        if not self.session.worth_parking(tensor):
            state.note_held(tensor)  # stays on its device: the held-bytes meters must still see it
            return SavedHandle(None, tensor)
        handle = SavedHandle(group, tensor)  # parked with its group, two regions later (or kept: last)
        narrow = exact_narrow_dtype(tensor)
        if narrow is not None:
            if group.narrowed is None:
                group.narrowed = Narrowed()
            copy, saved = group.narrowed.of(tensor, narrow)
            handle.narrow_to(copy, tensor.dtype)
            self.session.copy.stats.bytes_narrowed += saved
        self.session.defer(group, handle)
        self.tensors_parked += 1
        return handle

    def _unpack(self, handle: SavedHandle | WeightRef | torch.Tensor) -> torch.Tensor:
        kind = type(handle)
        if kind is not SavedHandle:
            if kind is WeightRef:
                assert self.weights is not None
                return self.weights.unpack(handle)  # type: ignore[arg-type]
            return handle  # type: ignore[return-value]  # a parameter (or a view of one), kept as saved
        group = handle.group
        # its backward starts (parked, or kept as one of the step's last two calls: that one too reloads the
        # calls before it ahead of need; not while still pending, when a backward runs inside the forward)
        if group is not None and not group.started and (handle.parked is not None or group.kept_bytes):
            group.first_backward_use()
        if handle.parked is None:  # kept on the device (or backward ran inside the forward call)
            tensor = handle.device_tensor
            assert tensor is not None
        else:
            tensor = self.session.copy.fetch(handle.parked)
        # (most were never narrowed: no call for them)
        return tensor if handle.dtype is None else widened(tensor, handle.dtype)
