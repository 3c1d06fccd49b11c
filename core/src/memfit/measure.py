"""Measure one training step under a configuration: held activation bytes, peak memory, step time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.accounting import SavedBytesMeter
from memfit.adapters.spec import FamilyAdapter


@dataclass(frozen=True)
class StepMeasurement:
    """What one configuration costs per step.

    Attributes:
        held_bytes: activation bytes autograd holds between forward and backward (on the compute device).
        peak_bytes: ``torch.cuda.max_memory_allocated`` during the step (None on CPU).
        step_seconds: median wall time of the timed steps (forward + backward).
        frames: regions recorded per step (0 when nothing is installed).
        step_spread: how far apart the timed steps were: twice their median absolute deviation, over their
            median (0 with one step; one outlier among three steps does not move it).
    """

    held_bytes: int
    peak_bytes: int | None
    step_seconds: float
    frames: int
    step_spread: float = 0.0


def relative_spread(times: list[float]) -> float:
    """Twice the median absolute deviation of ``times`` over their median (see ``StepMeasurement``)."""
    median = statistics.median(times)
    return 2 * statistics.median(abs(t - median) for t in times) / median if median > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_step(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    config: dict[str, Any] | None,
    adapter: FamilyAdapter | None = None,
    warmup: int = 1,
    steps: int = 3,
) -> StepMeasurement:
    """Run ``warmup + steps`` forward/backward steps with ``config`` applied (None: unmodified model)."""
    import memfit

    device = next(model.parameters()).device
    handle = memfit.apply(model, config, adapter=adapter) if config else None
    try:
        times: list[float] = []
        held = 0
        frames = 0
        exclude = [*model.parameters(), *model.buffers()]
        for i in range(warmup + steps):
            model.zero_grad(set_to_none=True)
            if handle is not None:
                handle.reset_stats()
            if i == warmup and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            with SavedBytesMeter(exclude=exclude) as meter:
                loss = loss_fn(model(**inputs))
            loss.backward()
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - start)
            held = meter.device_bytes
            frames = handle.stats()["frames"] if handle is not None else 0
            del loss
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        model.zero_grad(set_to_none=True)
        return StepMeasurement(held, peak, statistics.median(times), frames, relative_spread(times))
    finally:
        if handle is not None:
            handle.remove()
