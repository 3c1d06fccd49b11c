"""Which frozen weights can stream from host memory, and which blocks stream (``docs/weight-streaming.md``).

What streams.  Every frozen parameter of a block (``requires_grad=False``, a plain ``nn.Parameter`` over a plain
strided floating-point tensor laid out densely). Left resident, on purpose: trainable parameters (LoRA),
non-floating ones, non-dense layouts and empty ones (the streamer also leaves tied weights: an upload would untie
them). Refused with an error: a frozen parameter that is a tensor subclass (quantized weights, DTensor): its bytes
are not a plain copy.

Which blocks.  A count, or the fewest blocks that stream at least some bytes, spread evenly over the step's frozen
bytes (:func:`choose_streamed_blocks`): each upload then hides behind about the same compute.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from memfit.engine import state
from memfit.errors import NotAvailableError
from memfit.offload.copy import dense_layout
from memfit.units import format_bytes

STREAM_KEY = "gradient_checkpointing_stream_blocks"


def streamable_parameters(block: nn.Module, *, streaming: bool = False) -> list[tuple[str, nn.Parameter]]:
    """The parameters of ``block`` that streaming moves to host memory (see "What streams"), by name.

    Args:
        block: the block.
        streaming: also those streaming now (their data a placeholder of the weight's shape between uploads).

    Raises:
        NotAvailableError: a frozen parameter is a tensor subclass (quantized weights, DTensor).
    """
    out = []
    for name, p in block.named_parameters():
        if p.requires_grad:
            continue
        if type(p) is not nn.Parameter or type(p.data) is not torch.Tensor:
            raise NotAvailableError(
                f"{STREAM_KEY}: the frozen parameter {name!r} of {type(block).__name__} is a "
                f"{type(p).__name__} over {type(p.data).__name__}, not a plain tensor (quantized weights, a "
                f"DTensor); memfit streams plain weights only. Stream fewer blocks, or keep this model's weights "
                f"in a plain dtype (bf16/fp16/fp32)."
            )
        plain = p.layout == torch.strided and p.is_floating_point() and p.numel() > 0 and dense_layout(p.data)
        if plain or (streaming and state.is_streamed(p)):
            out.append((name, p))
    return out


def frozen_block_bytes(block: nn.Module) -> int:
    """Bytes streaming ``block`` takes off the device (its host buffer's payload, padding aside), whether or not it
    streams now."""
    return sum(p.numel() * p.element_size() for _, p in streamable_parameters(block, streaming=True))


def frozen_sizes(lists: Mapping[str, Sequence[nn.Module]]) -> list[tuple[tuple[str, int], int]]:
    """((list path, index), :func:`frozen_block_bytes`) of every block of ``lists``, in call order: what
    :func:`choose_streamed_blocks` chooses from."""
    return [
        ((path, i), frozen_block_bytes(m)) for path, modules in lists.items() for i, m in enumerate(modules)
    ]


def choose_streamed_blocks(
    sizes: Sequence[tuple[Any, int]], *, count: int | None = None, min_bytes: int | None = None
) -> list[Any]:
    """Which blocks stream: ``count`` of them, or the fewest that stream at least ``min_bytes``.

    Args:
        sizes: (key, frozen bytes) of every block, in call order.
        count: stream this many blocks.
        min_bytes: stream blocks until at least this many bytes stream.

    Returns:
        The chosen keys, in call order.

    The blocks are spread evenly over the step's frozen bytes, not over the block count: block ``k`` of ``n`` is the
    one whose bytes hold the point ``(k + ½) / n`` of all frozen bytes (the nearest free one where two points fall
    in one block). A block's compute grows with its weights (the
    linear layers dominate), so each upload hides behind about the same compute, and a block with more bytes (a Flux
    double-stream block holds 2.4× a single-stream one) is picked proportionally more often.

    Raises:
        ValueError: neither or both of ``count``/``min_bytes``; more blocks or bytes than there are.
    """
    if (count is None) == (min_bytes is None):
        raise ValueError("give exactly one of count and min_bytes")
    candidates = [(key, nbytes) for key, nbytes in sizes if nbytes > 0]
    total = sum(n for _, n in candidates)
    if count is not None:
        if count > len(candidates):
            raise ValueError(f"{count} blocks asked, {len(candidates)} have frozen weights to stream")
        return _spread(candidates, count)
    assert min_bytes is not None
    if min_bytes > total:
        raise ValueError(
            f"{format_bytes(min_bytes)} asked, the blocks' frozen weights are {format_bytes(total)} in all"
        )
    for n in range(1, len(candidates) + 1):
        chosen = _spread(candidates, n)
        by_key = dict(candidates)
        if sum(by_key[k] for k in chosen) >= min_bytes:
            return chosen
    raise AssertionError("unreachable: every block streams at most the total")


def _spread(candidates: list[tuple[Any, int]], n: int) -> list[Any]:
    """``n`` of ``candidates`` spread evenly over their cumulative bytes (see :func:`choose_streamed_blocks`): the
    block holding each point, or, where that one is taken already, the free block nearest to it."""
    total = sum(b for _, b in candidates)
    starts, at = [], 0
    for _, nbytes in candidates:
        starts.append(at)
        at += nbytes
    chosen: set[int] = set()
    for k in range(n):
        target = (k + 0.5) * total / n
        holder = max(i for i, start in enumerate(starts) if start <= target)
        if holder in chosen:
            middles = {i: starts[i] + candidates[i][1] / 2 for i in range(len(candidates)) if i not in chosen}
            holder = min(middles, key=lambda i: (abs(middles[i] - target), i))
        chosen.add(holder)
    return [candidates[i][0] for i in sorted(chosen)]
