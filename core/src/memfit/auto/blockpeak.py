"""Memory the planner cannot count from saved tensors: one block's own forward+backward peak, and the
forward's working memory outside the blocks (CUDA allocator statistics; nothing here runs off CUDA).

Design notes
------------
Why measure a block alone.  The profiling forward holds nothing, so it sees neither a block's saved
activations living next to its forward temporaries nor its backward's gradient buffers (math attention's
probability gradients are as large as the probabilities). Summing guesses for both overshot Flux's real
peak by ~0.8 GiB; running the block once with gradients and reading the allocator's peak measures exactly
what the block adds while its backward runs. One run per *kind* of block (class, parameter count, input
shapes and which inputs require gradients): a model has two or three kinds.

Side effects.  None on the model: inputs are detached (and cloned where they need gradients), the block's
weight gradients are returned by ``torch.autograd.grad`` (never accumulated into ``.grad``), and the RNG is
forked (dropout draws nothing from the training stream).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten


def block_kind(block: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """Blocks of one kind have the same peak: the same class, parameter count, input shapes, and the same
    inputs requiring gradients (the first block's hidden states come from frozen layers; later ones' do not)."""
    leaves = tree_flatten((args, kwargs))[0]
    shapes = tuple((tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor) else type(x).__name__
                   for x in leaves)
    return type(block), sum(p.numel() for p in block.parameters()), shapes


@dataclass(frozen=True)
class BlockRun:
    """One isolated forward+backward of a block: its peak above its inputs, and how long each half took."""

    peak_bytes: int
    forward_seconds: float
    backward_seconds: float


def measure_block(block: nn.Module, args: tuple, kwargs: dict, device: torch.device) -> BlockRun:
    """:func:`measure_block_peak` run twice: the second run is timed (the first loads the backward's kernels,
    which the profiling forward never ran)."""
    measure_block_peak(block, args, kwargs, device)
    times: list[float] = []
    peak = measure_block_peak(block, args, kwargs, device, times=times)
    return BlockRun(peak, *times) if times else BlockRun(peak, 0.0, 0.0)


def measure_block_peak(block: nn.Module, args: tuple, kwargs: dict, device: torch.device, *,
                       times: list[float] | None = None) -> int:
    """Peak bytes one forward+backward of ``block`` allocates above what exists before it (its inputs).

    The inputs require gradients exactly where they did in the profiling forward (so the first block, fed by
    frozen layers, computes no input gradient, and rotary tables or a frozen time embedding none anywhere),
    every output that requires one gets a gradient of ones, allocated inside the measurement as in a real
    backward, and the outputs themselves do not count in the backward's peak (see "Outputs"). ``times``,
    when given, receives the forward's and the backward's seconds (CUDA events; one synchronisation).
    """
    flat, spec = tree_flatten((args, kwargs))
    leaves = [x.detach().requires_grad_(x.requires_grad) if _differentiable(x) else x for x in flat]
    # the block runs on copies: it may edit its inputs in place, which a leaf that requires grad forbids
    used = [x.clone() if isinstance(x, torch.Tensor) and x.requires_grad else x for x in leaves]
    wrt = [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    wrt += [p for p in block.parameters() if p.requires_grad]
    call_args, call_kwargs = tree_unflatten(used, spec)
    # storages a real step holds through the backward as well: the inputs and their copies (a block may
    # return one unchanged) and, noted by the hook below, whatever the graph saves
    held = {x.untyped_storage().data_ptr() for x in (*flat, *used) if isinstance(x, torch.Tensor)}
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    with torch.enable_grad(), torch.random.fork_rng(devices=[device]), \
            torch.autograd.graph.saved_tensors_hooks(lambda t: _note(held, t), lambda t: t):
        marks[0].record()
        out = block(*call_args, **call_kwargs)
        marks[1].record()
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        forward_peak = torch.cuda.max_memory_allocated(device)
        backward_peak = 0
        if outs and wrt:
            dead = {s.data_ptr(): s.nbytes() for s in (t.untyped_storage() for t in outs) if s.data_ptr() not in held}
            grads = [torch.ones_like(t) for t in outs]
            torch.cuda.reset_peak_memory_stats(device)
            marks[2].record()
            torch.autograd.grad(outs, wrt, grads, allow_unused=True)
            marks[3].record()
            backward_peak = torch.cuda.max_memory_allocated(device) - sum(dead.values())
            del grads
        del out, outs
    if times is not None and backward_peak:
        marks[3].synchronize()
        times += [marks[0].elapsed_time(marks[1]) / 1e3, marks[2].elapsed_time(marks[3]) / 1e3]
    return max(0, forward_peak - before, backward_peak - before)


# Outputs.  In a training step a block's outputs are dead by the time its backward runs: the next block
# consumed them and released what it kept of them. Held here through the backward (autograd wants them as
# roots) they would add their size to its peak (~27 MiB for a Flux block at 4096 tokens), so the backward's
# peak is read on its own and their bytes taken off, unless the graph saved them (then a real step holds
# them too).


def _note(storages: set[int], t: torch.Tensor) -> torch.Tensor:
    storages.add(t.untyped_storage().data_ptr())
    return t


def _differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


class ForwardMemory:
    """What the profiling forward's block hooks record for the measurements above.

    ``enter``/``leave`` bracket each block call: between calls the allocator's peak is the working memory
    outside the blocks; at each call the first block of its kind keeps its arguments for
    :meth:`block_runs`, which runs after the forward.
    """

    def __init__(self, device: torch.device, n_blocks: int) -> None:
        self.device = device
        self.kinds: list[tuple | None] = [None] * n_blocks
        self.samples: dict[tuple, tuple[nn.Module, tuple, dict]] = {}
        self.peak = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    def enter(self, b: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        self.peak = max(self.peak, torch.cuda.max_memory_allocated(self.device))
        self.kinds[b] = kind = block_kind(block, args, kwargs)
        self.samples.setdefault(kind, (block, args, kwargs))

    def leave(self, b: int) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)  # a block's own peak is measured on its own

    def outside_workspace(self, static: int) -> int:
        """Peak bytes above ``static`` outside the block calls (call once the forward has returned)."""
        return max(0, max(self.peak, torch.cuda.max_memory_allocated(self.device)) - static)

    def block_runs(self) -> list[BlockRun | None]:
        """Per block, the measured run of its kind (None for a block the forward never called)."""
        samples, self.samples = self.samples, {}  # the sample arguments are not held past the measurement
        runs = {kind: measure_block(block, args, kwargs, self.device) for kind, (block, args, kwargs) in samples.items()}
        return [runs.get(kind) if kind is not None else None for kind in self.kinds]
