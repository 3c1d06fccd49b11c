"""Where does an offload mode's extra step time go? CPU issue time vs GPU time, and a profile per mode.

    python -m memfit_benchmarks.diagnose --family flux --out DIR            # GPU, preset full
    python -m memfit_benchmarks.diagnose --family flux --preset tiny --device cpu --out DIR   # smoke
    python -m memfit_benchmarks.diagnose --family synthetic-1024 --out DIR  # the synthetic stack, one shape

Per mode: median over timed steps of the GPU step time (CUDA events; the forward's part of it: an event recorded
as the forward call returns, so the GPU reaches it when the forward's work is done) and of the host time spent inside
``forward`` and ``backward`` calls (``perf_counter``, no synchronisation inside the step): when the host time
reaches the GPU time, the step is bound by Python/launch overhead, not by kernels or copies. Once every mode is
timed, one step per mode under ``torch.profiler``: the ops with the most self CPU time go to
``diagnose-<family>.md`` with one more step's Python profile (cProfile), and a Chrome trace (with Python frames) per mode to
``trace-<family>-<mode>.json.gz``. Variants (``unsloth[no-timing]`` …) rerun a mode with one engine knob
changed, to test a hypothesis side by side; ``auto@<budget>`` (``auto@103.8GiB``) is the ``auto`` backend at
that budget, traced too, its plan's counts in the report (a plan against the fixed mode it should beat,
profiled side by side); ``<mode>+stream<N>`` (``unsloth+stream20``) a fixed mode with *N* blocks' frozen weights
streamed. The profiled step's kernel and copy times summed tell a step whose kernels slowed from one that waited.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gzip
import io
import json
import pstats
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.units import parse_bytes
from memfit_benchmarks.auto_sweep import SYNTHETIC_TARGETS, auto_config, build_target
from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.families import build_lora_model
from memfit_benchmarks.modes import MODES, Mode, is_offload
from memfit_benchmarks.variants import VARIANTS, variant_keywords


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _device_ms(prof: torch.profiler.profile) -> dict[str, float]:
    """The profiled step's device time: its kernels' and its copies' durations summed (the kernels of a step that
    waits, for copies or for the host, add up to less than its step time)."""
    kernels = copies = 0.0
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.time_range.elapsed_us() / 1e3
        if event.name.startswith(("Memcpy", "Memset")):
            copies += ms
        else:
            kernels += ms
    return {"profiled_kernel_ms": kernels, "profiled_copy_ms": copies}


def _host_profile(step: Any, model: Any, cuda: bool, *, rows: int = 30) -> str:
    """One more step under cProfile: the Python functions with the most own time, then memfit's own by
    cumulative time (where the host time of a host-bound step goes; CUDA calls show as their callers)."""
    model.zero_grad(set_to_none=True)
    _sync(cuda)
    profiler = cProfile.Profile()
    profiler.enable()
    step()
    _sync(cuda)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(rows)
    stats.sort_stats("cumulative").print_stats("memfit/", rows)
    return out.getvalue()


@contextlib.contextmanager
def _applied(model, config, apply_kwargs, *, adapter) -> Iterator[Any]:
    """memfit applied with ``config`` (nothing for ``None``: no checkpointing), removed after; gradients cleared."""
    handle = memfit.apply(model, config, adapter=adapter, **apply_kwargs) if config else None
    try:
        yield handle
    finally:
        model.zero_grad(set_to_none=True)
        if handle is not None:
            handle.remove()


def measure(
    model,
    batch,
    loss_fn,
    config,
    apply_kwargs,
    *,
    adapter,
    cuda: bool,
    steps: int,
    warmup: int,
) -> dict[str, Any]:
    """Time one mode's steps (no profiler anywhere near them): medians of the step's GPU time, its forward's,
    and the host time inside ``forward`` and ``backward``; the handle's stats and plan after them."""
    fwd, bwd, gpu, gpu_fwd = [], [], [], []
    with _applied(model, config, apply_kwargs, adapter=adapter) as handle:
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            _sync(cuda)
            start = torch.cuda.Event(enable_timing=True) if cuda else None
            mid = torch.cuda.Event(enable_timing=True) if cuda else None
            end = torch.cuda.Event(enable_timing=True) if cuda else None
            if start is not None:
                start.record()
            t0 = time.perf_counter()
            loss = loss_fn(model(**batch))
            t1 = time.perf_counter()
            if mid is not None:  # where the forward's work ends on the GPU (queued behind it)
                mid.record()
            loss.backward()
            t2 = time.perf_counter()
            if end is not None:
                end.record()
            _sync(cuda)
            t3 = time.perf_counter()
            if i >= warmup:
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
                gpu.append(start.elapsed_time(end) if start is not None else (t3 - t0) * 1e3)
                gpu_fwd.append(start.elapsed_time(mid) if start is not None else (t1 - t0) * 1e3)
        stats = handle.stats() if handle is not None else {}
        plan = getattr(handle, "plan", None)
    return {
        "host_forward_ms": statistics.median(fwd),
        "host_backward_ms": statistics.median(bwd),
        "step_ms": statistics.median(gpu),
        "gpu_forward_ms": statistics.median(gpu_fwd),
        "stats": {k: v for k, v in stats.items() if isinstance(v, int | float)},
        "plan": plan.counts() if plan is not None else None,
    }


def profile(
    model, batch, loss_fn, config, apply_kwargs, *, adapter, cuda: bool, warmup: int, trace: Path | None
) -> dict[str, Any]:
    """One mode's profiles, after its warm-up steps: one step under ``torch.profiler`` (its table, its kernels' and
    copies' device time, a Chrome trace if ``trace``), then one under cProfile."""

    def step() -> None:
        loss_fn(model(**batch)).backward()

    with _applied(model, config, apply_kwargs, adapter=adapter):
        for _ in range(warmup):
            model.zero_grad(set_to_none=True)
            step()
        model.zero_grad(set_to_none=True)
        _sync(cuda)
        # with_stack: the trace shows the Python frames (memfit's own among them) around every op
        activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if cuda else []
        )
        with torch.profiler.profile(activities=activities, with_stack=trace is not None) as prof:
            step()
            _sync(cuda)
        table = prof.key_averages().table(
            sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60
        )
        if trace is not None:
            raw = trace.with_suffix("")
            prof.export_chrome_trace(str(raw))
            with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
                shutil.copyfileobj(src, dst)
            raw.unlink()
        host_profile = _host_profile(step, model, cuda)
    return {**_device_ms(prof), "profile_table": table, "host_profile": host_profile}


def _resolve_modes(names: list[str], parser: argparse.ArgumentParser) -> list[tuple[str, str, Mode]]:
    """(name, base mode name, mode) per requested mode (a variant's own keywords: ``variant_keywords``); a typo
    stops here."""
    modes = {m.name: m for m in MODES}
    out = []
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        parser.error(
            f"mode(s) {twice} listed twice: each mode gets one row; list each once (to see a mode's time drift "
            "over a run, step modes in turn with memfit_benchmarks.interleaved)"
        )
    for name in names:
        base = VARIANTS[name][0] if name in VARIANTS else name
        base, streamed = _streamed_suffix(base, parser)
        if base.startswith("auto@"):
            try:
                mode = Mode(name, auto_config(parse_bytes(base.removeprefix("auto@"))))
            except ValueError:
                parser.error(
                    f"mode {name!r}: the budget after 'auto@' is not a size; write e.g. auto@103.8GiB"
                )
        elif base in modes:
            mode = modes[base]
        else:
            parser.error(
                f"unknown mode {name!r}: one of {sorted(modes)}, a variant {sorted(VARIANTS)}, "
                f"or auto@<budget>"
            )
        if streamed:
            mode = Mode(name, {**mode.config, "gradient_checkpointing_stream_blocks": streamed})
        out.append((name, base, mode))
    return out


def _streamed_suffix(name: str, parser: argparse.ArgumentParser) -> tuple[str, int]:
    """``unsloth+stream20`` -> (``unsloth``, 20): a fixed mode with that many blocks' weights streamed."""
    base, plus, count = name.partition("+stream")
    if not plus:
        return name, 0
    if not count.isdigit() or int(count) < 1:
        parser.error(f"mode {name!r}: write the streamed block count after '+stream', e.g. unsloth+stream20")
    return base, int(count)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=None)
    parser.add_argument(
        "--modes",
        default="none,torch,unsloth,torch-ffn,unsloth-ffn,offload_attention,torch-ffn + offload_attention",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--no-traces",
        dest="traces",
        action="store_false",
        help="write no Chrome trace (a full-size model's, with Python frames, runs to tens of MB per mode)",
    )
    args = parser.parse_args(argv)
    if args.family in SYNTHETIC_TARGETS and args.tokens is not None:
        parser.error(
            f"--tokens does not apply to {args.family!r}: a synthetic target names its shape; pick another "
            f"({', '.join(SYNTHETIC_TARGETS)})"
        )
    chosen = _resolve_modes([m.strip() for m in args.modes.split(",")], parser)  # before a model is built
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    dtype = torch.bfloat16 if cuda else torch.float32
    if (
        args.family in SYNTHETIC_TARGETS
    ):  # the synthetic stack at one of the sweep's shapes (flash SDPA there)
        model, batch, adapter, _ = build_target(args.family, args.preset, device, dtype, 16)
    else:
        adapter = memfit.available_adapters()[args.family]
        model, batch, _ = build_lora_model(
            adapter,
            args.preset,
            dtype=dtype,
            device=device,
            rank=16,
            tokens=args.tokens or adapter.presets[args.preset].default_tokens,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    stamp = run_stamp("diagnose", torch.cuda.get_device_name() if cuda else "cpu")
    sdpa = "default dispatch, cuDNN SDPA disabled" if cuda else "default (CPU)"
    lines = [
        f"# diagnose {args.family} ({args.preset}) on {stamp['device']}, torch {stamp['torch']}\n",
        f"{stamp['date']}, commit {stamp['git_commit']}, SDPA: {sdpa}; {args.warmup} warm-up and {args.steps} "
        "timed steps per mode (medians), every mode timed before any is profiled; then per mode one profiled step "
        "and one under cProfile.\n",
        "| mode | step ms | GPU forward ms | host forward ms | host backward ms | kernel ms (profiled step) "
        "| copy ms (profiled step) |",
        "|---|---|---|---|---|---|---|",
    ]
    # Every mode is timed before any is profiled: timed after the first mode's profiled step (CUDA activity
    # tracing), later modes ran 18-67% over their steps in a process with no profiler (docs/cost-model.md).
    runs = []
    on_model = (model, batch, adapter.loss)
    # the profiling pass warms up as the timed one did: auto's closed loop settles the same way
    options = {"adapter": adapter, "cuda": cuda, "warmup": args.warmup}
    for name, _base, mode in chosen:
        if is_offload(mode) and not cuda:
            continue
        kwargs = variant_keywords(name, mode.config) if mode.config else {}
        r = measure(*on_model, mode.config, kwargs, steps=args.steps, **options)
        results[name] = r
        runs.append((name, mode, kwargs))
        print(f"| {name} | {r['step_ms']:.1f} | ... timed", flush=True)
    for name, mode, kwargs in runs:
        slug = name.replace(" ", "_").replace("[", "-").replace("]", "").replace("@", "-")
        # every mode, the baseline too: its idle gaps are what memfit's modes add to (trace_gaps)
        trace = args.out / f"trace-{args.family}-{slug}.json.gz" if args.traces else None
        r = results[name]
        r.update(profile(*on_model, mode.config, kwargs, trace=trace, **options))
        lines.append(
            f"| {name} | {r['step_ms']:.1f} | {r['gpu_forward_ms']:.1f} | {r['host_forward_ms']:.1f} "
            f"| {r['host_backward_ms']:.1f} "
            f"| {r.get('profiled_kernel_ms', 0.0):.1f} | {r.get('profiled_copy_ms', 0.0):.1f} |"
        )
        print(lines[-1], flush=True)
    for name, r in results.items():
        plan = [f"plan: `{json.dumps(r['plan'])}`", ""] if r["plan"] is not None else []
        lines += [
            "",
            f"## {name}",
            "",
            *plan,
            f"stats: `{json.dumps(r['stats'])}`",
            "",
            "```",
            r["profile_table"],
            "```",
            "",
            "Host (cProfile, one step):",
            "",
            "```",
            r["host_profile"],
            "```",
        ]
    (args.out / f"diagnose-{args.family}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
