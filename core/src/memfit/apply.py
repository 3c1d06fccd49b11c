"""``memfit.apply(model, config)``: resolve the family, validate the request, install the engine."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memfit.adapters.discovery import find_adapter
from memfit.adapters.spec import FamilyAdapter
from memfit.auto.controller import AutoController
from memfit.config import Backend, MemfitConfig, as_config
from memfit.distributed import ShardOrderGuard, is_fsdp_module
from memfit.engine.install import RegionEngine, RegionSite, chain_sites, diffusers_block_entry
from memfit.engine.schedule import plan_blocks
from memfit.errors import ConfigError, MemfitError, MemfitWarning, NotAvailableError, UnsupportedBoundaryError
from memfit.handle import MemfitHandle
from memfit.offload.copy import CopyEngine
from memfit.offload.pool import PinnedBucketPool
from memfit.offload.session import AttentionOffloader, OffloadSession, OffloadStash

# models with memfit on; weak, and holding nothing that refers back to the model (a handle would keep it alive)
_applied: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def apply(
    model: nn.Module,
    config: MemfitConfig | Mapping[str, Any] | str | None = None,
    /,
    *,
    adapter: FamilyAdapter | None = None,
    strict: bool = True,
    copy_engine: CopyEngine | None = None,
    min_offload_bytes: int = 1 << 20,
    **overrides: Any,
) -> MemfitHandle:
    """Install checkpointing/offload on ``model`` as ``config`` asks.

    Args:
        model: the transformer (a diffusers model, or any model an installed adapter serves).
        config: a dict of SPEC §1 keys (a trainer's JSON pasted as is), a :class:`MemfitConfig`,
            or a path to a JSON file. Keyword arguments override single keys.
        adapter: use this adapter instead of looking one up from the model's class.
        strict: reject unknown keys (default). ``strict=False`` ignores keys that do not start
            with ``gradient_checkpointing`` (a full trainer config).
        copy_engine: for the offload backends, the engine that parks tensors in host memory; default
            a CUDA :class:`~memfit.offload.copy.CopyEngine` over a pinned pool sized by the config.
            (``SyncCopyEngine`` runs the same logic on CPU tensors, for tests.)
        min_offload_bytes: tensors smaller than this stay on the device (copying them frees little).

    Returns:
        A :class:`MemfitHandle`; ``handle.remove()`` restores the model exactly.

    Raises:
        ConfigError: a key or value is invalid.
        UnsupportedBoundaryError: the family has not declared the requested scope.
        NotAvailableError: the backend cannot run here.
        MemfitError: the model already has memfit applied, or cannot be checkpointed at all.

    Example:
        >>> handle = memfit.apply(transformer, {"gradient_checkpointing": True,
        ...                                     "gradient_checkpointing_backend": "torch-ffn"})
        >>> ...  # train
        >>> handle.remove()
    """
    cfg = as_config(config, strict=strict, **overrides)
    if model in _applied:
        raise MemfitError(
            f"memfit is already applied to this {type(model).__name__}; call handle.remove() on the "
            f"first handle before applying a new configuration."
        )
    adapter = adapter if adapter is not None else find_adapter(model)
    family = adapter.name if adapter is not None else None
    cfg = _effective_config(model, cfg, adapter)
    if cfg.enabled and cfg.backend is Backend.AUTO:
        return _apply_auto(model, cfg, adapter, copy_engine, min_offload_bytes)
    offloads = (cfg.enabled and cfg.backend.offloads_inputs) or cfg.offload_attention
    session = _offload_session(model, cfg, copy_engine, min_offload_bytes) if offloads else None
    if session is not None and cfg.enabled and cfg.backend.offloads_inputs:
        engine = RegionEngine(model, stash_factory=lambda: OffloadStash(session))
    else:
        engine = RegionEngine(model)
    if cfg.enabled:
        _plan(engine, model, cfg, adapter)
    offloader = None
    if cfg.offload_attention:
        assert session is not None
        offloader = AttentionOffloader(session, _attention_modules(model, adapter))
    if session is not None:
        engine.step_listeners.append(session)
    if offloader is not None:
        engine.step_listeners.append(offloader)
    engine.install()
    # FSDP2: memfit goes on after fully_shard; sharding afterwards is refused at the next forward.
    if cfg.enabled or cfg.offload_attention:
        engine._handles.append(ShardOrderGuard(model, _watched_blocks(model, adapter)).install())
    if offloader is not None:
        offloader.install()
    handle = MemfitHandle(
        model,
        cfg,
        family,
        engine,
        on_remove=lambda: _applied.discard(model),
        session=session,
        offloader=offloader,
    )
    _applied.add(model)
    return handle


def _apply_auto(
    model: nn.Module,
    cfg: MemfitConfig,
    adapter: FamilyAdapter | None,
    copy_engine: CopyEngine | None,
    min_offload_bytes: int,
) -> MemfitHandle:
    """The ``auto`` backend: a controller that plans per block at the first forward of each input shape."""
    if adapter is None:
        raise UnsupportedBoundaryError(
            f"gradient_checkpointing_backend='auto' plans each block and needs the blocks and regions an adapter "
            f"declares, but {type(model).__name__} has no memfit adapter. Install the adapter for its family "
            f"(`memfit list`), or use a fixed backend such as 'torch'."
        )
    if any(is_fsdp_module(m) for m in model.modules()):
        raise NotAvailableError(
            "gradient_checkpointing_backend='auto' does not support FSDP2 (fully_shard) yet: its profiling forward "
            "calls the model outside FSDP's own hooks. Use a fixed backend ('torch', 'unsloth', ...) with FSDP2."
        )
    param = next(model.parameters(), None)
    on_cuda = param is not None and param.is_cuda
    budget = cfg.memory_budget if cfg.memory_budget is not None else _free_device_memory(model, on_cuda)
    session = None
    if copy_engine is not None:
        session = OffloadSession(copy_engine, model, min_offload_bytes=min_offload_bytes)
    elif on_cuda:  # the offload policies are offered only where a copy engine can run
        session = _offload_session(model, cfg, None, min_offload_bytes)
    controller = AutoController(model, adapter, budget, session=session, min_offload_bytes=min_offload_bytes)
    controller.install()
    controller.keep_until_removed(ShardOrderGuard(model, _watched_blocks(model, adapter)).install())
    handle = MemfitHandle(
        model,
        cfg,
        adapter.name,
        None,
        on_remove=lambda: _applied.discard(model),
        session=session,
        auto=controller,
    )
    _applied.add(model)
    return handle


def _free_device_memory(model: nn.Module, on_cuda: bool) -> int:
    """The default budget: what this process can still allocate on the model's GPU, plus what it holds."""
    if not on_cuda:
        raise ConfigError(
            "gradient_checkpointing_backend='auto' needs gradient_checkpointing_memory_budget (e.g. \"24GiB\") when "
            "the model is not on a CUDA device: off CUDA the budget counts activation bytes held for backward, and "
            "there is no card whose free memory could serve as the default."
        )
    device = next(model.parameters()).device
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _offload_session(
    model: nn.Module, cfg: MemfitConfig, copy_engine: CopyEngine | None, min_offload_bytes: int
) -> OffloadSession:
    if copy_engine is None:
        what = (
            f"gradient_checkpointing_backend={cfg.backend.value!r}"
            if cfg.backend.offloads_inputs and cfg.enabled
            else "gradient_checkpointing_offload_attention"
        )
        param = next(model.parameters(), None)
        if not torch.cuda.is_available() or param is None or not param.is_cuda:
            raise NotAvailableError(
                f"{what} parks activations in pinned CPU memory and needs the model on a CUDA device "
                f"(CUDA available: {torch.cuda.is_available()}; model on "
                f"{param.device if param is not None else 'no parameters'}). Move the model to the GPU, or "
                f"use 'torch' / 'torch-ffn' (recompute instead of offload)."
            )
        copy_engine = CopyEngine(PinnedBucketPool.from_config(cfg))
    return OffloadSession(copy_engine, model, min_offload_bytes=min_offload_bytes)


def _attention_modules(model: nn.Module, adapter: FamilyAdapter | None) -> list[nn.Module]:
    if adapter is None or not adapter.has_attention:
        who = f"family {adapter.name!r}" if adapter else f"{type(model).__name__} (no memfit adapter)"
        raise UnsupportedBoundaryError(
            f"gradient_checkpointing_offload_attention needs declared attention regions, but {who} declares "
            f"none. Install/extend the family's adapter, or turn attention offload off."
        )
    return [m for _, _, block in adapter.iter_blocks(model) for m in adapter.attention_modules(block)]


def _effective_config(model: nn.Module, cfg: MemfitConfig, adapter: FamilyAdapter | None) -> MemfitConfig:
    """Apply the SPEC §1 interaction rules that turn settings off (each with one warning)."""
    if not cfg.enabled:
        return cfg
    if _fsdp_checkpointing_applied(model):
        warnings.warn(
            "FSDP activation checkpointing is already applied to this model; memfit's model-level "
            "checkpointing is disabled to avoid checkpointing twice (remove FSDP's checkpoint wrapper to use "
            "memfit's backends).",
            MemfitWarning,
            stacklevel=3,
        )
        return dataclasses.replace(cfg, enabled=False)
    if cfg.backend.ffn_only:
        _require_ffn(model, adapter, cfg.backend)
    if cfg.interval > 1 and not cfg.backend.ffn_only and (adapter is None or not adapter.supports_interval):
        who = f"family {adapter.name!r}" if adapter else f"{type(model).__name__} (no memfit adapter)"
        warnings.warn(
            f"gradient_checkpointing_interval={cfg.interval} is ignored: {who} does not support interval "
            f"chunks; every checkpointed block is its own region (interval 1).",
            MemfitWarning,
            stacklevel=3,
        )
        return dataclasses.replace(cfg, interval=1)
    return cfg


def _require_ffn(model: nn.Module, adapter: FamilyAdapter | None, backend: Backend) -> None:
    if adapter is None:
        raise UnsupportedBoundaryError(
            f"gradient_checkpointing_backend={backend.value!r} needs a declared FFN boundary, but "
            f"{type(model).__name__} has no memfit adapter. Install the adapter for its family, or use the "
            f"whole-block backend 'torch'."
        )
    if not adapter.has_ffn:
        raise UnsupportedBoundaryError(
            f"gradient_checkpointing_backend={backend.value!r}: family {adapter.name!r} declares no safe FFN "
            f"boundary. Use the whole-block backend 'torch' instead."
        )
    for path, _, block in adapter.iter_blocks(model):
        if adapter.spec_for(block) is None:
            raise UnsupportedBoundaryError(
                f"gradient_checkpointing_backend={backend.value!r}: block class {type(block).__name__} in "
                f"{path!r} is not declared by family {adapter.name!r}, so it has no known FFN boundary."
            )


def _plan(engine: RegionEngine, model: nn.Module, cfg: MemfitConfig, adapter: FamilyAdapter | None) -> None:
    diffusers_entry = diffusers_block_entry(model, adapter)
    if adapter is None:
        if not diffusers_entry:
            raise MemfitError(
                f"{type(model).__name__} has no memfit adapter and does not support diffusers gradient "
                f"checkpointing, so memfit does not know its blocks. Install the adapter for its family "
                f"(see `memfit list`) or write one (README: 'Write an adapter for a new family')."
            )
        lists = _discover_block_lists(model)
    else:
        lists = adapter.resolve_block_lists(model)
    plan = plan_blocks(
        {p: len(m) for p, m in lists.items()}, interval=cfg.interval, stride=cfg.segment_stride
    )
    if cfg.backend.ffn_only:
        assert adapter is not None
        ffn_adapter = adapter

        def locate() -> dict[nn.Module, RegionSite]:
            sites: dict[nn.Module, RegionSite] = {}
            for (path, index), _slot in plan.items():
                block = lists[path][index]
                assert ffn_adapter.spec_for(block) is not None  # checked by _require_ffn
                for r, chain in enumerate(ffn_adapter.ffn_chains(block)):
                    for module, site in chain_sites(("ffn", path, index, r), chain, "ffn"):
                        _add_site(sites, module, site)
            return sites

        engine.hook_sites = locate()
        engine.watch(locate)  # follows modules PEFT replaces after apply (LoRA wrappers, unload_lora)
        return
    engine.known_blocks = {block for blocks in lists.values() for block in blocks}
    for (path, index), slot in plan.items():
        chunk = tuple(lists[path][slot.chunk_start + i] for i in range(slot.length))
        _add_site(
            engine.block_sites, lists[path][index], RegionSite(slot.chunk_key, chunk, slot.position, "block")
        )
    engine.block_entry = "diffusers" if diffusers_entry else "hooks"
    # Hooks on blocks only where an adapter declared them; the generic path trusts diffusers' routing.
    engine.hook_blocks = adapter is not None
    if adapter is None and cfg.segment_stride is None:
        # generic path: every block diffusers routes to us is its own region
        engine.block_sites.clear()
        engine.known_blocks.clear()


def _add_site(sites: dict, module: nn.Module, site: RegionSite) -> None:
    if module in sites:
        raise MemfitError(
            f"module {type(module).__name__} belongs to two declared regions ({sites[module].key} and "
            f"{site.key}); an adapter must declare each module in one region only."
        )
    sites[module] = site


def _discover_block_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    """Generic path: the model's own (top-level) ModuleLists are its block lists."""
    return {name: m for name, m in model.named_children() if isinstance(m, nn.ModuleList) and len(m)}


def _watched_blocks(model: nn.Module, adapter: FamilyAdapter | None) -> list[nn.Module]:
    lists = adapter.resolve_block_lists(model) if adapter is not None else _discover_block_lists(model)
    return [block for blocks in lists.values() for block in blocks]


def _fsdp_checkpointing_applied(model: nn.Module) -> bool:
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover - torch without distributed
        _get_registry = None
    for module in model.modules():
        if type(module).__name__ == "CheckpointWrapper":
            return True
        if _get_registry is not None:
            registry = _get_registry(module)
            if registry and "checkpoint" in registry:
                return True
    return False
