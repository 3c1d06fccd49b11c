"""The frame: a run of consecutive module calls whose activations are recomputed in backward.

Design notes
------------
Recording.  While one of the frame's calls runs, saved-tensor hooks replace every
tensor autograd wants to save by a :class:`_Holder` (which holds nothing), and note the
tensor's shape, dtype and device. A parameter (or a view of one: a linear layer saves
``weight.t()``) is kept as it is, with its version: it lives as long as the model does,
so keeping it costs nothing, and it never needs recomputing. The frame records each
call as (module, flattened args/kwargs, replayed state: see :mod:`.replay`). Between
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
recorded state, feeding chained outputs forward, and fills the holders in the order
the forward packed them. A holder is emptied when it is unpacked, so memory is
released as backward proceeds; a second backward over a retained graph simply
recomputes again.

Early stop.  The recompute only has to fill the holders backward can still unpack:
those still alive (autograd drops a holder when the node that saved it has run or was
freed). It replays calls up to the last one with a live holder; trailing calls that saved
nothing needed are never replayed (a frozen projection without LoRA saves only its
weight, which is kept, not a holder). Calls are the unit of the frame's bookkeeping (the
hooks sit on module boundaries), and skipping them costs nothing. Inside the last
needed call the replay can also stop at op level, as ``torch.utils.checkpoint``'s
non-reentrant early stop does: raising from the saved-tensor hook once its last live
holder is filled (:class:`_StopRecompute`, caught by the frame). Autograd saves an op's
inputs before running its kernel, so the op that saves the last needed tensor is itself
not run: the frozen projection at the end of a block. That exception costs host time,
so the frame cuts a call only when the forward kept large parameters after the call's
last needed holder (:data:`CUT_TAIL_WEIGHTS`), when the call's output is large
(:data:`CUT_TAIL_OUTPUT`: the elementwise ops at a block's end are then worth skipping), when a
large state entered any region of the latest forward (:data:`CUT_TAIL_STATE`: the GPU is then the
bottleneck, and a small region's tail is worth skipping too), or when holders after it are dead.
Entries only skipped calls read are not fetched.

Safety checks (each raises :class:`~memfit.errors.MemfitError` instead of producing wrong
gradients): a call that edits an entry in place; an entry edited after being recorded;
a parameter or buffer of a replayed module edited between forward and recompute, or a
kept parameter edited before backward used it; a recompute that saves a different number
of tensors, or a tensor of a different shape, dtype or device, than the forward saved
(a different attention kernel, an autocast or grad-mode change, data-dependent control
flow); parameters of a replayed module gone (a PEFT adapter unloaded) or PEFT adapters
deleted between forward and backward.

Not detectable cheaply: a forward pre-hook on a region's module that edits the module's
input through ``.data`` (no version bump) runs again in the recompute, on the already
edited tensor — see :meth:`Frame.recompute`.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from memfit.engine import state
from memfit.engine.replay import TREES, CallContext, ModuleTree
from memfit.engine.stash import Stash
from memfit.errors import MemfitError

# A saved tensor that is a parameter or a view of one (a linear saves ``weight.t()``) is kept as is, unless its data
# streams from host memory (a streamed block's upload must not outlive its forward: its weights are recomputed like
# activations). Tested inline in both saved-tensor hooks, which run for every saved tensor: ``type(t) is
# _PARAMETER`` or ``type(t._base) is _PARAMETER`` (``isinstance`` on Parameter is a Python-level check), and the id
# not in ``_STREAMED`` (the live set ``memfit.engine.state.mark_streamed`` updates).
_PARAMETER = torch.nn.Parameter
_STREAMED = state.streamed_parameter_ids()

# Cutting the last needed call short costs an exception through the module stack (tens of microseconds of host
# time). It pays when what it skips holds a large projection: the forward kept at least this many parameter
# elements (a 1024 x 1024 weight; LoRA factors are far smaller) after the call's last saved tensor still needed.
# Calls after the last needed one are skipped whatever their size (that costs nothing).
CUT_TAIL_WEIGHTS = 1 << 20
# It also pays when the call's output is this large (a 4096-token x 2048-wide state; Flux at 1024 tokens is below it):
# the ops it skips (a block's gate multiply and residual add, Wan's in fp32) are passes over the output that take
# longer on the GPU than the exception on the host, and a call that size keeps the GPU, not the host, the bottleneck.
CUT_TAIL_OUTPUT = 1 << 23
# And when a tensor this large entered any region of the latest forward: states that size keep the GPU the
# bottleneck, so the exception's host time hides behind them and whatever a cut skips is GPU time saved, in the
# step's small regions too (a double-stream block's text FFN and its LoRA's last factor). What enters a region is a
# state (hidden states, an FFN's normed input), never an MLP's 4x wider inner activation.
CUT_TAIL_STATE = 1 << 23


class _Holder:
    """What autograd keeps instead of a saved tensor; filled by the recompute.

    ``meta``: (shape, dtype, device) of the tensor the forward saved, to check the recomputed one against.
    """

    __slots__ = ("__weakref__", "frame", "meta", "value")

    def __init__(self, frame: Frame, meta: tuple) -> None:
        self.frame = frame
        self.meta = meta
        self.value: torch.Tensor | None = None


class _Kept(tuple):
    """A parameter (or a view of one) saved inside a region: kept as is, with its version and frame."""

    __slots__ = ()


class _StopRecompute(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised from the recompute's saved-tensor hook once every live holder is filled (early stop).

    An ``Exception`` (as ``torch.utils.checkpoint``'s), so ``always_call`` forward hooks still see the call end.
    """


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
    tree: ModuleTree
    holders: list[weakref.ref] = field(default_factory=list)
    # parameter elements the forward kept after the call's last holder (the projections a cut would skip)
    tail: int = 0
    # elements of the call's largest output tensor (the passes over it a cut would skip)
    out_elements: int = 0
    # versions of ``tree.tensors`` when the call returned (parameters and buffers it read)
    versions: tuple[int, ...] = ()
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
    # stream of a double-stream model's last block), so backward never needed them; or every tensor they
    # saved was a parameter
    unused: int = 0
    # calls that continued a sub-block chain without consuming any output of the chain so far: the
    # declared chain is not a chain (still correct — the input is kept as an entry — but it saves less)
    chain_breaks: int = 0
    holders: int = 0
    # early stop: whole calls a recompute did not replay (nothing they saved was still needed), and calls whose
    # replay stopped before their end (after the last saved tensor still needed)
    calls_skipped_early_stop: int = 0
    calls_cut_early_stop: int = 0
    by_scope: dict[str, int] = field(default_factory=dict)
    # not a counter: elements of the largest tensor entering a region in the latest forward (the engine zeroes it as
    # a forward starts), which tells early stop whether the step keeps the GPU or the host busy (CUT_TAIL_STATE)
    largest_entry: int = 0

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

    def describe(self, call_index: int | None = None) -> str:
        """The region (and call) for error messages."""
        where = f"region {self.key!r}"
        if call_index is None:
            return where
        return f"{type(self.calls[call_index].module).__name__} (call {call_index} of {where})"

    # -- forward ------------------------------------------------------------------------------------------------

    def expects(self, module: torch.nn.Module) -> bool:
        n = len(self.calls)
        return not self.closed and n < len(self.expected) and self.expected[n] is module

    @property
    def complete(self) -> bool:
        return len(self.calls) == len(self.expected)

    def begin_call(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Record the call's arguments and start swapping saved tensors for holders."""
        flat, spec = _flatten_call(args, kwargs)
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
        tree = TREES.of(module)
        call = _Call(module, spec, leaves, CallContext(tensors, tree), tree)
        self.calls.append(call)
        # a partial, not a lambda: one Python frame less per saved tensor
        self._hooks = torch.autograd.graph.saved_tensors_hooks(
            functools.partial(self._pack, call), self._unpack
        )
        self._hooks.__enter__()
        state.enter_region_call(self._undo_call)
        self.stats.calls += 1

    def end_call(self, output: Any) -> None:
        """Stop swapping, check the call did not edit its entries, remember outputs for chaining."""
        state.exit_region_call()
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        call = self.calls[-1]
        self.stats.holders += len(call.holders)
        for leaf in call.leaves:
            if leaf[0] == "entry":
                entry = self.entries[leaf[1]]
                if self.stash.version(entry.handle) != entry.version:
                    raise MemfitError(
                        f"{type(call.module).__name__} modified one of its inputs in place; a module that "
                        f"edits its inputs cannot be a checkpoint boundary. Declare a region that does not "
                        f"include it, or choose a backend that does not checkpoint it."
                    )
        # after the call: a module that updates its own buffers (running statistics) is not an edit
        call.versions = call.tree.versions()
        out_leaves = _flatten_output(output)
        call.out_elements = max((t.numel() for t in out_leaves if isinstance(t, torch.Tensor)), default=0)
        call.outputs = [
            (weakref.ref(t), t._version) if isinstance(t, torch.Tensor) else (None, 0) for t in out_leaves
        ]
        if self.complete:
            self.close()

    def _undo_call(self) -> None:
        """The call was interrupted and never ended (see :func:`memfit.engine.state.undo_open_calls`)."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(None, None, None)
        self.close()

    def abort_call(self) -> None:
        """The call raised: stop swapping and make sure nothing more joins this frame."""
        self.stats.holders += len(self.calls[-1].holders)
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
        if tensor.numel() > self.stats.largest_entry:
            self.stats.largest_entry = tensor.numel()
        resident = self.stash.resident(entry.handle)
        if resident is not None:  # kept on its device: count it as held (parked entries are not)
            state.note_held(resident)
        return index

    def _pack(self, call: _Call, tensor: torch.Tensor) -> _Holder | _Kept:
        base = tensor if type(tensor) is _PARAMETER else tensor._base
        if type(base) is _PARAMETER and id(base) not in _STREAMED:
            call.tail += tensor.numel()
            return _Kept((tensor, tensor._version, self))
        holder = _Holder(self, (tensor.shape, tensor.dtype, tensor.device))
        call.holders.append(weakref.ref(holder))
        call.tail = 0
        return holder

    # -- backward -----------------------------------------------------------------------------------------------

    @staticmethod
    def _unpack(saved: _Holder | _Kept) -> torch.Tensor:
        if type(saved) is _Kept:
            tensor, version, frame = saved
            if tensor._version != version:
                raise frame._edited_parameter(tensor)
            return tensor
        if saved.value is None:
            saved.frame.recompute()
        value, saved.value = saved.value, None
        if value is None:  # pragma: no cover - guarded by the count check in recompute
            raise MemfitError("internal error: a recompute did not fill a saved tensor")
        return value

    def recompute(self) -> None:
        """Replay the calls whose saved tensors backward still needs, and fill their live holders.

        Replaying a call runs ``module(*args, **kwargs)``, its forward pre-hooks included: a pre-hook that is a
        function of the call's inputs computes the same again, but one that edits an input in place through
        ``.data`` (invisible to version counters) edits the already edited tensor a second time. Like
        ``torch.utils.checkpoint``, memfit cannot see that; such a hook must return new arguments instead.

        Raises:
            MemfitError: the recompute cannot reproduce the forward (see the module docstring's safety checks).
        """
        if self._hooks is not None or not self.closed:
            raise MemfitError(
                "backward reached a checkpointed region while its forward was still running; "
                "memfit does not support backward inside a model's forward."
            )
        last, stop_at = self._last_needed()
        last_call = self.calls[last]
        if (
            stop_at == len(last_call.holders) - 1
            and last_call.tail < CUT_TAIL_WEIGHTS
            and last_call.out_elements < CUT_TAIL_OUTPUT
            and self.stats.largest_entry < CUT_TAIL_STATE
        ):
            stop_at = -1  # what follows the last holder is cheaper than cutting the call short
        self.stats.recomputes += 1
        self._recomputed[0] = True
        if self.on_recompute is not None:
            self.on_recompute()
        entries: list[torch.Tensor | None] = [None] * len(self.entries)
        outputs: list[list[Any]] = []
        filler = _Filler(self)
        with (
            torch.enable_grad(),
            state.recompute_scope(),
            torch.autograd.graph.saved_tensors_hooks(filler.pack, filler.unpack),
        ):
            for index in range(last + 1):
                call = self.calls[index]
                self._check_reads(index)
                flat = [self._resolve(leaf, entries, outputs) for leaf in call.leaves]
                args, kwargs = _unflatten_call(flat, call.spec)
                filler.begin(index, stop_at if index == last else -1)
                try:
                    with call.context.restored(functools.partial(self.describe, index)):
                        out = call.module(*args, **kwargs)
                except _StopRecompute:
                    if not filler.stopped:  # pragma: no cover - only the filler raises it
                        raise
                finally:
                    if call.tree.buffers:  # the replay may update buffers again (running statistics)
                        call.versions = call.tree.versions()
                if filler.stopped:
                    break
                filler.end()
                outputs.append(_flatten_output(out))
        self.stats.calls_skipped_early_stop += len(self.calls) - 1 - last
        self.stats.calls_cut_early_stop += filler.stopped

    def _last_needed(self) -> tuple[int, int]:
        """(index of the last call with a live holder, position of its last live holder)."""
        for index in range(len(self.calls) - 1, -1, -1):
            holders = self.calls[index].holders
            for position in range(len(holders) - 1, -1, -1):
                if holders[position]() is not None:
                    return index, position
        raise MemfitError(  # pragma: no cover - a recompute starts from a live holder's unpack
            "internal error: a region was recomputed with no saved tensor left to fill"
        )

    def _resolve(self, leaf: tuple, entries: list[torch.Tensor | None], outputs: list[list[Any]]) -> Any:
        kind = leaf[0]
        if kind == "const":
            return leaf[1]
        if kind == "ref":
            return outputs[leaf[1]][leaf[2]]
        value = entries[leaf[1]]
        if value is None:  # fetched on first use: entries only skipped calls read are never fetched
            entry = self.entries[leaf[1]]
            value = self.stash.get(entry.handle)
            if self.stash.version(entry.handle) != entry.version:
                raise MemfitError(
                    "a tensor that enters a checkpointed region was modified in place after the region ran, "
                    "so it cannot be recomputed. Avoid in-place edits of block inputs (use out-of-place ops)."
                )
            if entry.requires_grad:  # a leaf of the recompute's own graph (the kept alias stays as it is)
                value = value.detach().requires_grad_(True)
            elif value.requires_grad:  # switched on since the forward: taken as the forward took it
                value = value.detach()
            entries[leaf[1]] = value
        return value

    def _check_reads(self, index: int) -> None:
        """The parameters and buffers call ``index`` reads are the ones it read in forward, unedited."""
        call = self.calls[index]
        tree = call.tree
        if tree.versions() != call.versions:
            then = dict(zip(tree.names, call.versions, strict=True))
            name = next(n for n, t in zip(tree.names, tree.tensors, strict=True) if t._version != then[n])
            raise self._edited(index, name)
        if tree.generation != TREES.generation:
            # modules were registered somewhere since: the forward's parameters must all still be there (one added
            # since, such as an inactive adapter, is harmless; one gone means the replay would run other code)
            gone = sorted(set(tree.names) - set(TREES.of(call.module).names))
            if gone:
                raise MemfitError(
                    f"the modules of {self.describe(index)} changed between the forward and the backward "
                    f"(parameters or buffers gone: {gone[:4]}; e.g. a PEFT adapter unloaded), so the region cannot "
                    f"be recomputed as it ran. Change the model after backward()."
                )

    def _edited(self, index: int, name: str) -> MemfitError:
        return MemfitError(
            f"parameter or buffer {name!r} of {self.describe(index)} was modified in place between the forward and "
            f"the backward (an optimizer step or an in-place edit before backward()); the recompute would use the "
            f"new values and give wrong gradients. Call optimizer.step() after loss.backward(), and edit "
            f"parameters only between a backward and the next forward."
        )

    def _edited_parameter(self, tensor: torch.Tensor) -> MemfitError:
        for index, call in enumerate(self.calls):
            name = call.tree.name_of(tensor)
            if name is not None:
                return self._edited(index, name)
        return self._edited(0, f"<a parameter of shape {tuple(tensor.shape)} saved inside the region>")


# -- call arguments and outputs as flat lists --------------------------------------------------------------------
# ``tree_flatten`` costs ~10 us of host time for a block's (tensor, tensor) arguments; most region calls take plain
# tensors (or None) as arguments and return one tensor or a tuple of them, which flatten to the same leaves in the same
# order without it. ``_FlatCall`` stands for the spec of such a call: its keyword names.
_TENSOR = torch.Tensor


class _FlatCall(tuple):
    """The spec of a call whose arguments are all plain tensors or None: (positional count, keyword names)."""

    __slots__ = ()


def _flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    flat = [*args, *kwargs.values()] if kwargs else list(args)
    for x in flat:
        if x is not None and type(x) is not _TENSOR:
            return tree_flatten((args, kwargs))
    return flat, _FlatCall((len(args), tuple(kwargs)))


def _unflatten_call(flat: list[Any], spec: Any) -> tuple[tuple, dict]:
    if type(spec) is _FlatCall:
        count, names = spec
        return tuple(flat[:count]), dict(zip(names, flat[count:], strict=True))
    return tree_unflatten(flat, spec)


def _flatten_output(output: Any) -> list[Any]:
    if type(output) is _TENSOR:
        return [output]
    if type(output) is tuple and all(type(x) is _TENSOR for x in output):
        return list(output)
    return tree_flatten(output)[0]


def _on_frame_freed(stats: FrameStats, recomputed: list[bool], release: Any) -> None:
    """Runs when autograd frees the graph that held a frame (never holds a reference to the frame)."""
    if not recomputed[0]:
        stats.unused += 1
    if release is not None:  # an offload stash gives its host buffers back
        release()


class _Filler:
    """Saved-tensor hooks active during a recompute: route each saved tensor to its holder.

    Each tensor a live holder gets is checked against what the forward saved at the same position (shape, dtype,
    device) first: a mismatch would hand autograd a tensor its backward formula does not expect.
    """

    def __init__(self, frame: Frame) -> None:
        self.frame = frame
        self.call_index = -1
        self.holders: list[weakref.ref] = []
        self.count = 0
        self.stop_at = -1  # position of the last holder still needed in this call (-1: the whole call)
        self.stopped = False

    def begin(self, call_index: int, stop_at: int) -> None:
        self.call_index = call_index
        self.holders = self.frame.calls[call_index].holders
        self.count = 0
        self.stop_at = stop_at

    def pack(self, tensor: torch.Tensor) -> None:
        if self.stopped:  # the model caught the stop signal and went on: keep stopping
            raise _StopRecompute
        base = tensor if type(tensor) is _PARAMETER else tensor._base
        if type(base) is _PARAMETER and id(base) not in _STREAMED:  # kept by the forward, not a holder
            return None
        position = self.count
        if position >= len(self.holders):
            raise self._mismatch(len(self.holders), position + 1)
        self.count = position + 1
        holder = self.holders[position]()
        if holder is not None:  # still needed by backward: it gets this tensor, which must be what was saved
            meta = (tensor.shape, tensor.dtype, tensor.device)
            if meta != holder.meta:
                raise self._different(position, holder.meta, meta)
            holder.value = tensor.detach()
        if position == self.stop_at:
            self.stopped = True
            raise _StopRecompute
        return None

    def unpack(self, _: None) -> torch.Tensor:  # pragma: no cover - the recomputed graph is never backwarded
        raise MemfitError("internal error: the recomputed graph of a region was backwarded")

    def end(self) -> None:
        expected = len(self.frame.calls[self.call_index].holders)
        if self.count != expected:
            raise self._mismatch(expected, self.count)

    _CAUSES = (
        "a different attention kernel (sdpa_kernel or a backend flag set around only the forward or only the "
        "backward, for a kernel memfit does not replay), autocast or grad mode changed between forward and "
        "backward, data-dependent control flow, or state the module reads changed in between"
    )

    def _mismatch(self, expected: int, got: int) -> MemfitError:
        return MemfitError(
            f"recomputing {self.frame.describe(self.call_index)} saved {got}+ tensors for backward where the "
            f"forward saved {expected}: the region does not compute the same way twice ({self._CAUSES}), so it "
            f"cannot be checkpointed."
        )

    def _different(self, position: int, then: tuple, now: tuple) -> MemfitError:
        def show(meta: tuple) -> str:
            shape, dtype, device = meta
            return f"{tuple(shape)} {dtype} on {device}"

        return MemfitError(
            f"recomputing {self.frame.describe(self.call_index)}: saved tensor #{position} is {show(now)} where the "
            f"forward saved {show(then)}. The region does not compute the same way twice ({self._CAUSES}), so "
            f"its gradients would be wrong; memfit stops here."
        )
