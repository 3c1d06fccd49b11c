"""Every family at its published size: frozen bf16 base + PEFT LoRA r16, every memfit mode the family supports.

    python -m memfit_benchmarks.families --family all --out benchmarks/results            # GPU, preset full
    python -m memfit_benchmarks.families --family flux --preset tiny --device cpu --out /tmp/f   # CPU smoke
    python -m memfit_benchmarks --suite families ...                                      # same, via nox bench

``--family all`` is every installed diffusion family (the ``hf-decoder*`` LLM adapters only when named).
One process runs all requested families one after the other, freeing each model before the next. Per
family: the preset's model with random weights (nothing downloaded), LoRA on every ``nn.Linear`` inside the
adapter's declared blocks (found with ``iter_blocks``), inputs at ``--tokens`` (default: the preset's
``default_tokens``). Modes: ``runner.MODES``, minus ``*-ffn`` where the family declares no FFN boundary,
offload modes off CUDA, ``offload_attention`` without attention regions and intervals where the family
does not support them (listed under ``skipped``). A mode that runs out of memory is an ``oom`` row.
Writes ``family-<name>-<preset>-<date>.json`` per family to ``--out``, then renders markdown and PNGs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit
from memfit.adapters.spec import FamilyAdapter
from memfit_benchmarks.rounds import add_rounds_option
from memfit_benchmarks.runner import MODES, Mode, is_offload, measure_modes, pinned_bandwidth


def _progress(iterable, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is a nicety; plain prints below still show it
        return iterable
    return tqdm(iterable, **kw)


def default_families() -> list[str]:
    return sorted(n for n in memfit.available_adapters() if not n.startswith("hf-decoder"))


def skip_reason(mode: Mode, adapter: FamilyAdapter, device: torch.device) -> str | None:
    """Why ``mode`` is not run for ``adapter`` on ``device`` (None: it runs)."""
    cfg = mode.config or {}
    backend = str(cfg.get("gradient_checkpointing_backend", ""))
    if backend.endswith("-ffn") and not adapter.has_ffn:
        return "no FFN boundary declared"
    if cfg.get("gradient_checkpointing_offload_attention") and not adapter.has_attention:
        return "no attention region declared"
    if "gradient_checkpointing_interval" in cfg and not adapter.supports_interval:
        return "family does not support intervals"
    if is_offload(mode) and device.type != "cuda":
        return "offload needs CUDA"
    return None


def lora_targets(model: nn.Module, adapter: FamilyAdapter) -> list[str]:
    """Qualified names of every ``nn.Linear`` inside the adapter's declared blocks."""
    prefix = {id(m): n for n, m in model.named_modules()}
    targets = []
    for _path, _index, block in adapter.iter_blocks(model):
        base = prefix[id(block)]
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                targets.append(f"{base}.{name}" if name else base)
    return targets


def add_lora(
    model: nn.Module, adapter: FamilyAdapter, rank: int, dtype: torch.dtype
) -> tuple[nn.Module, list[str]]:
    from peft import LoraConfig, inject_adapter_in_model

    model.requires_grad_(False)
    targets = lora_targets(model, adapter)
    if not targets:
        raise RuntimeError(f"family {adapter.name!r}: no nn.Linear inside the declared blocks")
    model = inject_adapter_in_model(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets), model)
    for name, p in model.named_parameters():
        is_lora = "lora_" in name
        p.requires_grad_(is_lora)
        if is_lora and p.dtype != dtype:
            p.data = p.data.to(dtype)
    return model, targets


def build_lora_model(
    adapter: FamilyAdapter,
    preset_name: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    tokens: int,
) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """The preset's model (random weights) with LoRA, its inputs on ``device`` (seed 0), and what to record:
    ``lora_targets_count``, ``trainable_params``, ``total_params``, ``input_shapes``."""
    preset = adapter.presets[preset_name]
    model = preset.build(dtype=dtype, device=device)
    model, targets = add_lora(model, adapter, rank, dtype)
    batch = preset.inputs(model, tokens=tokens, batch=1, generator=torch.Generator().manual_seed(0))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    info = {
        "lora_targets_count": len(targets),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "total_params": sum(p.numel() for p in model.parameters()),
        "input_shapes": {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)},
    }
    return model, batch, info


def lora_regime_description(dtype: torch.dtype, rank: int) -> str:
    """What a family row measures (also the auto sweep's family targets)."""
    return (
        f"frozen {str(dtype).removeprefix('torch.')} base + PEFT LoRA r{rank} on every nn.Linear of the declared "
        f"blocks, batch 1, adapter loss, forward+backward"
    )


def _environment(device: torch.device) -> dict[str, Any]:
    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:
        diffusers_version = None
    cuda = device.type == "cuda"
    return {
        "suite": "families",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(device)
        if cuda
        else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers_version,
        "python": platform.python_version(),
        "git_commit": os.environ.get("MEMFIT_GIT_COMMIT"),
        "sdpa_backend": "default dispatch, cuDNN SDPA disabled" if cuda else "default (CPU)",
    }


def family_payload(
    name: str,
    preset: str,
    env: dict[str, Any],
    *,
    dtype: torch.dtype,
    tokens: int,
    rank: int,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """The header of one family's results (rows and skipped modes still empty); the auto sweep, whose fixed
    rows are measured the same way, writes its family targets' rows under this header too."""
    return {
        **env,
        "suite": "families",
        "family": name,
        "preset": preset,
        "preset_description": memfit.available_adapters()[name].presets[preset].description,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "batch": 1,
        "lora_rank": rank,
        "regime": "lora",
        "regime_description": lora_regime_description(dtype, rank),
        "steps": steps,
        "warmup": warmup,
        "rows": [],
        "skipped": {},
    }


def run_family(
    name: str, args: argparse.Namespace, device: torch.device, env: dict[str, Any]
) -> dict[str, Any]:
    adapter = memfit.available_adapters()[name]
    preset = adapter.presets[args.preset]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = args.tokens or preset.default_tokens
    payload = family_payload(
        name,
        args.preset,
        env,
        dtype=dtype,
        tokens=tokens,
        rank=args.rank,
        steps=args.steps,
        warmup=args.warmup,
    )
    payload["rounds"] = args.rounds
    model = batch = None
    try:
        model, batch, info = build_lora_model(
            adapter, args.preset, dtype=dtype, device=device, rank=args.rank, tokens=tokens
        )
        payload.update(info)
        modes = [m for m in MODES if args.modes is None or m.name in args.modes]
        for mode in modes:
            reason = skip_reason(mode, adapter, device)
            if reason is not None:
                payload["skipped"][mode.name] = reason
        modes = [m for m in modes if m.name not in payload["skipped"]]
        payload["rows"] = measure_modes(
            model,
            batch,
            adapter.loss,
            modes,
            adapter=adapter,
            rounds=args.rounds,
            warmup=args.warmup,
            steps=args.steps,
            tag=f"[{name}]",
            progress=lambda it: _progress(it, desc=name, unit="row"),
        )
    except torch.OutOfMemoryError as exc:  # the model or its inputs do not fit at all
        payload["error"] = f"OOM before the modes ran: {str(exc).splitlines()[0]}"
    except Exception as exc:  # one broken family must not cost the others their GPU time
        payload["error"] = f"{type(exc).__name__}: {exc}"
        payload["traceback"] = traceback.format_exc()
        print(payload["traceback"], flush=True)
    finally:
        del model, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return payload


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="all", help="comma-separated family names, or 'all'")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--tokens", type=int, default=None, help="default: each preset's default_tokens")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    add_rounds_option(parser)
    parser.add_argument(
        "--modes", default=None, help="comma-separated mode names (default: all of runner.MODES)"
    )
    parser.add_argument("--no-render", action="store_true", help="write JSON only")
    args = parser.parse_args(argv)
    args.modes = None if args.modes is None else [m.strip() for m in args.modes.split(",")]
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs CUDA (use --device cpu --preset tiny for a smoke run)")
        torch.backends.cuda.enable_cudnn_sdp(False)
    families = default_families() if args.family == "all" else [f.strip() for f in args.family.split(",")]
    installed = memfit.available_adapters()
    missing = [f for f in families if f not in installed]
    if missing:
        raise SystemExit(f"not installed: {missing} (installed: {sorted(installed)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment(device)
    env["pinned_bandwidth"] = pinned_bandwidth() if device.type == "cuda" else None
    print(json.dumps(env, indent=1), flush=True)
    written = []
    for name in families:
        payload = run_family(name, args, device, env)
        path = out / f"family-{name}-{args.preset}-{env['date'][:10]}.json"
        path.write_text(json.dumps(payload, indent=1))
        written.append(path)
        print(f"wrote {path}", flush=True)
    if not args.no_render:
        from memfit_benchmarks.render import render_files

        render_files(written)
    return written


if __name__ == "__main__":
    main()
