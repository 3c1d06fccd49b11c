"""What the ``auto`` planner may choose for one block, and what each choice keeps, moves and recomputes."""

from __future__ import annotations

import enum


class BlockPolicy(enum.StrEnum):
    """One block's treatment. Declared order = preference when two plans cost the same (least intrusive first)."""

    KEEP = "keep"  # untouched: every activation stays on the GPU
    ATTENTION_OFFLOAD = "attention-offload"  # what attention saves goes to pinned host memory (no recompute)
    FFN = "ffn"  # FFN region(s) recomputed in backward
    FFN_ATTENTION_OFFLOAD = "ffn+attention-offload"
    FFN_OFFLOAD = "ffn-offload"  # FFN recomputed, its saved inputs parked in host memory
    BLOCK = "block"  # whole block recomputed
    BLOCK_OFFLOAD = "block-offload"  # whole block recomputed, its saved inputs parked in host memory

    @property
    def recompute(self) -> str | None:
        """``"block"``, ``"ffn"`` or None."""
        if self in (BlockPolicy.BLOCK, BlockPolicy.BLOCK_OFFLOAD):
            return "block"
        if self in (BlockPolicy.FFN, BlockPolicy.FFN_ATTENTION_OFFLOAD, BlockPolicy.FFN_OFFLOAD):
            return "ffn"
        return None

    @property
    def offloads_inputs(self) -> bool:
        return self in (BlockPolicy.BLOCK_OFFLOAD, BlockPolicy.FFN_OFFLOAD)

    @property
    def offloads_attention(self) -> bool:
        return self in (BlockPolicy.ATTENTION_OFFLOAD, BlockPolicy.FFN_ATTENTION_OFFLOAD)

    @property
    def copies(self) -> bool:
        return self.offloads_inputs or self.offloads_attention


def allowed_policies(*, has_ffn: bool, has_attention: bool, can_offload: bool) -> tuple[BlockPolicy, ...]:
    """The policies a block may take: FFN ones need a declared FFN boundary, attention ones a declared
    attention region, copies a copy engine (CUDA, or a synchronous engine in tests)."""
    out = []
    for p in BlockPolicy:
        if p.recompute == "ffn" and not has_ffn:
            continue
        if p.offloads_attention and not has_attention:
            continue
        if p.copies and not can_offload:
            continue
        out.append(p)
    return tuple(out)
