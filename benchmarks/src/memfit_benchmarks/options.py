"""Command-line options the synthetic and the family sweeps share."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from memfit_benchmarks.runner import MAX_STEPS_FACTOR
from memfit_benchmarks.training import TrainingConfig, parse_configs

T = TypeVar("T")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def _configs(text: str) -> list[TrainingConfig]:
    try:
        return parse_configs(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_sweep_options(
    parser: argparse.ArgumentParser, *, default_config: str, default_modes: str, per_shape: bool
) -> None:
    """``--configs``, ``--modes``, ``--rounds``, ``--steps``, ``--min-seconds``, ``--warmup``, ``--dry-run`` and
    ``--stop-at``.

    With ``per_shape``, ``--modes``, ``--steps``, ``--min-seconds`` and ``--warmup`` take one value per shape
    separated by ``/`` (``--steps 8/3/2/2``), or one value for every shape (:func:`per_shape_values` parses them).
    """
    each = " (one per shape, separated by '/', or one for all)" if per_shape else ""
    parser.add_argument(
        "--configs",
        type=_configs,
        default=parse_configs(default_config),
        help=f"training configs, comma-separated: {', '.join(c.value for c in TrainingConfig)}, or all "
        f"(default {default_config})",
    )
    parser.add_argument(
        "--modes",
        default=default_modes,
        help="mode names or sets (all, memfit, peers, checkpoint-peers), comma-separated"
        + each
        + f" (default {default_modes})",
    )
    parser.add_argument(
        "--rounds",
        type=_at_least_one,
        default=1,
        help="measure every mode this many times, round-robin; a row reports the median round's step (each "
        "round's in step_s_rounds) and ratios are paired round by round",
    )
    parser.add_argument("--steps", default="5", help="timed steps per measurement, at least" + each)
    parser.add_argument(
        "--min-seconds",
        default="0",
        help="a measurement keeps taking timed steps until they add up to this many seconds too (at most "
        f"{MAX_STEPS_FACTOR}x --steps steps; each row records its count in timed_steps)" + each,
    )
    parser.add_argument("--warmup", default="2", help="warm-up steps per measurement" + each)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options and print what would be measured, without building a model or needing a GPU",
    )
    parser.add_argument(
        "--stop-at",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="no measurement starts after this time (e.g. $(( $(date +%%s) + 300 ))); what ran is written, "
        "modes left out are 'not_measured' rows",
    )


def per_shape_values(
    parser: argparse.ArgumentParser, name: str, text: str, count: int, parse: Callable[[str], T]
) -> list[T]:
    """``text`` (``a/b/c`` or one ``a``) as ``count`` values, through ``parse``; a wrong count or an unparsable
    value exits with a usage error naming the option."""
    parts = text.split("/")
    if len(parts) == 1:
        parts *= count
    if len(parts) != count:
        parser.error(f"--{name} {text!r}: give one value, or one per shape ({count}) separated by '/'")
    try:
        return [parse(p) for p in parts]
    except ValueError as exc:
        parser.error(f"--{name} {text!r}: {exc}")


def step_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("steps cannot be negative")
    return value


def seconds(text: str) -> float:
    """A non-negative number of seconds (``--min-seconds``)."""
    value = float(text)
    if not value >= 0:  # also refuses nan
        raise ValueError("seconds cannot be negative")
    return value


def deadline(stop_at: float | None) -> Callable[[], bool]:
    """``stop()`` for the rounds: true once ``stop_at`` (Unix time) has passed; never without one."""
    return (lambda: False) if stop_at is None else (lambda: time.time() >= stop_at)


def benchmark_device(name: str, *, without_cuda: str) -> torch.device:
    """``--device`` as a torch device. On CUDA, CUDA must be there (else ``SystemExit(without_cuda)``, which names
    the smoke run to use instead), and cuDNN's SDPA is switched off: its backward corrupts memory on diffusers models
    in bf16 on the H200 image's torch (README)."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit(without_cuda)
        torch.backends.cuda.enable_cudnn_sdp(False)
    return device
