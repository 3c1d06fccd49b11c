"""Measure one training step under a configuration: held activation bytes, peak memory, step time.

A measurement can fail without ending the caller: :func:`measure_guarded` turns an out-of-memory error into a
:class:`RungFailure` ("does not fit (out of memory at X GiB)") after releasing what the failed step held, and
a CUDA fault into a "crashed" failure that says the CUDA context is lost (only a fresh process can go on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.accounting import SavedBytesMeter
from memfit.adapters.spec import FamilyAdapter
from memfit.errors import BudgetError, DeviceMemoryError, MemfitError
from memfit.units import format_bytes

# device memory a failed rung may leave allocated (cached small blocks, RNG state) before the next needs a fresh process
LEFT_BEHIND_TOLERANCE = 64 << 20

# `--sdpa` choices: the backend names of torch.nn.attention.SDPBackend users know, plus torch's own dispatch.
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "math": "MATH",
    "cudnn": "CUDNN_ATTENTION",
}
SDPA_CHOICES = ("default", *SDPA_BACKENDS)
SDPA_ON_CPU = ("default", "flash", "math")  # torch has no CPU kernel for the others


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
        peak_reserved_bytes: ``torch.cuda.max_memory_reserved`` during the timed steps (None on CPU): what the
            caching allocator took from the card, which is what a card of that size must hold.
        streamed_blocks: blocks whose frozen weights streamed from host memory (``auto`` may choose some).
        planning_seconds: ``auto``: the time its searches took over the warm-up and timed steps (the first plan
            and the re-plans while it calibrates; None for a fixed backend).
    """

    held_bytes: int
    peak_bytes: int | None
    step_seconds: float
    frames: int
    step_spread: float = 0.0
    peak_reserved_bytes: int | None = None
    streamed_blocks: int = 0
    planning_seconds: float | None = None


class FailureKind(enum.StrEnum):
    OUT_OF_MEMORY = "out of memory"
    CRASHED = "crashed"  # a CUDA fault or a dead process: the measurement says nothing about memory
    REFUSED = "refused"  # memfit refused the configuration (e.g. auto's budget below its smallest plan)
    ERROR = "error"  # the step raised something else


@dataclass(frozen=True)
class RungFailure:
    """Why one configuration could not be measured.

    Attributes:
        kind: what happened (see :class:`FailureKind`).
        message: the error, one line.
        phase: where: ``"apply"``, ``"forward"``, ``"backward"`` or ``"build"`` (None if unknown).
        peak_bytes: on CUDA, the peak allocated before the failure (None elsewhere).
        context_lost: the CUDA context is unusable; nothing more can run in this process.
        left_behind: the failed rung left memfit on the model or device memory allocated (an out-of-memory
            error inside memfit's own removal): the next rung needs a fresh process.
    """

    kind: FailureKind
    message: str
    phase: str | None = None
    peak_bytes: int | None = None
    context_lost: bool = False
    left_behind: bool = False

    @property
    def needs_fresh_process(self) -> bool:
        return self.context_lost or self.left_behind

    def describe(self) -> str:
        """The row's status, e.g. ``does not fit (out of memory at 23.94 GiB)`` or ``crashed: CUDA error: …``."""
        if self.kind is FailureKind.OUT_OF_MEMORY:
            at = f" at {format_bytes(self.peak_bytes)}" if self.peak_bytes else ""
            return f"does not fit (out of memory{at})"
        where = f" (in {self.phase})" if self.phase else ""
        if self.kind is FailureKind.CRASHED:
            return f"crashed{where}: {self.message}"
        if self.kind is FailureKind.REFUSED:
            return f"does not fit: {self.message}"
        return f"failed{where}: {self.message}"


def relative_spread(times: list[float]) -> float:
    """Twice the median absolute deviation of ``times`` over their median (see ``StepMeasurement``)."""
    median = statistics.median(times)
    return 2 * statistics.median(abs(t - median) for t in times) / median if median > 0 else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _noop(_phase: str) -> None:
    pass


def measure_step(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    config: dict[str, Any] | None,
    adapter: FamilyAdapter | None = None,
    warmup: int = 1,
    steps: int = 3,
    on_phase: Callable[[str], None] = _noop,
    optimizer: Callable[[], torch.optim.Optimizer] | None = None,
    device: torch.device | None = None,
) -> StepMeasurement:
    """Run ``warmup + steps`` forward/backward steps with ``config`` applied (None: unmodified model).

    Args:
        on_phase: told ``"apply"``, ``"forward"``, ``"backward"`` and ``"optimizer"`` as each begins (for crash
            reports).
        optimizer: makes this measurement's optimizer, stepped after each backward (its state is freed with it).
        device: where the model trains when its weights start on the host: ``memfit.apply(..., device=)``
            places it there for this measurement (the unmodified model too) and ``remove()`` takes it back.
    """
    import memfit

    if device is not None and not config:
        config = {"gradient_checkpointing": False}  # installs nothing; the placement is apply's
    home = next(model.parameters()).device
    device = device if device is not None else home
    on_phase("apply")
    placing = {"device": device} if device != home else {}
    handle = memfit.apply(model, config, adapter=adapter, **placing) if config else None
    try:
        return _timed_steps(
            model,
            inputs,
            loss_fn,
            handle,
            device,
            warmup=warmup,
            steps=steps,
            on_phase=on_phase,
            optimizer=optimizer() if optimizer is not None else None,
        )
    except BaseException as exc:
        if handle is not None:
            # the failed step's activations live in the traceback's frames: free them before memfit takes its
            # hooks off (putting streamed weights back on the device needs the memory an out-of-memory step held)
            exc.__traceback__ = None
            release_memory(model, device)
            handle.remove()
        raise
    finally:
        if handle is not None:
            handle.remove()


def _timed_steps(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    handle: Any,
    device: torch.device,
    *,
    warmup: int,
    steps: int,
    on_phase: Callable[[str], None],
    optimizer: torch.optim.Optimizer | None = None,
) -> StepMeasurement:
    times: list[float] = []
    held = 0
    frames = 0
    planning = None
    exclude = [*model.parameters(), *model.buffers()]
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=True)
        if handle is not None:
            handle.reset_stats()
        if i == warmup and device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        start = time.perf_counter()
        on_phase("forward")
        with SavedBytesMeter(exclude=exclude) as meter:
            loss = loss_fn(model(**inputs))
        on_phase("backward")
        loss.backward()
        if optimizer is not None:
            on_phase("optimizer")
            optimizer.step()
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
        held = meter.device_bytes
        stats = handle.stats() if handle is not None else {}
        frames, streamed = stats.get("frames", 0), stats.get("streamed_blocks", 0)
        planning = stats.get("planning_seconds")
        del loss
    cuda = device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    reserved = torch.cuda.max_memory_reserved(device) if cuda else None
    model.zero_grad(set_to_none=True)
    return StepMeasurement(
        held,
        peak,
        statistics.median(times),
        frames,
        relative_spread(times),
        peak_reserved_bytes=reserved,
        streamed_blocks=streamed,
        planning_seconds=planning,
    )


def is_cuda_fault(exc: BaseException) -> bool:
    """A CUDA error (illegal address, launch failure, device assert …): the context is unusable afterwards."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(exc, accelerator_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        marker in text for marker in ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "cuDNN error")
    )


def first_line(exc: BaseException) -> str:
    """The error's first non-empty line (CUDA errors carry several lines of debugging advice)."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def release_memory(model: nn.Module, device: torch.device) -> None:
    """Drop gradients and whatever a failed step left cached, so the next measurement starts clean."""
    model.zero_grad(set_to_none=True)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure_guarded(
    model: nn.Module,
    inputs: dict[str, Any],
    loss_fn: Callable[[Any], torch.Tensor],
    *,
    config: dict[str, Any] | None,
    adapter: FamilyAdapter | None = None,
    steps: int = 3,
    on_phase: Callable[[str], None] = _noop,
    measure: Callable[..., StepMeasurement] = measure_step,
    optimizer: Callable[[], torch.optim.Optimizer] | None = None,
    device: torch.device | None = None,
) -> StepMeasurement | RungFailure:
    """:func:`measure_step`, with a failure returned as a :class:`RungFailure` instead of raised.

    Out of memory: the failure records the peak reached, and the memory the failed step held is released
    (gradients, the allocator's cache). A CUDA fault: ``context_lost`` is set. ``KeyboardInterrupt`` is not
    caught.

    Args:
        measure: the measuring function (``measure_step``; tests pass stand-ins).
        device: where the model trains when its weights start on the host (``measure_step``'s).
    """
    placing = {"device": device} if device is not None else {}
    device = device if device is not None else next(model.parameters()).device
    phase: list[str | None] = [None]

    def track(name: str) -> None:
        phase[0] = name
        on_phase(name)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    failure: RungFailure | None = None
    try:
        return measure(
            model,
            inputs,
            loss_fn,
            config=config,
            adapter=adapter,
            steps=steps,
            on_phase=track,
            optimizer=optimizer,
            **placing,
        )
    except torch.OutOfMemoryError as exc:
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        failure = RungFailure(FailureKind.OUT_OF_MEMORY, first_line(exc), phase[0], peak)
    except DeviceMemoryError as exc:  # the part that stays on the card does not fit it
        failure = RungFailure(FailureKind.OUT_OF_MEMORY, first_line(exc), phase[0])
    except BudgetError as exc:
        failure = RungFailure(FailureKind.REFUSED, first_line(exc), phase[0])
    except MemfitError as exc:
        failure = RungFailure(FailureKind.ERROR, first_line(exc), phase[0])
    except Exception as exc:
        if is_cuda_fault(exc):
            return RungFailure(FailureKind.CRASHED, first_line(exc), phase[0], context_lost=True)
        failure = RungFailure(FailureKind.ERROR, f"{type(exc).__name__}: {first_line(exc)}", phase[0])
    # out of the except blocks: the exception and the frames (and tensors) its traceback held are gone now
    release_memory(model, device)
    from memfit.apply import is_applied

    leaked = device.type == "cuda" and torch.cuda.memory_allocated(device) > before + LEFT_BEHIND_TOLERANCE
    if is_applied(model) or leaked:
        failure = dataclasses.replace(failure, left_behind=True)
    return failure


def sdpa_context(name: str) -> contextlib.AbstractContextManager[Any]:
    """Pin scaled-dot-product attention to one backend (``"default"``: leave torch's dispatch alone).

    The pin is global in torch (not per thread), so it also holds in the autograd thread that runs backward
    and the recomputes inside it.
    """
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, SDPA_BACKENDS[name]))


def sdpa_description(name: str, device: torch.device) -> str:
    """What ``--sdpa name`` measures with, for reports: ``flash (pinned)``, or ``torch default (cudnn, flash,
    efficient, math)``: the backends torch's dispatch may pick from."""
    if name != "default":
        return f"{name} (pinned)"
    if device.type != "cuda":
        return "torch default (CPU)"
    enabled = [
        label
        for label, on in (
            ("cudnn", torch.backends.cuda.cudnn_sdp_enabled()),
            ("flash", torch.backends.cuda.flash_sdp_enabled()),
            ("efficient", torch.backends.cuda.mem_efficient_sdp_enabled()),
            ("math", torch.backends.cuda.math_sdp_enabled()),
        )
        if on
    ]
    return f"torch default ({', '.join(enabled)})"
