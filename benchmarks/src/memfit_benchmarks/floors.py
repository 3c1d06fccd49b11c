"""The smallest budget ``auto`` can meet per family, with and without weight streaming.

    python -m memfit_benchmarks.floors --out DIR                          # GPU: every family at its full size
    python -m memfit_benchmarks.floors --family flux --preset tiny --device cpu --out DIR

Per family: the preset's model (random weights; bf16 on CUDA) with LoRA r16 on every block linear, inputs at the
preset's default tokens (or ``--tokens name=N``), then ``auto`` at a one-byte budget twice — with
``gradient_checkpointing_stream_blocks: 0`` (activation policies only) and unset (weights may stream) — and the
``BudgetError`` of each names the smallest peak its planner reaches. Nothing is trained: each is one profiling
forward. Off CUDA the budget counts held activations, which streaming does not change (both floors agree there).
Writes ``floors.json`` and ``floors.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import gc
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.units import format_bytes
from memfit_benchmarks.environment import environment
from memfit_benchmarks.families import build_lora_model, default_families, family_tokens, parse_tokens
from memfit_benchmarks.options import deadline
from memfit_benchmarks.results import write_results

SDPA = "default dispatch, cuDNN SDPA disabled"


def floor_of(
    model: torch.nn.Module, batch: dict[str, Any], adapter: memfit.FamilyAdapter, **extra: Any
) -> int:
    """The smallest peak ``auto`` reaches on ``model`` at ``batch`` (its BudgetError at a one-byte budget)."""
    config = {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_memory_budget": 1,
        **extra,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memfit.MemfitWarning)
        try:
            with memfit.apply(model, config, adapter=adapter):
                adapter.loss(model(**batch)).backward()
        except memfit.BudgetError as exc:
            return exc.smallest_peak_bytes
        finally:
            model.zero_grad(set_to_none=True)
    raise AssertionError("auto planned a step at a one-byte budget")


def measure_family(name: str, args: argparse.Namespace) -> dict[str, Any]:
    adapter = memfit.get_adapter(name)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = family_tokens(args.tokens, name) or adapter.presets[args.preset].default_tokens
    started = time.perf_counter()
    model, batch, info = build_lora_model(
        adapter, args.preset, dtype=dtype, device=device, rank=args.rank, tokens=tokens
    )
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {
        "family": name,
        "tokens": tokens,
        "weight_bytes": weights,
        "floor_without_streaming_bytes": floor_of(
            model, batch, adapter, gradient_checkpointing_stream_blocks=0
        ),
        "floor_bytes": floor_of(model, batch, adapter),
        "seconds": time.perf_counter() - started,
        **{k: info[k] for k in ("trainable_params", "total_params") if k in info},
    }
    del model, batch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(
        f"[floors] {name}: {format_bytes(row['floor_without_streaming_bytes'])} without streaming, "
        f"{format_bytes(row['floor_bytes'])} with",
        flush=True,
    )
    return row


def render(payload: dict[str, Any]) -> str:
    def gib(n: int) -> str:
        return f"{n / 2**30:.2f}"

    lines = [
        "# The smallest budget auto meets, per family",
        "",
        "| family | tokens | weights GiB | floor without streaming GiB | floor with streaming GiB | lower by |",
        "|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        if "floor_bytes" not in r:
            lines.append(f"| {r['family']} | not measured ({r.get('skipped', 'deadline')}) | | | | |")
            continue
        saved = r["floor_without_streaming_bytes"] - r["floor_bytes"]
        lines.append(
            f"| {r['family']} | {r['tokens']} | {gib(r['weight_bytes'])} | {gib(r['floor_without_streaming_bytes'])} "
            f"| {gib(r['floor_bytes'])} | {gib(saved)} |"
        )
    lines += [
        "",
        f"{payload['training']}. Each floor is the smallest peak {payload['metric']} the planner predicts (its "
        f"BudgetError at a one-byte budget): activation policies only (`gradient_checkpointing_stream_blocks: 0`), "
        f"and with weight streaming allowed (host RAM permitting).",
        "",
        f"Device: {payload['device']}; torch {payload['torch']}, diffusers {payload.get('diffusers')}; SDPA: "
        f"{payload['sdpa_backend']}; commit {payload.get('git_commit')}; {payload['date']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", default="all", help="comma-separated family names, or 'all'")
    parser.add_argument("--preset", default="full")
    parser.add_argument(
        "--tokens", default=None, help="one count, or name=N pairs (default: each preset's default tokens)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the options, print the plan, measure nothing"
    )
    args = parser.parse_args(argv)
    families = default_families() if args.family == "all" else args.family.split(",")
    unknown = [f for f in families if f not in memfit.available_adapters()]
    if unknown:
        parser.error(f"--family: {unknown} not installed ({sorted(memfit.available_adapters())})")
    try:
        args.tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        parser.error(f"--tokens: {exc}")
    if args.dry_run:
        print(f"would measure the floors of {families} ({args.preset})", flush=True)
        return None
    if args.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda needs CUDA (use --device cpu --preset tiny for a smoke run)")
        torch.backends.cuda.enable_cudnn_sdp(
            False
        )  # cuDNN's SDPA backward fails on diffusers models (README)
    device = torch.device(args.device)
    over = deadline(args.stop_at)
    rows = []
    for name in families:
        if args.preset not in memfit.get_adapter(name).presets:
            rows.append({"family": name, "skipped": f"no preset {args.preset!r}"})
        elif over():
            rows.append({"family": name, "skipped": "the run's deadline passed first"})
        else:
            rows.append(measure_family(name, args))
    payload = {
        **environment("floors", device, sdpa=SDPA if device.type == "cuda" else "default (CPU)"),
        "suite": "floors",
        "preset": args.preset,
        "training": f"{'bfloat16' if device.type == 'cuda' else 'float32'} base, PEFT LoRA r{args.rank} on every "
        f"block nn.Linear, batch 1",
        "metric": "allocated" if device.type == "cuda" else "of held activations",
        "rows": rows,
    }
    return write_results(Path(args.out), payload, render)


if __name__ == "__main__":
    main()
