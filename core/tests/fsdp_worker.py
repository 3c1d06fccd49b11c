"""Rank body of the 2-rank gloo FSDP2 tests (imported by spawned processes; see test_fsdp2.py).

One spawn runs every scenario (each rank imports diffusers once: that is most of the time), and rank 0
writes a JSON summary the tests read.
"""

from __future__ import annotations

import json
import os
import warnings

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import memfit
from memfit.offload.copy import SyncCopyEngine
from memfit.offload.pool import PinnedBucketPool

CASES = [("torch", 1), ("torch", 2), ("torch-ffn", 1), ("torch-ffn", 2)]


def _build():
    import memfit_flux

    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build(seed=0)
    inputs = preset.inputs(model, tokens=16, generator=torch.Generator().manual_seed(1))
    return model, inputs


def _shard(model) -> None:
    for blocks in (model.transformer_blocks, model.single_transformer_blocks):
        for block in blocks:
            fully_shard(block)
    fully_shard(model)


def _step(model, inputs):
    loss = model(**inputs)[0].float().pow(2).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    full = {n: g.full_tensor() for n, g in grads.items()}  # collective: every rank gathers
    return loss.detach(), grads, full


def _compare(ref, got) -> dict:
    loss_ref, local_ref, full_ref = ref
    loss, local, full = got
    return {
        "loss_equal": bool(torch.equal(loss, loss_ref)),
        "same_grad_names": sorted(full) == sorted(full_ref),
        "full_grads_equal": all(torch.equal(full[n], full_ref[n]) for n in full_ref if n in full),
        "local_shards_equal": all(
            torch.equal(local[n].to_local(), local_ref[n].to_local()) for n in local_ref if n in local
        ),
        "max_abs_diff": max(
            ((full[n] - full_ref[n]).abs().max().item() for n in full_ref if n in full), default=float("nan")
        ),
    }


def _cfg(backend: str, interval: int = 1, **extra) -> dict:
    return {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": backend,
        "gradient_checkpointing_interval": interval,
        **extra,
    }


def _sync_engine() -> SyncCopyEngine:
    return SyncCopyEngine(
        PinnedBucketPool(
            allocate=lambda n, pinned: torch.empty(n, dtype=torch.uint8),
            available_host_bytes=lambda: 1 << 40,
            host_reserve_bytes=0,
        )
    )


def run(rank: int, world: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results: dict = {}
    try:
        model, inputs = _build()
        _shard(model)
        ref = _step(model, inputs)

        for backend, interval in CASES:
            model, inputs = _build()
            _shard(model)
            handle = memfit.apply(model, _cfg(backend, interval))
            cmp = _compare(ref, _step(model, inputs))
            cmp["recomputes"] = handle.stats()["recomputes"]
            results[f"{backend}/{interval}"] = cmp

        # offload logic under FSDP on CPU tensors (the CUDA copy engine's bookkeeping, synchronous)
        for name, cfg in (
            ("unsloth/2", _cfg("unsloth", 2)),
            ("attention-offload", {"gradient_checkpointing_offload_attention": True}),
        ):
            model, inputs = _build()
            _shard(model)
            params = {p.to_local().untyped_storage().data_ptr() for p in model.parameters()}
            handle = memfit.apply(model, cfg, copy_engine=_sync_engine(), min_offload_bytes=0)
            cmp = _compare(ref, _step(model, inputs))
            cmp["bytes_offloaded"] = handle.stats()["bytes_offloaded"]
            cmp["sharded_params_untouched"] = params == {
                p.to_local().untyped_storage().data_ptr() for p in model.parameters()
            }
            results[name] = cmp

        # the default offload engine needs CUDA: documented error, also when sharded
        for backend in ("unsloth", "unsloth-ffn"):
            model, _ = _build()
            _shard(model)
            try:
                memfit.apply(model, _cfg(backend))
                results[f"cuda-error/{backend}"] = None
            except memfit.NotAvailableError as e:
                results[f"cuda-error/{backend}"] = str(e)

        # wrong order: memfit first, fully_shard afterwards -> clear error at the next forward
        model, inputs = _build()
        handle = memfit.apply(model, _cfg("torch"))
        _shard(model)
        try:
            model(**inputs)
            results["wrong-order"] = None
        except memfit.MemfitError as e:
            results["wrong-order"] = str(e)
        handle.remove()
        results["after-remove-reapply"] = _compare(ref, _step(model, inputs)) if _reapply(model) else None

        # FSDP2 + its own activation checkpointing (composable checkpoint on each block)
        from torch.distributed._composable import checkpoint

        model, inputs = _build()
        for blocks in (model.transformer_blocks, model.single_transformer_blocks):
            for block in blocks:
                checkpoint(block)
        _shard(model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handle = memfit.apply(model, _cfg("torch-ffn", 2))
        ours = [w for w in caught if issubclass(w.category, memfit.MemfitWarning)]
        cmp = _compare(ref, _step(model, inputs))
        cmp.update(
            warnings=[str(w.message) for w in ours],
            enabled=handle.config.enabled,
            recomputes=handle.stats()["recomputes"],
        )
        results["fsdp-ac"] = cmp
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(results, f, indent=1)


def _reapply(model) -> bool:
    """The documented fix for the wrong order: re-apply memfit once the model is sharded."""
    for p in model.parameters():
        p.grad = None
    memfit.apply(model, _cfg("torch", 2))
    return True
