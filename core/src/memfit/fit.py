"""The fit finder: walk SPEC §1's decision ladder on real steps and recommend a configuration.

Ladder: leave checkpointing off if it fits; else ``torch-ffn``; else ``torch``; else (on CUDA)
``unsloth-ffn``, then ``unsloth``. When checkpointing is needed, the ``auto`` backend at the same budget is
measured too and competes; on CUDA, once the ``torch`` rung fits, the interval is raised (2, 3, …) on families
that support it to win speed back, while it still fits.

What "fits" means: on CUDA, the step's peak allocated memory is within the budget; on a CPU-only machine
(no real peak to read), the activation bytes held for backward are.

Failures are rows, not the end: a rung that runs out of memory does not fit ("out of memory at X GiB"); a rung
that crashes (a CUDA fault, a dead process) is a "crashed" row; the ladder goes on either way. Rungs that
crashed in backward with torch's default attention dispatch get one line of advice (cuDNN's SDPA backward is
the known culprit: measure with ``--sdpa flash``, disable cuDNN attention in the trainer).

Ranking.  On CUDA the fastest candidate is recommended, unless a leaner one is as fast within the spread of the
measurements (``StepMeasurement.step_spread`` of either, at least :data:`MIN_TIE`): the measurement cannot tell
those apart, and the leaner leaves more headroom for a larger aspect-ratio bucket or a longer caption. On CPU,
step times are not evidence of GPU speed (and wander by more than the differences between rungs): the candidate
that holds the most activation bytes within the budget is recommended — every byte it keeps is a byte the GPU
does not recompute or copy — and interval rungs, a pure speed lever, are not measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from memfit.adapters.spec import FamilyAdapter
from memfit.auto.allocator import EXPANDABLE_HINT, expandable_segments
from memfit.config import Backend
from memfit.measure import (
    FailureKind,
    RungFailure,
    StepMeasurement,
    measure_guarded,
    measure_step,
    sdpa_context,
)

# backends whose rungs may copy to host memory (see RungResult.may_copy)
_COPYING_BACKENDS = {Backend.UNSLOTH.value, Backend.UNSLOTH_FFN.value, Backend.AUTO.value}
MIN_TIE = 0.01  # step times closer than this are the same speed (see "Ranking")
# weight-streaming rungs tried when nothing fits by activations: frozen bytes to stream, as shares of the budget
STREAM_SHARES = (0.25, 0.5, 0.75)


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

    @classmethod
    def streaming(cls, stream_bytes: int) -> Rung:
        """``unsloth`` with the frozen weights of blocks holding at least ``stream_bytes`` streamed from host
        memory (``gradient_checkpointing_stream_blocks``)."""
        size = f"{max(1, stream_bytes >> 20)}MiB"
        return cls(
            f"unsloth + stream {size}",
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_backend": Backend.UNSLOTH.value,
                "gradient_checkpointing_stream_blocks": size,
            },
        )

    @classmethod
    def auto(cls, budget_bytes: int) -> Rung:
        return cls(
            "auto",
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_backend": Backend.AUTO.value,
                "gradient_checkpointing_memory_budget": budget_bytes,
            },
        )


@dataclass
class RungResult:
    """A measured rung, or the failure that ended it (``measurement`` None, ``failure`` set)."""

    rung: Rung
    measurement: StepMeasurement | None
    fits: bool
    ratio_to_none: float | None = None
    failure: RungFailure | None = None

    @property
    def budget_bytes_used(self) -> int | None:
        m = self.measurement
        if m is None:
            return None
        return m.peak_bytes if m.peak_bytes is not None else m.held_bytes

    @property
    def crashed(self) -> bool:
        return self.failure is not None and self.failure.kind is FailureKind.CRASHED

    @property
    def may_copy(self) -> bool:
        """Whether the rung's configuration copies to host memory: activations parked, weights streamed, or a plan
        of ``auto`` that may do either."""
        cfg = self.rung.config or {}
        return (
            cfg.get("gradient_checkpointing_backend") in _COPYING_BACKENDS
            or bool(cfg.get("gradient_checkpointing_offload_attention"))
            or bool(cfg.get("gradient_checkpointing_stream_blocks"))
        )

    @property
    def status(self) -> str:
        return self.status_with()

    def status_with(self, *more: str) -> str:
        """The row's status, its notes and ``more`` in brackets (``fits (streams 3 blocks' weights; recommended)``)."""
        if self.failure is not None:
            return self.failure.describe()
        m, notes = self.measurement, []
        if m is not None and m.streamed_blocks:
            notes.append(f"streams {m.streamed_blocks} blocks' weights")
        if m is not None and m.planning_seconds is not None:  # paid in the first steps of each input shape
            seconds = m.planning_seconds
            notes.append(f"planned in {seconds:.1f} s" if seconds >= 1 else f"planned in {seconds:.2f} s")
        notes += more
        return ("fits" if self.fits else "does not fit") + (f" ({'; '.join(notes)})" if notes else "")


class RungRunner(Protocol):
    """Measures one rung at a time (in this process, or in a child that survives CUDA faults)."""

    def measure(self, rung: Rung, on_phase: Callable[[str], None]) -> StepMeasurement | RungFailure: ...


def _noop(_phase: str) -> None:
    pass


class InProcessRunner:
    """Measures rungs on a model built in this process.

    A CUDA fault leaves this process without a usable CUDA context: the rung is a "crashed" row, and every
    later rung is reported as not measured (use :class:`memfit.isolation.ChildRunner` to go on).
    """

    def __init__(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        loss_fn: Callable[[Any], torch.Tensor],
        *,
        adapter: FamilyAdapter | None,
        steps: int = 3,
        sdpa: str = "default",
        measure: Callable[..., StepMeasurement] = measure_step,
        optimizer: Callable[[], torch.optim.Optimizer] | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.model, self.inputs, self.loss_fn = model, inputs, loss_fn
        self.adapter, self.steps, self.sdpa, self._measure = adapter, steps, sdpa, measure
        self.optimizer = optimizer
        self.device = device  # where the model trains when its weights start on the host
        self._lost: RungFailure | None = None

    @classmethod
    def of(cls, workload: Any, *, steps: int = 3, sdpa: str = "default") -> InProcessRunner:
        """A runner over a :class:`memfit.job.Workload` (model, inputs, loss, adapter)."""
        return cls(
            workload.model,
            workload.inputs,
            workload.loss,
            adapter=workload.adapter,
            steps=steps,
            sdpa=sdpa,
            optimizer=workload.optimizer,
            device=workload.device,
        )

    def measure(self, rung: Rung, on_phase: Callable[[str], None] = _noop) -> StepMeasurement | RungFailure:
        if self._lost is not None:
            what = (
                "the CUDA context was lost" if self._lost.context_lost else "memfit or memory was left behind"
            )
            return RungFailure(
                FailureKind.CRASHED,
                f"not measured: {what} in an earlier rung ({self._lost.message})",
                context_lost=self._lost.context_lost,
                left_behind=self._lost.left_behind,
            )
        with sdpa_context(self.sdpa):
            outcome = measure_guarded(
                self.model,
                self.inputs,
                self.loss_fn,
                config=rung.config,
                adapter=self.adapter,
                steps=self.steps,
                on_phase=on_phase,
                measure=self._measure,
                optimizer=self.optimizer,
                device=self.device,
            )
        if isinstance(outcome, RungFailure) and outcome.needs_fresh_process:
            self._lost = outcome
        return outcome


@dataclass
class FitReport:
    device: str
    budget_bytes: int | None
    metric: str  # "peak allocated" or "held activations"
    results: list[RungResult] = field(default_factory=list)
    recommended: RungResult | None = None
    sdpa: str = "default"  # what attention ran with (see memfit.measure.sdpa_description)
    ranking: str = "step time"  # "step time" (CUDA) or "held activations" (CPU)
    weights_on_host: bool = False  # the model was built on the CPU and placed by each rung (see memfit.job)

    def recommended_config(self) -> dict[str, Any]:
        if self.recommended is None:
            return {}
        return self.recommended.rung.config or {"gradient_checkpointing": False}

    @property
    def all_crashed(self) -> bool:
        return bool(self.results) and all(r.crashed for r in self.results)

    def crash_advice(self) -> str | None:
        """One line naming the likely cause of the crashed rungs and the fix (None when nothing crashed)."""
        crashed = [r for r in self.results if r.crashed]
        if not crashed:
            return None
        assert crashed[0].failure is not None
        first = crashed[0].failure.message
        what = (
            f"Every rung crashed ({first})"
            if self.all_crashed
            else f"{len(crashed)} of {len(self.results)} rungs crashed ({first})"
        )
        phases = {r.failure.phase for r in crashed if r.failure is not None}
        in_backward = phases <= {"backward", None}
        default_dispatch = self.sdpa.startswith(("default", "torch default", "cudnn"))
        if self.device.startswith("cuda") and in_backward and default_dispatch:
            return (
                f"{what} in backward: most likely cuDNN's scaled-dot-product-attention backward, which "
                f"corrupts memory on some torch/CUDA builds. Measure with `--sdpa flash`, and in your trainer "
                f"call `torch.backends.cuda.enable_cudnn_sdp(False)` before training."
            )
        return (
            f"{what}. The CUDA context of each crashed rung was lost, so the ladder went on in a fresh process; "
            f"try `--sdpa math` to rule out the attention kernels, and keep the --json report for a bug report."
        )

    def allocator_advice(self) -> str | None:
        """On CUDA with the caching allocator's default segments, where a rung that copies to host memory ran out
        of memory: one line naming expandable segments (None otherwise; docs/cost-model.md, "Copy reserve")."""
        if not self.device.startswith("cuda") or expandable_segments():
            return None
        out_of_memory = [
            r.rung.name
            for r in self.results
            if r.may_copy and r.failure is not None and r.failure.kind is FailureKind.OUT_OF_MEMORY
        ]
        if not out_of_memory:
            return None
        return (
            f"{', '.join(out_of_memory)} ran out of memory with the CUDA caching allocator's default segments, "
            f"where what a step copies to host memory needs about as much room again on the card. Run fit again "
            f"(and train) with {EXPANDABLE_HINT} set in the environment: copies then need no such room."
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "budget_bytes": self.budget_bytes,
            "metric": self.metric,
            "ranking": self.ranking,
            "sdpa": self.sdpa,
            "rows": [_row_json(r) for r in self.results],
            "recommended": self.recommended.rung.name if self.recommended else None,
            "recommended_config": self.recommended_config() if self.recommended else None,
            "weights_on_host": self.weights_on_host,
            "crash_advice": self.crash_advice(),
            "allocator_advice": self.allocator_advice(),
        }


def _row_json(r: RungResult) -> dict[str, Any]:
    measured = asdict(r.measurement) if r.measurement is not None else dict.fromkeys(_MEASUREMENT_FIELDS)
    failure = asdict(r.failure) if r.failure is not None else None
    return {
        "name": r.rung.name,
        "config": r.rung.config,
        **measured,
        "fits": r.fits,
        "status": r.status,
        "failure": failure,
        "time_ratio_to_none": r.ratio_to_none,
    }


_MEASUREMENT_FIELDS = tuple(StepMeasurement.__dataclass_fields__)


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


def run_ladder(
    runner: RungRunner,
    *,
    adapter: FamilyAdapter | None,
    budget_bytes: int | None,
    device_type: str,
    max_interval: int = 4,
    extra: Sequence[Rung] = (),
    sdpa: str = "default",
    on_start: Callable[[int, int, Rung], None] | None = None,
    on_phase: Callable[[str], None] = _noop,
    on_rung: Callable[[RungResult], None] | None = None,
) -> FitReport:
    """Measure the ladder through ``runner`` and pick a configuration within ``budget_bytes``.

    Args:
        budget_bytes: memory budget; None = everything fits (the ladder then stops at "none").
        device_type: ``"cuda"`` (peaks, step times rank) or ``"cpu"`` (held bytes rank; see "Ranking").
        max_interval: the largest interval tried when winning speed back (CUDA only).
        extra: further candidates measured after the ladder (e.g. the configuration a trainer file has).
        sdpa: how attention was pinned, for the report.
        on_start: called as ``on_start(k, n, rung)`` before rung ``k`` of (at most) ``n`` is measured.
        on_phase: told each phase of the rung being measured (``apply``, ``forward``, ``backward``).
        on_rung: called after each measured rung.
    """
    on_cuda = device_type == "cuda"
    report = FitReport(
        device_type,
        budget_bytes,
        "peak allocated" if on_cuda else "held activations",
        sdpa=sdpa,
        ranking="step time" if on_cuda else "held activations",
    )
    base = ladder(adapter, offload=on_cuda)
    may_auto = budget_bytes is not None and adapter is not None
    intervals = list(range(2, max_interval + 1)) if on_cuda and adapter and adapter.supports_interval else []

    def run(rung: Rung, still_possible: int) -> RungResult:
        if on_start is not None:
            on_start(len(report.results) + 1, len(report.results) + 1 + still_possible, rung)
        outcome = runner.measure(rung, on_phase)
        if isinstance(outcome, RungFailure):
            result = RungResult(rung, None, False, failure=outcome)
        else:
            used = outcome.peak_bytes if outcome.peak_bytes is not None else outcome.held_bytes
            result = RungResult(rung, outcome, budget_bytes is None or used <= budget_bytes)
            none = report.results[0].measurement if report.results else outcome
            if none is not None and none.step_seconds:
                result.ratio_to_none = outcome.step_seconds / none.step_seconds
        report.results.append(result)
        if on_rung is not None:
            on_rung(result)
        return result

    first_fit: RungResult | None = None
    for i, rung in enumerate(base):
        result = run(rung, len(base) - i - 1 + int(may_auto) + len(intervals) + len(extra))
        if result.fits:
            first_fit = result
            break
    candidates = [first_fit] if first_fit is not None else []
    raise_interval = first_fit is not None and bool(intervals) and first_fit.rung.name == Backend.TORCH.value
    if may_auto and budget_bytes is not None and (first_fit is None or first_fit.rung.config):
        result = run(Rung.auto(budget_bytes), len(intervals) * raise_interval + len(extra))
        if result.fits:
            candidates.append(result)
    if raise_interval:
        for j, interval in enumerate(intervals):
            result = run(Rung.of(Backend.TORCH, interval), len(intervals) - j - 1 + len(extra))
            if not result.fits:
                break  # a larger interval keeps more resident: it will not fit either
            candidates.append(result)
    if not candidates and on_cuda and budget_bytes is not None and adapter is not None:
        # nothing fits by activations alone (the frozen weights are most of the card): stream weights, the
        # least first (each more streamed byte is a copy the step may wait for)
        for j, share in enumerate(STREAM_SHARES):
            result = run(Rung.streaming(int(budget_bytes * share)), len(STREAM_SHARES) - j - 1 + len(extra))
            if result.fits:
                candidates.append(result)
                break
    for j, rung in enumerate(extra):
        result = run(rung, len(extra) - j - 1)
        if result.fits:
            candidates.append(result)
    if candidates:
        report.recommended = recommend(candidates) if on_cuda else recommend_by_held_bytes(candidates)
    return report


def find_fit(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    adapter: FamilyAdapter | None,
    budget_bytes: int | None,
    steps: int = 3,
    max_interval: int = 4,
    sdpa: str = "default",
    on_rung: Callable[[RungResult], None] | None = None,
) -> FitReport:
    """Measure the ladder on ``model`` in this process and pick a configuration within ``budget_bytes``.

    Args:
        budget_bytes: memory budget; None = everything fits (the ladder then stops at "none").
        max_interval: the largest interval tried when winning speed back.
        sdpa: pin attention to one backend (``"flash"`` …; ``"default"`` leaves torch's dispatch).
        on_rung: called after each measured rung (progress display).

    Example:
        >>> report = find_fit(model, inputs, adapter.loss, adapter=adapter, budget_bytes=24 * 2**30)
        >>> report.recommended_config()
    """
    runner = InProcessRunner(model, inputs, loss_fn, adapter=adapter, steps=steps, sdpa=sdpa)
    device = next(model.parameters()).device
    return run_ladder(
        runner,
        adapter=adapter,
        budget_bytes=budget_bytes,
        device_type=device.type,
        max_interval=max_interval,
        sdpa=sdpa,
        on_rung=on_rung,
    )


def recommend(candidates: list[RungResult]) -> RungResult:
    """The fastest of ``candidates``, or a leaner one as fast within the measurements' spread (see "Ranking")."""
    measured = [r for r in candidates if r.measurement is not None]
    fastest = min(measured, key=_seconds)

    def as_fast(r: RungResult) -> bool:
        assert r.measurement is not None and fastest.measurement is not None
        tie = max(MIN_TIE, r.measurement.step_spread, fastest.measurement.step_spread)
        return _seconds(r) <= _seconds(fastest) * (1 + tie)

    return min((r for r in measured if as_fast(r)), key=lambda r: (r.budget_bytes_used or 0, _seconds(r)))


def recommend_by_held_bytes(candidates: list[RungResult]) -> RungResult:
    """The candidate holding the most activation bytes (the least dropped); the earlier rung on a tie."""
    measured = [r for r in candidates if r.measurement is not None]
    return max(enumerate(measured), key=lambda ir: (ir[1].measurement.held_bytes, -ir[0]))[1]  # type: ignore[union-attr]


def _seconds(r: RungResult) -> float:
    assert r.measurement is not None
    return r.measurement.step_seconds
