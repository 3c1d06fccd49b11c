"""Weight streaming: the frozen weights of chosen blocks live in host memory and are uploaded ahead of need.

Design notes (``docs/weight-streaming.md`` has the longer story)
----------------------------------------------------------------
What streams.  Every frozen parameter of a streamed block (``requires_grad=False``, a plain ``nn.Parameter``
over a plain strided floating-point tensor laid out densely) gets a host master: a view into one host buffer per
block (page-locked on CUDA), filled once at installation. Its ``param.data`` becomes a placeholder: one NaN
element expanded to the parameter's shape, on its device, in its dtype (``.shape``, ``.dtype``, ``.device``
answer as before; a read outside the block's forward gives NaN, never a plausible wrong number). Left resident,
on purpose: trainable parameters (LoRA), non-floating ones, parameters whose storage another parameter or buffer
shares (tied weights: an upload would untie them), non-dense layouts and empty ones. Refused with an error: a
frozen parameter that is a tensor subclass (quantized weights, DTensor): its bytes are not a plain copy.

Upload.  A forward pre-hook on the block points its parameters at views of one device buffer holding the block's
bytes, uploaded in one copy; a forward post-hook puts the placeholders back. The hooks run for the forward and
for the recompute alike. A streamed block recomputed whole (the fixed knob's, and ``auto``'s where cheapest) saves
holders only: once its forward returns, nothing but the parameters pointed at the upload, and it is freed. In
backward the recompute uploads again; the recomputed saved tensors (views of the upload) keep it until the
block's backward has used them. Any other policy saves references instead ("Saved weights").

Ahead of need.  In forward, when streamed block ``k`` starts, the next ``forward_ahead`` streamed blocks in call
order are uploaded (the first ones when the forward starts); at the end of a forward with gradients, the last
``ahead`` ones (backward needs them first); when block ``k``'s backward starts (the first gradient reaches one of
its outputs), the ``ahead`` streamed blocks before it, once the blocks after it let go of theirs. An upload's copy
starts only where compute was when it was issued (its buffer is free from there), so issued before any kernel of
that backward (and before the reloads its regions issue then) it hides behind all of it; issued later, when the
block recomputes or reads its first weight, it waits (docs/weight-streaming.md, "Ahead of need"). So at
most ``max(ahead, forward_ahead) + 1`` streamed blocks are on the device at once. ``1`` both ways by default: in
backward a block's recompute and backward hide the next upload; in forward the resident blocks between two
streamed ones do (the streamed blocks are spread over the call order for that). A block's forward is a third of
its backward, so where the forward's uploads do not hide one block ahead, ``auto`` may lead them further (its
plan says how far: :mod:`memfit.auto.streaming`); the link copies one at a time either way.

Saved weights.  A streamed block whose plan does not recompute it whole (``auto``: keep, FFN recompute, attention
offload, parked whole) saves its weights for backward like any layer: a linear keeps its weight, or a view of it.
Held, they would hold the upload from the forward to the backward. So while such a block's forward runs (outside
a recompute, with gradients) the streamer's saved-tensor hooks are on: a saved tensor over the running upload is
kept as a :class:`WeightRef` (which weights, which view), everything else as it is; inner regions' hooks (attention
offload, a parked block) ask :meth:`WeightStreamer.reference` first. In backward the first reference of the block
unpacked uploads its weights (or takes the upload issued ahead) and issues the uploads of the ``ahead`` streamed
blocks before it; the reference becomes the same view of that upload. A region recomputed inside such a block (its
FFN) runs with its layers' weights pointed at that upload by hooks on each layer that owns streamed weights.

Turnarounds.  Two uploads would have nothing to hide behind: the last streamed block's for the backward that
starts with it, and the first one's for the next step's forward. Both blocks have just used those weights, and
the weights are frozen. With ``keep_last`` the last streamed block's forward upload is kept for its recompute
(it would be uploaded again at the forward's end anyway); with ``keep_first`` = *K* the first *K* streamed
blocks' recompute uploads (the backward's last) are kept for the next forward, whose uploads then start at the
*K*-th. Kept uploads are held between steps, through the optimizer step and the forward of the blocks before
them: the plan chooses *K* (the fixed knob: 1 where the plan's first block streams, since nothing runs before it;
``auto`` more where the forward's uploads queue on the link and the memory is there,
:mod:`memfit.auto.streaming`). Both assume the regions memfit installs: a kept forward upload is not checked for
being held after the forward.

Streams (CUDA).  Mirrors :mod:`memfit.offload.copy`: the device buffer is allocated on the compute stream, the
upload stream waits for an event recorded there after the allocation, copies, and records a done event; the
compute stream waits for that event before the parameters point at the buffer. Every upload is waited for before
it is dropped (also one never used), so no ``record_stream`` is needed. Nothing is ever copied back: the host
master is the truth.

Without streams (a model on the CPU: tests, CPU-only machines) the same bookkeeping runs with synchronous
copies.

Where the weights start.  The streamer's ``device`` is where the model trains; a weight may start elsewhere (a
model loaded on the CPU, too large for the card: ``memfit.apply(..., device=)``). Its master is filled from
where it is and its placeholder made on ``device``, so a streamed weight never passes through the device at
installation. Each weight remembers that place (its home): :meth:`WeightStreamer.remove` puts it back there,
while a block that stops streaming in a re-plan comes back to ``device``, where the model trains.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import math
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import memfit.offload.hostmem as hostmem
from memfit.distributed import is_fsdp_module
from memfit.engine import state
from memfit.engine.hooks import Attached, attached_hook, on_first_gradient, queue_at_backward_end
from memfit.errors import HostMemoryError, MemfitError, MemfitWarning, NotAvailableError
from memfit.offload.copy import StreamApi
from memfit.offload.streamable import STREAM_KEY, streamable_parameters
from memfit.units import format_bytes

_ALIGN = 512  # bytes: where each parameter starts in a block's buffer (the caching allocator's alignment)
UPLOADS_AHEAD = 1  # streamed blocks uploaded ahead of the one running (see "Ahead of need")
# backward's uploads issued as the block after starts its backward ("Ahead of need"; off: when it recomputes or
# reads its first weight; a benchmark's switch, not a user's)
UPLOADS_AT_BACKWARD_START = True


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


# -- the streamer -----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class _Weight:
    """One streamed parameter: where its bytes sit in the block's buffers, and its placeholder."""

    param: nn.Parameter
    name: str  # in its block, at installation (for messages)
    offset: int  # bytes into the block's buffers
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    placeholder: torch.Tensor
    home: torch.device  # where it was when streaming began (``remove`` puts it back there)
    master: torch.Tensor | None = None  # a view of the host buffer


@dataclass(eq=False)
class _Block:
    """One streamed block: its weights, its host buffer, its place among the streamed blocks."""

    name: str
    module: nn.Module
    position: int
    weights: list[_Weight]
    nbytes: int  # its buffers' size (each weight at an ``_ALIGN`` boundary)
    payload: int  # the weights' own bytes
    host: torch.Tensor | None = None
    handles: list[Any] = field(default_factory=list)  # its hooks while it streams
    # calls of the block made while it runs (a profiler measuring it alone): they share its upload
    nested: int = 0
    referenced: bool = False  # its forward saves references to its weights, not the weights ("Saved weights")
    scope: Any = None  # the saved-tensor hooks of its forward while they are on


@dataclass(eq=False)
class _Upload:
    """One upload of a block's weights to the device: the buffer, the parameters' views of it, its done event."""

    block: _Block
    views: list[torch.Tensor]
    storage: weakref.ref  # the device buffer's storage: alive while any view of it is
    buffer: torch.Tensor | None = None  # the buffer itself (a reference unpacked in backward is viewed in it)
    done: Any = None  # the upload stream's event after the copy (None: synchronous)
    started: Any = None  # a timing event before the copy (CUDA timing)
    waited: bool = False


@dataclass(frozen=True, eq=False)
class WeightRef:
    """A tensor a streamed block's forward saved over its uploaded weights, kept as where it lies ("Saved
    weights"): backward views the same place of the block's next upload."""

    block: _Block
    dtype: torch.dtype
    shape: torch.Size
    stride: tuple[int, ...]
    offset: int  # elements of ``dtype`` from the start of the block's buffer


@dataclass
class WeightStats:
    """Counters of one streamer (``handle.stats()`` shows them)."""

    uploads: int = 0
    bytes_uploaded: int = 0
    uploads_on_demand: int = 0  # issued when the block was needed, not ahead of it
    uploads_kept: int = 0  # kept at a turnaround for the block's next use instead of uploading again
    max_alive: int = 0  # most streamed blocks on the device at once (uploads alive)
    held_after_forward: int = 0  # forward uploads still referenced when the forward returned (should stay 0)
    weights_referenced: int = 0  # saved tensors over an upload kept as a WeightRef ("Saved weights")
    wait_events: list[tuple[Any, Any]] = field(default_factory=list)  # forward's
    backward_wait_events: list[tuple[Any, Any]] = field(default_factory=list)  # recompute's and backward's
    copy_events: list[tuple[Any, Any]] = field(default_factory=list)
    wait_ms: float = 0.0
    backward_wait_ms: float = 0.0
    copy_ms: float = 0.0


class WeightStreamer:
    """Streams the frozen weights of some blocks from host memory (see the module notes).

    Args:
        model: the model (its other parameters and buffers are checked for shared storage; FSDP2 is refused).
        blocks: (name, block) of the streamed blocks, in call order.
        streams: the stream and event calls; ``None`` copies synchronously (a model on the CPU).
        device: where the model trains: uploads and placeholders go there (default: where the first streamed
            weight is). A weight elsewhere (on the CPU) is copied to its master from there ("Where the weights
            start").
        ahead: streamed blocks uploaded ahead of the one running (:data:`UPLOADS_AHEAD`).
        forward_ahead: the same in forward (default: ``ahead``).
        keep_last: keep the last streamed block's forward upload for its recompute ("Turnarounds").
        keep_first: how many of the first streamed blocks keep the upload of their recompute for the next forward
            ("Turnarounds"; ``True`` is 1).
        available_host_bytes: host RAM that can still be allocated (default: :mod:`memfit.offload.hostmem`).
        host_reserve_bytes: RAM left free for the rest of the process (default: 10% of the host, at least 2 GiB).
        allocate: ``allocate(nbytes, pinned)`` returns a 1-D ``uint8`` CPU tensor (default: exact pinning).
        timing: time the waits and copies with events (CUDA).

    Raises:
        NotAvailableError: the model is sharded with FSDP2, or a frozen weight is a tensor subclass.
        MemfitError: a block has no frozen weight to stream.
        HostMemoryError: the host masters do not fit in host RAM.

    Example:
        >>> streamer = WeightStreamer(model, [("blocks.3", model.blocks[3])])  # doctest: +SKIP
        >>> streamer.install()  # doctest: +SKIP
        >>> ...  # forward and backward through memfit's installation
        >>> streamer.remove()  # doctest: +SKIP
    """

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        *,
        streams: StreamApi | None = None,
        device: torch.device | None = None,
        ahead: int = UPLOADS_AHEAD,
        forward_ahead: int | None = None,
        keep_last: bool = False,
        keep_first: int = 0,
        available_host_bytes: Callable[[], int] | None = None,
        host_reserve_bytes: int | None = None,
        allocate: Callable[[int, bool], torch.Tensor] = hostmem.allocate_host,
        timing: bool = True,
    ) -> None:
        forward_ahead = ahead if forward_ahead is None else forward_ahead
        if min(ahead, forward_ahead) < 1:
            raise ValueError(f"ahead and forward_ahead must be 1 or more, not {ahead} and {forward_ahead}")
        if keep_first < 0:
            raise ValueError(f"keep_first counts streamed blocks: 0 or more, not {keep_first}")
        if any(is_fsdp_module(m) for m in model.modules()):
            raise NotAvailableError(
                f"{STREAM_KEY} does not work with FSDP2 (fully_shard): sharding already spreads the weights over "
                f"the ranks, and a sharded weight is gathered per call, not a tensor memfit can keep in host "
                f"memory. Unset {STREAM_KEY} (or set it to 0) under FSDP2."
            )
        self.model = model
        self.streams = streams
        self.ahead = ahead
        self.forward_ahead = forward_ahead
        self.keep_last = keep_last
        self.keep_first = int(keep_first)
        self.timing = timing and streams is not None
        self._available = available_host_bytes or hostmem.available_host_bytes
        self._reserve = host_reserve_bytes
        self._allocate = allocate
        self._fixed_device = device is not None
        self.device = device if device is not None else first_weight_device(blocks)
        self.blocks = self._plan(blocks)
        self._index()
        self.stats = WeightStats()
        self.pinned_bytes = 0
        self.host_allocations = 0  # host buffers allocated (at installation only: none in the steady state)
        self._pending: dict[_Block, _Upload] = {}  # uploaded ahead, not used yet
        self._active: dict[_Block, _Upload] = {}  # the block is running on it
        self._backward: dict[_Block, _Upload] = {}  # a referenced block's backward runs on it
        # layers pointed at an upload for a recompute inside a block
        self._pointed: dict[nn.Module, _Upload] = {}
        self._alive: list[weakref.ref] = []  # storages of uploads (dead ones pruned as uploads are issued)
        self._forward_uploads: list[tuple[_Block, weakref.ref]] = []  # this forward's, checked as it returns
        self._training = False
        self._prefetch = True  # off while ``auto`` profiles (:meth:`profiling`)
        self._warned_held = False
        self._end_queued = False  # a callback at the end of the running backward is queued
        self._h2d: Any = None
        self.installed = False

    # -- installation ------------------------------------------------------------------------------------------

    def _plan(self, blocks: Sequence[tuple[str, nn.Module]]) -> list[_Block]:
        shared = _shared_storages(self.model)
        planned = []
        for position, (name, module) in enumerate(blocks):
            weights, offset, payload = [], 0, 0
            for pname, p in streamable_parameters(module):
                if _storage_ptr(p) in shared:
                    continue  # tied to another parameter or buffer: an upload would untie them
                placeholder = torch.full((), math.nan, dtype=p.dtype, device=self.device).expand(p.shape)
                weights.append(_Weight(p, pname, offset, p.shape, p.stride(), p.dtype, placeholder, p.device))
                nbytes = p.numel() * p.element_size()
                offset += _padded(nbytes)
                payload += nbytes
            if not weights:
                raise MemfitError(
                    f"{STREAM_KEY}: block {name} ({type(module).__name__}) has no frozen weight memfit can stream "
                    f"(every weight trains, or is tied to another). Freeze the base weights before memfit.apply "
                    f"(model.requires_grad_(False), then add LoRA), or stream fewer blocks."
                )
            planned.append(_Block(name, module, position, weights, offset, payload))
        return planned

    def install(self) -> None:
        """Copy every streamed weight to its host master (blocks that kept theirs through :meth:`suspend` reuse
        it), swap in the placeholders and add the hooks."""
        if self.installed:
            return
        self._check_host_memory([b for b in self.blocks if b.host is None])
        if self.streams is not None and self._h2d is None:
            self._h2d = self.streams.new_stream()
        for block in self.blocks:
            self._stream(block)
        self.installed = True

    def _stream(self, block: _Block) -> None:
        """``block``'s weights to their host master (made once), placeholders in their place, its hooks on."""
        if block.host is None:
            pinned = self.device.type == "cuda"
            host = self._allocate(block.nbytes, pinned)
            self.host_allocations += 1
            typed: dict[torch.dtype, torch.Tensor] = {}
            for w in block.weights:
                w.master = _view(host, w, typed)
                w.master.copy_(w.param.data)
            block.host = host
            self.pinned_bytes += block.nbytes if pinned else 0
        for w in block.weights:
            w.param.data = w.placeholder
        state.mark_streamed([w.param for w in block.weights], streamed=True)
        module = block.module
        block.handles = [
            module.register_forward_pre_hook(attached_hook(self._pre)),
            module.register_forward_hook(attached_hook(self._post), always_call=True),
            # first among the block's forward hooks: its outputs' gradient hooks run before those of the regions
            # that reload activations as the block's backward starts ("Ahead of need")
            module.register_forward_hook(
                attached_hook(self._watch_backward_start), with_kwargs=True, prepend=True
            ),
            module.register_state_dict_post_hook(_StateDictHook(self._state_dict)),
            module.register_load_state_dict_pre_hook(Attached(self._refuse_load)),
        ]
        for layer in _layers_with(block):  # a region recomputed inside the block ("Saved weights")
            block.handles.append(layer.register_forward_pre_hook(attached_hook(self._layer_pre)))
            block.handles.append(
                layer.register_forward_hook(attached_hook(self._layer_post), always_call=True)
            )

    def _restore(
        self, block: _Block, *, home: bool = False, homes: Mapping[int, torch.device] | None = None
    ) -> None:
        """``block``'s weights back on the device (``home``: where each was when it began streaming, or where
        ``homes`` says by parameter id) from their host master (kept), its hooks off."""
        for uploads in (self._pending, self._active, self._backward):
            upload = uploads.pop(block, None)
            if upload is not None:
                self._settle(upload)
        for handle in block.handles:
            handle.remove()
        block.handles = []
        state.mark_streamed([w.param for w in block.weights], streamed=False)
        for w in block.weights:
            assert w.master is not None
            device = _home(w, homes) if home else self.device
            restored = torch.empty_strided(w.shape, w.stride, dtype=w.dtype, device=device)
            w.param.data = restored.copy_(w.master)

    def _check_host_memory(self, blocks: list[_Block]) -> None:
        """The host masters of ``blocks`` fit in host RAM. Weights that start on the host (a model loaded on the
        CPU, trained on a GPU) give their memory back block by block as their masters fill, so it counts as
        free, less the largest block's buffer (its master and its weights exist together for a moment)."""
        need = sum(b.nbytes for b in blocks)
        if not need:
            return
        released = 0
        if self.device.type != "cpu":
            released = sum(
                w.shape.numel() * w.dtype.itemsize for b in blocks for w in b.weights if w.home.type == "cpu"
            )
            released = max(0, released - max(b.nbytes for b in blocks))
        reserve = self._reserve if self._reserve is not None else hostmem.default_host_reserve()
        available = int(self._available())
        if need > available - reserve + released:
            also = (
                f" (plus {format_bytes(released)} the weights free as they leave the CPU)" if released else ""
            )
            raise HostMemoryError(
                f"{STREAM_KEY}: the frozen weights of {len(blocks)} streamed block(s) need "
                f"{format_bytes(need)} of host memory, but {format_bytes(max(0, available))} is available{also} and "
                f"{format_bytes(reserve)} of it is kept free for the rest of the process. Stream fewer blocks "
                f"(a smaller {STREAM_KEY}), or free host RAM (fewer dataloader workers, smaller caches)."
            )

    def remove(self, *, homes: Mapping[int, torch.device] | None = None) -> None:
        """Put every streamed weight back where it was when it began streaming (same values, same Parameter
        objects); free the masters.

        Args:
            homes: by parameter id, where a weight goes instead (where it was before something else moved it to
                the device: ``memfit.placement``), so that it never comes back to the device on its way there.
        """
        for block in self.blocks:
            if self.installed:
                self._restore(block, home=True, homes=homes)
            else:  # suspended: on the device, where the model trains; home may be elsewhere
                for w in block.weights:
                    home = _home(w, homes)
                    if w.param.device != home:
                        w.param.data = w.param.data.to(home)
            self._release(block)
        self.installed = False

    def suspend(self) -> None:
        """Put every streamed weight back on its device and take the hooks off, keeping the host masters: a later
        :meth:`install` streams again without copying to host memory (``auto`` profiles a new input shape on the
        model with all its weights in place)."""
        if not self.installed:
            return
        for block in self.blocks:
            self._restore(block)
        self.installed = False

    def retarget(self, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        """Stream ``blocks`` (name, block; in call order) from now on (installed) or from the next :meth:`install`.
        Blocks streamed before keep their host masters and placeholders; blocks no longer streamed get their
        weights back on the device and their masters freed; new ones are copied to host memory (installed: now).

        Raises:
            MemfitError: a new block has no frozen weight to stream.
            HostMemoryError: installed, and the new blocks' masters do not fit in host RAM.
        """
        kept = {b.module: b for b in self.blocks}
        fresh = self._plan([(name, m) for name, m in blocks if m not in kept])
        by_module = {b.module: b for b in fresh}
        planned = []
        for position, (name, module) in enumerate(blocks):
            block = kept.pop(module, None) or by_module[module]
            block.name, block.position = name, position
            planned.append(block)
        if self.installed:
            self._check_host_memory(fresh)
            for block in fresh:  # first: taking weights off the device makes room for those that come back
                self._stream(block)
        for block in kept.values():  # no longer streamed
            if self.installed:
                self._restore(block)
            self._release(block)
        self.blocks = planned
        self._index()
        if planned and not self._fixed_device:
            self.device = planned[0].weights[0].param.device

    def _index(self) -> None:
        self._by_module = {b.module: b for b in self.blocks}
        # each layer that owns streamed weights: its block and which of the block's weights are its own
        self._by_layer: dict[nn.Module, tuple[_Block, list[int]]] = {
            layer: (b, own) for b in self.blocks for layer, own in _layers_with(b).items()
        }

    def reference_saves(self, modules: Iterable[nn.Module]) -> None:
        """The streamed blocks among ``modules`` save references to their weights from now on, not the weights
        ("Saved weights": their plan does not recompute them whole); every other streamed block saves nothing of
        them past its forward (it is recomputed whole)."""
        chosen = set(modules)
        for block in self.blocks:
            block.referenced = block.module in chosen

    def _release(self, block: _Block) -> None:
        """Free ``block``'s host master (its weights are on the device)."""
        if block.host is None:
            return
        for w in block.weights:
            w.master = None
        if self.device.type == "cuda":
            self.pinned_bytes -= block.nbytes
        block.host = None

    # -- step boundaries (the installation forwards the model's) ---------------------------------------------------

    @contextlib.contextmanager
    def profiling(self) -> Iterator[None]:
        """While ``auto`` profiles the model with these weights streaming (a card that cannot hold them all): the
        uploads waiting are dropped and none is made ahead of need, so the only streamed weights on the device are
        those of the block running (the profile adds them back to its static bytes)."""
        for block in list(self._pending):
            self._settle(self._pending.pop(block))
        self._prefetch = False
        try:
            yield
        finally:
            self._prefetch = True

    def begin_forward(self) -> None:
        """The model's forward starts: drop stale uploads, upload the first streamed blocks."""
        self._training = torch.is_grad_enabled()
        if self.timing:  # fold the completed timing events into the totals (the lists never grow past a step)
            self.wait_ms()
            self.copy_ms()
        self._forward_uploads.clear()
        self._end_backward()
        self._end_interrupted_calls()
        first = self.blocks[: self.forward_ahead]
        # the first ones' uploads wait: issued ahead, or kept from their last recompute ("Turnarounds")
        waiting = self.blocks[: max(self.forward_ahead, self.keep_first)]
        for block in [b for b in self._pending if b not in waiting]:
            self._settle(self._pending.pop(block))
        for block in first:
            self._ensure(block)

    def _end_interrupted_calls(self) -> None:
        """A forward interrupted inside a streamed block (a ``KeyboardInterrupt`` skips its post-hook) left it
        running: its weights go back to their placeholders, its upload is dropped."""
        for layer in list(self._pointed):
            self._layer_post(layer, (), None)
        for block in list(self._active):
            self._settle(self._active.pop(block))
            self._close_scope(block)  # (already undone with the thread's open calls)
            block.nested = 0
            for w in block.weights:
                w.param.data = w.placeholder

    def end_forward(self, *, failed: bool) -> None:
        """The model's forward returned (or raised): check nothing kept a forward upload; upload for backward."""
        held = [b.name for b, storage in self._forward_uploads if storage() is not None]
        self._forward_uploads.clear()
        if held and not failed:
            self.stats.held_after_forward += len(held)
            if not self._warned_held:
                self._warned_held = True
                warnings.warn(
                    f"the weights of streamed block(s) {', '.join(held)} stayed on the device after their forward "
                    f"(something outside a recomputed region saved them for backward), so streaming saves "
                    f"nothing there. A streamed block must be recomputed whole or save references to its weights "
                    f"(memfit's plans do one or the other). This warning is shown once.",
                    MemfitWarning,
                    stacklevel=2,
                )
        if failed:
            for block in list(self._pending):
                self._settle(self._pending.pop(block))
            return
        if self._training:
            for block in self.blocks[::-1][: self.ahead]:
                self._ensure(block)

    # -- hooks -------------------------------------------------------------------------------------------------

    def _pre(self, module: nn.Module, args: tuple) -> None:
        block = self._by_module[module]
        if block in self._active:  # called again from inside its own call: its weights are in place already
            block.nested += 1
            return
        recomputing = state.recomputing()
        if recomputing:
            self._backward_reaches(block)
        upload = self._take(block, backward=recomputing)
        for w, view in zip(block.weights, upload.views, strict=True):
            self._check(block, w)
            w.param.data = view
        self._active[block] = upload
        if not recomputing and self._training:
            self._forward_uploads.append((block, upload.storage))
        # (not while auto profiles: its own hooks must see every saved tensor, and keep none)
        if block.referenced and not recomputing and torch.is_grad_enabled() and self._prefetch:
            self._open_scope(block)
        self._upload_ahead(block, backward=recomputing)

    def _upload_ahead(self, block: _Block, *, backward: bool) -> None:
        """Issue the uploads of the streamed blocks the pass reaches next after ``block`` ("Ahead of need"; none
        while ``auto`` profiles)."""
        step, lead = (-1, self.ahead) if backward else (1, self.forward_ahead)
        for k in range(1, lead + 1 if self._prefetch else 1):
            position = block.position + step * k
            if 0 <= position < len(self.blocks):
                self._ensure(self.blocks[position])

    def _post(self, module: nn.Module, args: tuple, output: Any) -> None:
        block = self._by_module[module]
        if block.nested:
            block.nested -= 1
            return
        if block.scope is not None:
            state.exit_region_call()
            self._close_scope(block)
        for w in block.weights:
            w.param.data = w.placeholder
        upload = self._active.pop(block, None)
        if upload is not None and self._kept_for_next_use(block):
            self._pending[block] = upload
            self._forward_uploads = [(b, ref) for b, ref in self._forward_uploads if b is not block]
            self.stats.uploads_kept += 1

    def _watch_backward_start(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        """In a training forward: the first gradient to reach one of the block's outputs issues the uploads
        backward reaches next, before any kernel of the block's backward or reload its regions issue then."""
        if state.recomputing() or not (self._training and self._prefetch and torch.is_grad_enabled()):
            return
        if not UPLOADS_AT_BACKWARD_START:
            return
        block = self._by_module[module]

        def backward_starts() -> None:
            if block.handles:  # (not once the block stopped streaming)
                # the blocks after it let go of their uploads first: two alive, not three
                self._backward_reaches(block)
                self._upload_ahead(block, backward=True)

        on_first_gradient(output, backward_starts, passed_through=(args, kwargs))

    def _kept_for_next_use(self, block: _Block) -> bool:
        """Whether the upload ``block`` just used serves its next use too (see "Turnarounds")."""
        if not self._prefetch:  # profiling: only the running block's weights on the device
            return False
        if state.recomputing():
            return block.position < self.keep_first
        return self.keep_last and self._training and block.position == len(self.blocks) - 1

    # -- saved weights ("Saved weights") ---------------------------------------------------------------------

    def _open_scope(self, block: _Block) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack_saved, self._unpack_saved)
        hooks.__enter__()
        block.scope = hooks
        # no region: attention offload and FFN regions still open inside the block
        state.enter_region_call(functools.partial(self._close_scope, block), region=False)

    @staticmethod
    def _close_scope(block: _Block) -> None:
        if block.scope is not None:
            block.scope.__exit__(None, None, None)
            block.scope = None

    def _pack_saved(self, tensor: torch.Tensor) -> Any:
        ref = self.reference(tensor)
        if ref is not None:
            return ref
        state.note_held(tensor)  # an activation the block keeps: the held-bytes meters must still see it
        return tensor

    def _unpack_saved(self, saved: Any) -> torch.Tensor:
        return self.unpack(saved) if type(saved) is WeightRef else saved

    def reference(self, tensor: torch.Tensor) -> WeightRef | None:
        """A :class:`WeightRef` for ``tensor`` when it lies in the upload of a running streamed block that saves
        references (else None: the caller keeps or parks it as any saved tensor)."""
        if not self._active:
            return None
        ptr = tensor.untyped_storage().data_ptr()
        for block, upload in self._active.items():
            if block.referenced and upload.buffer is not None and upload.buffer.data_ptr() == ptr:
                self.stats.weights_referenced += 1
                return WeightRef(block, tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset())
        return None

    def unpack(self, ref: WeightRef) -> torch.Tensor:
        """The tensor ``ref`` stands for, in the upload of its block's backward."""
        upload = self._for_backward(ref.block)
        assert upload.buffer is not None
        return upload.buffer.view(ref.dtype).as_strided(ref.shape, ref.stride, ref.offset)

    def _for_backward(self, block: _Block) -> _Upload:
        """The upload ``block``'s backward runs on: taken from the uploads issued ahead (or uploaded now) when its
        backward begins, which also issues the uploads of the blocks backward reaches next."""
        upload = self._backward.get(block) or self._active.get(block)  # (a backward inside its forward)
        if upload is not None:
            return upload
        self._backward_reaches(block)
        upload = self._backward[block] = self._take(block, backward=True)
        self._upload_ahead(block, backward=True)
        if not self._end_queued:  # the uploads of the backward's last blocks are released when it ends
            self._end_queued = queue_at_backward_end(self._end_backward)
        return upload

    def _backward_reaches(self, block: _Block) -> None:
        """Backward reached ``block``: the blocks after it in call order are done with their uploads."""
        for done in [b for b in self._backward if b.position > block.position]:
            self._done_with(done)

    def _end_backward(self) -> None:
        """The backward is over (or the next forward begins): its last blocks are done with their uploads."""
        self._end_queued = False
        for block in list(self._backward):
            self._done_with(block)

    def _done_with(self, block: _Block) -> None:
        """``block``'s backward is over: its upload is dropped, but for the first ``keep_first`` streamed blocks,
        whose uploads serve the next forward ("Turnarounds")."""
        upload = self._backward.pop(block)
        if block.position < self.keep_first and self._prefetch and block not in self._pending:
            self._pending[block] = upload
            self.stats.uploads_kept += 1
        else:
            self._settle(upload)

    def _layer_pre(self, layer: nn.Module, args: tuple) -> None:
        """A layer of a streamed block runs in a recompute that is not its block's: its weights point at the
        upload of the block's backward ("Saved weights")."""
        if not state.recomputing():
            return
        block, own = self._by_layer[layer]
        if block in self._active or layer in self._pointed:
            return
        upload = self._for_backward(block)
        for i in own:
            self._check(block, block.weights[i])
            block.weights[i].param.data = upload.views[i]
        self._pointed[layer] = upload

    def _layer_post(self, layer: nn.Module, args: tuple, output: Any) -> None:
        if self._pointed.pop(layer, None) is None:
            return
        block, own = self._by_layer[layer]
        for i in own:
            block.weights[i].param.data = block.weights[i].placeholder

    @staticmethod
    def _check(block: _Block, w: _Weight) -> None:
        p = w.param
        if p.requires_grad:
            raise MemfitError(
                f"{block.name}.{w.name} streams from host memory as a frozen weight, but it requires grad now; a "
                f"streamed weight cannot train (its optimizer would update a placeholder). Call handle.remove(), "
                f"change which weights train, and apply memfit again."
            )
        if p.data_ptr() != w.placeholder.data_ptr():
            raise MemfitError(
                f"{block.name}.{w.name} streams from host memory, but its data was replaced since memfit.apply "
                f"(model.to(), a dtype cast, load_state_dict(assign=True)?). Call handle.remove() before changing "
                f"the model's weights, device or dtype, then apply memfit again."
            )

    def _state_dict(self, module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
        """The block's entries are its host masters, never the placeholders (the names as they are now: PEFT may
        have wrapped a layer since)."""
        masters = {id(w.param): w.master for w in self._by_module[module].weights}
        for name, p in module.named_parameters():
            master = masters.get(id(p))
            if master is not None and prefix + name in state_dict:
                state_dict[prefix + name] = master

    def _refuse_load(self, module: nn.Module, state_dict: Mapping, prefix: str, *args: Any) -> None:
        block = self._by_module[module]
        streamed = {id(w.param) for w in block.weights}
        keys = [
            prefix + n for n, p in module.named_parameters() if id(p) in streamed and prefix + n in state_dict
        ]
        if keys:
            raise MemfitError(
                f"load_state_dict would write {keys[0]}{' and others' if len(keys) > 1 else ''}, a weight memfit "
                f"streams from host memory ({STREAM_KEY}). Load the weights before memfit.apply, or call "
                f"handle.remove(), load, and apply memfit again. (Loading only trainable weights, such as LoRA, "
                f"works while weights stream.)"
            )

    # -- uploads -----------------------------------------------------------------------------------------------

    def _take(self, block: _Block, *, backward: bool) -> _Upload:
        """``block``'s upload issued ahead (or issued now, on demand), the compute stream waiting for it (in
        ``backward``: for its recompute or its backward)."""
        upload = self._pending.pop(block, None)
        if upload is None:
            upload = self._issue(block)
            self.stats.uploads_on_demand += 1
        self._wait(upload, backward=backward)
        return upload

    def _ensure(self, block: _Block) -> None:
        """``block``'s weights are uploaded or on their way (unless it is running now)."""
        if block not in self._pending and block not in self._active:
            self._pending[block] = self._issue(block)

    def _issue(self, block: _Block) -> _Upload:
        assert block.host is not None
        buffer = torch.empty(block.nbytes, dtype=torch.uint8, device=self.device)  # on the compute stream
        api = self.streams
        if api is None:
            buffer.copy_(block.host)
            upload = _Upload(block, _views(buffer, block), weakref.ref(buffer.untyped_storage()), buffer)
        else:
            compute = api.current_stream(self.device)
            ready = api.new_event()
            ready.record(compute)
            self._h2d.wait_event(ready)  # the buffer's memory is free for the copy once compute got there
            with api.use(self._h2d, restore=compute):
                started = api.new_event(timing=True) if self.timing else None
                if started is not None:
                    started.record(self._h2d)
                buffer.copy_(block.host, non_blocking=True)
                done = api.new_event(timing=self.timing)
                done.record(self._h2d)
            if started is not None:
                self.stats.copy_events.append((started, done))
            upload = _Upload(
                block, _views(buffer, block), weakref.ref(buffer.untyped_storage()), buffer, done, started
            )
        self.stats.uploads += 1
        self.stats.bytes_uploaded += block.payload
        self._alive = [ref for ref in self._alive if ref() is not None]
        self._alive.append(upload.storage)
        self.stats.max_alive = max(self.stats.max_alive, len(self._alive))
        return upload

    def _wait(self, upload: _Upload, *, backward: bool) -> None:
        """The compute stream waits for ``upload``'s copy (timed when it has not landed yet, by phase)."""
        waited, upload.waited = upload.waited, True
        api = self.streams
        if waited or upload.done is None or api is None or upload.done.query():
            return
        compute = api.current_stream(self.device)
        if self.timing:
            before, after = api.new_event(timing=True), api.new_event(timing=True)
            before.record(compute)
            compute.wait_event(upload.done)
            after.record(compute)
            (self.stats.backward_wait_events if backward else self.stats.wait_events).append((before, after))
        else:
            compute.wait_event(upload.done)

    def _settle(self, upload: _Upload) -> None:
        """An upload is dropped: compute waits for its copy first, so its memory is reused only after it."""
        if upload.done is not None and not upload.waited and not upload.done.query():
            self.streams.current_stream(self.device).wait_event(upload.done)  # type: ignore[union-attr]
        upload.waited = True

    # -- inspection --------------------------------------------------------------------------------------------

    def upload_of(self, module: nn.Module) -> _Upload | None:
        """The upload ``module``'s parameters point at while it runs (None outside its forward and recompute)."""
        block = self._by_module.get(module)
        return self._active.get(block) if block is not None else None

    def alive(self) -> list[str]:
        """Names of the streamed blocks whose uploaded weights are on the device now (referenced by anything)."""
        unique = {
            id(ref): (b, ref) for b, ref in self._uploads_by_block()
        }  # a running block's is listed twice
        return [b.name for b, ref in unique.values() if ref() is not None]

    def _uploads_by_block(self) -> Iterable[tuple[_Block, weakref.ref]]:
        for upload in [*self._pending.values(), *self._active.values(), *self._backward.values()]:
            yield upload.block, upload.storage
        yield from self._forward_uploads

    def wait_ms(self) -> float:
        """Milliseconds compute waited for uploads (the copy time not hidden behind compute)."""
        self.stats.wait_ms += _resolve(self.stats.wait_events)
        return self.stats.wait_ms + self.backward_wait_ms()

    def backward_wait_ms(self) -> float:
        """The part of :meth:`wait_ms` in backward: for a recompute's or a backward's upload."""
        self.stats.backward_wait_ms += _resolve(self.stats.backward_wait_events)
        return self.stats.backward_wait_ms

    def copy_ms(self) -> float:
        """Milliseconds the upload stream spent copying (bytes / this = the bandwidth reached)."""
        self.stats.copy_ms += _resolve(self.stats.copy_events)
        return self.stats.copy_ms

    def reset_stats(self) -> None:
        self.stats = WeightStats()

    def homes(self) -> dict[int, torch.device]:
        """By parameter id, where each streamed weight was when it began streaming."""
        return {id(w.param): w.home for b in self.blocks for w in b.weights}

    @property
    def streamed_bytes(self) -> int:
        """The frozen bytes streaming takes off the device (while no upload is alive)."""
        return sum(b.payload for b in self.blocks)


def _home(weight: _Weight, homes: Mapping[int, torch.device] | None) -> torch.device:
    """Where ``weight`` goes when streaming ends: ``homes``' entry for its parameter, else where it began."""
    return homes.get(id(weight.param), weight.home) if homes else weight.home


def first_weight_device(blocks: Sequence[tuple[str, nn.Module]]) -> torch.device:
    """Where the first streamable weight of ``blocks`` is (the CPU when none is)."""
    for _, module in blocks:
        for _, p in streamable_parameters(module):
            return p.device
    return torch.device("cpu")


def stream_api_for(device: torch.device) -> StreamApi | None:
    """The stream calls for weights streamed to ``device``: CUDA's on a CUDA device, else None (synchronous copies;
    tests replace this function to run the stream logic over recording or delayed streams)."""
    return StreamApi() if device.type == "cuda" else None


def weight_stats(streamer: WeightStreamer | None, *, planned_blocks: int) -> dict[str, Any]:
    """What ``handle.stats()`` reports about weight streaming (zeros when ``streamer`` is None).

    Keys: ``streamed_blocks`` / ``resident_blocks`` (of the plan's ``planned_blocks``); ``weight_streamed_bytes``
    (the frozen bytes streaming takes off the device); ``weight_pinned_bytes`` (the host masters, with their
    alignment); ``weight_bytes_uploaded`` and ``weight_uploads`` (host→device, cumulative);
    ``weight_uploads_on_demand`` (uploads not issued ahead of need); ``weight_uploads_kept`` (uploads kept at a
    turnaround for the block's next use instead of made again); ``weight_upload_wait_ms`` (compute waiting for
    uploads: the copy time not hidden), ``weight_upload_wait_ms_backward`` (its part in backward: recomputes and
    backward's own uploads) and ``weight_upload_copy_ms`` (the upload stream's copy time);
    ``weight_uploads_alive_max`` (most streamed blocks on the device at once); ``weight_held_after_forward``
    (forward uploads something kept until backward: 0 unless streaming saves nothing somewhere).
    """
    s = streamer.stats if streamer is not None else WeightStats()
    streamed = len(streamer.blocks) if streamer is not None else 0
    return {
        "streamed_blocks": streamed,
        "resident_blocks": planned_blocks - streamed,
        "weight_streamed_bytes": streamer.streamed_bytes if streamer is not None else 0,
        "weight_pinned_bytes": streamer.pinned_bytes if streamer is not None else 0,
        "weight_bytes_uploaded": s.bytes_uploaded,
        "weight_uploads": s.uploads,
        "weight_uploads_on_demand": s.uploads_on_demand,
        "weight_uploads_kept": s.uploads_kept,
        "weight_upload_wait_ms": streamer.wait_ms() if streamer is not None else 0.0,
        "weight_upload_wait_ms_backward": streamer.backward_wait_ms() if streamer is not None else 0.0,
        "weight_upload_copy_ms": streamer.copy_ms() if streamer is not None else 0.0,
        "weight_uploads_alive_max": s.max_alive,
        "weight_held_after_forward": s.held_after_forward,
    }


class _StateDictHook(Attached):
    """:class:`Attached` with a ``__dict__``: ``register_state_dict_post_hook`` marks the hook it registers."""


def _resolve(events: list[tuple[Any, Any]]) -> float:
    """The summed milliseconds of the completed (start, end) timing pairs; they leave ``events``."""
    total, pending = 0.0, []
    for start, end in events:
        if end.query():
            total += start.elapsed_time(end)
        else:
            pending.append((start, end))
    events[:] = pending
    return total


def _view(buffer: torch.Tensor, w: _Weight, typed: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """``w``'s tensor in ``buffer`` (a block's ``uint8`` buffer): the buffer viewed as ``w``'s dtype once per dtype,
    then one ``as_strided`` per weight."""
    whole = typed.get(w.dtype)
    if whole is None:
        whole = typed[w.dtype] = buffer.view(
            w.dtype
        )  # a block's size is a multiple of _ALIGN: every dtype divides
    return whole.as_strided(w.shape, w.stride, w.offset // w.dtype.itemsize)


def _views(buffer: torch.Tensor, block: _Block) -> list[torch.Tensor]:
    typed: dict[torch.dtype, torch.Tensor] = {}
    return [_view(buffer, w, typed) for w in block.weights]


def _layers_with(block: _Block) -> dict[nn.Module, list[int]]:
    """The layers of ``block`` that own streamed weights (directly), each with the indices of its own among the
    block's."""
    index = {id(w.param): i for i, w in enumerate(block.weights)}
    out: dict[nn.Module, list[int]] = {}
    for layer in block.module.modules():
        own = [index[id(p)] for p in layer.parameters(recurse=False) if id(p) in index]
        if own and layer is not block.module:
            out[layer] = own
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _shared_storages(model: nn.Module) -> set[int]:
    """Storage addresses registered more than once among ``model``'s parameters and buffers (tied weights: one
    Parameter in two places, or two over one storage)."""
    registered = itertools.chain(
        model.named_parameters(remove_duplicate=False), model.named_buffers(remove_duplicate=False)
    )
    counts = collections.Counter(_storage_ptr(t) for _, t in registered)
    return {ptr for ptr, n in counts.items() if n > 1 and ptr}
