"""Interval and segment-stride plan: which blocks are checkpointed, and in which chunk.

Per block list (each list is planned on its own, indices restart at 0):

* segments start every ``stride`` blocks; the first ``interval`` blocks of a segment are
  checkpointed, the rest run normally and keep their activations on the GPU;
* for whole-block backends the checkpointed blocks of one segment form ONE chunk (one
  frame, one set of entry tensors); for FFN backends each selected block contributes its
  FFN regions as separate frames (a chunk of FFNs would save nothing more).

``interval=1, stride=None`` is ordinary every-block checkpointing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class BlockSlot:
    """Where one checkpointed block sits in its chunk."""

    list_path: str
    chunk_start: int  # index (in its list) of the chunk's first block
    position: int  # 0-based position inside the chunk
    length: int  # number of blocks in the chunk

    @property
    def chunk_key(self) -> tuple[str, str, int]:
        return ("block", self.list_path, self.chunk_start)


def plan_blocks(
    list_lengths: Mapping[str, int], *, interval: int, stride: int | None
) -> dict[tuple[str, int], BlockSlot]:
    """Map ``(list_path, index)`` of every checkpointed block to its :class:`BlockSlot`.

    Blocks absent from the result run normally.
    """
    if interval < 1:
        raise ValueError(f"interval must be >= 1, got {interval}")
    step = interval if stride is None else stride
    if step < interval:
        raise ValueError(f"stride ({stride}) must be >= interval ({interval})")
    plan: dict[tuple[str, int], BlockSlot] = {}
    for path, length in list_lengths.items():
        for start in range(0, length, step):
            chunk_len = min(interval, length - start)
            for pos in range(chunk_len):
                plan[(path, start + pos)] = BlockSlot(path, start, pos, chunk_len)
    return plan


def chunk_count(list_lengths: Mapping[str, int], *, interval: int, stride: int | None) -> int:
    """How many chunks (frames per forward) :func:`plan_blocks` yields."""
    plan = plan_blocks(list_lengths, interval=interval, stride=stride)
    return len({slot.chunk_key for slot in plan.values()})
