"""The fit finder: walk SPEC §1's decision ladder on real steps and recommend a configuration.

Ladder: leave checkpointing off if it fits; else ``torch-ffn``; else ``torch``; else (on CUDA)
``unsloth-ffn``, then ``unsloth``; once the ``torch`` rung fits, raise the interval (2, 3, …) on
families that support it to win speed back, keeping the fastest configuration that still fits. When
checkpointing is needed, the ``auto`` backend at the same budget is measured too and competes.

What "fits" means: on CUDA, the step's peak allocated memory is within the budget; on a
CPU-only machine (no real peak to read), the activation bytes held for backward are.

Ties.  The fastest candidate is recommended, unless a leaner one is as fast within the spread of the
measurements (``StepMeasurement.step_spread`` of either, at least :data:`MIN_TIE`): the measurement
cannot tell those apart, and the leaner leaves more headroom for a larger aspect-ratio bucket or a longer
caption. (Drift between measurements, large on a loaded CPU, is not in that spread: there the
recommendation can still change from run to run.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.config import Backend
from memfit.errors import BudgetError
from memfit.measure import StepMeasurement, measure_step

MIN_TIE = 0.01  # step times closer than this are the same speed (see "Ties")


@dataclass(frozen=True)
class Rung:
    """One configuration on the ladder."""

    name: str
    config: dict[str, Any] | None  # None: memfit off

    @classmethod
    def of(cls, backend: Backend | None, interval: int = 1) -> Rung:
        if backend is None:
            return cls("none", None)
        cfg: dict[str, Any] = {
            "gradient_checkpointing": True,
            "gradient_checkpointing_backend": backend.value,
        }
        name = backend.value
        if interval > 1:
            cfg["gradient_checkpointing_interval"] = interval
            name += f" interval {interval}"
        return cls(name, cfg)


@dataclass
class RungResult:
    rung: Rung
    measurement: StepMeasurement
    fits: bool
    ratio_to_none: float | None = None

    @property
    def budget_bytes_used(self) -> int:
        m = self.measurement
        return m.peak_bytes if m.peak_bytes is not None else m.held_bytes


@dataclass
class FitReport:
    device: str
    budget_bytes: int | None
    metric: str  # "peak allocated" or "held activations"
    results: list[RungResult] = field(default_factory=list)
    recommended: RungResult | None = None

    def recommended_config(self) -> dict[str, Any]:
        if self.recommended is None:
            return {}
        return self.recommended.rung.config or {"gradient_checkpointing": False}

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "metric": self.metric,
            "rows": [
                {
                    "name": r.rung.name,
                    "config": r.rung.config,
                    **asdict(r.measurement),
                    "fits": r.fits,
                    "time_ratio_to_none": r.ratio_to_none,
                }
                for r in self.results
            ],
            "recommended": self.recommended.rung.name if self.recommended else None,
            "recommended_config": self.recommended_config() if self.recommended else None,
        }


def ladder(adapter: FamilyAdapter | None, *, offload: bool = False) -> list[Rung]:
    """The base rungs in SPEC §1 order, limited to what the family declares.

    Args:
        offload: include the offload rungs (``unsloth-ffn``, then ``unsloth``); they need CUDA.
    """
    has_ffn = adapter is not None and adapter.has_ffn
    rungs = [Rung.of(None)]
    if has_ffn:
        rungs.append(Rung.of(Backend.TORCH_FFN))
    rungs.append(Rung.of(Backend.TORCH))
    if offload:
        if has_ffn:
            rungs.append(Rung.of(Backend.UNSLOTH_FFN))
        rungs.append(Rung.of(Backend.UNSLOTH))
    return rungs


def find_fit(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    adapter: FamilyAdapter | None,
    budget_bytes: int | None,
    steps: int = 3,
    max_interval: int = 4,
    on_rung: Callable[[RungResult], None] | None = None,
) -> FitReport:
    """Measure the ladder and pick the fastest configuration within ``budget_bytes``.

    Args:
        budget_bytes: memory budget; None = everything fits (the ladder then stops at "none").
        max_interval: the largest interval tried when winning speed back.
        on_rung: called after each measured rung (progress display).
    """
    device = next(model.parameters()).device
    report = FitReport(
        str(device), budget_bytes, "peak allocated" if device.type == "cuda" else "held activations"
    )

    def run(rung: Rung) -> RungResult:
        m = measure_step(model, inputs, loss_fn, config=rung.config, adapter=adapter, steps=steps)
        used = m.peak_bytes if m.peak_bytes is not None else m.held_bytes
        result = RungResult(rung, m, budget_bytes is None or used <= budget_bytes)
        base = report.results[0].measurement.step_seconds if report.results else m.step_seconds
        result.ratio_to_none = m.step_seconds / base if base else None
        report.results.append(result)
        if on_rung is not None:
            on_rung(result)
        return result

    first_fit: RungResult | None = None
    for rung in ladder(adapter, offload=device.type == "cuda"):
        result = run(rung)
        if result.fits:
            first_fit = result
            break
    candidates = [first_fit] if first_fit is not None else []
    if budget_bytes is not None and adapter is not None and (first_fit is None or first_fit.rung.config):
        # the per-block planner at the same budget: one more candidate, measured like the others
        auto = Rung(
            "auto",
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_backend": Backend.AUTO.value,
                "gradient_checkpointing_memory_budget": budget_bytes,
            },
        )
        try:
            result = run(auto)
        except BudgetError:
            result = None
        if result is not None and result.fits:
            candidates.append(result)
    if first_fit is None:
        if candidates:
            report.recommended = candidates[0]
        return report
    if (
        first_fit.rung.config is not None
        and adapter is not None
        and adapter.supports_interval
        and first_fit.rung.name == Backend.TORCH.value
    ):
        for interval in range(2, max_interval + 1):
            result = run(Rung.of(Backend.TORCH, interval))
            if result.fits:
                candidates.append(result)
    report.recommended = recommend(candidates)
    return report


def recommend(candidates: list[RungResult]) -> RungResult:
    """The fastest of ``candidates``, or a leaner one as fast within the measurements' spread (see "Ties")."""
    fastest = min(candidates, key=lambda r: r.measurement.step_seconds)

    def as_fast(r: RungResult) -> bool:
        tie = max(MIN_TIE, r.measurement.step_spread, fastest.measurement.step_spread)
        return r.measurement.step_seconds <= fastest.measurement.step_seconds * (1 + tie)

    return min(
        (r for r in candidates if as_fast(r)), key=lambda r: (r.budget_bytes_used, r.measurement.step_seconds)
    )
