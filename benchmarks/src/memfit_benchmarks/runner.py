"""Measure training steps under each memfit mode, side by side in one process.

Every row of one shape is measured in the same process on the same model, one mode after
the other (``memfit.apply`` → warm-up steps → timed steps → ``remove``), so ratios between
rows are like for like. Step time is the median of CUDA-event timings (``perf_counter`` off CUDA); peaks come from
the caching allocator; offload rows also report bytes parked per step, exposed copy time
(the compute stream's waits on copies) and the pinned pool's counters.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import memfit
from memfit.adapters.spec import FamilyAdapter
from memfit_benchmarks.rounds import paired_ratio, round_robin


@dataclass(frozen=True)
class Mode:
    name: str
    config: dict[str, Any] | None


def _cfg(backend: str | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {}
    if backend is not None:
        cfg = {"gradient_checkpointing": True, "gradient_checkpointing_backend": backend}
    for key, value in extra.items():
        cfg[f"gradient_checkpointing_{key}"] = value
    return cfg


MODES = [
    Mode("none", None),
    Mode("torch-ffn", _cfg("torch-ffn")),
    Mode("unsloth-ffn", _cfg("unsloth-ffn")),
    Mode("torch", _cfg("torch")),
    Mode("unsloth", _cfg("unsloth")),
    Mode("torch interval 2", _cfg("torch", interval=2)),
    Mode("torch interval 2 stride 4", _cfg("torch", interval=2, segment_stride=4)),
    Mode("offload_attention", _cfg(offload_attention=True)),
    Mode("torch-ffn + offload_attention", _cfg("torch-ffn", offload_attention=True)),
]


def pinned_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Measured pinned host<->device copy bandwidth in GB/s (each way, and both at once)."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn: Callable[[], None], moved: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        for s in (s1, s2):
            torch.cuda.current_stream().wait_stream(s)
        end.record()
        torch.cuda.synchronize()
        return moved * repeats / (start.elapsed_time(end) / 1e3) / 1e9

    def d2h() -> None:
        host.copy_(dev, non_blocking=True)

    def h2d() -> None:
        dev.copy_(host, non_blocking=True)

    def both() -> None:
        s1.wait_stream(torch.cuda.current_stream())
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s1):
            host.copy_(dev, non_blocking=True)
        with torch.cuda.stream(s2):
            dev2.copy_(host2, non_blocking=True)

    return {"d2h_gbs": timed(d2h, nbytes), "h2d_gbs": timed(h2d, nbytes), "both_gbs": timed(both, 2 * nbytes)}


def is_offload(mode: Mode) -> bool:
    """Whether a mode parks tensors in pinned host memory (needs CUDA)."""
    cfg = mode.config or {}
    return str(cfg.get("gradient_checkpointing_backend", "")).startswith("unsloth") or bool(
        cfg.get("gradient_checkpointing_offload_attention")
    )


def _device_of(model: nn.Module, inputs: dict[str, Any]) -> torch.device:
    for value in inputs.values():
        if isinstance(value, torch.Tensor):
            return value.device
    return next(model.parameters()).device


def _free(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def _alloc_retries() -> int:
    return int(torch.cuda.memory_stats().get("num_alloc_retries", 0))


def _segments_allocated() -> int:
    """cudaMalloc calls of the caching allocator so far (each a new segment; slow, and they synchronize)."""
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def measure_mode(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    mode: Mode,
    *,
    adapter: FamilyAdapter | None,
    warmup: int = 2,
    steps: int = 5,
    optimizer_factory: Callable[[], torch.optim.Optimizer] | None = None,
    inspect: Callable[[Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One row: median step time, peaks, offload telemetry. OOM is recorded, not raised (GPU memory, or host RAM
    for the offload pool: ``oom_where: "host"``).

    On CUDA the step is timed with CUDA events and peaks come from the caching allocator; on any other
    device the step is timed with ``time.perf_counter`` and the peaks are ``None`` (CPU smoke runs).
    ``optimizer_factory``: when given, a fresh optimizer is made for this row and its ``step()`` runs
    inside every (timed) step, after backward; it and its state are freed when the row ends.
    ``inspect``: called with the handle after the timed steps (before ``remove``); the dict it returns is merged
    into the row (e.g. the plan an ``auto`` handle made). ``peak_allocated_warmup`` is the peak of the warm-up
    steps (with ``auto``, the first one includes the planning forward).
    """
    cuda = _device_of(model, inputs).type == "cuda"
    _free(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    handle = None
    optimizer = None
    oom = False
    host_error: str | None = None
    try:
        handle = memfit.apply(model, mode.config, adapter=adapter) if mode.config else None
        optimizer = optimizer_factory() if optimizer_factory is not None else None
        leaf_inputs = [v for v in inputs.values() if isinstance(v, torch.Tensor) and v.requires_grad]

        backward_peaks: list[int] = []

        def step() -> None:
            model.zero_grad(set_to_none=True)
            for tensor in leaf_inputs:
                tensor.grad = None
            loss_fn(model(**inputs)).backward()
            if optimizer is not None:
                if cuda:  # the activation peak, before the optimizer step adds its own (full regime)
                    backward_peaks.append(torch.cuda.max_memory_allocated())
                optimizer.step()

        for _ in range(warmup):
            step()
        warmup_peak = None
        if cuda:
            torch.cuda.synchronize()
            warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if handle is not None:
            handle.reset_stats()
        retries_before = _alloc_retries() if cuda else 0
        segments_before = _segments_allocated() if cuda else 0
        times = []
        backward_peaks.clear()
        peaks: list[tuple[int, int]] = []
        for _ in range(steps):
            if cuda:
                if optimizer is not None:  # per step, so the activation peak read mid-step is this step's
                    torch.cuda.reset_peak_memory_stats()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
                peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
            else:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {
            "mode": mode.name,
            "config": mode.config,
            "step_s": statistics.median(times),
            "peak_allocated": max(p for p, _ in peaks) if cuda else None,
            "peak_reserved": max(r for _, r in peaks) if cuda else None,
            "peak_allocated_warmup": warmup_peak,
            # full regime: the peak of forward+backward alone (the optimizer step's own peak comes after)
            "peak_allocated_before_optimizer": max(backward_peaks) if backward_peaks else None,
            "timing": "cuda-events" if cuda else "perf_counter",
            # the caching allocator freed its cache and retried a cudaMalloc (slow: a device sync each time)
            "alloc_retries_in_timed_steps": _alloc_retries() - retries_before if cuda else None,
            "segments_allocated_in_timed_steps": _segments_allocated() - segments_before if cuda else None,
            "step_times_s": times,  # each timed step, in order (a first step slower than the rest: warm-up left)
            "oom": False,
        }
        if handle is not None:
            s = handle.stats()
            row["frames_per_step"] = s["frames"] / steps
            if "bytes_offloaded" in s:
                row.update(
                    bytes_offloaded_per_step=s["bytes_offloaded"] / steps,
                    bytes_reloaded_per_step=s["bytes_reloaded"] / steps,
                    exposed_copy_ms_per_step=s["stall_ms"] / steps,
                    pinned_bytes_held=s["pinned_bytes_held"],
                    new_pinned_allocations_in_timed_steps=s["pinned_allocations"],
                    pool_hits=s["pool_hits"],
                    # host syncs on a buffer's copy (not in the exposed copy time, which counts GPU-side waits)
                    pool_waits_in_timed_steps=s["pool_waits"],
                    dedup_hits_per_step=s["dedup_hits"] / steps,
                )
            if inspect is not None:
                row.update(inspect(handle))
        return row
    except torch.OutOfMemoryError:
        oom = True  # the traceback (and the activations its frames hold) is released when this clause ends
    except (
        memfit.HostMemoryError
    ) as exc:  # the offload pool ran out of host RAM: this mode does not fit either
        oom, host_error = True, str(exc)
    finally:
        model.zero_grad(set_to_none=True)
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.requires_grad:
                value.grad = None
        if optimizer is not None:
            optimizer.state.clear()
        optimizer = None
        if handle is not None:
            handle.remove()
        _free(cuda)
    assert oom
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if host_error is not None:
        return {
            "mode": mode.name,
            "config": mode.config,
            "oom": True,
            "oom_where": "host",
            "error": host_error,
        }
    return {"mode": mode.name, "config": mode.config, "oom": True}


def _row_summary(row: dict[str, Any]) -> str:
    """One measured row as a progress line: ``OOM``, or its step time and peak."""
    if row.get("oom"):
        return "OOM (host RAM)" if row.get("oom_where") == "host" else "OOM"
    peak = row.get("peak_allocated")
    return f"{row['step_s']:.4f} s, peak " + ("n/a" if peak is None else f"{peak / 2**30:.2f} GiB")


def measure_modes(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    modes: list[Mode],
    *,
    adapter: FamilyAdapter | None,
    rounds: int = 1,
    warmup: int = 2,
    steps: int = 5,
    optimizer_factory: Callable[[], torch.optim.Optimizer] | None = None,
    tag: str = "",
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
) -> list[dict[str, Any]]:
    """Every mode of ``modes`` (``measure_mode``) in ``rounds`` round-robin rounds (``rounds.round_robin``), each
    measurement printed as it ends (after ``tag``): one row per mode, in ``modes`` order, with its ratios
    (``add_ratios``). ``progress`` wraps the iteration over all measurements (e.g. a progress bar)."""

    def measure(mode: Mode) -> dict[str, Any]:
        row = measure_mode(
            model,
            inputs,
            loss_fn,
            mode,
            adapter=adapter,
            warmup=warmup,
            steps=steps,
            optimizer_factory=optimizer_factory,
        )
        print(f"{tag} {mode.name}: {_row_summary(row)}", flush=True)
        return row

    rows = round_robin(modes, rounds, measure, progress)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Step-time ratios ``x_none`` / ``x_torch`` / ``x_torch_ffn`` (ratios of the median rounds' steps), with
    ``x_none_paired`` / ``x_torch_paired`` / ``x_torch_ffn_paired`` (the median of per-round ratios,
    ``rounds.paired_ratio``) where both rows were measured in the same rounds, and peak ratios ``peak_x_none`` /
    ``peak_x_torch`` (when peaks were measured) to the rows of the same run."""
    by = {r["mode"]: r for r in rows if not r.get("oom") and "step_s" in r}
    for r in rows:
        if r.get("oom") or "step_s" not in r:
            continue
        for ref in ("none", "torch", "torch-ffn"):
            if ref not in by:
                continue
            key = ref.replace("-", "_")
            r[f"x_{key}"] = r["step_s"] / by[ref]["step_s"]
            paired = paired_ratio(r, by[ref])
            if paired is not None:
                r[f"x_{key}_paired"] = paired
            if ref != "torch-ffn" and r.get("peak_allocated") and by[ref].get("peak_allocated"):
                r[f"peak_x_{key}"] = r["peak_allocated"] / by[ref]["peak_allocated"]
