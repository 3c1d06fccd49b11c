"""``python -m memfit_benchmarks``: the synthetic sweep (SPEC §6 shapes) in one or all training regimes.

    python -m memfit_benchmarks --regime all --out benchmarks/results       # lora, frozen, full: one process
    python -m memfit_benchmarks --suite families --family all --out DIR     # = python -m memfit_benchmarks.families

Regimes: ``lora`` (frozen bf16 base + PEFT LoRA r16), ``frozen`` (frozen base, only ``hidden_states``
requires grad), ``full`` (every weight trainable, a foreach AdamW step inside the timed step). Each regime
writes ``synthetic-<regime>-<date>.json`` (with a ``regime`` field) and, through the renderer,
``synthetic-<regime>-<date>.md`` and one PNG per shape to ``--out`` (default benchmarks/results).
``--rounds N`` measures every mode of a shape N times round-robin, as the family sweep does
(``memfit_benchmarks.rounds``): each row reports its median round (each round's step in ``step_s_rounds``), and
target ratios are paired round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import gc
import json
import os
import platform
import sys
from pathlib import Path

import torch

from memfit_benchmarks.report import render_markdown
from memfit_benchmarks.rounds import add_rounds_option
from memfit_benchmarks.runner import MODES, is_offload, measure_modes, pinned_bandwidth
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs

# (label, width, depth, tokens): width 3072 at 1024/4096/16384 tokens (2x2-packed 64², 128², 256² latents),
# and 32 layers x 4096 wide at 3072 tokens. Depth 15 puts the no-checkpoint peaks near SPEC §6's.
SHAPES = [
    ("3072w x15, 1024 tok", 3072, 15, 1024),
    ("3072w x15, 4096 tok", 3072, 15, 4096),
    ("3072w x15, 16384 tok", 3072, 15, 16384),
    ("4096w x32, 3072 tok", 4096, 32, 3072),
]


TINY_SHAPE = ("64w x2, 64 tok (CPU smoke)", 64, 2, 64)

REGIMES = {
    "lora": "frozen {dtype} base + LoRA r16 (peft), batch 1, loss = mean(out^2), forward+backward",
    "frozen": "frozen {dtype} base, only hidden_states requires grad, batch 1, loss = mean(out^2), "
    "forward+backward",
    "full": "every weight trainable ({dtype}), forward+backward+AdamW step (foreach, lr 1e-6) inside the timed "
    "step, batch 1, loss = mean(out^2)",
}


def add_lora(model: torch.nn.Module, rank: int = 16) -> None:
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(
        LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_qkv", "to_out", "proj_in", "proj_out"]), model
    )
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)


def prepare(model: torch.nn.Module, batch: dict, regime: str):
    """Set up ``model``/``batch`` for ``regime``; returns the optimizer factory (``full`` only)."""
    if regime == "lora":
        add_lora(model)
        return None
    if regime == "frozen":
        model.requires_grad_(False)
        batch["hidden_states"].requires_grad_(True)
        return None
    if regime == "full":
        model.requires_grad_(True)
        return lambda: torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=True)
    raise ValueError(f"unknown regime {regime!r}")


def main(argv: list[str] | None = None) -> list[Path]:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--suite", choices=("synthetic", "families"), default="synthetic")
    known, rest = pre.parse_known_args(argv)
    if known.suite == "families":
        from memfit_benchmarks import families

        return families.main(rest)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--suite",
        choices=("synthetic", "families"),
        default="synthetic",
        help="families: every remaining argument goes to python -m memfit_benchmarks.families",
    )
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shape indices (default: all), or 'tiny' (CPU smoke shape)",
    )
    parser.add_argument(
        "--regime",
        default="lora",
        help="lora | frozen | full, a comma-separated list of them, or all (one process, one JSON "
        "per regime)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    add_rounds_option(parser)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("the benchmark needs CUDA (or --device cpu --shapes tiny for a smoke run)")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if cuda else torch.float32
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.shapes == "tiny":
        shapes = [TINY_SHAPE]
    else:
        shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    regimes = list(REGIMES) if args.regime == "all" else [r.strip() for r in args.regime.split(",")]
    unknown = [r for r in regimes if r not in REGIMES]
    if unknown:
        parser.error(f"unknown regime(s) {unknown}: choose from {sorted(REGIMES)} or 'all'")
    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:
        diffusers_version = None
    meta = {
        "suite": "synthetic",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "diffusers": diffusers_version,
        "python": platform.python_version(),
        "git_commit": os.environ.get("MEMFIT_GIT_COMMIT"),
        "sdpa_backend": "flash (cuDNN SDPA disabled)" if cuda else "default (CPU)",
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "pinned_bandwidth": pinned_bandwidth() if cuda else None,
    }
    print(json.dumps(meta, indent=1), flush=True)
    modes = [m for m in MODES if cuda or not is_offload(m)]
    written = []
    for regime in regimes:
        results = []
        for label, width, depth, tokens in shapes:
            model = build(dim=width, depth=depth, dtype=dtype, device=str(device))
            batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
            optimizer_factory = prepare(model, batch, regime)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda else contextlib.nullcontext():
                rows = measure_modes(
                    model,
                    batch,
                    SYNTHETIC.loss,
                    modes,
                    adapter=SYNTHETIC,
                    rounds=args.rounds,
                    warmup=args.warmup,
                    steps=args.steps,
                    optimizer_factory=optimizer_factory,
                    tag=f"[{regime}] [{label}]",
                )
            results.append({"shape": label, "width": width, "depth": depth, "tokens": tokens, "rows": rows})
            del model, batch, optimizer_factory
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        payload = {
            **meta,
            "regime": regime,
            "regime_description": REGIMES[regime].format(dtype=str(dtype).removeprefix("torch.")),
            "results": results,
        }
        stamp = meta["date"][:10]
        path = out / f"synthetic-{regime}-{stamp}.json"
        path.write_text(json.dumps(payload, indent=1))
        written.append(path)
        print(render_markdown(payload), flush=True)
    from memfit_benchmarks.render import render_files

    render_files(written)
    return written


if __name__ == "__main__":
    main()
