"""What the caching allocator holds above the allocated peak under each offload mode, and whether the mode runs in
a process limited to a little more than that peak: with the allocator's default segments or expandable ones (the
process's environment), with the reloads tied to the copy stream (the default) or to none.

    python -m memfit_benchmarks.reserve --out DIR                               # GPU: the stack at 16384 tokens
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python -m memfit_benchmarks.reserve --limits 1.087,1.04 \
        --stem reserve-expandable --out DIR
    python -m memfit_benchmarks.reserve --shape tiny --device cpu --modes unsloth --out DIR   # smoke

The planner charges a plan one byte of card per byte it copies to host memory with the default segments
(``COPY_RESERVE``), none with expandable ones (docs/cost-model.md, "Copy reserve"). This is the measurement behind
both. A reload tied to its copy stream with ``record_stream`` is freed into a block the allocator may not hand out
until the copy stream's work queued by then has finished; the ``[reloads untied]`` variants tell whether that is
where the reserve comes from (it is not).

Per round (the rows' order reversed every other round), per row: the cache emptied, the mode installed, warm-up
steps, then timed steps; the row's peak allocated and reserved over its timed steps, the bytes it copied per
step, and the reserve above the peak per byte copied. With ``--limits`` each row runs again in a process limited
to that multiple of its own unconstrained peak (``torch.cuda.set_per_process_memory_fraction``): whether its
steps made the allocator free its cache and retry (slow: a device sync each) or ran out of memory. Off CUDA there
is no caching allocator: the smoke run proves the script. Writes ``<--stem>.{json,md}`` (default ``reserve``) to
``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.host_overhead import installed
from memfit_benchmarks.options import benchmark_device
from memfit_benchmarks.results import write_results
from memfit_benchmarks.shapes import SHAPES, TINY_SHAPE
from memfit_benchmarks.synthetic import lora_stack
from memfit_benchmarks.training import TrainingConfig, describe
from memfit_benchmarks.variants import VARIANTS

DEFAULT_MODES = (
    "offload_attention",
    "offload_attention[reloads untied]",
    "unsloth",
    "unsloth[reloads untied]",
    "unsloth-ffn",
    "unsloth-ffn[reloads untied]",
)
GIB = 1 << 30


def _alloc_stats() -> tuple[int, int]:
    """(cache frees and retries, segments allocated) so far: the caching allocator's counters."""
    stats = torch.cuda.memory_stats()
    return int(stats.get("num_alloc_retries", 0)), int(stats.get("segment.all.allocated", 0))


def measure_row(model, batch, name: str, *, cuda: bool, warmup: int, steps: int) -> dict[str, Any]:
    """One row: ``name`` installed, ``warmup`` steps, then ``steps`` timed ones; peaks over the timed steps."""
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    row: dict[str, Any] = {"mode": name}
    try:
        with installed(model, batch, name, cuda=cuda) as run:
            for _ in range(warmup):
                run.step()
            run.reset()
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                retries, segments = _alloc_stats()
            times = []
            for _ in range(steps):
                t0 = time.perf_counter()
                run.step()
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            stats = run.handle.stats() if run.handle is not None else {}
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        return {**row, "oom": True}
    row.update(
        step_s=statistics.median(times), copied_per_step=stats.get("bytes_offloaded", 0) / steps, oom=False
    )
    if cuda:
        now_retries, now_segments = _alloc_stats()
        row.update(
            peak_allocated=torch.cuda.max_memory_allocated(),
            peak_reserved=torch.cuda.max_memory_reserved(),
            alloc_retries=now_retries - retries,
            segments_allocated=now_segments - segments,
        )
    model.zero_grad(set_to_none=True)
    return row


def _limited(model, batch, name: str, bytes_: int, **options: Any) -> dict[str, Any]:
    """``name`` in a process limited to ``bytes_`` (what the caching allocator may reserve), as on a card of that
    size; the limit lifted after."""
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, bytes_ / total))
    try:
        return measure_row(model, batch, name, **options)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's rounds: medians of the step and the bytes copied, the largest peaks."""
    done = [r for r in rows if not r.get("oom")]
    if not done:
        return {"mode": rows[0]["mode"], "oom": True}
    out: dict[str, Any] = {"mode": rows[0]["mode"], "oom": len(done) < len(rows), "rounds": len(done)}
    out["step_s"] = statistics.median(r["step_s"] for r in done)
    out["copied_per_step"] = statistics.median(r["copied_per_step"] for r in done)
    for key in ("peak_allocated", "peak_reserved", "alloc_retries", "segments_allocated"):
        if done[0].get(key) is not None:
            out[key] = max(r[key] for r in done)
    if out.get("peak_reserved") is not None:
        out["reserve_over_peak"] = out["peak_reserved"] - out["peak_allocated"]
        copied = out["copied_per_step"]
        out["reserve_per_byte_copied"] = out["reserve_over_peak"] / copied if copied else None
    return out


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def render(payload: dict[str, Any]) -> str:
    lines = [
        f"# Allocator reserve per offload mode — {payload['device']}, torch {payload['torch']}, {payload['date']}",
        "",
        f"Synthetic stack {payload['shape']}, {payload['regime']}; SDPA: {payload['sdpa_backend']}. Each row: cache "
        f"emptied, mode installed, {payload['warmup']} warm-up and {payload['steps']} timed steps, {payload['rounds']} "
        "rounds in alternating order; caching allocator: "
        f"{payload.get('allocator_conf', 'default')}; peaks are the largest over the timed steps of every round. *Reserve*: peak "
        "reserved less peak allocated, what the caching allocator holds that no tensor uses. Commit: "
        f"{payload.get('git_commit') or 'n/a'}.",
        "",
        "| mode | copied GiB / step | peak allocated GiB | peak reserved GiB | reserve GiB | reserve ÷ copied | "
        "cache frees + retries | step ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["modes"]:
        if r.get("oom") and "step_s" not in r:
            lines.append(f"| {r['mode']} | out of memory | | | | | | |")
            continue
        per = r.get("reserve_per_byte_copied")
        lines.append(
            f"| {r['mode']} | {_gib(r['copied_per_step'])} | {_gib(r.get('peak_allocated'))} | "
            f"{_gib(r.get('peak_reserved'))} | {_gib(r.get('reserve_over_peak'))} | "
            f"{'-' if per is None else f'{per:.2f}'} | {r.get('alloc_retries', '-')} | {r['step_s'] * 1e3:.1f} |"
        )
    if payload.get("limited"):
        lines += [
            "",
            "In a process limited to a multiple of the mode's own unconstrained peak allocated:",
            "",
            "| mode | limit × peak | limit GiB | cache frees + retries in the timed steps | out of memory | step ms |",
            "|---|---|---|---|---|---|",
        ]
        for r in payload["limited"]:
            step = "-" if r.get("oom") else f"{r['step_s'] * 1e3:.1f}"
            lines.append(
                f"| {r['mode']} | {r['limit_factor']:.2f} | {_gib(r['limit_bytes'])} | "
                f"{r.get('alloc_retries', '-')} | {'yes' if r.get('oom') else 'no'} | {step} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape", default="2", help="index into the sweep's shapes (default 2: 16384 tokens), or tiny"
    )
    parser.add_argument("--modes", default=",".join(DEFAULT_MODES), help="comma-separated modes and variants")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--limits", default="", help="multiples of each mode's peak to run it again under, e.g. 1.1,1.3"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stem", default="reserve", help="the results files' name (<stem>.json, <stem>.md)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    from memfit_benchmarks.host_overhead import row_names

    known = row_names(diffusers=False) | set(VARIANTS)
    unknown = [m for m in args.modes if m not in known]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: one of {sorted(known)}")
    args.limits = [float(x) for x in args.limits.split(",") if x.strip()]
    if args.shape != "tiny" and not (args.shape.isdigit() and int(args.shape) < len(SHAPES)):
        parser.error(f"--shape: an index below {len(SHAPES)}, or tiny")
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        parser.error("--rounds, --steps and --warmup must be at least 1")
    return args


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    device = benchmark_device(
        args.device, without_cuda="needs CUDA (or --device cpu --shape tiny for a smoke run)"
    )
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = TINY_SHAPE if args.shape == "tiny" else SHAPES[int(args.shape)]
    model, batch = lora_stack(shape, device=device, dtype=dtype)
    options = {"cuda": cuda, "warmup": args.warmup, "steps": args.steps}
    per_mode: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    limited: list[dict[str, Any]] = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda else contextlib.nullcontext():
        for r in range(args.rounds):
            for name in args.modes if r % 2 == 0 else reversed(args.modes):
                per_mode[name].append(measure_row(model, batch, name, **options))
                print(per_mode[name][-1], flush=True)
        summaries = [_summary(rows) for rows in per_mode.values()]
        if cuda:
            for s in summaries:
                for factor in args.limits:
                    if s.get("peak_allocated") is None:
                        continue
                    bytes_ = int(factor * s["peak_allocated"])
                    row = _limited(model, batch, s["mode"], bytes_, **options)
                    limited.append({**row, "limit_factor": factor, "limit_bytes": bytes_})
                    print(limited[-1], flush=True)
    payload = {
        **run_stamp("reserve", torch.cuda.get_device_name() if cuda else "cpu"),
        "shape": shape[0],
        "tokens": shape[3],
        "regime": describe(TrainingConfig.LORA_ALL, dtype=dtype),
        "sdpa_backend": "flash (cuDNN SDPA disabled)" if cuda else "default (CPU)",
        "rounds": args.rounds,
        "warmup": args.warmup,
        "steps": args.steps,
        "modes": summaries,
        "limited": limited,
    }
    return write_results(args.out, payload, render, stem=args.stem)


if __name__ == "__main__":
    main()
