"""Offload step-time ratios measured step by step: two copies of the model, one per mode, stepped in turn.

    python -m memfit_benchmarks.interleaved --out DIR [--shape 0] [--steps 200] [--compile inductor]

At 1024 tokens the step is bound by host time, and the host's speed wanders: the `none` step's median over a
20-step round can move by half between rounds, so ratios of rounds measured seconds apart spread widely. Here mode A runs on one copy of the model and mode B on another (same weights,
each with its memfit handle applied once), and their steps alternate A, B, A, B…; each A step is compared with
the mean of the B steps on either side of it, so a drift slower than one step cancels. The copies swap modes
halfway, so a difference between the copies cancels too. Reported per pair: the median of those per-step
ratios with its interquartile range, and each mode's median step.

Pairs: ``unsloth`` / ``torch``, ``unsloth-ffn`` / ``torch-ffn``, ``offload_attention`` / ``none`` (the three
offload step-time targets; the bound of the last also needs D/B, which the synthetic sweep reports). Off CUDA (a smoke
run) steps are timed with ``perf_counter`` and the offload modes park through streams that do nothing
(``host_overhead.NullStreams``): their host time only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.modes import MODES, Mode
from memfit_benchmarks.results import write_results
from memfit_benchmarks.shapes import SHAPES, TINY_SHAPE
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
from memfit_benchmarks.training import TrainingConfig, prepare

PAIRS = [("unsloth", "torch", 1.02), ("unsloth-ffn", "torch-ffn", 1.03), ("offload_attention", "none", None)]


def _timed_step(model, batch, cuda: bool) -> float:
    """One forward+backward, in seconds (CUDA events around it, then a sync: the next step starts idle)."""
    model.zero_grad(set_to_none=True)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        SYNTHETIC.loss(model(**batch)).backward()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    SYNTHETIC.loss(model(**batch)).backward()
    return time.perf_counter() - t0


def compile_blocks(model, backend: str) -> None:
    """Compile each block on its own (regional compilation, as diffusers' ``compile_repeated_blocks`` does)."""
    for block in model.blocks:
        block.compile(backend=backend)


def per_step_ratios(a: list[float], b: list[float]) -> list[float]:
    """``a[i]`` over the mean of the ``b`` steps run just before and just after it (``b[i]`` ran after ``a[i]``,
    ``b[i-1]`` before): a drift slower than a step cancels. The first ``a`` step has only its later neighbour."""
    out = []
    for i, t in enumerate(a):
        neighbours = [b[j] for j in (i - 1, i) if 0 <= j < len(b)]
        out.append(t / statistics.fmean(neighbours))
    return out


def _cpu_offload(mode: Mode, cuda: bool) -> dict[str, Any]:
    """Off CUDA an offload mode parks through the copy engine over streams that do nothing (as
    ``host_overhead`` does): its host time, not its copies."""
    from memfit_benchmarks.host_overhead import offload_on_cpu

    return {} if cuda else offload_on_cpu(mode)


def measure_pair(
    models: tuple[Any, Any],
    batch: dict,
    a: Mode,
    b: Mode,
    *,
    steps: int,
    warmup: int,
    cuda: bool,
    compiled: bool = False,
) -> dict[str, Any]:
    """``a`` and ``b`` stepped in turn on the two copies (``steps`` each), swapping copies halfway.

    ``compiled``: the blocks are compiled; after memfit goes on, Dynamo's caches are reset so that the blocks are
    traced again with memfit's hooks (code traced before does not see the hooks on their submodules)."""
    times: dict[str, list[float]] = {a.name: [], b.name: []}
    per_step: dict[str, dict[str, float]] = {}  # mode -> its handle's counters per timed step
    ratios: list[float] = []
    for half, (model_a, model_b) in enumerate((models, models[::-1])):
        n = steps // 2 if half == 0 else steps - steps // 2
        handles = [
            memfit.apply(m, mode.config, adapter=SYNTHETIC, **_cpu_offload(mode, cuda))
            if mode.config
            else None
            for m, mode in ((model_a, a), (model_b, b))
        ]
        if compiled:
            torch._dynamo.reset()  # the warm-up steps compile again
        try:
            for _ in range(warmup):
                _timed_step(model_a, batch, cuda)
                _timed_step(model_b, batch, cuda)
            for h in handles:
                if h is not None:
                    h.reset_stats()
            ta, tb = [], []
            for _ in range(n):
                ta.append(_timed_step(model_a, batch, cuda))
                tb.append(_timed_step(model_b, batch, cuda))
            for mode, h in zip((a, b), handles, strict=True):
                if h is not None:
                    _add_per_step(per_step.setdefault(mode.name, {}), h.stats(), steps)
        finally:
            for h in handles:
                if h is not None:
                    h.remove()
        times[a.name] += ta
        times[b.name] += tb
        ratios += per_step_ratios(ta, tb)
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "a": a.name,
        "b": b.name,
        "steps": steps,
        "ratio_median": median,
        "ratio_q1": q1,
        "ratio_q3": q3,
        "a_step_s": statistics.median(times[a.name]),
        "b_step_s": statistics.median(times[b.name]),
        "a_step_times_s": times[a.name],
        "b_step_times_s": times[b.name],
        "stats_per_step": per_step,
    }


# what each mode did per timed step (so a ratio near 1 can be told from a mode that did nothing)
PER_STEP_STATS = (
    "recomputes",
    "bytes_offloaded",
    "bytes_reloaded",
    "attention_tensors_parked",
    "stall_ms",
    "pinned_allocations",
)


def _add_per_step(into: dict[str, float], stats: dict[str, Any], steps: int) -> None:
    """Add one half's counters to ``into``, divided by the pair's ``steps`` per mode (both halves: per step)."""
    for key in PER_STEP_STATS:
        if key in stats:
            into[key] = into.get(key, 0.0) + stats[key] / steps


def _describe_per_step(stats: dict[str, float]) -> str:
    parts = []
    if stats.get("recomputes"):
        parts.append(f"{stats['recomputes']:.0f} recomputes")
    if stats.get("bytes_offloaded"):
        parts.append(f"{stats['bytes_offloaded'] / 2**20:.0f} MiB parked")
    if stats.get("attention_tensors_parked"):
        parts.append(f"{stats['attention_tensors_parked']:.0f} attention tensors")
    if "stall_ms" in stats:
        parts.append(f"{stats['stall_ms']:.2f} ms stall")
    return ", ".join(parts) or "-"


def render(payload: dict[str, Any]) -> str:
    lines = [
        f"# Interleaved step-time ratios — {payload['device']}, torch {payload['torch']}, {payload['date']}",
        "",
        f"Synthetic stack {payload['shape']}, {payload['regime']}; SDPA: {payload['sdpa_backend']}. Two copies of "
        f"the model, one per mode, stepped in turn ({payload['steps']} steps each after {payload['warmup']} "
        f"warm-up steps, the copies swapping modes halfway); each A step over the mean of its neighbouring B "
        f"steps. Commit: {payload.get('git_commit') or 'n/a'}.",
        "",
        "| A / B | median ratio | interquartile | A step ms | B step ms | A per step | target |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in payload["pairs"]:
        target = (
            f"≤ {r['target']:.2f}× ({'PASS' if r['ratio_median'] <= r['target'] else 'FAIL'})"
            if r.get("target")
            else "see the sweep (needs D/B)"
        )
        lines.append(
            f"| {r['a']} / {r['b']} | {r['ratio_median']:.3f} | {r['ratio_q1']:.3f}–{r['ratio_q3']:.3f} | "
            f"{r['a_step_s'] * 1e3:.1f} | {r['b_step_s'] * 1e3:.1f} | "
            f"{_describe_per_step(r.get('stats_per_step', {}).get(r['a'], {}))} | {target} |"
        )
    return "\n".join(lines) + "\n"


def _parse_pairs(
    text: str, modes: dict[str, Mode], parser: argparse.ArgumentParser
) -> list[tuple[str, str, float | None]]:
    """``"offload_attention/none,unsloth/torch"`` -> pairs with the default pairs' targets; a typo stops here."""
    targets = {(a, b): t for a, b, t in PAIRS}
    pairs = []
    for item in text.split(","):
        a, slash, b = (part.strip() for part in item.partition("/"))
        if not slash or a not in modes or b not in modes:
            parser.error(f"pair {item!r}: write A/B with A and B among {sorted(modes)}")
        pairs.append((a, b, targets.get((a, b))))
    return pairs


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--shape", default="0", help="index into the sweep's shapes (0: 1024 tokens), or 'tiny'"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per mode and pair")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--pairs",
        default=None,
        help="comma-separated A/B mode pairs (default: "
        + ", ".join(f"{a}/{b}" for a, b, _ in PAIRS)
        + "); a default pair keeps its target",
    )
    parser.add_argument(
        "--compile",
        default=None,
        metavar="BACKEND",
        help="compile every block with torch.compile (regional, as diffusers' compile_repeated_blocks "
        "does), e.g. 'inductor'; Dynamo is reset after each apply, so the blocks are traced with "
        "memfit's hooks",
    )
    args = parser.parse_args(argv)
    if args.steps < 2 or args.warmup < 1:
        parser.error("--steps must be at least 2 and --warmup at least 1")
    modes = {m.name: m for m in MODES}
    chosen = PAIRS if args.pairs is None else _parse_pairs(args.pairs, modes, parser)
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("needs CUDA (or --device cpu --shape tiny for a smoke run)")
    label, width, depth, tokens = TINY_SHAPE if args.shape == "tiny" else SHAPES[int(args.shape)]
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(dim=width, depth=depth, dtype=dtype, device=args.device)
    batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
    prepare(model, batch, TrainingConfig.LORA_ALL, SYNTHETIC, dtype=dtype)
    models = (model, copy.deepcopy(model))
    if args.compile:
        for m in models:
            compile_blocks(m, args.compile)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    pairs = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda else contextlib.nullcontext():
        for a, b, target in chosen:
            row = measure_pair(
                models,
                batch,
                modes[a],
                modes[b],
                steps=args.steps,
                warmup=args.warmup,
                cuda=cuda,
                compiled=bool(args.compile),
            )
            row["target"] = target
            pairs.append(row)
            print(
                f"{a} / {b}: {row['ratio_median']:.3f} ({row['ratio_q1']:.3f}-{row['ratio_q3']:.3f})",
                flush=True,
            )
            gc.collect()
    suite = (
        "interleaved-compiled" if args.compile else "interleaved"
    )  # a file of its own next to the eager run
    payload = {
        **run_stamp(suite, torch.cuda.get_device_name() if cuda else "cpu"),
        "shape": label,
        "regime": "lora" + (f", blocks compiled ({args.compile})" if args.compile else ", eager"),
        "compile": args.compile,
        "sdpa_backend": "flash (cuDNN SDPA disabled)" if cuda else "default (CPU)",
        "steps": args.steps,
        "warmup": args.warmup,
        "pairs": pairs,
    }
    return write_results(args.out, payload, render)


if __name__ == "__main__":
    main()
