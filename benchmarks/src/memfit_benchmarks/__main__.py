"""``python -m memfit_benchmarks``: the synthetic sweep (SPEC §6 shapes), memfit against its peers.

    python -m memfit_benchmarks --configs lora-all,lora-attn --rounds 3 --out DIR   # GPU
    python -m memfit_benchmarks --device cpu --shapes tiny --steps 1 --out DIR      # CPU smoke
    python -m memfit_benchmarks --suite families ...                                # = python -m memfit_benchmarks.families

Per shape, one model (random weights, seed 0); per training config (``--configs``: ``lora-all``, ``lora-attn``,
``frozen``, ``full``; ``memfit_benchmarks.training``) every mode of ``--modes`` (memfit's and the peers',
``memfit_benchmarks.modes``) measured ``--rounds`` times round-robin (``memfit_benchmarks.rounds``): each row
reports its median round and its ratio to its peer, paired round by round. ``--modes``, ``--steps``,
``--min-seconds`` (keep timing until the timed steps add up to that long: short steps are noisy) and ``--warmup``
take one value per shape (``8/3/2/2``) where shapes differ in cost. Offload modes need CUDA; the
peers that do not apply (diffusers' checkpointing on this stack) are listed as skipped. Writes
``<name>.json`` (default ``synthetic``; rewritten after every entry, ``complete`` true at the end), then its
markdown and plot (``memfit_benchmarks.render``) unless ``--no-render``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit_benchmarks import peers
from memfit_benchmarks.environment import environment
from memfit_benchmarks.modes import Mode, is_offload, select_modes
from memfit_benchmarks.options import add_sweep_options, deadline, per_shape_values, seconds, step_count
from memfit_benchmarks.results import write_json
from memfit_benchmarks.runner import measure_modes
from memfit_benchmarks.shapes import SHAPES, TINY_SHAPE
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
from memfit_benchmarks.training import prepare

SDPA = "flash (cuDNN SDPA disabled)"


def skip_reasons(modes: list[Mode], model: torch.nn.Module, device: torch.device) -> dict[str, str]:
    """Mode name → why it does not run on the synthetic stack on ``device``."""
    out = {}
    for mode in modes:
        if mode.peer is not None:
            reason = peers.unsupported(mode.peer, model, SYNTHETIC)
        else:
            reason = "offload needs CUDA" if is_offload(mode) and device.type != "cuda" else None
        if reason is not None:
            out[mode.name] = reason
    return out


def _parse(argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
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
    parser.add_argument("--name", default="synthetic", help="the results file's name (without .json)")
    parser.add_argument(
        "--shapes",
        default=None,
        help="comma-separated shape indices (default: all), or 'tiny' (CPU smoke shape)",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-render", action="store_true", help="write JSON only")
    add_sweep_options(parser, default_config="lora-all", default_modes="all", per_shape=True)
    return parser, parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[Path]:
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--suite", choices=("synthetic", "families"), default="synthetic")
    known, rest = pre.parse_known_args(argv)
    if known.suite == "families":
        from memfit_benchmarks import families

        return families.main(rest)
    parser, args = _parse(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if args.shapes == "tiny":
        shapes = [TINY_SHAPE]
    else:
        shapes = SHAPES if args.shapes is None else [SHAPES[int(i)] for i in args.shapes.split(",")]
    n = len(shapes)
    modes = per_shape_values(parser, "modes", args.modes, n, select_modes)
    steps = per_shape_values(parser, "steps", args.steps, n, step_count)
    warmup = per_shape_values(parser, "warmup", args.warmup, n, step_count)
    min_seconds = per_shape_values(parser, "min-seconds", args.min_seconds, n, seconds)
    if any(s < 1 for s in steps):
        parser.error("--steps: at least one timed step per measurement")
    if args.dry_run:
        for (label, *_), shape_modes, shape_steps, shape_warmup, shape_seconds in zip(
            shapes, modes, steps, warmup, min_seconds, strict=True
        ):
            print(
                f"would measure {label}: configs {[c.value for c in args.configs]}, {args.rounds} rounds of "
                f"{shape_warmup} warm-up + {shape_steps} timed steps"
                + (f" and at least {shape_seconds:g} s of them" if shape_seconds else "")
                + f", modes {[m.name for m in shape_modes]}",
                flush=True,
            )
        return []
    if cuda and not torch.cuda.is_available():
        raise SystemExit("the benchmark needs CUDA (or --device cpu --shapes tiny for a smoke run)")
    stop = deadline(args.stop_at)
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if cuda else torch.float32
    payload: dict[str, Any] = {
        **environment("synthetic", device, sdpa=SDPA),
        "configs": [c.value for c in args.configs],
        "dtype": str(dtype).removeprefix("torch."),
        "batch": 1,
        "rounds": args.rounds,
        "complete": False,
        "results": [],
    }
    path = Path(args.out) / f"{args.name}.json"
    for (label, width, depth, tokens), shape_modes, shape_steps, shape_warmup, shape_seconds in zip(
        shapes, modes, steps, warmup, min_seconds, strict=True
    ):
        shape = {"label": label, "shape": label, "width": width, "depth": depth, "tokens": tokens}
        if stop():
            for config in args.configs:
                payload["results"].append(
                    {**shape, "config": config.value, "rows": [], "skipped": {}, "cut": "the deadline passed"}
                )
            continue
        model = build(dim=width, depth=depth, dtype=dtype, device=str(device))
        batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
        skipped = skip_reasons(shape_modes, model, device)
        runnable = [m for m in shape_modes if m.name not in skipped]
        for config in args.configs:
            training = prepare(model, batch, config, SYNTHETIC, dtype=dtype)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda else contextlib.nullcontext():
                rows = measure_modes(
                    model,
                    batch,
                    SYNTHETIC.loss,
                    runnable,
                    adapter=SYNTHETIC,
                    rounds=args.rounds,
                    warmup=shape_warmup,
                    steps=shape_steps,
                    min_seconds=shape_seconds,
                    optimizer_factory=training.optimizer_factory,
                    tag=f"[{config.value}] [{label}]",
                    stop=stop,
                )
            training.undo()
            payload["results"].append(
                {
                    **shape,
                    **training.info(),
                    "steps": shape_steps,
                    "min_seconds": shape_seconds,
                    "warmup": shape_warmup,
                    "rows": rows,
                    "skipped": skipped,
                }
            )
            write_json(path, payload)
        del model, batch
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    payload["complete"] = True
    write_json(path, payload)
    print(f"wrote {path}", flush=True)
    if not args.no_render:
        from memfit_benchmarks.render import render_files

        render_files([path])
    return [path]


if __name__ == "__main__":
    main()
