"""What the ``auto`` planner may choose for one block (:class:`memfit.plan.BlockPolicy`)."""

from __future__ import annotations

from memfit.plan import BlockPolicy

# The planner's menu. unsloth-ffn with attention offload is a fixed backend's policy only: its cost is not
# modelled (its FFN inputs and attention tensors are copied on the same stream in one block).
MENU = tuple(p for p in BlockPolicy if p is not BlockPolicy.FFN_OFFLOAD_ATTENTION_OFFLOAD)


def allowed_policies(*, has_ffn: bool, has_attention: bool, can_offload: bool) -> tuple[BlockPolicy, ...]:
    """The policies a block may take: FFN ones need a declared FFN boundary, attention ones a declared
    attention region, copies a copy engine (CUDA, or a synchronous engine in tests)."""
    out = []
    for p in MENU:
        if p.recompute == "ffn" and not has_ffn:
            continue
        if p.offloads_attention and not has_attention:
            continue
        if p.copies and not can_offload:
            continue
        out.append(p)
    return tuple(out)
