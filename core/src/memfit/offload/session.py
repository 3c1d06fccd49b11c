"""What the offload backends install: parked frame entries and parked attention activations.

Design notes
------------
One session per applied model. It owns the copy engine, and two things shared by every
region of a step:

* a **dedup registry** — the same data entering many regions (time embedding, rotary
  tables, text context, one input saved as a new view by each of several ops) is parked
  once and shared; tensors below ``min_offload_bytes``, parameters and tensors not on the
  compute device stay where they are (copying them frees nothing worth a copy);
* a **timeline** of the step's regions in forward order. Backward visits them in reverse, so
  when region *i* is first needed, region *i-1* is reloaded ahead (its copy overlaps region
  *i*'s recompute/backward), and *i-2* too when *i-1* is the smaller one. Every region
  triggers this as its backward starts, also one that keeps its tensors on the device (the
  step's last two, ``auto``'s blocks that keep everything): otherwise the first parked region
  after them in backward would be reloaded only when needed, in the open;
* a **deferral** of every region's parking until two later regions have started: the step's
  last two regions never park (at the backward peak they are on the device anyway).

Entries (``unsloth`` backends) are parked by :class:`OffloadStash`, the frame's stash.
Attention activations (``offload_attention``) are parked by :class:`AttentionOffloader`
hooks: every tensor an attention call saves for backward goes to host memory and comes
back when backward unpacks it — no recompute. Inside a region call or a recompute
the attention hooks do nothing, so nothing is ever copied twice.

Host buffers go back to the pool when autograd frees the graph that needs them (or
immediately when a forward raises: :meth:`OffloadSession.abort_step`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from memfit.distributed import is_fsdp_module
from memfit.engine import state
from memfit.engine.install import HookRuns, eager_hook
from memfit.engine.stash import DeviceStash
from memfit.errors import MemfitError
from memfit.offload.copy import CopyEngine, Parked

# Most regions reloaded ahead in backward (see ``OffloadSession.needed`` for which): two, for a region whose
# backward is short (a Flux double block's text-stream FFN, 512 tokens, runs just before the image FFN in
# backward) and cannot hide the next reload on its own. The planner's peak model follows the same rule
# (``memfit.auto.planner.reloaded_ahead``).
PREFETCH_DEPTH = 2
_LOOKAHEAD_SCAN = 16  # regions looked at per reload-ahead decision, parked or not


class OffloadSession:
    """Shared state of the offload backends for one model.

    Args:
        copy_engine: :class:`CopyEngine` (CUDA) or ``SyncCopyEngine`` (CPU tests).
        model: its parameters and buffers are never parked.
        min_offload_bytes: smaller tensors stay on the device.
        prefetch_depth: at most how many regions ahead (in backward order) to reload (:data:`PREFETCH_DEPTH`).
    """

    def __init__(
        self,
        copy_engine: CopyEngine,
        model: nn.Module,
        *,
        min_offload_bytes: int = 1 << 20,
        prefetch_depth: int = PREFETCH_DEPTH,
    ) -> None:
        self.copy = copy_engine
        self.model = model
        self.min_offload_bytes = min_offload_bytes
        self.prefetch_depth = prefetch_depth
        self._registry: dict[tuple, Parked] = {}  # _view_key -> parked copy, this step
        self._pending: list[tuple[Any, Any]] = []  # (region, item) not parked yet, in region order
        self._regions_started = 0  # regions of this step so far (parking or not)
        self._timeline: list[weakref.ref] = []
        self._step_parked: list[weakref.ref] = []
        self._param_storages: set[int] = set()
        self._call_param_storages: set[int] = set()
        # The model's parameters and buffers, listed once: walking thousands of modules (Flux with LoRA: 5.5k)
        # every step cost ~10 ms of host time. A parameter or buffer registered anywhere (PEFT adding
        # adapters) drops the list; storages are re-read every step (``.to()`` swaps them in place).
        self._static_tensors: list[torch.Tensor] | None = None
        # memfit goes on after fully_shard (a later one is refused): sharding is known from here on
        self._sharded = any(is_fsdp_module(m) for m in model.modules())
        self._registration_hooks: list[Any] = []  # registered at the first step, removed by close()

    # -- step boundaries (called by the engine's model hooks) -----------------------------------------------------

    def new_step(self) -> None:
        # New containers, not cleared ones: regions of an earlier step keep their own timeline.
        self._registry = {}
        self._timeline = []
        self._step_parked = []
        self._pending = []
        self._regions_started = 0
        if not self._registration_hooks:
            # global hooks: held weakly (a model dropped without remove() must not be kept alive by them),
            # and removed with the session if remove() is never called
            hook = _weak_hook(self._tensors_registered)
            self._registration_hooks += [
                torch.nn.modules.module.register_module_parameter_registration_hook(hook),
                torch.nn.modules.module.register_module_buffer_registration_hook(hook),
            ]
            weakref.finalize(self, _remove_hooks, self._registration_hooks)
        if self._static_tensors is None:
            # Only a storage of at least ``min_offload_bytes`` can hold a tensor worth parking (smaller tensors and
            # broadcast views are refused first in ``worth_parking``), so smaller ones are not re-read every step:
            # a LoRA model's many adapter weights are. The 8x margin covers a later dtype change of the weights
            # (fp8 to fp64) that the cached list would not notice.
            floor = self.min_offload_bytes // 8
            self._static_tensors = [
                t for t in (*self.model.parameters(), *self.model.buffers()) if _storage_nbytes(t) >= floor
            ]
        self._param_storages = _storage_ptrs(self._static_tensors)

    def _tensors_registered(self, module: nn.Module, name: str, tensor: Any) -> None:
        self._static_tensors = None

    def close(self) -> None:
        """Remove the registration hooks (the handle's ``remove()``)."""
        _remove_hooks(self._registration_hooks)
        self._static_tensors = None

    def note_parameters(self, module: nn.Module) -> None:
        """Never park the parameters ``module`` uses in the call starting now.

        FSDP2 swaps in all-gathered (unsharded) parameters for each call and frees them afterwards, so
        they are looked up per call; replaced, not accumulated (a freed address may later hold an activation).
        An unsharded model's parameters are all in the step's set already: nothing to walk per call.
        """
        if self._sharded:
            self._call_param_storages = _storage_ptrs(module.parameters())

    def end_step(self) -> None:
        # The last two regions' tensors (frame entries, attention activations) were never parked: backward
        # needs the last region first and reloads the one before it as that one's backward begins, so at the
        # backward peak both are on the device anyway. A round trip through host memory would free nothing
        # there and cost two copies each (and the first reload of backward would wait for the forward's
        # last device→host copies).
        seen = set()
        for region, item in self._pending:
            tensor = region.tensor_of(item)
            key = _view_key(tensor)
            parked = self._registry.get(key)
            # each view once, as parking would have copied it (a view parked earlier this step counts there)
            if key not in seen and (parked is None or not _still_parked(parked, tensor)):
                seen.add(key)
                self.copy.stats.bytes_kept_on_device += tensor.numel() * tensor.element_size()
            region.keep(item)
        self._pending = []
        self._registry = {}  # a later forward must not share this step's parked tensors

    def abort_step(self) -> None:
        """The forward raised: give every buffer of this step back to the pool now."""
        self._pending = []
        for ref in self._step_parked:
            parked = ref()
            if parked is not None:
                self.copy.release(parked)
        self.new_step()

    # -- parking ----------------------------------------------------------------------------------------------------

    def worth_parking(self, tensor: torch.Tensor) -> bool:
        # Called for every saved tensor of a parking region (hundreds per step): cheapest tests first. A
        # parameter is recognised by its storage below (``isinstance(t, Parameter)`` costs a metaclass hook).
        logical = tensor.numel() * tensor.element_size()
        if logical < self.min_offload_bytes or tensor.layout != torch.strided:
            return False
        if not tensor.is_cuda and not self.copy.parks_cpu_tensors:
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() < logical:
            # A broadcast (expanded) view, e.g. an attention mask: its storage is smaller than the tensor,
            # so parking it would copy — and later allocate — far more than it frees.
            return False
        ptr = storage.data_ptr()
        return ptr not in self._param_storages and ptr not in self._call_param_storages

    def park(self, tensor: torch.Tensor) -> Parked:
        """Park ``tensor`` (or share the parked copy made earlier this step for the same tensor)."""
        return self.park_many([tensor])[0]

    def park_many(self, tensors: list[torch.Tensor]) -> list[Parked]:
        """Park tensors in one batch of copies; a view parked earlier this step is shared, not copied.

        Shared means the same data: the same storage, offset, shape, strides and dtype. Autograd often saves
        a fresh view object of one tensor per op (a LoRA layer's input, reshaped for each of q, k and v), so
        object identity alone would copy the same bytes several times.
        """
        slots: list[Parked | int] = []  # a Parked shared from earlier, or an index into ``fresh``
        fresh: list[torch.Tensor] = []
        batch: dict[tuple, int] = {}  # view key -> index into ``fresh``
        for tensor in tensors:
            key = _view_key(tensor)
            parked = self._registry.get(key)
            if parked is not None and _still_parked(parked, tensor):
                parked.users += 1
                self.copy.stats.dedup_hits += 1
                slots.append(parked)
            elif key in batch:
                slots.append(batch[key])
            else:
                batch[key] = len(fresh)
                slots.append(len(fresh))
                fresh.append(tensor)
        new = self.copy.offload_many(fresh)
        for key, parked in zip(batch, new, strict=True):  # dicts keep insertion order: the order of ``fresh``
            self._step_parked.append(weakref.ref(parked))
            self._registry[key] = parked
        result, seen = [], set()
        for slot in slots:
            if isinstance(slot, int):
                parked = new[slot]
                if slot in seen:  # the same view twice in this batch
                    parked.users += 1
                    self.copy.stats.dedup_hits += 1
                seen.add(slot)
                slot = parked
            result.append(slot)
        return result

    def unpark(self, parked: Parked) -> None:
        """One user is done with ``parked``; the last one returns its host buffer."""
        parked.users -= 1
        if parked.users <= 0:
            self.copy.release(parked)

    # -- reload ahead ---------------------------------------------------------------------------------------------

    def defer(self, region: Any, item: Any) -> None:
        """Park ``item``'s tensor (``region.tensor_of(item)``) once two later regions have started (see
        :meth:`end_step` for why); ``region.park(item, parked)`` or ``region.keep(item)`` then follows."""
        self._pending.append((region, item))

    def region_started(self) -> int:
        """Any region starts (parking or not); returns its number in the step. The deferred entries of the
        regions before the previous one are not among the step's last two: they are parked now."""
        self._regions_started += 1
        self.flush_deferred(before=self._regions_started - 1)
        return self._regions_started

    def flush_deferred(self, *, before: int) -> None:
        """Park the deferred tensors of the regions numbered below ``before``, in one batch of copies."""
        pending = [(region, item) for region, item in self._pending if region.number < before]
        self._pending = [(region, item) for region, item in self._pending if region.number >= before]
        if not pending:
            return
        parked = self.park_many([region.tensor_of(item) for region, item in pending])
        for (region, item), p in zip(pending, parked, strict=True):
            region.park(item, p)

    def register(self, region: Any) -> int:
        """Add a parking region (has ``prefetch()``) to the step's timeline; returns its index."""
        self._timeline.append(weakref.ref(region))
        return len(self._timeline) - 1

    def needed(self, index: int, timeline: list[weakref.ref] | None = None) -> None:
        """Region ``index`` is needed in backward now: reload the ones backward visits next.

        Always the next region that holds anything; a further one only while the regions ahead of it are
        smaller, up to ``prefetch_depth`` regions. A region's bytes (parked, or kept on the device as the
        step's last regions do) stand for its compute, as both grow with its tokens: a reload is issued early
        enough to hide behind the regions before it, and no earlier. On a stack of equal blocks that is one
        region ahead, which keeps one input less on the device at the backward peak than two
        (``test_on_equal_regions_one_region_is_reloaded_ahead``).
        """
        timeline = self._timeline if timeline is None else timeline
        ahead = visited = 0
        stop = max(
            min(index, len(timeline)) - _LOOKAHEAD_SCAN, 0
        )  # a long run of empty regions: give up there
        for j in range(min(index, len(timeline)) - 1, stop - 1, -1):
            region = timeline[j]()
            if region is None:
                continue
            parked = sum(p.nbytes for p in region.parked)
            size = parked + region.kept_bytes
            if not size:
                continue  # nothing there (or freed already)
            if visited == self.prefetch_depth or (visited and ahead >= size):
                return
            if parked:
                region.prefetch()
            ahead += size
            visited += 1

    def snapshot_timeline(self) -> list[weakref.ref]:
        return self._timeline


def _weak_hook(method: Callable[..., None]) -> Callable[..., None]:
    """A hook that calls ``method`` while its object lives, without keeping it alive."""
    ref = weakref.WeakMethod(method)

    def hook(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return hook


def _remove_hooks(handles: list[Any]) -> None:
    for h in handles:
        h.remove()
    handles.clear()


def _view_key(tensor: torch.Tensor) -> tuple:
    """What makes two tensors the same data: storage address, offset, shape, strides, dtype."""
    # (``tensor.shape`` is a tuple subclass that hashes and compares as the tuple: no copy needed)
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
    )


def _still_parked(parked: Parked, tensor: torch.Tensor) -> bool:
    """``parked`` still holds ``tensor``'s data: its buffer is held, the storage it copied is the tensor's and
    still alive (so its address was not reused; the view it was copied through may be gone), unmodified since."""
    storage = parked.storage() if parked.storage is not None else None
    return (
        parked.buffer is not None
        and storage is not None
        and storage is tensor.untyped_storage()
        and tensor._version == parked.version
    )


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
        region = pending.pop()
        inputs = {id(a) for a in tree_flatten((args, kwargs))[0]}  # an input passed through is not its output
        for out in tree_flatten(output)[0]:
            if isinstance(out, torch.Tensor) and out.requires_grad and id(out) not in inputs:
                out.register_hook(region.backward_reached)

    kept = {id(block): nbytes for block, nbytes in blocks}
    handles = []
    for block, _ in blocks:
        handles.append(block.register_forward_pre_hook(eager_hook(started)))
        handles.append(block.register_forward_hook(eager_hook(returned), with_kwargs=True, always_call=True))
    return handles


def _storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage (a DTensor's local shard's); a freed storage counts as large (kept listed)."""
    try:
        return getattr(tensor, "_local_tensor", tensor).untyped_storage().nbytes()
    except RuntimeError:
        return 1 << 62


def _storage_ptrs(tensors: Any) -> set[int]:
    """Storage addresses of ``tensors``; a DTensor (FSDP2's sharded parameter) counts by its local shard,
    and a freed storage (an FSDP2 unsharded parameter between calls) is skipped."""
    ptrs: set[int] = set()
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        if ptr:
            ptrs.add(ptr)
    return ptrs


class _ParkingRegion:
    """A region of the step's timeline whose tensors are parked: numbered as it starts (the deferral of
    :meth:`OffloadSession.region_started`) and registered for reload-ahead (:meth:`OffloadSession.needed`).
    Subclasses say how one of their items is parked (``tensor_of``, ``park``) or kept (``keep``)."""

    def __init__(self, session: OffloadSession) -> None:
        self.session = session
        self.parked: list[Parked] = []
        self.kept_bytes = 0  # worth parking, but stays on the device (the step's last two regions)
        self.number = session.region_started()
        self.timeline = session.snapshot_timeline()
        self.index = session.register(self)
        self.started = False  # its backward has begun (see first_backward_use)

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


class OffloadStash(_ParkingRegion):
    """A frame's stash for the ``unsloth`` backends: entries are parked in host memory.

    A handle is a small list ``[state, value, source]``: ``("device", tensor)`` kept on the device,
    ``("pending", alias, tensor)`` waiting for two later regions to start, ``("parked", Parked)``.
    """

    def put(self, tensor: torch.Tensor) -> list:
        if not self.session.worth_parking(tensor):
            return ["device", tensor.detach(), None]
        handle = ["pending", tensor.detach(), tensor]
        self.session.defer(self, handle)
        return handle

    @staticmethod
    def tensor_of(handle: list) -> torch.Tensor:
        return handle[2]

    def park(self, handle: list, parked: Parked) -> None:
        self.parked.append(parked)
        handle[:] = ["parked", parked, None]

    def keep(self, handle: list) -> None:
        """The entry stays on the device (a last region's)."""
        handle[:] = ["device", handle[1], None]
        self.kept_bytes += handle[1].untyped_storage().nbytes()
        state.note_held(handle[1])

    def get(self, handle: list) -> torch.Tensor:
        kind, value, _ = handle
        return self.session.copy.fetch(value) if kind == "parked" else value

    def resident(self, handle: list) -> torch.Tensor | None:
        return handle[1] if handle[0] == "device" else None

    def version(self, handle: list) -> int:
        kind, value, _ = handle
        if kind != "parked":
            return value._version
        source = value.source() if value.source is not None else None
        return source._version if source is not None else value.version

    def on_recompute(self) -> None:
        self.backward_starts()

    def release_all(self) -> None:
        parked, self.parked = self.parked, []
        for p in parked:
            self.session.unpark(p)


class _KeepingRegion(_ParkingRegion):
    """A call of a block that keeps everything on the device, in a plan that also parks (``auto``): it parks
    nothing, its kept bytes stand for its backward's compute in the reload-ahead rule, and when its backward
    starts (the gradient of its output arrives) it reloads the parked regions before it ahead of need."""

    def __init__(self, session: OffloadSession, kept_bytes: int) -> None:
        super().__init__(session)
        self.kept_bytes = kept_bytes

    def backward_reached(self, grad: torch.Tensor) -> None:
        """Hook on its outputs' gradients: the first one to arrive starts its backward."""
        self.first_backward_use()


class _SavedGroup(_ParkingRegion):
    """The tensors one attention call saved, parked together (a timeline region)."""

    def __init__(self, session: OffloadSession) -> None:
        super().__init__(session)
        weakref.finalize(self, _release_group, session, self.parked)

    @staticmethod
    def tensor_of(handle: _SavedHandle) -> torch.Tensor:
        tensor = handle.device_tensor
        assert tensor is not None
        if tensor._version != handle.version:
            # parked two regions after the call (or kept): what backward would get is not what was saved
            raise MemfitError(
                "a tensor an attention call saved for backward was modified in place after the call (autograd "
                "rejects that too, at backward); make the edit out of place, or do not offload this attention "
                "(gradient_checkpointing_offload_attention: false)."
            )
        return tensor

    def park(self, handle: _SavedHandle, parked: Parked) -> None:
        handle.parked, handle.device_tensor = parked, None
        self.parked.append(parked)

    def keep(self, handle: _SavedHandle) -> None:
        """The activation stays on the device (a last region's)."""
        tensor = self.tensor_of(handle)
        state.note_held(tensor)
        self.kept_bytes += tensor.numel() * tensor.element_size()


def _release_group(session: OffloadSession, parked: list[Parked]) -> None:
    for p in parked:
        session.unpark(p)
    parked.clear()


class _SavedHandle:
    __slots__ = ("group", "parked", "device_tensor", "version")

    def __init__(self, group: _SavedGroup | None, parked: Parked | None, device_tensor: torch.Tensor | None):
        self.group = group
        self.parked = parked
        self.device_tensor = device_tensor
        self.version = device_tensor._version if device_tensor is not None else 0


class AttentionOffloader:
    """Removable hooks that park everything an attention call saves for backward.

    Args:
        session: the model's :class:`OffloadSession`.
        modules: the attention modules (declared attention regions).
    """

    def __init__(self, session: OffloadSession, modules: list[nn.Module]) -> None:
        self.session = session
        self.modules = modules
        self.calls = 0
        self.tensors_parked = 0
        self.hooks = HookRuns("attention")  # runs of the pre-hook, offloading or not
        self._handles: list[Any] = []
        self._active: list[tuple[nn.Module, Any, _SavedGroup]] = []

    def install(self) -> None:
        for m in self.modules:
            # eager even inside a compiled block: the hooks manage saved-tensor hooks, never traced
            self._handles.append(m.register_forward_pre_hook(eager_hook(self._pre)))
            self._handles.append(m.register_forward_hook(eager_hook(self._post), always_call=True))

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
        group = _SavedGroup(self.session)
        # a partial, not a lambda: one Python frame less per saved tensor
        hooks = torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, group), self._unpack)
        hooks.__enter__()
        state.enter_region_call()
        self._active.append((module, hooks, group))
        self.calls += 1

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not self._active or self._active[-1][0] is not module:
            return
        _, hooks, group = self._active.pop()
        state.exit_region_call()
        hooks.__exit__(None, None, None)

    def _pack(self, group: _SavedGroup, tensor: torch.Tensor) -> _SavedHandle:
        if not self.session.worth_parking(tensor):
            state.note_held(tensor)  # stays on its device: the held-bytes meters must still see it
            return _SavedHandle(None, None, tensor)
        handle = _SavedHandle(group, None, tensor)  # parked with its group, two regions later (or kept: last)
        self.session.defer(group, handle)
        self.tensors_parked += 1
        return handle

    def _unpack(self, handle: _SavedHandle) -> torch.Tensor:
        group = handle.group
        # its backward starts (parked, or kept as one of the step's last two calls: that one too reloads the
        # calls before it ahead of need; not while still pending, when a backward runs inside the forward)
        if group is not None and (handle.parked is not None or group.kept_bytes):
            group.first_backward_use()
        if handle.parked is None:  # kept on the device (or backward ran inside the forward call)
            assert handle.device_tensor is not None
            return handle.device_tensor
        return self.session.copy.fetch(handle.parked)
