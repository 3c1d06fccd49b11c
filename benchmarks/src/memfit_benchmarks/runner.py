"""Measure training steps under each memfit mode and each peer baseline, side by side in one process.

Every row of one shape is measured in the same process on the same model, one mode after
the other (``memfit.apply`` or the peer's installation → warm-up steps → timed steps → ``remove``), so ratios
between rows are like for like. Step time is the median of CUDA-event timings (``perf_counter`` off CUDA); peaks
come from the caching allocator; offload rows also report bytes parked per step, exposed copy time
(the compute stream's waits on copies) and the pinned pool's counters. Every row also records the floor under
its peak: what was allocated when the step began plus the gradients alive when backward ends.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

import memfit
from memfit import FamilyAdapter
from memfit_benchmarks import peers
from memfit_benchmarks.modes import PEERS_OF, Mode
from memfit_benchmarks.report import oom_cell, region_counts
from memfit_benchmarks.rounds import (
    FAILED,
    NOT_MEASURED,
    measured,
    paired_ratio,
    per_round_ratios,
    round_robin,
)
from memfit_benchmarks.training import grad_leaves

# ``min_seconds`` never makes a measurement take more than this many times ``steps`` timed steps
MAX_STEPS_FACTOR = 50


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


def _grad_bytes(model: nn.Module, leaves: list[torch.Tensor]) -> int:
    """Bytes of every gradient alive now (parameters and input leaves)."""
    tensors = [p for p in model.parameters() if p.grad is not None] + [
        t for t in leaves if t.grad is not None
    ]
    return sum(t.grad.numel() * t.grad.element_size() for t in tensors)


def more_timed_steps(times: list[float], *, steps: int, min_seconds: float) -> bool:
    """Whether a measurement takes another timed step after the ones timed so far (``times``, in seconds): while it
    has fewer than ``steps``, or fewer than ``min_seconds`` of them in all and fewer than ``MAX_STEPS_FACTOR`` ×
    ``steps`` steps.

    Example:
        >>> more_timed_steps([0.03] * 6, steps=6, min_seconds=1.0)
        True
        >>> more_timed_steps([0.3] * 4, steps=2, min_seconds=1.0)
        False
    """
    if len(times) < steps:
        return True
    return sum(times) < min_seconds and len(times) < MAX_STEPS_FACTOR * steps


def measure_mode(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    mode: Mode,
    *,
    adapter: FamilyAdapter | None,
    warmup: int = 2,
    steps: int = 5,
    min_seconds: float = 0.0,
    optimizer_factory: Callable[[], torch.optim.Optimizer] | None = None,
    inspect: Callable[[Any], dict[str, Any]] | None = None,
    settle: int = 0,
) -> dict[str, Any]:
    """One row: median step time, peaks, the floor under the peak, offload telemetry. OOM is recorded, not raised
    (GPU memory, or host RAM for the offload pool: ``oom_where: "host"``).

    A memfit mode goes on through ``memfit.apply``; a peer through :func:`peers.install` (its step context wraps
    each step's forward and loss; checkpoint peers count their checkpointed calls). On CUDA the step is timed
    with CUDA events and peaks come from the caching allocator; on any other device the step is timed with
    ``time.perf_counter`` and the peaks are ``None`` (CPU smoke runs). ``peak_floor_bytes`` (CUDA) = allocated
    bytes when the last timed step began (weights, inputs, optimizer state) + ``grad_bytes``, the gradients alive
    when its backward ended: no mode's peak can be below it.
    ``steps`` and ``min_seconds``: the timed steps go on until there are ``steps`` of them and they add up to
    ``min_seconds`` (at most ``MAX_STEPS_FACTOR`` × ``steps``; :func:`more_timed_steps`); ``timed_steps`` says how
    many ran, and every per-step figure is per timed step.
    ``optimizer_factory``: when given, a fresh optimizer is made for this row and its ``step()`` runs
    inside every (timed) step, after backward; it and its state are freed when the row ends.
    ``inspect``: called with the handle after the timed steps (before ``remove``); the dict it returns is merged
    into the row (e.g. the plan an ``auto`` handle made). ``peak_allocated_warmup`` is the peak of the warm-up
    steps (with ``auto``, the first one includes the planning forward).
    ``settle``: with ``auto``, up to this many more warm-up steps until every input shape's closed loop has
    settled (it stops measuring and re-planning), so that the timed steps run the plan a trainer keeps;
    ``settle_steps`` says how many ran.
    """
    cuda = _device_of(model, inputs).type == "cuda"
    _free(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    handle = installation = None
    optimizer = None
    oom = False
    host_error: str | None = None
    device_error: str | None = None
    failure: str | None = None
    try:
        if mode.peer is not None:
            installation = peers.install(mode.peer, model, adapter)
        elif mode.config:
            handle = memfit.apply(model, mode.config, adapter=adapter, **mode.options)
        step_context = installation.step_context if installation is not None else contextlib.nullcontext
        optimizer = optimizer_factory() if optimizer_factory is not None else None
        leaf_inputs = grad_leaves(inputs)

        backward_peaks: list[int] = []
        resident: list[int] = []

        def step() -> None:
            model.zero_grad(set_to_none=True)
            for tensor in leaf_inputs:
                tensor.grad = None
            if cuda:
                resident.append(torch.cuda.memory_allocated())
            with step_context():
                loss = loss_fn(model(**inputs))
            loss.backward()
            del loss
            if optimizer is not None:
                if cuda:  # the activation peak, before the optimizer step adds its own (full regime)
                    backward_peaks.append(torch.cuda.max_memory_allocated())
                optimizer.step()

        for _ in range(warmup):
            step()
        settle_steps = 0
        while handle is not None and settle_steps < settle and not _settled(handle):
            step()
            settle_steps += 1
        warmup_peak = None
        if cuda:
            torch.cuda.synchronize()
            warmup_peak = torch.cuda.max_memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        if handle is not None:
            handle.reset_stats()
        calls_before = installation.checkpointed_calls() if installation is not None else None
        retries_before = _alloc_retries() if cuda else 0
        segments_before = _segments_allocated() if cuda else 0
        times = []
        backward_peaks.clear()
        peaks: list[tuple[int, int]] = []
        while more_timed_steps(times, steps=steps, min_seconds=min_seconds):
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
        grad_bytes = _grad_bytes(model, leaf_inputs)
        timed = len(times)
        row: dict[str, Any] = {
            "mode": mode.name,
            "config": mode.config,
            "peer": mode.peer.value if mode.peer is not None else None,
            "step_s": statistics.median(times),
            "timed_steps": timed,
            "peak_allocated": max(p for p, _ in peaks) if cuda else None,
            "peak_reserved": max(r for _, r in peaks) if cuda else None,
            "peak_allocated_warmup": warmup_peak,
            "settle_steps": settle_steps,
            # full regime: the peak of forward+backward alone (the optimizer step's own peak comes after)
            "peak_allocated_before_optimizer": max(backward_peaks) if backward_peaks else None,
            "resident_bytes_at_step_start": resident[-1] if resident else None,
            "grad_bytes": grad_bytes,
            "peak_floor_bytes": resident[-1] + grad_bytes if resident else None,
            "timing": "cuda-events" if cuda else "perf_counter",
            # the caching allocator freed its cache and retried a cudaMalloc (slow: a device sync each time)
            "alloc_retries_in_timed_steps": _alloc_retries() - retries_before if cuda else None,
            "segments_allocated_in_timed_steps": _segments_allocated() - segments_before if cuda else None,
            "step_times_s": times,  # each timed step, in order (a first step slower than the rest: warm-up left)
            "oom": False,
        }
        if calls_before is not None:
            row["checkpointed_calls_per_step"] = (installation.checkpointed_calls() - calls_before) / timed
        if handle is not None:
            s = handle.stats()
            row["frames_per_step"] = s["frames"] / timed
            if "bytes_offloaded" in s:
                row.update(
                    bytes_offloaded_per_step=s["bytes_offloaded"] / timed,
                    bytes_reloaded_per_step=s["bytes_reloaded"] / timed,
                    exposed_copy_ms_per_step=s["stall_ms"] / timed,
                    pinned_bytes_held=s["pinned_bytes_held"],
                    new_pinned_allocations_in_timed_steps=s["pinned_allocations"],
                    pool_hits=s["pool_hits"],
                    # host syncs on a buffer's copy (not in the exposed copy time, which counts GPU-side waits)
                    pool_waits_in_timed_steps=s["pool_waits"],
                    dedup_hits_per_step=s["dedup_hits"] / timed,
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
    except memfit.DeviceMemoryError as exc:  # apply(..., device=): what stays on the card does not fit it
        oom, device_error = True, str(exc)
    except Exception as exc:
        if mode.peer is None:
            raise  # memfit's own failure is a bug to see, not a row
        failure = (
            f"{type(exc).__name__}: {exc}"  # a peer that breaks on this model is recorded, the run goes on
        )
    finally:
        model.zero_grad(set_to_none=True)
        for tensor in grad_leaves(inputs):
            tensor.grad = None
        if optimizer is not None:
            optimizer.state.clear()
        optimizer = None
        if handle is not None:
            handle.remove()
        if installation is not None:
            installation.remove()
        _free(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    row = {
        "mode": mode.name,
        "config": mode.config,
        "peer": mode.peer.value if mode.peer else None,
        "oom": oom,
    }
    if failure is not None:
        row[FAILED] = failure
    if host_error is not None:
        row.update(oom_where="host", error=host_error)
    if device_error is not None:
        row.update(oom_where="placing the model", error=device_error)
    return row


def _row_summary(row: dict[str, Any]) -> str:
    """One measured row as a progress line: ``OOM``, or its step time and peak."""
    if not measured(row):
        return oom_cell(row)
    peak = row.get("peak_allocated")
    return f"{row['step_s']:.4f} s ({row.get('timed_steps', '?')} timed steps), peak " + (
        "n/a" if peak is None else f"{peak / 2**30:.2f} GiB"
    )


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
    min_seconds: float = 0.0,
    optimizer_factory: Callable[[], torch.optim.Optimizer] | None = None,
    tag: str = "",
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
    stop: Callable[[], bool] = lambda: False,
) -> list[dict[str, Any]]:
    """Every mode of ``modes`` (``measure_mode``) in ``rounds`` round-robin rounds (``rounds.round_robin``), each
    measurement printed as it ends (after ``tag``): one row per mode, in ``modes`` order, with its ratios
    (``add_ratios``). ``progress`` wraps the iteration over all measurements (e.g. a progress bar); once
    ``stop()`` is true no further measurement starts."""

    def measure(mode: Mode) -> dict[str, Any]:
        row = measure_mode(
            model,
            inputs,
            loss_fn,
            mode,
            adapter=adapter,
            warmup=warmup,
            steps=steps,
            min_seconds=min_seconds,
            optimizer_factory=optimizer_factory,
        )
        print(f"{tag} {mode.name}: {_row_summary(row)}", flush=True)
        return row

    rows = round_robin(modes, rounds, measure, progress, stop)
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Step-time ratios ``x_none`` / ``x_torch`` / ``x_torch_ffn`` (ratios of the median rounds' steps), with
    ``x_none_paired`` / ``x_torch_paired`` / ``x_torch_ffn_paired`` (the median of per-round ratios,
    ``rounds.paired_ratio``) where both rows were measured in the same rounds, and peak ratios ``peak_x_none`` /
    ``peak_x_torch`` (when peaks were measured) to the rows of the same run; then each memfit row's ratios to its
    peer (``add_peer_ratios``)."""
    by = {r["mode"]: r for r in rows if measured(r)}
    for r in rows:
        if not measured(r):
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
    add_peer_ratios(rows)


def add_peer_ratios(rows: list[dict[str, Any]]) -> None:
    """For each measured memfit row with a peer among ``rows`` (``modes.PEERS_OF``: the first measured one that
    checkpoints as many regions per step as the memfit row, else the first measured one):
    ``vs_peer`` (its name), ``x_peer`` (the median of per-round step ratios where both ran in two or more of the
    same rounds, ``x_peer_paired`` true; else the ratio of the two steps), ``x_peer_rounds`` (the per-round
    ratios), ``peak_x_peer``, and ``x_peers`` (the step ratio to every measured peer). A peer out of memory where
    the memfit row fits: ``vs_peer`` with ``peer_oom`` true; a peer that failed: ``peer_failed`` (its error)."""
    all_rows = {r["mode"]: r for r in rows}
    for r in rows:
        candidates = [all_rows[p] for p in PEERS_OF.get(r["mode"], ()) if p in all_rows]
        candidates = [c for c in candidates if NOT_MEASURED not in c]
        if not measured(r) or not candidates:
            continue
        timed = [c for c in candidates if measured(c)]
        if not timed:
            ref = candidates[0]
            r.update(
                vs_peer=ref["mode"],
                **({"peer_failed": ref[FAILED]} if ref.get(FAILED) else {"peer_oom": True}),
            )
            continue
        # like for like first: where diffusers routes only some of a model's blocks through its checkpointing
        # (Krea 2's text-fusion blocks), a per-block checkpoint over the same blocks as memfit is the peer
        ref = next((c for c in timed if region_counts(r, c) is None), timed[0])
        ratios = per_round_ratios(r, ref)
        r.update(
            vs_peer=ref["mode"],
            x_peer=statistics.median(ratios) if ratios else r["step_s"] / ref["step_s"],
            x_peer_paired=ratios is not None,
            x_peer_rounds=ratios,
            x_peers={c["mode"]: paired_ratio(r, c) or r["step_s"] / c["step_s"] for c in timed},
        )
        if r.get("peak_allocated") and ref.get("peak_allocated"):
            r["peak_x_peer"] = r["peak_allocated"] / ref["peak_allocated"]


def _settled(handle: Any) -> bool:
    """Every input shape ``auto`` planned has settled (True for a handle without a closed loop)."""
    return all(shape.get("settled", True) for shape in handle.stats().get("shapes") or [])
