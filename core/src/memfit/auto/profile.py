"""One profiled forward: what each block saves for backward, its FLOPs, and the calibration.

Design notes
------------
Bytes.  A saved-tensor hook sees every tensor autograd saves. It records the tensor's storage
(once per storage: views and repeated saves count once) against the block, and the FFN or
attention region, that was running, then returns a placeholder instead of the tensor: nothing is
held, so profiling needs only the forward's working memory, never the full activations (the very
model that does not fit must still be profiled). Storages a later block saves again (time embedding,
rotary tables, text context) are *shared*: no single block's plan frees them. Because nothing is
held, an address can be reused within the forward; a weak reference to each storage object (one
Python object per storage, alive while any tensor uses it) tells a live storage from a new one.

Time.  Per-block FLOPs come from ``torch.utils.flop_counter`` (deterministic, so the same model,
shape and budget give the same plan); one plain forward without gradients, timed per block, turns
FLOPs into seconds (a single rate, snapped to a quarter-octave grid). Pinned copy bandwidth is probed
once per controller and snapped down to the same grid (never optimistic about copies).

Memory.  On CUDA: the bytes allocated before the forward (parameters, gradients, optimizer state,
inputs), the forward's working memory outside the blocks, and each kind of block's own forward+backward
peak (:mod:`memfit.auto.blockpeak`). Off CUDA all three are 0 and the budget counts activation bytes
held for backward.

Streaming while profiling.  On a card that cannot hold every weight the profile runs with some blocks' frozen
weights streaming (:meth:`memfit.offload.weights.WeightStreamer.profiling`: only the running block's are on the
device). A saved weight is then a view of the upload, not of a parameter's own storage, so weights are told
apart by what they are (a parameter or a view of one), not by storage. The static bytes get the streamed
weights back (as allocated: each rounded to the allocator's 512 bytes), so a profile reads the same either way.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from memfit.accounting import tensor_storages
from memfit.adapters.spec import FamilyAdapter
from memfit.auto.blockpeak import BlockRun, ForwardMemory
from memfit.engine import state
from memfit.errors import NotAvailableError
from memfit.offload.copy import covers_storage
from memfit.offload.narrow import exact_narrow_dtype, narrowed_bytes
from memfit.offload.streamable import frozen_block_bytes


@dataclass(frozen=True)
class BlockProfile:
    """One block at one input shape (bytes are distinct storages, parameters and shared tensors excluded)."""

    path: str
    index: int
    saved_bytes: int  # everything the block saves for backward
    input_bytes: int  # the block's own inputs (what a whole-block region keeps)
    input_parkable_bytes: int  # the part of them in tensors worth a copy (what input offload moves)
    ffn_saved_bytes: int  # saved only inside FFN regions (freed by FFN recompute)
    ffn_input_bytes: int  # the FFN regions' inputs (what an FFN region keeps)
    ffn_input_parkable_bytes: int
    attention_bytes: int  # saved only inside attention regions, in tensors worth a copy
    # what parking them copies: each distinct view once (may exceed their storages), or the storage's bytes once
    # where its views cover it and the copy engine copies such storages once (``parks_storages_once``)
    attention_copy_bytes: int
    flops: int
    ffn_flops: int
    has_ffn: bool
    has_attention: bool
    # saved tensors attention offload handles (each is packed in forward and fetched in backward by Python
    # hooks: the host time that makes a many-tensor region cost more than its copies)
    attention_saves: int = 0
    # every tensor autograd saves inside the block's attention calls, parked or not (parameters, small
    # tensors): each goes through the pack hook in forward and the fetch hook in backward
    attention_hook_calls: int = 0
    # CUDA: the peak of one forward+backward of this block alone (everything it saves held, gradients of
    # its outputs, inputs and trainable weights), above its inputs; measured once per kind of block
    backward_peak_bytes: int = 0
    # CUDA: the same run's forward half alone, and its backward half alone (in the profile for inspection:
    # where a block peaks in its forward, a recompute that skips part of it never reaches that peak)
    forward_peak_bytes: int = 0
    backward_only_peak_bytes: int = 0
    trainable_bytes: int = 0  # its weights that train: their gradients exist from its backward on
    # CUDA: the same run's peak from its attention's backward on (the first use of a tensor its attention
    # calls saved), above its inputs: what a reload issued then meets; 0 where not measured
    attention_backward_peak_bytes: int = 0
    # the FFN regions' inputs that the block does not save itself (an FFN whose first layer is frozen): a
    # region keeps them through its recompute, where the isolated run had freed them
    ffn_input_unsaved_bytes: int = 0
    attention_calls: int = (
        0  # calls of its declared attention modules (one region each under attention offload)
    )
    # saved outside every block after this block's call and before the next block's (a final norm or
    # projection saving the last block's output, a concatenation between two stacks): held from the forward
    # until backward reaches those layers, so under the backward of the blocks after this one only
    saved_after_bytes: int = 0
    # its frozen weights that could stream from host memory (memfit.offload.weights): what streaming it frees
    frozen_bytes: int = 0
    # parking the whole block (BlockPolicy.PARK): its own saved storages worth a copy (what parking frees), what
    # parking them copies (as ``attention_copy_bytes``), and every tensor autograd saves inside its call (each goes
    # through the pack hook in forward and the fetch hook in backward)
    park_bytes: int = 0
    park_copy_bytes: int = 0
    park_hook_calls: int = 0

    @property
    def name(self) -> str:
        return f"{self.path}.{self.index}"


@dataclass(frozen=True)
class ModelProfile:
    """Everything the planner needs about one model at one input shape."""

    blocks: tuple[BlockProfile, ...]
    device: str
    static_bytes: int  # allocated before the forward (CUDA; 0 elsewhere)
    outside_bytes: (
        int  # saved before the blocks, or shared between them (after a block: its saved_after_bytes)
    )
    workspace_bytes: int  # the forward's working memory outside the blocks, on top of what is held (CUDA)
    flops_per_second: float
    copy_bytes_per_second: float | None  # None: no copy engine, offload policies are not offered
    # CUDA: the budget is the peak, which includes the block whose activations come back in backward.
    # Elsewhere it counts bytes held between forward and backward, where nothing comes back yet.
    counts_transient: bool = True
    # Views saved inside attention calls that no single block owns (shared between blocks, such as rotary
    # tables, or also saved outside attention): attention offload copies them once per step, freeing nothing.
    attention_shared_copy_bytes: int = 0
    attention_shared_saves: int = 0
    # How long the blocks' backward takes per second of their forward: how much backward compute a block's
    # reload can hide behind. CUDA: timed on the isolated block runs of the peak measurement, snapped to
    # quarters. Elsewhere the matmuls' FLOP ratio, a lower bound: 1 (gradients of the inputs) + the share of
    # the weights that train.
    backward_to_forward: float = 2.0
    outside_trainable_bytes: int = 0  # trainable weights outside every block: their gradients come first
    # CUDA: the FFN regions' own FLOP rate (large GEMMs run faster than the block's average: FFN recompute
    # priced at the block's rate overcharged it by a third on the synthetic stack); None: the block rate
    ffn_flops_per_second: float | None = None
    # CUDA: how much longer the blocks' forward takes with gradients (autograd, saving) than the timed one
    # without, from the isolated block runs, snapped to quarters, at least 1: the compute a block's
    # device-to-host copies hide behind
    forward_with_grad: float = 1.0
    # what the optimizer's step holds on top of the static bytes (which then include its state): every gradient and
    # the step's temporaries; no plan's peak is below static + this (set by the budget planner, not measured)
    optimizer_step_bytes: int = 0
    # CUDA: frozen weights that streamed from host memory during the profile (a card that cannot hold them all);
    # they are in ``static_bytes`` as if resident, like every plan's accounting expects
    streamed_while_profiled_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["blocks"] = [asdict(b) for b in self.blocks]
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelProfile:
        """The profile :meth:`to_json` wrote, to plan again offline (``memfit_benchmarks.replan``). Fields the
        writing version did not have keep their defaults; fields this version does not know are dropped.

        Raises:
            TypeError: a field without a default is missing (not a profile).
        """
        block_fields = {f.name for f in fields(BlockProfile)}
        blocks = tuple(
            BlockProfile(**{k: v for k, v in b.items() if k in block_fields}) for b in data["blocks"]
        )
        own = {f.name for f in fields(cls)} - {"blocks"}
        return cls(blocks=blocks, **{k: v for k, v in data.items() if k in own})


RATE_STEPS_PER_OCTAVE = 4  # measured rates snap to 2**(k/4): within 9% of the measurement


def round_rate(x: float, *, down: bool = False, per_octave: int = RATE_STEPS_PER_OCTAVE) -> float:
    """``x`` snapped to the grid ``2**(k/per_octave)`` (nearest, or the step below with ``down``).

    Measured rates vary from run to run and plans should not; a quarter octave keeps the cost model
    within 9%, and copy bandwidth snaps down on an eighth of an octave (docs/cost-model.md).
    """
    if x <= 0:
        return 0.0
    steps = math.log2(x) * per_octave
    return float(2.0 ** ((math.floor(steps + 1e-9) if down else round(steps)) / per_octave))


UNSAVED = -1  # a storage seen only as a block's input so far


@dataclass
class _Storage:
    nbytes: int
    block: int | None  # first block that saved it (None: outside every block; UNSAVED: nobody yet)
    ref: weakref.ref  # to the storage object
    after: int = -1  # saved outside every block: the last block that had returned then (-1: none yet)
    blocks: set[int | None] = field(default_factory=set)  # every block (None: outside) that saved it
    received: set[int] = field(default_factory=set)  # blocks that took it as an input
    scopes: set[str] = field(default_factory=set)  # "ffn", "attention", "other" within its block
    attention_views: dict[tuple, int] = field(default_factory=dict)  # saved in attention: view -> bytes
    attention_view_saves: dict[tuple, int] = field(default_factory=dict)  # view -> times saved
    block_views: dict[tuple, int] = field(default_factory=dict)  # saved inside a block call: view -> bytes
    # views whose history proves them an exact up-cast: view -> the dtype they are parked in (memfit.offload.narrow)
    narrow_views: dict[tuple, torch.dtype] = field(default_factory=dict)

    def attention_copy_bytes(self, min_bytes: int, *, storages_once: bool) -> int:
        """Bytes attention offload copies to park this storage's views saved inside attention calls (views
        smaller than ``min_bytes`` or larger than the storage — broadcasts — stay): one copy per distinct view, or
        with ``storages_once`` the storage's bytes once where those views cover it (as the CUDA copy engine
        copies them, :func:`memfit.offload.copy.covers_storage`)."""
        return self._copy_bytes(self.attention_views, min_bytes, storages_once)

    def park_copy_bytes(self, min_bytes: int, *, storages_once: bool) -> int:
        """Bytes parking its block whole copies for this storage's views (as :meth:`attention_copy_bytes`)."""
        return self._copy_bytes(self.block_views, min_bytes, storages_once)

    def _copy_bytes(self, views: dict[tuple, int], min_bytes: int, storages_once: bool) -> int:
        copied = {v: n for v, n in views.items() if min_bytes <= n <= self.nbytes}
        # a proven up-cast is parked as its narrow copy, apart from the other views (memfit.offload.narrow)
        narrow = sum(
            narrowed_bytes(n, v[3], self.narrow_views[v]) for v, n in copied.items() if v in self.narrow_views
        )
        copied = {v: n for v, n in copied.items() if v not in self.narrow_views}
        return narrow + self._wide_copy_bytes(copied, storages_once)

    def _wide_copy_bytes(self, copied: dict[tuple, int], storages_once: bool) -> int:
        if storages_once and copied:
            # a view key is (storage offset in elements, shape, strides, dtype)
            extents = {(v[0] * v[3].itemsize, n) for v, n in copied.items()}
            if covers_storage(self.nbytes, sum(n for _, n in extents), next(iter(copied))[3].itemsize):
                return self.nbytes
        return sum(copied.values())

    def attention_saves(self, min_bytes: int) -> int:
        """How many saved tensors attention offload packs for those views (every save, repeated ones too)."""
        return sum(
            self.attention_view_saves[v]
            for v, n in self.attention_views.items()
            if min_bytes <= n <= self.nbytes
        )


class _Recorder:
    """Attributes saved storages to (block, region); see the module notes."""

    def __init__(self, excluded: set[int], n_blocks: int) -> None:
        self.excluded = excluded
        self.storages: list[_Storage] = []
        self.live: dict[tuple[str, int], int] = {}
        self.block: int | None = None
        self.last_returned = -1  # the last block whose call has returned
        self.scope: list[str] = []
        self.block_inputs: list[list[int]] = [[] for _ in range(n_blocks)]
        self.ffn_inputs: list[list[int]] = [[] for _ in range(n_blocks)]
        # FLOPs from the counter's running total at region entry/exit (its module names are relative to
        # whichever module was *called*; the profile calls model.forward, so names would not resolve)
        self.counter: FlopCounterMode | None = None
        self.block_flops = [0] * n_blocks
        self.ffn_flops = [0] * n_blocks
        self.attention_hook_calls = [0] * n_blocks
        self.block_hook_calls = [0] * n_blocks
        self.attention_calls = [0] * n_blocks
        self._mark: list[int] = []

    def flops_now(self) -> int:
        return int(self.counter.get_total_flops()) if self.counter is not None else 0

    def _lookup(self, tensor: torch.Tensor, *, saved: bool) -> int | None:
        """The record of ``tensor``'s storage, made on first sight (by a save, or as an input: UNSAVED)."""
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return None
        base = tensor if type(tensor) is nn.Parameter else tensor._base
        if type(base) is nn.Parameter:  # a weight (a streamed one's storage is its upload)
            return None
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self.excluded:
            return None
        key = (tensor.device.type, ptr)
        i = self.live.get(key)
        if i is not None and self.storages[i].ref() is not None:
            if saved and self.storages[i].block == UNSAVED:
                self.storages[i].block, self.storages[i].after = self.block, self.last_returned
            return i
        self.storages.append(
            _Storage(
                storage.nbytes(),
                self.block if saved else UNSAVED,
                weakref.ref(storage),
                after=self.last_returned,
            )
        )
        self.live[key] = len(self.storages) - 1
        return self.live[key]

    def pack(self, tensor: torch.Tensor) -> None:
        if self.block is not None:
            self.block_hook_calls[self.block] += 1
            if self.scope and self.scope[-1] == "attention":
                self.attention_hook_calls[self.block] += 1
        i = self._lookup(tensor, saved=True)
        if i is not None:
            s = self.storages[i]
            s.blocks.add(self.block)
            view = (tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if self.block is not None:
                s.block_views[view] = nbytes
            narrow = exact_narrow_dtype(tensor)
            if narrow is not None:
                s.narrow_views[view] = narrow
            if self.scope and self.scope[-1] == "attention":
                s.attention_views[view] = nbytes
                s.attention_view_saves[view] = s.attention_view_saves.get(view, 0) + 1
            if self.block is not None and self.block == s.block:
                s.scopes.add(self.scope[-1] if self.scope else "other")
        return None  # nothing is held: see the module notes

    def note_inputs(self, into: list[list[int]], args: Any) -> None:
        # inputs are judged once the forward is over: a tensor first seen here may be saved later, by this
        # block or by several (rotary tables, text context, time embedding reach the first block unsaved)
        if self.block is None:
            return
        for t in _tensors(args):
            i = self._lookup(t, saved=False)
            if i is not None:
                into[self.block].append(i)
                if into is self.block_inputs:
                    self.storages[i].received.add(self.block)

    # module hooks: they must return None (a forward hook's return value replaces the module's output)
    def enter_attention(self, module: nn.Module, args: tuple) -> None:
        if self.block is not None:
            self.attention_calls[self.block] += 1
        self.scope.append("attention")

    def leave_scope(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.scope.pop()

    def enter_ffn(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.note_inputs(self.ffn_inputs, (args, kwargs))
        self.scope.append("ffn")
        self._mark.append(self.flops_now())

    def leave_ffn(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.scope.pop()
        start = self._mark.pop()
        if self.block is not None:
            self.ffn_flops[self.block] += self.flops_now() - start

    def enter_block(self, b: int, args: tuple, kwargs: dict) -> None:
        self.block = b
        self.note_inputs(self.block_inputs, (args, kwargs))
        self._mark.append(self.flops_now())

    def leave_block(self, b: int) -> None:
        self.block_flops[b] += self.flops_now() - self._mark.pop()
        self.block = None
        self.last_returned = b

    def shared(self, i: int) -> bool:
        """Saved by more than one block (or also outside them), or an input of several: no single block's
        plan frees it."""
        s = self.storages[i]
        return len(s.blocks) > 1 or len(s.received) > 1

    def saved_after(self, b: int) -> int:
        """Bytes saved outside every block between block ``b``'s call and the next block's, not shared
        (``b`` = -1: before the first block)."""
        return sum(
            s.nbytes
            for i, s in enumerate(self.storages)
            if s.block is None and s.after == b and not self.shared(i)
        )

    def input_bytes(
        self,
        b: int,
        entries: list[int],
        *,
        only_scope: str | None = None,
        min_bytes: int = 0,
        unsaved: bool = False,
    ) -> int:
        """Bytes of block ``b``'s inputs (or its FFN regions') that a region of ``b`` would be alone to keep:
        not shared, not saved outside the blocks or by an earlier block (those hold them anyway). ``unsaved``:
        only those block ``b`` does not save either."""
        total, seen = 0, set()
        for e in entries:
            s = self.storages[e]
            if (
                e in seen
                or self.shared(e)
                or s.block is None
                or 0 <= s.block < b
                or (unsaved and s.block == b)
            ):
                continue
            if only_scope is not None and s.block == b and s.scopes != {only_scope}:
                continue  # also saved outside the region: held whatever the region does
            seen.add(e)
            total += s.nbytes if s.nbytes >= min_bytes else 0
        return total


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The non-parameter tensors inside (nested) call arguments."""
    return [
        t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)
    ]


def profile_model(
    model: nn.Module,
    adapter: FamilyAdapter,
    args: tuple,
    kwargs: dict,
    *,
    min_offload_bytes: int,
    copy_bytes_per_second: float | None,
    storages_once: bool = False,
) -> ModelProfile:
    """Profile ``model(*args, **kwargs)`` (called as ``model.forward``: model hooks do not fire).

    Runs two forwards: one with gradients (bytes and FLOPs, nothing held), one without (time).
    ``storages_once``: the copy engine that will park copies views covering their storage as its bytes, once
    (:attr:`memfit.offload.copy.CopyEngine.parks_storages_once`); else each distinct view is priced on its own.
    """
    blocks = list(adapter.iter_blocks(model))
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    # (a quantized weight wraps tensors of its own: counted by those)
    excluded = {s.data_ptr() for p in (*model.parameters(), *model.buffers()) for s in tensor_storages(p)}
    rec = _Recorder(excluded, len(blocks))
    regions = [(adapter.ffn_chains(block), adapter.attention_modules(block)) for _, _, block in blocks]
    allocated = torch.cuda.memory_allocated(device) if cuda else 0
    streamed = streamed_allocation(model) if cuda else 0
    memory = ForwardMemory(device, len(blocks), attention=[a for _, a in regions]) if cuda else None
    handles = _profile_hooks(rec, blocks, regions, memory)
    try:
        with (
            torch.enable_grad(),
            FlopCounterMode(display=False) as rec.counter,
            torch.autograd.graph.saved_tensors_hooks(rec.pack, _never_unpacked),
        ):
            out = model.forward(*args, **kwargs)
        del out
    finally:
        rec.counter = None
        for h in handles:
            h.remove()
    workspace = memory.outside_workspace(allocated) if memory is not None else 0
    runs = memory.block_runs() if memory is not None else [None] * len(blocks)

    profiles = []
    for b, ((path, index, block), (ffn, attention)) in enumerate(zip(blocks, regions, strict=True)):
        own = [s for i, s in enumerate(rec.storages) if s.block == b and not rec.shared(i)]
        # each storage's bytes and what parking the block copies of it
        parked = [(s.nbytes, s.park_copy_bytes(min_offload_bytes, storages_once=storages_once)) for s in own]
        profiles.append(
            BlockProfile(
                path=path,
                index=index,
                saved_bytes=sum(s.nbytes for s in own),
                input_bytes=rec.input_bytes(b, rec.block_inputs[b]),
                input_parkable_bytes=rec.input_bytes(b, rec.block_inputs[b], min_bytes=min_offload_bytes),
                ffn_saved_bytes=sum(s.nbytes for s in own if s.scopes == {"ffn"}),
                ffn_input_bytes=rec.input_bytes(b, rec.ffn_inputs[b], only_scope="ffn"),
                ffn_input_parkable_bytes=rec.input_bytes(
                    b, rec.ffn_inputs[b], only_scope="ffn", min_bytes=min_offload_bytes
                ),
                attention_bytes=sum(
                    s.nbytes for s in own if s.scopes == {"attention"} and s.nbytes >= min_offload_bytes
                ),
                attention_copy_bytes=sum(
                    s.attention_copy_bytes(min_offload_bytes, storages_once=storages_once)
                    for s in own
                    if s.scopes == {"attention"} and s.nbytes >= min_offload_bytes
                ),
                flops=rec.block_flops[b],
                ffn_flops=rec.ffn_flops[b],
                has_ffn=bool(ffn),
                has_attention=bool(attention),
                attention_saves=sum(
                    s.attention_saves(min_offload_bytes)
                    for s in own
                    if s.scopes == {"attention"} and s.nbytes >= min_offload_bytes
                ),
                attention_hook_calls=rec.attention_hook_calls[b],
                backward_peak_bytes=runs[b].peak_bytes if runs[b] is not None else 0,
                forward_peak_bytes=runs[b].forward_peak_bytes if runs[b] is not None else 0,
                backward_only_peak_bytes=runs[b].backward_peak_bytes if runs[b] is not None else 0,
                attention_backward_peak_bytes=runs[b].attention_peak_bytes if runs[b] is not None else 0,
                ffn_input_unsaved_bytes=rec.input_bytes(b, rec.ffn_inputs[b], only_scope="ffn", unsaved=True),
                attention_calls=rec.attention_calls[b],
                saved_after_bytes=rec.saved_after(b),
                trainable_bytes=_trainable_bytes(block.parameters()),
                frozen_bytes=_streamable_bytes(block),
                park_bytes=sum(n for n, copied in parked if copied),
                park_copy_bytes=sum(copied for _, copied in parked),
                park_hook_calls=rec.block_hook_calls[b],
            )
        )
    # (an input of several blocks counts too: every checkpointed region among them holds it; what is saved
    # outside the blocks after one of them is that block's ``saved_after_bytes``)
    outside = rec.saved_after(-1) + sum(s.nbytes for i, s in enumerate(rec.storages) if rec.shared(i))
    attention_copies = sum(
        s.attention_copy_bytes(min_offload_bytes, storages_once=storages_once) for s in rec.storages
    )
    attention_saves = sum(s.attention_saves(min_offload_bytes) for s in rec.storages)
    seconds, ffn_seconds = _time_blocks(model, blocks, regions, args, kwargs, cuda=cuda, device=device)
    total_flops = sum(p.flops for p in profiles)
    rate = round_rate(total_flops / seconds) if seconds > 0 and total_flops > 0 else 1.0
    ffn_flops = sum(p.ffn_flops for p in profiles)
    # (off CUDA a second measured rate would make plans depend on noisy timings: the block rate serves)
    ffn_rate = round_rate(ffn_flops / ffn_seconds) if cuda and ffn_seconds > 0 and ffn_flops > 0 else None
    return ModelProfile(
        blocks=tuple(profiles),
        device=str(device),
        static_bytes=allocated + streamed,
        outside_bytes=outside,
        workspace_bytes=workspace,
        flops_per_second=rate,
        ffn_flops_per_second=ffn_rate,
        copy_bytes_per_second=round_rate(copy_bytes_per_second, down=True, per_octave=8)
        if copy_bytes_per_second
        else None,
        counts_transient=cuda,
        attention_shared_copy_bytes=attention_copies - sum(p.attention_copy_bytes for p in profiles),
        attention_shared_saves=attention_saves - sum(p.attention_saves for p in profiles),
        backward_to_forward=_measured_backward_to_forward(runs) or 1.0 + _trainable_share(blocks),
        forward_with_grad=_forward_with_grad(runs, seconds),
        # (a weight shared by several blocks counts in each of them: never below 0)
        outside_trainable_bytes=max(
            0, _trainable_bytes(model.parameters()) - sum(p.trainable_bytes for p in profiles)
        ),
        streamed_while_profiled_bytes=streamed,
    )


_ALLOCATION_GRANULE = 512  # bytes: the CUDA caching allocator rounds every allocation up to this


def streamed_allocation(model: nn.Module) -> int:
    """What the weights streaming from host memory now would allocate on the device if they were resident."""
    sizes = (p.numel() * p.element_size() for p in model.parameters() if state.is_streamed(p))
    return sum(-(-n // _ALLOCATION_GRANULE) * _ALLOCATION_GRANULE for n in sizes)


def _streamable_bytes(block: nn.Module) -> int:
    """The block's frozen weights that weight streaming moves (0 where they cannot stream: quantized)."""
    try:
        return frozen_block_bytes(block)
    except NotAvailableError:
        return 0


def _trainable_bytes(params: Any) -> int:
    return sum(p.numel() * p.element_size() for p in params if p.requires_grad)


def _measured_backward_to_forward(runs: list[BlockRun | None]) -> float | None:
    """Σ backward seconds / Σ forward seconds over the blocks (each block counts its kind's run), snapped to
    quarters and never below a half; None without timed runs (off CUDA, or nothing trains)."""
    timed = [r for r in runs if r is not None and r.forward_seconds > 0 and r.backward_seconds > 0]
    if not timed:
        return None
    ratio = sum(r.backward_seconds for r in timed) / sum(r.forward_seconds for r in timed)
    return max(0.5, round(ratio * 4) / 4)


def _forward_with_grad(runs: list[BlockRun | None], seconds_without: float) -> float:
    """Σ forward seconds of the block runs (with gradients) / the blocks' timed forward without, snapped to
    quarters and at least 1 (1 without timed runs)."""
    timed = [r.forward_seconds for r in runs if r is not None and r.forward_seconds > 0]
    if len(timed) < len(runs) or seconds_without <= 0:
        return 1.0
    return max(1.0, round(sum(timed) / seconds_without * 4) / 4)


def _trainable_share(blocks: list) -> float:
    """The share of the blocks' parameter elements that require gradients."""
    total = trainable = 0
    for _, _, block in blocks:
        for p in block.parameters():
            total += p.numel()
            trainable += p.numel() if p.requires_grad else 0
    return trainable / total if total else 1.0


def _never_unpacked(_: Any) -> torch.Tensor:
    raise RuntimeError(
        "memfit's profiling forward holds no activations; its graph must not be backpropagated"
    )


def _profile_hooks(rec: _Recorder, blocks: list, regions: list, memory: ForwardMemory | None) -> list[Any]:
    handles = []
    for b, ((_, _, block), (ffn, attention)) in enumerate(zip(blocks, regions, strict=True)):
        handles.append(
            block.register_forward_pre_hook(lambda m, a, k, b=b: rec.enter_block(b, a, k), with_kwargs=True)
        )
        handles.append(block.register_forward_hook(lambda m, a, o, b=b: rec.leave_block(b), always_call=True))
        if memory is not None:
            # first among the block's pre-hooks: a streamed block's upload (its own pre-hook) is the block's, not
            # working memory outside the blocks
            handles.append(
                block.register_forward_pre_hook(
                    lambda m, a, k, b=b: memory.enter(b, m, a, k), with_kwargs=True, prepend=True
                )
            )
            handles.append(
                block.register_forward_hook(lambda m, a, o, b=b: memory.leave(b), always_call=True)
            )
        for chain in ffn:
            handles.append(chain[0].register_forward_pre_hook(rec.enter_ffn, with_kwargs=True))
            handles.append(chain[-1].register_forward_hook(rec.leave_ffn, always_call=True))
        for module in attention:
            handles.append(module.register_forward_pre_hook(rec.enter_attention))
            handles.append(module.register_forward_hook(rec.leave_scope, always_call=True))
    return handles


def _time_blocks(
    model: nn.Module,
    blocks: list,
    regions: list,
    args: tuple,
    kwargs: dict,
    *,
    cuda: bool,
    device: torch.device,
) -> tuple[float, float]:
    """Seconds the blocks, and the FFN regions inside them, take in one forward without gradients (the FLOP
    rates' denominators)."""
    marks: dict[str, list[tuple[Any, Any]]] = {"block": [], "ffn": []}

    def now() -> Any:
        if cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(kind: str) -> Callable[..., None]:
        return lambda *a, **k: marks[kind].append((now(), None))

    def stop(kind: str) -> Callable[..., None]:
        return lambda *a: marks[kind].__setitem__(-1, (marks[kind][-1][0], now()))

    handles = []
    for (_, _, block), (ffn, _) in zip(blocks, regions, strict=True):
        handles.append(block.register_forward_pre_hook(start("block")))
        handles.append(block.register_forward_hook(stop("block")))
        for chain in ffn:
            handles.append(chain[0].register_forward_pre_hook(start("ffn")))
            handles.append(chain[-1].register_forward_hook(stop("ffn")))
    try:
        with torch.no_grad():
            model.forward(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if cuda:
        torch.cuda.synchronize(device)

    def total(kind: str) -> float:
        if cuda:
            return sum(a.elapsed_time(b) for a, b in marks[kind] if b is not None) / 1e3
        return sum(b - a for a, b in marks[kind] if b is not None)

    return total("block"), total("ffn")
