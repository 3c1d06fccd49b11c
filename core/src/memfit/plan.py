"""The plan: what each block does, in which chunk, entered how. Every backend is one of these.

A fixed backend (``torch``, ``torch-ffn``, ``unsloth``, ``unsloth-ffn``, attention offload, interval and
stride) and the ``auto`` planner produce the same :class:`RegionPlan`; :func:`memfit.install.install`
turns it into hooks and frames. Where the choices come from:

* :func:`policy_for` — a fixed backend's :class:`BlockPolicy` for its checkpointed blocks (and for the
  blocks a segment stride leaves out);
* :meth:`RegionPlan.from_config` — the fixed backends' plan: that policy per block, chunked by interval
  and stride (:func:`memfit.engine.schedule.plan_blocks`);
* :meth:`RegionPlan.from_policies` — one policy per block by name (``auto``), no chunks.

Weight streaming is orthogonal to the policy (:attr:`PlannedBlock.stream_weights`): a block whose frozen weights
stream from host memory is a chunk of its own. The fixed knob recomputes it whole (``BLOCK``, or ``BLOCK_OFFLOAD``
where the backend parks inputs), so nothing but its parameters refers to its uploaded weights between its forward
and its recompute; under ``auto`` it may take any policy, its forward then saving references to its weights
instead of the weights ("Saved weights" in :mod:`memfit.offload.weights`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from torch import nn

from memfit.config import Backend, MemfitConfig
from memfit.engine.schedule import plan_blocks
from memfit.errors import ConfigError
from memfit.offload.streamable import STREAM_KEY, choose_streamed_blocks, frozen_sizes
from memfit.units import format_bytes, parse_bytes


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
    PARK = "park"  # nothing recomputed: everything the block saves goes to pinned host memory (auto only)

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
    def parks_block(self) -> bool:
        """Every tensor the block's call saves is parked, as attention offload parks an attention call's."""
        return self is BlockPolicy.PARK

    @property
    def copies(self) -> bool:
        return self.offloads_inputs or self.offloads_attention or self.parks_block


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
    chunk of one). ``stream_weights``: its frozen weights live in host memory and are uploaded ahead of its
    forward and its recompute (then its policy recomputes the whole block, alone).
    """

    path: str
    index: int
    policy: BlockPolicy
    chunk_start: int
    chunk_position: int = 0
    chunk_length: int = 1
    stream_weights: bool = False

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
        forward_uploads_ahead: streamed blocks whose weights the forward uploads ahead of the one running (the
            fixed knob: 1; ``auto`` may lead further, :mod:`memfit.auto.streaming`).
        kept_uploads: the first streamed blocks whose last recompute's upload serves the next forward (held
            between steps); ``None``: the turnaround rule, :attr:`uploads_kept_first`.
        copies_in_flight: device-to-host bytes the forward may have in flight before compute waits for the link
            (``auto``'s copy queue, :mod:`memfit.auto.planner`, "Queue"); 0: the copy engine's own bound.
        reload_equal_ahead: backward reloads a further region ahead also where it equals the bytes taken
            (``auto``'s choice where the backward's link waits less and the peak fits,
            :mod:`memfit.offload.ahead`, "Equal regions two ahead").
    """

    blocks: tuple[PlannedBlock, ...]
    entry: BlockEntry = BlockEntry.AUTO
    checkpoint_routed: bool = False
    forward_uploads_ahead: int = 1
    kept_uploads: int | None = None
    copies_in_flight: int = 0
    reload_equal_ahead: bool = False

    @property
    def uploads_kept_first(self) -> int:
        """How many of the first streamed blocks keep their last recompute's upload for the next forward: the
        plan's own count, else 1 where the plan's first block streams (nothing runs before it), else 0
        (:mod:`memfit.offload.weights`, "Turnarounds")."""
        if self.kept_uploads is not None:
            return self.kept_uploads
        return int(bool(self.blocks) and self.blocks[0].stream_weights)

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
        recompute (FFN regions are never chunked across blocks: that would save nothing more). The blocks
        ``gradient_checkpointing_stream_blocks`` streams are whole-block recomputed alone, whatever the backend's
        scope, interval and stride (:func:`streamed_places`).

        Raises:
            ConfigError: more blocks or bytes to stream than the blocks' frozen weights hold.
        """
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
        if backend is not None and cfg.stream_blocks:
            streamed = streamed_places(cfg.stream_blocks, lists)
            alone = BlockPolicy.BLOCK_OFFLOAD if backend.offloads_inputs else BlockPolicy.BLOCK
            blocks = _chunks_around(
                [
                    PlannedBlock(b.path, b.index, alone, b.index, stream_weights=True)
                    if (b.path, b.index) in streamed
                    else b
                    for b in blocks
                ]
            )
        return cls(tuple(blocks), entry, checkpoint_routed)

    @classmethod
    def from_policies(
        cls,
        policies: Iterable[tuple[str, BlockPolicy]],
        *,
        streamed: Collection[str] = (),
        forward_uploads_ahead: int = 1,
        kept_uploads: int | None = None,
        copies_in_flight: int = 0,
        reload_equal_ahead: bool = False,
        entry: BlockEntry = BlockEntry.AUTO,
    ) -> RegionPlan:
        """One policy per block name (``"transformer_blocks.3"``), each block its own region; the blocks named in
        ``streamed`` stream their frozen weights (any policy: see "Saved weights"), the forward
        uploading them ``forward_uploads_ahead`` ahead, the first ``kept_uploads`` of them on the uploads of their
        last recompute; ``copies_in_flight`` and ``reload_equal_ahead`` as the class says."""
        blocks = []
        for name, policy in policies:
            path, _, index = name.rpartition(".")
            blocks.append(PlannedBlock(path, int(index), policy, int(index), stream_weights=name in streamed))
        return cls(
            tuple(blocks),
            entry,
            forward_uploads_ahead=forward_uploads_ahead,
            kept_uploads=kept_uploads,
            copies_in_flight=copies_in_flight,
            reload_equal_ahead=reload_equal_ahead,
        )

    @property
    def streamed(self) -> tuple[PlannedBlock, ...]:
        """The blocks whose frozen weights stream from host memory, in call order."""
        return tuple(b for b in self.blocks if b.stream_weights)

    @property
    def needed(self) -> bool:
        """False when every block keeps everything and no weight streams (nothing to install)."""
        return self.checkpoint_routed or any(
            b.policy is not BlockPolicy.KEEP or b.stream_weights for b in self.blocks
        )

    def policy_of(self, path: str, index: int) -> BlockPolicy:
        """The block's policy (``KEEP`` for a block the plan does not list)."""
        return self._by_place().get((path, index), BlockPolicy.KEEP)

    def _by_place(self) -> dict[tuple[str, int], BlockPolicy]:
        cached = self.__dict__.get("_places")
        if cached is None:
            cached = {(b.path, b.index): b.policy for b in self.blocks}
            object.__setattr__(self, "_places", cached)
        return cached


def streamed_places(target: int | str, lists: Mapping[str, nn.ModuleList]) -> set[tuple[str, int]]:
    """(list path, index) of the blocks ``gradient_checkpointing_stream_blocks=target`` streams: a count of blocks,
    or a size (stream blocks until at least that many frozen bytes stream), chosen by
    :func:`memfit.offload.streamable.choose_streamed_blocks` (spread evenly over the frozen bytes in call order).

    Raises:
        ConfigError: the blocks have no frozen weight, or fewer blocks/bytes than asked.
    """
    sizes = frozen_sizes(lists)
    total = sum(n for _, n in sizes)
    if not total:
        raise ConfigError(
            f"{STREAM_KEY}={target!r}: the model's blocks have no frozen weights to stream (every weight trains). "
            f"Freeze the base weights before memfit.apply (model.requires_grad_(False), then add LoRA), or unset "
            f"{STREAM_KEY}."
        )
    try:
        if isinstance(target, str):
            chosen = choose_streamed_blocks(sizes, min_bytes=parse_bytes(target))
        else:
            chosen = choose_streamed_blocks(sizes, count=target)
    except ValueError as exc:
        streamable = sum(1 for _, n in sizes if n)
        raise ConfigError(
            f"{STREAM_KEY}={target!r}: {exc}. At most {streamable} blocks ({format_bytes(total)} of frozen "
            f"weights) can stream; ask for fewer."
        ) from None
    return set(chosen)


def _chunks_around(blocks: list[PlannedBlock]) -> list[PlannedBlock]:
    """Whole-block chunks cut around the streamed blocks: a chunk that held one becomes the runs of consecutive
    blocks on either side (each still one region)."""
    streamed = {(b.path, b.index) for b in blocks if b.stream_weights}
    out = []
    for b in blocks:
        if b.stream_weights or b.chunk_length == 1 or b.policy.recompute != "block":
            out.append(b)
            continue
        members = range(b.chunk_start, b.chunk_start + b.chunk_length)
        start, end = b.index, b.index
        while start - 1 in members and (b.path, start - 1) not in streamed:
            start -= 1
        while end + 1 in members and (b.path, end + 1) not in streamed:
            end += 1
        out.append(
            dataclasses.replace(
                b, chunk_start=start, chunk_position=b.index - start, chunk_length=end - start + 1
            )
        )
    return out
