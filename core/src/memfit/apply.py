"""``memfit.apply(model, config)``: validate the request, choose the planner, hand over to the controller.

The layers, top down (``docs/architecture.md``): config → plan (:mod:`memfit.plan`; ``auto``:
:mod:`memfit.auto`) → installation (:mod:`memfit.install`) → regions (:mod:`memfit.engine`) → copy engine
(:mod:`memfit.offload`). This module only does the first step and wires the rest together.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from memfit.adapters.discovery import find_adapter, get_adapter
from memfit.adapters.spec import FamilyAdapter
from memfit.auto.budget_planner import BudgetPlanner, host_bytes_for_plans
from memfit.config import Backend, MemfitConfig, as_config
from memfit.controller import Controller, FixedPlanner, Planner
from memfit.distributed import ShardOrderGuard, is_fsdp_module
from memfit.errors import ConfigError, MemfitError, MemfitWarning, NotAvailableError, UnsupportedBoundaryError
from memfit.handle import MemfitHandle
from memfit.install import block_lists, supports_diffusers_checkpointing
from memfit.offload.copy import CopyEngine
from memfit.offload.pool import PinnedBucketPool
from memfit.offload.session import OffloadSession
from memfit.placement import check_movable, target_device
from memfit.plan import BlockEntry, RegionPlan

# models with memfit on; weak, and holding nothing that refers back to the model (a handle would keep it alive)
_applied: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def apply(
    model: nn.Module,
    config: MemfitConfig | Mapping[str, Any] | str | None = None,
    /,
    *,
    adapter: FamilyAdapter | str | None = None,
    strict: bool = True,
    copy_engine: CopyEngine | None = None,
    min_offload_bytes: int = 1 << 20,
    device: torch.device | str | int | None = None,
    **overrides: Any,
) -> MemfitHandle:
    """Install checkpointing/offload on ``model`` as ``config`` asks.

    Args:
        model: the transformer (a diffusers model, or any model an installed adapter serves).
        config: a dict of SPEC §1 keys (a trainer's JSON pasted as is), a :class:`MemfitConfig`,
            or a path to a JSON file. Keyword arguments override single keys.
        adapter: use this adapter (or the installed adapter of this family name) instead of looking one up
            from the model's class.
        strict: reject unknown keys (default). ``strict=False`` ignores keys that do not start
            with ``gradient_checkpointing`` (a full trainer config).
        copy_engine: for the offload backends, the engine that parks tensors in host memory; default
            a CUDA :class:`~memfit.offload.copy.CopyEngine` over a pinned pool sized by the config.
            (``SyncCopyEngine`` runs the same logic on CPU tensors, for tests.)
        min_offload_bytes: tensors smaller than this stay on the device (copying them frees little).
        device: where the model trains, when it is not there yet (a model loaded on the CPU that the card cannot
            hold whole): ``apply`` moves it, and the frozen weights of the blocks that stream
            (``gradient_checkpointing_stream_blocks``) go from where they are straight into pinned host memory,
            never through the device. ``handle.remove()`` moves everything back where it was. Default: the model
            trains where its weights are.

    Returns:
        A :class:`MemfitHandle`; ``handle.remove()`` restores the model exactly.

    Raises:
        TypeError: ``model`` is not a module, or ``adapter`` neither an adapter nor a family name.
        ConfigError: a key or value is invalid, or ``device`` is given and a weight is on the meta device.
        UnsupportedBoundaryError: the family has not declared the requested scope.
        NotAvailableError: the backend cannot run here, ``device`` is a CUDA device this process cannot see, or
            ``device`` is given for a model sharded with FSDP2.
        DeviceMemoryError: what stays on ``device`` does not fit there (the model is left where it was).
        MemfitError: the model already has memfit applied, or cannot be checkpointed at all.

    Example:
        >>> handle = memfit.apply(transformer, {"gradient_checkpointing": True,
        ...                                     "gradient_checkpointing_backend": "torch-ffn"})
        >>> ...  # train
        >>> handle.remove()
    """
    cfg = as_config(config, strict=strict, **overrides)
    target = target_device(device)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"memfit.apply(model, ...) needs the model as a torch.nn.Module (the transformer), got "
            f"{type(model).__name__}. Pass the model itself, e.g. memfit.apply(pipeline.transformer, config)."
        )
    if isinstance(adapter, str):
        adapter = get_adapter(adapter)
    elif adapter is not None and not isinstance(adapter, FamilyAdapter):
        raise TypeError(
            f"adapter must be a memfit FamilyAdapter or an installed family's name (e.g. 'flux'), got "
            f"{type(adapter).__name__}"
        )
    if target is not None:
        check_movable(model, target)
    if model in _applied:
        raise MemfitError(
            f"memfit is already applied to this {type(model).__name__}; call handle.remove() on the "
            f"first handle before applying a new configuration."
        )
    adapter = adapter if adapter is not None else find_adapter(model)
    cfg = _effective_config(model, cfg, adapter)
    session: OffloadSession | None
    planner: Planner
    if cfg.enabled and cfg.backend is Backend.AUTO:
        session = _auto_session(model, cfg, adapter, copy_engine, min_offload_bytes, target)
        assert adapter is not None  # checked by _auto_session
        budget = cfg.memory_budget if cfg.memory_budget is not None else _free_device_memory(model, target)
        controller: Controller | None = None  # set below; a plan asked for before then counts the pool alone

        def pinned_by_this_model() -> int:
            # what the plan running now pins is the next plan's to reuse, not taken from it
            streamer = controller.streamer if controller is not None else None
            held = session.pinned_bytes_held() if session is not None else 0
            return held + (streamer.pinned_bytes if streamer is not None else 0)

        planner = BudgetPlanner(
            model,
            adapter,
            budget,
            can_offload=session is not None,
            parks_storages_once=session is not None and session.copy.parks_storages_once,
            min_offload_bytes=min_offload_bytes,
            host_bytes=lambda: host_bytes_for_plans(pinned_by_this_model()),
            can_stream=cfg.stream_blocks != 0,  # 0: every weight stays on the device
            optimizer_state_per_byte=cfg.optimizer_state_per_byte,
            optimizer_temporaries_per_byte=cfg.optimizer_step_temporaries_per_byte,
            device=target,
        )
        initial = RegionPlan(())
    else:
        offloads = (cfg.enabled and cfg.backend.offloads_inputs) or cfg.offload_attention
        session = _offload_session(model, cfg, copy_engine, min_offload_bytes, target) if offloads else None
        initial = _fixed_plan(model, cfg, adapter)
        planner = FixedPlanner(initial)
    controller = Controller(model, adapter, planner, initial=initial, session=session, device=target)
    # FSDP2: memfit goes on after fully_shard; sharding afterwards is refused at the next forward.
    if cfg.installs_anything:
        lists = block_lists(model, adapter)
        controller.keep_until_removed(
            ShardOrderGuard(model, [block for blocks in lists.values() for block in blocks]).install()
        )
    _applied.add(model)
    family = adapter.name if adapter is not None else None
    return MemfitHandle(model, cfg, family, controller, on_remove=lambda: _applied.discard(model))


def _fixed_plan(model: nn.Module, cfg: MemfitConfig, adapter: FamilyAdapter | None) -> RegionPlan:
    """A fixed backend's plan (nothing when checkpointing and attention offload are both off)."""
    if not cfg.installs_anything:
        return RegionPlan(())
    if adapter is None and cfg.enabled:
        if not supports_diffusers_checkpointing(model):
            raise MemfitError(
                f"{type(model).__name__} has no memfit adapter and does not support diffusers gradient "
                f"checkpointing, so memfit does not know its blocks. Install the adapter for its family "
                f"(see `memfit list`) or write one (README: 'Write an adapter for a new family')."
            )
        # the generic path: diffusers routes the blocks; without a stride, every routed block is a region
        routed = cfg.segment_stride is None
        return RegionPlan.from_config(cfg, block_lists(model, None), checkpoint_routed=routed)
    entry = BlockEntry(adapter.block_entry) if adapter is not None else BlockEntry.AUTO
    return RegionPlan.from_config(cfg, block_lists(model, adapter), entry=entry)


def _auto_session(
    model: nn.Module,
    cfg: MemfitConfig,
    adapter: FamilyAdapter | None,
    copy_engine: CopyEngine | None,
    min_offload_bytes: int,
    target: torch.device | None,
) -> OffloadSession | None:
    """The ``auto`` backend's checks, and its offload session (None where no copy engine can run)."""
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
    if copy_engine is not None:
        return OffloadSession(copy_engine, model, min_offload_bytes=min_offload_bytes)
    device = _training_device(model, target)
    if device is not None and device.type == "cuda":  # the offload policies are offered only where copies run
        return _offload_session(model, cfg, None, min_offload_bytes, target)
    return None


def _training_device(model: nn.Module, target: torch.device | None) -> torch.device | None:
    """``apply``'s ``device``, else where the model's first parameter is (None: no parameter)."""
    if target is not None:
        return target
    param = next(model.parameters(), None)
    return param.device if param is not None else None


def _free_device_memory(model: nn.Module, target: torch.device | None) -> int:
    """The default budget: what this process can still allocate on the model's GPU, plus what it holds."""
    device = _training_device(model, target)
    if device is None or device.type != "cuda":
        raise ConfigError(
            "gradient_checkpointing_backend='auto' needs gradient_checkpointing_memory_budget (e.g. \"24GiB\") when "
            "the model is not on a CUDA device: off CUDA the budget counts activation bytes held for backward, and "
            "there is no card whose free memory could serve as the default."
        )
    free, _total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device)


def _offload_session(
    model: nn.Module,
    cfg: MemfitConfig,
    copy_engine: CopyEngine | None,
    min_offload_bytes: int,
    target: torch.device | None = None,
) -> OffloadSession:
    if copy_engine is None:
        what = (
            f"gradient_checkpointing_backend={cfg.backend.value!r}"
            if cfg.backend.offloads_inputs and cfg.enabled
            else "gradient_checkpointing_offload_attention"
        )
        device = _training_device(model, target)
        if not torch.cuda.is_available() or device is None or device.type != "cuda":
            raise NotAvailableError(
                f"{what} parks activations in pinned CPU memory and needs the model on a CUDA device "
                f"(CUDA available: {torch.cuda.is_available()}; model on "
                f"{device if device is not None else 'no parameters'}). Move the model to the GPU (or pass "
                f"memfit.apply(..., device='cuda')), or use 'torch' / 'torch-ffn' (recompute instead of offload)."
            )
        copy_engine = CopyEngine(PinnedBucketPool.from_config(cfg))
    return OffloadSession(copy_engine, model, min_offload_bytes=min_offload_bytes)


def is_applied(model: nn.Module) -> bool:
    """memfit is on ``model`` (a handle not removed yet)."""
    return model in _applied


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
        if cfg.stream_blocks:
            raise ConfigError(
                f"gradient_checkpointing_stream_blocks={cfg.stream_blocks!r} needs memfit's checkpointing on (a "
                f"block whose weights stream is recomputed in backward), and FSDP's activation checkpointing on "
                f"this model turned it off: remove FSDP's checkpoint wrapper, or unset "
                f"gradient_checkpointing_stream_blocks."
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


def _fsdp_checkpointing_applied(model: nn.Module) -> bool:
    """FSDP's activation checkpointing (``CheckpointWrapper`` or composable ``checkpoint``) is on the model."""
    for module in model.modules():
        if type(module).__name__ == "CheckpointWrapper":
            return True
    if "torch.distributed" not in sys.modules:  # nothing can have applied the composable API
        return False
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return any("checkpoint" in (_get_registry(module) or {}) for module in model.modules())
