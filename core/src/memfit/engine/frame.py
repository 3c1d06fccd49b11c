"""The frame: a run of consecutive module calls whose activations are recomputed in backward.

Design notes
------------
Recording.  While one of the frame's calls runs, saved-tensor hooks replace every
tensor autograd wants to save by a :class:`_Holder` (which holds nothing). The frame
records each call as (module, flattened args/kwargs, RNG + autocast state). Between
calls the model's own code runs under whatever hooks were active outside, so a
residual add between two blocks is saved normally.

Chaining.  A tensor argument that *is* an output of an earlier call of the same
frame (same object, unchanged version counter: an in-place edit counts as a change)
is recorded as a reference to that output; the frame keeps only a weak reference,
so the tensor dies as usual. Every other tensor argument is an *entry*: the frame
keeps it (through its :class:`~memfit.engine.stash.Stash`), once, however many calls
use it. So a chunk of N blocks keeps one set of entry tensors, and code that edits a
tensor between two calls (a controlnet residual) simply makes it an entry: correct,
a little less saving.

Recompute.  The first unpack in backward replays the calls in order under the
recorded RNG/autocast state, feeding chained outputs forward, and fills the holders
in the order the forward packed them. A holder is emptied when it is unpacked, so
memory is released as backward proceeds; a second backward over a retained graph
simply recomputes again.

Safety checks.  A call that edits an entry in place, an entry edited after being
recorded, and a recompute that saves a different number of tensors than the forward
all raise :class:`~memfit.errors.MemfitError` instead of producing wrong gradients.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.engine import state
from memfit.engine.replay import CallContext
from memfit.engine.stash import Stash
from memfit.errors import MemfitError


class _Holder:
    """What autograd keeps instead of a saved tensor; filled by the recompute."""

    __slots__ = ("__weakref__", "frame", "call_index", "value")

    def __init__(self, frame: Frame, call_index: int) -> None:
        self.frame = frame
        self.call_index = call_index
        self.value: torch.Tensor | None = None


@dataclass
class _Entry:
    handle: Any
    requires_grad: bool
    version: int


@dataclass
class _Call:
    module: torch.nn.Module
    spec: Any
    # per flattened leaf: ("const", value) | ("entry", entry_index) | ("ref", call_index, output_leaf_index)
    leaves: list[tuple]
    context: CallContext
    holders: list[weakref.ref] = field(default_factory=list)
    # weak references to this call's output tensors and their versions, for chaining detection
    outputs: list[tuple[weakref.ref, int]] = field(default_factory=list)


@dataclass
class FrameStats:
    """Counters shared by all frames of one installed engine."""

    frames: int = 0
    calls: int = 0
    entries: int = 0
    entry_bytes: int = 0
    recomputes: int = 0
    # frames freed without ever being recomputed: their outputs never reached the loss (e.g. the text
    # stream of a double-stream model's last block), so backward never needed them
    unused: int = 0
    # calls that continued a sub-block chain without consuming any output of the chain so far: the
    # declared chain is not a chain (still correct — the input is kept as an entry — but it saves less)
    chain_breaks: int = 0
    holders: int = 0
    by_scope: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        """Zero every counter in place (live frames keep updating this same object)."""
        for f in fields(self):
            if f.name == "by_scope":
                self.by_scope.clear()
            else:
                setattr(self, f.name, 0)


class Frame:
    """One region instance: records calls in forward, recomputes them in backward.

    Args:
        key: identifies the region (e.g. ``("block", "transformer_blocks", 4)``); a call continues
            an open frame only if it is the next module the frame expects.
        modules: the modules this frame expects, in call order.
        scope: label for statistics (``"block"``, ``"ffn"``).
        stash: where entry tensors are kept.
        stats: counters to update.
    """

    def __init__(
        self, key: Any, modules: list[torch.nn.Module], scope: str, stash: Stash, stats: FrameStats
    ) -> None:
        self.key = key
        self.expected = modules
        self.scope = scope
        self.stash = stash
        self.stats = stats
        self.calls: list[_Call] = []
        self.entries: list[_Entry] = []
        self._entry_ids: dict[int, int] = {}  # id(tensor) -> entry index, only while recording
        self._entry_refs: list[torch.Tensor] = []  # keeps ids valid while recording
        self.closed = False
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        # Called when this frame's recompute starts: an offload stash reloads its entries and the
        # regions backward visits next from here.
        self.on_recompute: Any = getattr(stash, "on_recompute", None)
        self._recomputed = [False]
        weakref.finalize(self, _on_frame_freed, stats, self._recomputed, getattr(stash, "release_all", None))
        stats.frames += 1
        stats.by_scope[scope] = stats.by_scope.get(scope, 0) + 1

    # -- forward ------------------------------------------------------------------------------------------------

    def expects(self, module: torch.nn.Module) -> bool:
        n = len(self.calls)
        return not self.closed and n < len(self.expected) and self.expected[n] is module

    @property
    def complete(self) -> bool:
        return len(self.calls) == len(self.expected)

    def begin_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Record the call's arguments and start swapping saved tensors for holders."""
        flat, spec = tree_flatten((args, kwargs))
        leaves: list[tuple] = []
        tensors: list[torch.Tensor] = []
        for x in flat:
            if isinstance(x, torch.Tensor):
                tensors.append(x)
                leaves.append(self._find_output(x) or ("entry", self._entry_index(x)))
            else:
                leaves.append(("const", x))
        if self.calls and self.scope != "block" and not any(leaf[0] == "ref" for leaf in leaves):
            self.stats.chain_breaks += 1
        call = _Call(module, spec, leaves, CallContext.capture(tensors))
        self.calls.append(call)
        index = len(self.calls) - 1
        # a partial, not a lambda: one Python frame less per saved tensor
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, index), self._unpack
        )
        self._hooks.__enter__()
        state.enter_region_call()
        self.stats.calls += 1

    def end_call(self, output: Any) -> None:
        """Stop swapping, check the call did not edit its entries, remember outputs for chaining."""
        state.exit_region_call()
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        call = self.calls[-1]
        for leaf in call.leaves:
            if leaf[0] == "entry":
                entry = self.entries[leaf[1]]
                if self.stash.version(entry.handle) != entry.version:
                    raise MemfitError(
                        f"{type(call.module).__name__} modified one of its inputs in place; a module that "
                        f"edits its inputs cannot be a checkpoint boundary. Declare a region that does not "
                        f"include it, or choose a backend that does not checkpoint it."
                    )
        out_leaves, _ = tree_flatten(output)
        call.outputs = [
            (weakref.ref(t), t._version) if isinstance(t, torch.Tensor) else (None, 0) for t in out_leaves
        ]
        if self.complete:
            self.close()

    def abort_call(self) -> None:
        """The call raised: stop swapping and make sure nothing more joins this frame."""
        state.exit_region_call()
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self.close()

    def close(self) -> None:
        """No more calls join this frame; drop the recording-time bookkeeping."""
        self.closed = True
        self._entry_ids.clear()
        self._entry_refs.clear()
        for call in self.calls:
            call.outputs = []

    def _find_output(self, tensor: torch.Tensor) -> tuple | None:
        for ci in range(len(self.calls) - 1, -1, -1):
            for li, (ref, version) in enumerate(self.calls[ci].outputs):
                if ref is not None and ref() is tensor and tensor._version == version:
                    return ("ref", ci, li)
        return None

    def _entry_index(self, tensor: torch.Tensor) -> int:
        index = self._entry_ids.get(id(tensor))
        if index is not None and self._entry_refs[index] is tensor:
            return index
        entry = _Entry(self.stash.put(tensor), tensor.requires_grad, tensor._version)
        self.entries.append(entry)
        self._entry_refs.append(tensor)
        index = len(self.entries) - 1
        self._entry_ids[id(tensor)] = index
        self.stats.entries += 1
        self.stats.entry_bytes += tensor.untyped_storage().nbytes()
        resident = self.stash.resident(entry.handle)
        if resident is not None:  # kept on its device: count it as held (parked entries are not)
            state.note_held(resident)
        return index

    def _pack(self, call_index: int, tensor: torch.Tensor) -> _Holder:
        holder = _Holder(self, call_index)
        self.calls[call_index].holders.append(weakref.ref(holder))
        self.stats.holders += 1
        return holder

    # -- backward -----------------------------------------------------------------------------------------------

    @staticmethod
    def _unpack(holder: _Holder) -> torch.Tensor:
        if holder.value is None:
            holder.frame.recompute()
        value, holder.value = holder.value, None
        if value is None:  # pragma: no cover - guarded by the count check in recompute
            raise MemfitError("internal error: a recompute did not fill a saved tensor")
        return value

    def recompute(self) -> None:
        """Replay every call and fill the live holders with the recomputed saved tensors."""
        if self._hooks is not None or not self.closed:
            raise MemfitError(
                "backward reached a checkpointed region while its forward was still running; "
                "memfit does not support backward inside a model's forward."
            )
        self.stats.recomputes += 1
        self._recomputed[0] = True
        if self.on_recompute is not None:
            self.on_recompute()
        entries = []
        for entry in self.entries:
            value = self.stash.get(entry.handle)
            if self.stash.version(entry.handle) != entry.version:
                raise MemfitError(
                    "a tensor that enters a checkpointed region was modified in place after the region ran, "
                    "so it cannot be recomputed. Avoid in-place edits of block inputs (use out-of-place ops)."
                )
            value = value.detach()
            if entry.requires_grad:
                value.requires_grad_(True)
            entries.append(value)
        outputs: list[list[Any]] = []
        filler = _Filler(self)
        with (
            torch.enable_grad(),
            state.recompute_scope(),
            torch.autograd.graph.saved_tensors_hooks(filler.pack, filler.unpack),
        ):
            for index, call in enumerate(self.calls):
                flat = [self._resolve(leaf, entries, outputs) for leaf in call.leaves]
                args, kwargs = tree_unflatten(flat, call.spec)
                filler.begin(index)
                with call.context.restored():
                    out = call.module(*args, **kwargs)
                filler.end()
                outputs.append(tree_flatten(out)[0])

    @staticmethod
    def _resolve(leaf: tuple, entries: list[torch.Tensor], outputs: list[list[Any]]) -> Any:
        kind = leaf[0]
        if kind == "const":
            return leaf[1]
        if kind == "entry":
            return entries[leaf[1]]
        return outputs[leaf[1]][leaf[2]]


def _on_frame_freed(stats: FrameStats, recomputed: list[bool], release: Any) -> None:
    """Runs when autograd frees the graph that held a frame (never holds a reference to the frame)."""
    if not recomputed[0]:
        stats.unused += 1
    if release is not None:  # an offload stash gives its host buffers back
        release()


class _Filler:
    """Saved-tensor hooks active during a recompute: route each saved tensor to its holder."""

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.call_index = -1
        self.count = 0

    def begin(self, call_index: int) -> None:
        self.call_index = call_index
        self.count = 0

    def pack(self, tensor: torch.Tensor) -> None:
        holders = self.frame.calls[self.call_index].holders
        if self.count >= len(holders):
            raise self._mismatch(len(holders), self.count + 1)
        holder = holders[self.count]()
        self.count += 1
        if holder is not None:
            holder.value = tensor.detach()
        return None

    def unpack(self, _: None) -> torch.Tensor:  # pragma: no cover - the recomputed graph is never backwarded
        raise MemfitError("internal error: the recomputed graph of a region was backwarded")

    def end(self) -> None:
        expected = len(self.frame.calls[self.call_index].holders)
        if self.count != expected:
            raise self._mismatch(expected, self.count)

    def _mismatch(self, expected: int, got: int) -> MemfitError:
        module = type(self.frame.calls[self.call_index].module).__name__
        return MemfitError(
            f"recomputing {module} saved {got}+ tensors for backward where the forward saved {expected}: the "
            f"region does not compute the same way twice (data-dependent control flow, or state changed "
            f"between forward and backward), so it cannot be checkpointed."
        )
