"""Workloads for `memfit fit`'s failure tests, importable by a spawned measuring child (core/tests is on
sys.path there too: spawn passes the parent's path).

``crashing_workload`` builds the tiny Flux job and makes the first backward of the k-th measuring process
crash as ``plan[k]`` says: ``"abort"`` (the process dies of SIGABRT), ``"cuda"`` (a CUDA fault as torch
raises it: the process survives but its context is lost), ``"left-behind"`` (out of memory with memfit left on
the model, as when its removal failed) or ``None`` (runs normally). Processes count
themselves in ``counter`` (a file), so the plan holds across the restarts the runner makes.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from memfit.job import FitJob, Workload, build_workload

CUDA_FAULT = (
    "CUDA error: an illegal memory access was encountered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call."
)


def _crash(how: str, model: torch.nn.Module) -> None:
    if how == "left-behind":
        import memfit

        memfit.apply(model, {"gradient_checkpointing": True})
        raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
    if how == "abort":
        os.abort()
    if how == "cuda":
        raise RuntimeError(CUDA_FAULT)
    raise ValueError(f"unknown crash {how!r}")


def crashing_workload(counter: str, plan: tuple[str | None, ...]) -> Workload:
    path = Path(counter)
    index = int(path.read_text()) if path.exists() else 0
    path.write_text(str(index + 1))
    how = plan[min(index, len(plan) - 1)]
    workload = build_workload(FitJob(family="flux", tokens=16))
    if how is None:
        return workload
    loss = workload.loss

    def crashing_loss(output) -> torch.Tensor:
        value = loss(output)
        value.register_hook(lambda grad: _crash(how, workload.model))  # runs in backward
        return value

    workload.loss = crashing_loss
    return workload


def failing_build() -> Workload:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
