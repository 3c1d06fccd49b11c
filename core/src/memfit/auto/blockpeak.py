"""Memory the planner cannot count from saved tensors: one block's own forward+backward peak, and the
forward's working memory outside the blocks (CUDA allocator statistics; nothing here runs off CUDA).

Design notes
------------
Why measure a block alone.  The profiling forward holds nothing, so it sees neither a block's saved
activations living next to its forward temporaries nor its backward's gradient buffers (math attention's
probability gradients are as large as the probabilities), and summing guesses for both overshoots
(docs/cost-model.md); running the block once with gradients and reading the allocator's peak measures exactly
what the block adds while its backward runs. One run per *kind* of block (class, parameter count, input
shapes and which inputs require gradients): a model has two or three kinds.

Streamed blocks.  A block whose weights stream from host memory gets them uploaded by its own forward
pre-hook (``auto`` profiling on a card that cannot hold every weight). The run is measured from a pre-hook
of its own, registered after that one: the upload is then part of the starting point, as a block's inputs
are, and the time excludes the wait for it.

Side effects.  None on the model: inputs are detached (and cloned where they need gradients), the block's
weight gradients are returned by ``torch.autograd.grad`` (never accumulated into ``.grad``), and the RNG is
forked (dropout draws nothing from the training stream).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def block_kind(block: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Blocks of one kind have the same peak: the same class, parameter count, input shapes, and the same
    inputs requiring gradients (the first block's hidden states come from frozen layers; later ones' do not)."""
    leaves = tree_flatten((args, kwargs))[0]
    shapes = tuple(
        (tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else type(x).__name__
        for x in leaves
    )
    return type(block), sum(p.numel() for p in block.parameters()), shapes


@dataclass(frozen=True)
class BlockRun:
    """One isolated forward+backward of a block: its peak above its inputs, how long each half took, and the
    peak from its attention's backward on (0: no attention modules given, or none saved anything)."""

    peak_bytes: int
    forward_seconds: float
    backward_seconds: float
    attention_peak_bytes: int = 0
    forward_peak_bytes: int = (
        0  # the forward half's own peak (``peak_bytes`` is the larger of the two halves)
    )
    backward_peak_bytes: int = 0  # the backward half's own peak


def measure_block(
    block: nn.Module, args: tuple, kwargs: dict, device: torch.device, *, attention: Sequence[nn.Module] = ()
) -> BlockRun:
    """The block run twice: the second run is timed (the first loads the backward's kernels, which the
    profiling forward never ran). ``attention``: the block's attention modules (see "Attention phase")."""
    _run_block(block, args, kwargs, device, attention=attention, timed=False)
    return _run_block(block, args, kwargs, device, attention=attention, timed=True)


def measure_block_peak(block: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> int:
    """Peak bytes one forward+backward of ``block`` allocates above what exists before it (its inputs).

    The inputs require gradients exactly where they did in the profiling forward (so the first block, fed by
    frozen layers, computes no input gradient, and rotary tables or a frozen time embedding none anywhere),
    every output that requires one gets a gradient of ones that autograd alone holds, as in a step's
    backward, and the outputs are released before the backward unless the graph saved them (see "Output
    gradients").
    """
    return _run_block(block, args, kwargs, device, attention=(), timed=False).peak_bytes


# Attention phase.  Attention offload reloads the next block's tensors when the backward of this block's
# first attention call begins (its first parked tensor is fetched; a later call's region, reached before it
# in backward, reloads only that first call's), after the FFN's backward and its temporaries are gone. So
# the planner adds that reload to the peak from there on, not to the block's whole peak (docs/cost-model.md).
# The phase starts at the first backward use of a tensor saved inside the first
# attention call of the forward.


def _run_block(
    block: nn.Module,
    args: tuple,
    kwargs: dict,
    device: torch.device,
    *,
    attention: Sequence[nn.Module],
    timed: bool,
) -> BlockRun:
    flat, spec = tree_flatten((args, kwargs))
    leaves = [x.detach().requires_grad_(x.requires_grad) if _differentiable(x) else x for x in flat]
    # the block runs on copies: it may edit its inputs in place, which a leaf that requires grad forbids
    used = [x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in leaves]
    wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    wrt += [p for p in block.parameters() if p.requires_grad]
    call_args, call_kwargs = tree_unflatten(used, spec)
    phase = _AttentionPhase(device, attention)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    start: dict[str, int] = {}

    def started(*_: Any) -> None:
        # from the block's own pre-hooks on: a streamed block's weights are in place by now (see "Streamed blocks")
        start["before"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        marks[0].record()

    hook = block.register_forward_pre_hook(started)
    try:
        with (
            torch.enable_grad(),
            torch.random.fork_rng(devices=[device]),
            torch.autograd.graph.saved_tensors_hooks(phase.pack, phase.unpack),
        ):
            out = block(*call_args, **call_kwargs)
            marks[1].record()
            hook.remove()
            before = start["before"]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            forward_peak = torch.cuda.max_memory_allocated(device)
            backward_peak = attention_peak = 0
            root = _OutputGradients.apply(*outs) if outs and wrt else None
            del out, outs  # dead in a step's backward, unless the graph saved them (see "Output gradients")
            if root is not None:
                torch.cuda.reset_peak_memory_stats(device)
                marks[2].record()
                torch.autograd.grad(root, wrt, allow_unused=True)
                marks[3].record()
                late = torch.cuda.max_memory_allocated(device)
                backward_peak = max(phase.peak_before or 0, late)
                attention_peak = late if phase.peak_before is not None else 0
                del root
    finally:
        hook.remove()
        phase.remove()
    times = (0.0, 0.0)
    if timed and backward_peak:
        marks[3].synchronize()
        times = (marks[0].elapsed_time(marks[1]) / 1e3, marks[2].elapsed_time(marks[3]) / 1e3)
    return BlockRun(
        max(0, forward_peak - before, backward_peak - before),
        *times,
        attention_peak_bytes=max(0, attention_peak - before),
        forward_peak_bytes=max(0, forward_peak - before),
        backward_peak_bytes=max(0, backward_peak - before),
    )


# Output gradients.  In a step, a block's outputs are dead by the time its backward runs (the next block
# consumed them and released what it kept of them), and the gradients of its outputs come out of the next
# block's backward, owned by autograd alone. So the run drops its outputs before the backward (an output the
# graph saved stays, as in the step) and roots the backward at a scalar whose backward creates the outputs'
# gradients; on a residual block its backward peak is a real step's (GPU test). Gradients passed in by the
# caller (``grad_outputs``) cannot be summed in place into the residual stream's gradient (CPU test).


class _OutputGradients(torch.autograd.Function):
    """A scalar root over a block's outputs; its backward gives each output a gradient of ones that only
    autograd references (see "Output gradients"). Keeps the outputs' metadata, not the outputs."""

    @staticmethod
    def forward(ctx: Any, *outs: torch.Tensor) -> torch.Tensor:
        ctx.meta = [(o.shape, o.dtype, o.device) for o in outs]
        return outs[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ones(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.meta)


class _AttentionPhase:
    """Tags what the first attention call saves; at the first backward use of such a tensor, keeps the peak
    so far and restarts the allocator's peak (see "Attention phase")."""

    def __init__(self, device: torch.device, modules: Sequence[nn.Module]) -> None:
        self.device = device
        self.inside = 0
        self.calls = 0  # attention calls entered so far (outermost ones)
        self.peak_before: int | None = None  # the backward's peak before its attention phase began
        self.handles = [
            h
            for m in modules
            for h in (
                m.register_forward_pre_hook(lambda *_: self._enter()),
                m.register_forward_hook(lambda *_: self._leave(), always_call=True),
            )
        ]

    def _enter(self) -> None:
        self.calls += self.inside == 0
        self.inside += 1

    def _leave(self) -> None:
        self.inside -= 1

    def pack(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return t, self.inside > 0 and self.calls == 1

    def unpack(self, packed: tuple[torch.Tensor, bool]) -> torch.Tensor:
        t, in_first_call = packed
        if in_first_call and self.peak_before is None:
            self.peak_before = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return t

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


class ForwardMemory:
    """What the profiling forward's block hooks record for the measurements above.

    ``enter``/``leave`` bracket each block call: between calls the allocator's peak is the working memory
    outside the blocks; at each call the first block of its kind keeps its arguments for
    :meth:`block_runs`, which runs after the forward.
    """

    def __init__(
        self, device: torch.device, n_blocks: int, *, attention: Sequence[Sequence[nn.Module]] | None = None
    ) -> None:
        self.device = device
        self.kinds: list[tuple | None] = [None] * n_blocks
        self.attention = attention or [()] * n_blocks  # per block, its attention modules
        self.samples: dict[tuple, tuple[nn.Module, tuple, dict, Sequence[nn.Module]]] = {}
        self.peak = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def enter(self, b: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        self.kinds[b] = kind = block_kind(block, args, kwargs)
        self.samples.setdefault(kind, (block, args, kwargs, self.attention[b]))

    def leave(self, b: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)  # a block's own peak is measured on its own

    def outside_workspace(self, static: int) -> int:
        """Peak bytes above ``static`` outside the block calls (call once the forward has returned)."""
        return max(0, max(self.peak, torch.cuda.max_memory_allocated(self.device)) - static)

    def block_runs(self) -> list[BlockRun | None]:
        """Per block, the measured run of its kind (None for a block the forward never called)."""
        samples, self.samples = self.samples, {}  # the sample arguments are not held past the measurement
        runs = {
            kind: measure_block(block, args, kwargs, self.device, attention=attention)
            for kind, (block, args, kwargs, attention) in samples.items()
        }
        return [runs.get(kind) if kind is not None else None for kind in self.kinds]
