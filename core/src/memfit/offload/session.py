"""The offload session: what every parking region of one model's step shares.

Design notes
------------
One session per applied model. It owns the copy engine, and three things shared by every region of a
step (a region: one frame's saved inputs under the ``unsloth`` backends, or one attention call's saved
tensors under attention offload; :mod:`memfit.offload.regions`, :mod:`memfit.offload.attention`):

* a **dedup registry** — the same data entering many regions (time embedding, rotary tables, text context,
  one input saved as a new view by each of several ops) is parked once and shared; tensors below
  ``min_offload_bytes``, parameters and tensors not on the compute device stay where they are (copying them
  frees nothing worth a copy);
* a **timeline** of the step's regions in forward order. Backward visits them in reverse; when a region is
  first needed, the regions backward visits next are reloaded ahead (:mod:`memfit.offload.ahead`). Every
  region triggers this as its backward starts, also one that keeps its tensors on the device (the step's
  last two, ``auto``'s blocks that keep everything): otherwise the first parked region after them in
  backward would be reloaded only when needed, in the open;
* a **deferral** of every region's parking until two later regions have started: the step's last two
  regions never park (at the backward peak they are on the device anyway).

Host buffers go back to the pool when autograd frees the graph that needs them (or immediately when a
forward raises: :meth:`OffloadSession.abort_step`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from memfit.distributed import is_fsdp_module
from memfit.offload.ahead import PREFETCH_DEPTH, regions_ahead
from memfit.offload.copy import CopyEngine, Parked, copied_bytes

_LOOKAHEAD_SCAN = 16  # regions looked at per reload-ahead decision, parked or not


class ParkingRegion(Protocol):
    """A region of the step's timeline, as the session sees it (:class:`memfit.offload.regions.TimelineRegion`)."""

    number: int  # its place among the regions of the step (deferral)
    parked: list[Parked]
    parked_bytes: int  # of ``parked``
    kept_bytes: int

    def tensor_of(self, item: Any) -> torch.Tensor: ...

    def park(self, item: Any, parked: Parked) -> None: ...

    def keep(self, item: Any) -> None: ...

    def prefetch(self) -> None: ...


class OffloadSession:
    """Shared state of the offload backends for one model.

    Args:
        copy_engine: :class:`CopyEngine` (CUDA) or ``SyncCopyEngine`` (CPU tests).
        model: its parameters and buffers are never parked.
        min_offload_bytes: smaller tensors stay on the device.
        prefetch_depth: at most how many regions ahead (in backward order) to reload
            (:data:`memfit.offload.ahead.PREFETCH_DEPTH`).

    Attributes:
        reload_equal_ahead: reload a further region ahead also where it equals the bytes taken (the plan's
            choice, :mod:`memfit.offload.ahead`, "Equal regions two ahead"); set at each installation.
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
        self.reload_equal_ahead = False
        self._registry: dict[tuple, Parked] = {}  # _view_key -> parked copy, this step
        self._pending: list[tuple[ParkingRegion, Any]] = []  # (region, item) not parked yet, in region order
        self._regions_started = 0  # regions of this step so far (parking or not)
        self._timeline: list[weakref.ref[ParkingRegion]] = []
        self._step_parked: list[weakref.ref] = []
        self._param_storages: set[int] | None = None  # this step's parameter storages, read on first use
        self._call_param_storages: set[int] = set()
        # The model's parameters and buffers, listed once: walking thousands of modules (Flux with LoRA: 5.5k)
        # every step cost ~10 ms of host time. A parameter or buffer registered anywhere (PEFT adding
        # adapters) drops the list; storages are re-read every step (``.to()`` swaps them in place).
        self._static_tensors: list[torch.Tensor] | None = None
        self._static_local_shards = False  # any of them is a DTensor (read by its local shard)
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
        # read when the step first asks (``worth_parking``), not here: at the forward's start nothing is queued on
        # the device yet, so host time spent here is time the device waits
        self._param_storages = None

    def _read_param_storages(self) -> set[int]:
        """The storages of the model's parameters and buffers now (listed again after a registration)."""
        if self._static_tensors is None:
            # Only a storage of at least ``min_offload_bytes`` can hold a tensor worth parking (smaller tensors and
            # broadcast views are refused first in ``worth_parking``), so smaller ones are not re-read every step:
            # a LoRA model's many adapter weights are. The 8x margin covers a later dtype change of the weights
            # (fp8 to fp64) that the cached list would not notice.
            floor = self.min_offload_bytes // 8
            self._static_tensors = [
                t for t in (*self.model.parameters(), *self.model.buffers()) if _storage_nbytes(t) >= floor
            ]
            self._static_local_shards = any(hasattr(t, "_local_tensor") for t in self._static_tensors)
        return _storage_ptrs(self._static_tensors, local_shards=self._static_local_shards)

    @property
    def regions_started(self) -> int:
        """Regions of the latest step's timeline so far (parked or kept: frames, attention calls, blocks that
        keep everything in a plan that parks)."""
        return self._regions_started

    @property
    def static_tensors(self) -> list[torch.Tensor] | None:
        """The parameters and buffers whose storages are never parked, as listed at the latest step's first park
        (None until the next park after one was registered)."""
        return self._static_tensors

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
        kept: dict[tuple, torch.Tensor] = {}
        for region, item in self._pending:
            tensor = region.tensor_of(item)
            key = _view_key(tensor)
            parked = self._registry.get(key)
            # each view once (a view parked earlier this step counts there)
            if parked is None or not _still_parked(parked, tensor):
                kept.setdefault(key, tensor)
            region.keep(item)
        # as parking would have copied them
        self.copy.stats.bytes_kept_on_device += copied_bytes(
            list(kept.values()), storages_once=self.copy.parks_storages_once
        )
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
        if tensor.layout != torch.strided:
            return False
        logical = tensor.nbytes
        if logical < self.min_offload_bytes:
            return False
        if not tensor.is_cuda and not self.copy.parks_cpu_tensors:
            return False
        storage = tensor.untyped_storage()
        if storage.nbytes() < logical:
            # A broadcast (expanded) view, e.g. an attention mask: its storage is smaller than the tensor,
            # so parking it would copy — and later allocate — far more than it frees.
            return False
        ptr = storage.data_ptr()
        params = self._param_storages
        if params is None:
            params = self._param_storages = self._read_param_storages()
        return ptr not in params and ptr not in self._call_param_storages

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
        # (dicts keep insertion order: ``batch``'s is the order of ``fresh``)
        self._step_parked.extend(map(weakref.ref, new))
        self._registry.update(zip(batch, new, strict=True))
        if len(new) == len(tensors):  # nothing shared: the usual case
            return new
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

    def defer(self, region: ParkingRegion, item: Any) -> None:
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
        pending: list[tuple[ParkingRegion, Any]] = []
        later: list[tuple[ParkingRegion, Any]] = []
        for pair in self._pending:  # one pass: this runs as every region starts
            (pending if pair[0].number < before else later).append(pair)
        if not pending:
            return
        self._pending = later
        parked = self.park_many([region.tensor_of(item) for region, item in pending])
        for (region, item), p in zip(pending, parked, strict=True):
            region.park(item, p)

    def pinned_bytes_held(self) -> int:
        """Pinned host bytes the copy engine's pool holds, in use or kept for reuse."""
        return self.copy.pool.stats().pinned_bytes_held

    def register(self, region: ParkingRegion) -> int:
        """Add a parking region (has ``prefetch()``) to the step's timeline; returns its index."""
        self._timeline.append(weakref.ref(region))
        return len(self._timeline) - 1

    def needed(self, index: int, timeline: list[weakref.ref[ParkingRegion]] | None = None) -> None:
        """Region ``index`` is needed in backward now: reload the ones backward visits next
        (:func:`memfit.offload.ahead.regions_ahead`; a region's size is what it parked plus what it kept on the
        device, the step's last regions). A long run of empty regions ends the search after
        ``_LOOKAHEAD_SCAN`` of them (``test_on_equal_regions_one_region_is_reloaded_ahead``)."""
        timeline = self._timeline if timeline is None else timeline
        end = min(index, len(timeline))
        nearest: list[ParkingRegion | None] = []  # dereferenced as the rule asks for them (it stops early)

        def sizes() -> Iterator[int]:
            for i in range(end - 1, max(end - _LOOKAHEAD_SCAN, 0) - 1, -1):
                region = timeline[i]()
                nearest.append(region)
                yield 0 if region is None else region.parked_bytes + region.kept_bytes

        for position in regions_ahead(sizes(), self.prefetch_depth, equal_too=self.reload_equal_ahead):
            region = nearest[position]
            if region is not None and region.parked:
                region.prefetch()

    def snapshot_timeline(self) -> list[weakref.ref[ParkingRegion]]:
        """This step's timeline (a new list each step: regions of an earlier step keep their own)."""
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


def _storage_nbytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s storage (a DTensor's local shard's); a freed storage counts as large (kept listed)."""
    try:
        return getattr(tensor, "_local_tensor", tensor).untyped_storage().nbytes()
    except RuntimeError:
        return 1 << 62


def _storage_ptrs(tensors: Iterable[torch.Tensor], *, local_shards: bool = True) -> set[int]:
    """Storage addresses of ``tensors``; a DTensor (FSDP2's sharded parameter) counts by its local shard,
    and a freed storage (an FSDP2 unsharded parameter between calls) is skipped. ``local_shards=False``: the
    caller knows none is a DTensor (one pass, read every step)."""
    if not local_shards:
        try:
            ptrs = {t.untyped_storage().data_ptr() for t in tensors}
        except RuntimeError:  # a freed storage: the walk below skips it
            pass
        else:
            ptrs.discard(0)
            return ptrs
    ptrs = set()
    for t in tensors:
        local = getattr(t, "_local_tensor", t)
        try:
            ptr = local.untyped_storage().data_ptr()
        except RuntimeError:
            continue
        if ptr:
            ptrs.add(ptr)
    return ptrs
