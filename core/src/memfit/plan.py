"""The plan: what each block does, in which chunk, entered how. Every backend is one of these.

A fixed backend (``torch``, ``torch-ffn``, ``unsloth``, ``unsloth-ffn``, attention offload, interval and
stride) and the ``auto`` planner produce the same :class:`RegionPlan`; :func:`memfit.install.install`
turns it into hooks and frames. Where the choices come from:

* :func:`policy_for` — a fixed backend's :class:`BlockPolicy` for its checkpointed blocks (and for the
  blocks a segment stride leaves out);
* :meth:`RegionPlan.from_config` — the fixed backends' plan: that policy per block, chunked by interval
  and stride (:func:`memfit.engine.schedule.plan_blocks`);
* :meth:`RegionPlan.from_policies` — one policy per block by name (``auto``), no chunks.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from memfit.config import Backend, MemfitConfig
from memfit.engine.schedule import plan_blocks


class BlockPolicy(enum.StrEnum):
    """One block's treatment. Declared order = preference when two plans cost the same (least intrusive first)."""

    KEEP = "keep"  # untouched: every activation stays on the GPU
    ATTENTION_OFFLOAD = "attention-offload"  # what attention saves goes to pinned host memory (no recompute)
    FFN = "ffn"  # FFN region(s) recomputed in backward
    FFN_ATTENTION_OFFLOAD = "ffn+attention-offload"
    FFN_OFFLOAD = "ffn-offload"  # FFN recomputed, its saved inputs parked in host memory
    FFN_OFFLOAD_ATTENTION_OFFLOAD = "ffn-offload+attention-offload"  # unsloth-ffn with attention offload
    BLOCK = "block"  # whole block recomputed
    BLOCK_OFFLOAD = "block-offload"  # whole block recomputed, its saved inputs parked in host memory

    @property
    def recompute(self) -> str | None:
        """``"block"``, ``"ffn"`` or None."""
        if self in (BlockPolicy.BLOCK, BlockPolicy.BLOCK_OFFLOAD):
            return "block"
        if self.value.startswith("ffn"):
            return "ffn"
        return None

    @property
    def offloads_inputs(self) -> bool:
        """The recomputed regions' saved inputs are parked in host memory."""
        return self in (
            BlockPolicy.BLOCK_OFFLOAD,
            BlockPolicy.FFN_OFFLOAD,
            BlockPolicy.FFN_OFFLOAD_ATTENTION_OFFLOAD,
        )

    @property
    def offloads_attention(self) -> bool:
        """What the block's attention saves is parked (never inside a recomputed region: it would copy twice)."""
        return self.value.endswith("attention-offload")

    @property
    def copies(self) -> bool:
        return self.offloads_inputs or self.offloads_attention


class BlockEntry(enum.StrEnum):
    """How block calls reach the region engine.

    An adapter declares ``AUTO`` (the default) or ``HOOKS``; an installation resolves ``AUTO`` to
    ``DIFFUSERS`` where the model supports diffusers' gradient checkpointing, else ``HOOKS``.
    """

    AUTO = "auto"
    # through the model's ``_gradient_checkpointing_func(block, *args)`` (diffusers' checkpointing branch),
    # plus forward hooks on declared blocks the model does not route
    DIFFUSERS = "diffusers"
    HOOKS = "hooks"  # forward hooks on the declared blocks only; the model's own checkpointing stays off


def policy_for(backend: Backend | None, *, offload_attention: bool) -> BlockPolicy:
    """The policy a fixed backend gives the blocks it checkpoints (``None``: blocks it leaves alone).

    Inside a recomputed block attention offload does nothing (the block's activations are recomputed anyway),
    so ``torch`` and ``unsloth`` ignore it there; the blocks a segment stride leaves out still take it.
    """
    if backend is None:
        return BlockPolicy.ATTENTION_OFFLOAD if offload_attention else BlockPolicy.KEEP
    return {
        Backend.TORCH: BlockPolicy.BLOCK,
        Backend.UNSLOTH: BlockPolicy.BLOCK_OFFLOAD,
        Backend.TORCH_FFN: BlockPolicy.FFN_ATTENTION_OFFLOAD if offload_attention else BlockPolicy.FFN,
        Backend.UNSLOTH_FFN: (
            BlockPolicy.FFN_OFFLOAD_ATTENTION_OFFLOAD if offload_attention else BlockPolicy.FFN_OFFLOAD
        ),
    }[backend]


@dataclass(frozen=True)
class PlannedBlock:
    """One block of the plan: its place, its policy and, for whole-block recompute, its chunk.

    A chunk is a run of consecutive blocks of one list recomputed as one region (one set of saved inputs);
    ``chunk_start``/``chunk_position``/``chunk_length`` say where this block sits in it (a block alone: a
    chunk of one).
    """

    path: str
    index: int
    policy: BlockPolicy
    chunk_start: int
    chunk_position: int = 0
    chunk_length: int = 1

    @property
    def name(self) -> str:
        return f"{self.path}.{self.index}"


@dataclass(frozen=True)
class RegionPlan:
    """What every block does. Blocks absent from :attr:`blocks` are not the plan's (they run untouched).

    Args:
        blocks: the planned blocks, in call order.
        entry: how block calls reach the engine (``AUTO`` is resolved at installation).
        checkpoint_routed: the generic path (a diffusers model without an adapter, no segment stride): every
            block the model routes through its checkpointing function is a region of its own, and
            :attr:`blocks` (the model's top-level lists) only say which policy those regions take.
    """

    blocks: tuple[PlannedBlock, ...]
    entry: BlockEntry = BlockEntry.AUTO
    checkpoint_routed: bool = False

    @classmethod
    def from_config(
        cls,
        cfg: MemfitConfig,
        lists: Mapping[str, nn.ModuleList],
        *,
        entry: BlockEntry = BlockEntry.AUTO,
        checkpoint_routed: bool = False,
    ) -> RegionPlan:
        """A fixed backend's plan: its policy on the blocks interval and stride select, chunked for whole-block
        recompute (FFN regions are never chunked across blocks: that would save nothing more)."""
        backend = cfg.backend if cfg.enabled else None
        chosen = policy_for(backend, offload_attention=cfg.offload_attention)
        left_out = policy_for(None, offload_attention=cfg.offload_attention)
        slots = (
            plan_blocks(
                {p: len(m) for p, m in lists.items()}, interval=cfg.interval, stride=cfg.segment_stride
            )
            if backend is not None
            else {}
        )
        blocks = []
        for path, modules in lists.items():
            for index in range(len(modules)):
                slot = slots.get((path, index))
                if slot is None:
                    blocks.append(PlannedBlock(path, index, left_out, index))
                elif chosen.recompute == "block":
                    blocks.append(
                        PlannedBlock(path, index, chosen, slot.chunk_start, slot.position, slot.length)
                    )
                else:
                    blocks.append(PlannedBlock(path, index, chosen, index))
        return cls(tuple(blocks), entry, checkpoint_routed)

    @classmethod
    def from_policies(
        cls, policies: Iterable[tuple[str, BlockPolicy]], *, entry: BlockEntry = BlockEntry.AUTO
    ) -> RegionPlan:
        """One policy per block name (``"transformer_blocks.3"``), each block its own region."""
        blocks = []
        for name, policy in policies:
            path, _, index = name.rpartition(".")
            blocks.append(PlannedBlock(path, int(index), policy, int(index)))
        return cls(tuple(blocks), entry)

    @property
    def needed(self) -> bool:
        """False when every block keeps everything (nothing to install)."""
        return self.checkpoint_routed or any(b.policy is not BlockPolicy.KEEP for b in self.blocks)

    def policy_of(self, path: str, index: int) -> BlockPolicy:
        """The block's policy (``KEEP`` for a block the plan does not list)."""
        return self._by_place().get((path, index), BlockPolicy.KEEP)

    def _by_place(self) -> dict[tuple[str, int], BlockPolicy]:
        cached = self.__dict__.get("_places")
        if cached is None:
            cached = {(b.path, b.index): b.policy for b in self.blocks}
            object.__setattr__(self, "_places", cached)
        return cached
