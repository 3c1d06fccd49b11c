"""One plan, one installer: turn (model, adapter, :class:`~memfit.plan.RegionPlan`) into hooks and frames.

Every backend goes through :func:`install`: the fixed ones with the plan their config gives, ``auto`` with
the plan its planner chose for the current input shape. The :class:`Installation` it returns removes
exactly what it installed.

Per block policy (:class:`~memfit.plan.BlockPolicy`):

* whole-block recompute → a block site in the region engine (a chunk of blocks under an interval), its
  entries kept on the device or, ``*-offload``, parked by an :class:`~memfit.offload.regions.OffloadStash`;
* FFN recompute → sites on the block's declared FFN chains, re-resolved at every forward start (PEFT may
  replace those modules after installation);
* attention offload → the block's declared attention modules go to the
  :class:`~memfit.offload.attention.AttentionOffloader`;
* keep, in a plan that parks anything → the block still counts as a region of the step's offload timeline
  (:func:`~memfit.offload.regions.mark_keeping_blocks`), as do recomputed regions that keep their entries.

Blocks whose weights stream (:attr:`~memfit.plan.PlannedBlock.stream_weights`) go to the controller's
:class:`~memfit.offload.weights.WeightStreamer` (:func:`streamed_modules` names them): it outlives installations
(its host masters are made once); an installation installs it before the region hooks, and leaves it to the
controller.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.engine.frame import FrameStats
from memfit.engine.install import RegionEngine, RegionSite, StepListener, chain_sites
from memfit.engine.stash import DeviceStash, Stash
from memfit.errors import MemfitError, UnsupportedBoundaryError
from memfit.offload.attention import AttentionOffloader
from memfit.offload.regions import OffloadStash, device_stash_after_parking, mark_keeping_blocks
from memfit.offload.session import OffloadSession
from memfit.offload.weights import WeightStreamer, weight_stats
from memfit.plan import BlockEntry, BlockPolicy, RegionPlan


class Installation:
    """What :func:`install` put on a model for one plan.

    Attributes:
        plan: the plan it installs.
        engine: the region engine (block and FFN regions).
        offloader: the attention offloader, or None when no block offloads attention.
        streamer: the weight streamer (the controller's), or None when no block streams its weights.
    """

    def __init__(
        self,
        plan: RegionPlan,
        engine: RegionEngine,
        offloader: AttentionOffloader | None,
        marks: list[Any],
        streamer: WeightStreamer | None = None,
    ) -> None:
        self.plan = plan
        self.engine = engine
        self.offloader = offloader
        self.streamer = streamer
        self._marks = marks

    def begin_forward(self) -> None:
        if self.streamer is not None:
            self.streamer.begin_forward()
        self.engine.begin_forward()

    def end_forward(self, *, failed: bool) -> None:
        try:
            self.engine.end_forward(failed=failed)
        finally:
            if self.streamer is not None:
                self.streamer.end_forward(failed=failed)

    def weight_stats(self) -> dict[str, Any]:
        """Weight-streaming counters (zeros when no block streams): :func:`memfit.offload.weights.weight_stats`."""
        return weight_stats(self.streamer, planned_blocks=len(self.plan.blocks))

    def remove(self) -> None:
        """Take off every hook and restore every attribute this installation touched."""
        self.engine.remove()
        for handle in self._marks:
            handle.remove()
        self._marks.clear()
        if self.offloader is not None:
            self.offloader.remove()
        # (the streamer is the controller's: it stays for the next plan, see memfit.controller)


def install(
    model: nn.Module,
    adapter: FamilyAdapter | None,
    plan: RegionPlan,
    *,
    stats: FrameStats,
    session: OffloadSession | None,
    kept_bytes: Mapping[str, int] | None = None,
    streamer: WeightStreamer | None = None,
) -> Installation:
    """Install ``plan`` on ``model``.

    Args:
        model: the model.
        adapter: its family adapter (None: the generic diffusers path, whole blocks only).
        plan: what each block does.
        stats: the frame counters (shared by every plan of one handle).
        session: the offload session; required when a policy copies to host memory.
        kept_bytes: per block name, the bytes a block that keeps everything holds (``auto``'s profile): its
            weight in the reload-ahead rule. Unknown: 0.
        streamer: streams the plan's streamed blocks (:func:`streamed_modules`, in that order); installed here.

    Raises:
        UnsupportedBoundaryError: a policy needs a boundary the family has not declared.
        MemfitError: a module is declared in two regions, or a streamed block is not recomputed alone.
        NotAvailableError, HostMemoryError: weights cannot stream here (see
            :class:`~memfit.offload.weights.WeightStreamer`).
    """
    lists = block_lists(model, adapter)
    if bool(plan.streamed) != (streamer is not None):
        raise MemfitError("internal error: a plan that streams weights must be installed with its streamer")
    copies = any(b.policy.copies for b in plan.blocks)
    if copies and session is None:
        raise MemfitError("internal error: a plan that copies to host memory was installed without a session")
    if session is not None:
        session.copy.allow_in_flight(plan.copies_in_flight)
        session.reload_equal_ahead = plan.reload_equal_ahead
    offload: Callable[[], Stash] | None = (lambda: OffloadStash(session)) if session is not None else None
    keep: Callable[[], Stash] = device_stash_after_parking(session) if copies and session else DeviceStash

    block_sites: dict[nn.Module, RegionSite] = {}
    for b in plan.blocks:
        if b.policy.recompute != "block" or plan.checkpoint_routed:  # routed: every block is its own region
            continue
        blocks = lists[b.path]
        chunk = tuple(blocks[b.chunk_start + i] for i in range(b.chunk_length))
        stash = offload if b.policy.offloads_inputs else keep
        site = RegionSite(("block", b.path, b.chunk_start), chunk, b.chunk_position, "block", stash)
        _add_site(block_sites, blocks[b.index], site)

    ffn_blocks = [(b.path, b.index, b.policy) for b in plan.blocks if b.policy.recompute == "ffn"]
    if ffn_blocks and adapter is None:
        raise UnsupportedBoundaryError(
            f"{type(model).__name__} has no memfit adapter, so it has no declared FFN boundary."
        )

    def locate() -> dict[nn.Module, RegionSite]:
        sites: dict[nn.Module, RegionSite] = {}
        for path, index, policy in ffn_blocks:
            assert adapter is not None
            stash = offload if policy.offloads_inputs else keep
            for r, chain in enumerate(adapter.ffn_chains(lists[path][index])):
                for module, site in chain_sites(("ffn", path, index, r), chain, "ffn", stash_factory=stash):
                    _add_site(sites, module, site)
        return sites

    # the calls whose saves are parked whole: declared attention regions, and the blocks the plan parks
    parked_blocks = [lists[b.path][b.index] for b in plan.blocks if b.policy.parks_block]
    parked_calls = _attention_modules(model, adapter, lists, plan) + parked_blocks
    offloader = (
        AttentionOffloader(session, parked_calls, blocks=frozenset(parked_blocks), weights=streamer)
        if parked_calls and session is not None
        else None
    )
    listeners: list[StepListener] = [session] if session is not None else []
    if offloader is not None:
        listeners.append(offloader)
    whole_block_offload = any(b.policy is BlockPolicy.BLOCK_OFFLOAD for b in plan.blocks)
    engine = RegionEngine(
        model,
        stats=stats,
        block_sites=block_sites,
        known_blocks=[] if plan.checkpoint_routed else [m for blocks in lists.values() for m in blocks],
        block_entry=resolve_entry(model, adapter, plan.entry),
        checkpoint_routed=plan.checkpoint_routed,
        hook_blocks=adapter is not None,
        locate=locate if ffn_blocks else None,
        step_listeners=listeners,
        # blocks routed to the engine without a site of their own (undeclared) are checkpointed as the plan's
        # whole blocks are
        stash_factory=offload if whole_block_offload and offload is not None else keep,
        model_switch=adapter.model_checkpoint_switch if adapter is not None else None,
        switch_off_model_checkpointing=plan.needed,  # a plan that installs nothing leaves the model untouched
    )
    if streamer is not None:
        # streamed blocks not recomputed whole save references to their weights (memfit.offload.weights)
        streamer.reference_saves(
            lists[b.path][b.index] for b in plan.streamed if b.policy.recompute != "block"
        )
        streamer.install()  # its hooks first: a block's weights are in place before its region opens
    try:
        engine.install()
    except BaseException:
        if streamer is not None:
            streamer.suspend()
        raise
    marks: list[Any] = []
    if copies and session is not None:
        keeping = [
            (lists[b.path][b.index], (kept_bytes or {}).get(b.name, 0))
            for b in plan.blocks
            if b.policy is BlockPolicy.KEEP
        ]
        marks = mark_keeping_blocks(session, keeping) if keeping else []
    if offloader is not None:
        offloader.install()
    return Installation(plan, engine, offloader, marks, streamer)


def streamed_modules(
    model: nn.Module, adapter: FamilyAdapter | None, plan: RegionPlan
) -> list[tuple[str, nn.Module]]:
    """(name, block) of the plan's streamed blocks, in call order.

    Raises:
        MemfitError: a streamed block shares a chunk with other blocks.
    """
    streamed = plan.streamed
    if not streamed:
        return []
    lists = block_lists(model, adapter)
    for b in streamed:
        if b.chunk_length != 1:
            raise MemfitError(
                f"internal error: block {b.name} streams its weights but is planned in a chunk of "
                f"{b.chunk_length}; a streamed block is a region of its own"
            )
    return [(b.name, lists[b.path][b.index]) for b in streamed]


def block_lists(model: nn.Module, adapter: FamilyAdapter | None) -> dict[str, nn.ModuleList]:
    """The model's block lists: the adapter's, or on the generic path its own top-level ModuleLists."""
    if adapter is not None:
        return adapter.resolve_block_lists(model)
    return {name: m for name, m in model.named_children() if isinstance(m, nn.ModuleList) and len(m)}


def supports_diffusers_checkpointing(model: nn.Module) -> bool:
    """The model routes blocks through diffusers' ``gradient_checkpointing_func``."""
    return bool(getattr(model, "_supports_gradient_checkpointing", False)) and hasattr(
        model, "enable_gradient_checkpointing"
    )


def resolve_entry(model: nn.Module, adapter: FamilyAdapter | None, entry: BlockEntry) -> BlockEntry:
    """``AUTO`` → ``DIFFUSERS`` where the model supports it and the adapter allows it, else ``HOOKS``."""
    if entry is not BlockEntry.AUTO:
        return entry
    allowed = adapter is None or adapter.block_entry == BlockEntry.AUTO
    return BlockEntry.DIFFUSERS if allowed and supports_diffusers_checkpointing(model) else BlockEntry.HOOKS


def _attention_modules(
    model: nn.Module, adapter: FamilyAdapter | None, lists: Mapping[str, nn.ModuleList], plan: RegionPlan
) -> list[nn.Module]:
    wanted = [b for b in plan.blocks if b.policy.offloads_attention]
    if not wanted:
        return []
    if adapter is None or not adapter.has_attention:
        who = f"family {adapter.name!r}" if adapter else f"{type(model).__name__} (no memfit adapter)"
        raise UnsupportedBoundaryError(
            f"gradient_checkpointing_offload_attention needs declared attention regions, but {who} declares "
            f"none. Install/extend the family's adapter, or turn attention offload off."
        )
    return [m for b in wanted for m in adapter.attention_modules(lists[b.path][b.index])]


def _add_site(sites: dict[nn.Module, RegionSite], module: nn.Module, site: RegionSite) -> None:
    if module in sites:
        raise MemfitError(
            f"module {type(module).__name__} belongs to two declared regions ({sites[module].key} and "
            f"{site.key}); an adapter must declare each module in one region only."
        )
    sites[module] = site
