"""What every results file starts with (suite, date, device, versions, commit) and the measured copy bandwidth."""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
from collections.abc import Callable
from typing import Any

import torch

from memfit.auto.allocator import allocator_settings


def run_stamp(suite: str, device: str) -> dict[str, Any]:
    """The fields a results file starts with: suite, UTC date, device, torch, commit (``MEMFIT_GIT_COMMIT``)."""
    return {
        "suite": suite,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "git_commit": os.environ.get("MEMFIT_GIT_COMMIT"),
        # the CUDA caching allocator's settings, as torch reads them (expandable segments change what fits a card)
        "allocator_conf": allocator_settings() or "default",
    }


def environment(suite: str, device: torch.device, *, sdpa: str) -> dict[str, Any]:
    """:func:`run_stamp` plus CUDA, diffusers and Python versions, the SDPA backend and, on CUDA, the pinned copy
    bandwidth measured now (:func:`pinned_bandwidth`)."""
    try:
        import diffusers

        diffusers_version = diffusers.__version__
    except ImportError:
        diffusers_version = None
    cuda = device.type == "cuda"
    name = (
        torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()})"
    )
    return {
        **run_stamp(suite, name),
        "cuda": torch.version.cuda,
        "diffusers": diffusers_version,
        "python": platform.python_version(),
        "sdpa_backend": sdpa if cuda else "default (CPU)",
        "pinned_bandwidth": pinned_bandwidth() if cuda else None,
    }


def pinned_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> dict[str, float]:
    """Measured pinned host<->device copy bandwidth in GB/s (each way, both at once, each way while the other way
    runs, and host to device beside another host-to-device copy)."""
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

    def beside(
        short: torch.cuda.Stream, copy: Callable[[], None], long: torch.cuda.Stream, other: Callable[[], None]
    ) -> float:
        """GB/s of ``copy`` on ``short`` while ``long`` runs four of ``other`` (issued first): a weight upload beside
        a parked block's copy, or beside a reload."""
        rates = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(long):
                for _ in range(4):
                    other()
            with torch.cuda.stream(short):
                start.record()
                copy()
                end.record()
            torch.cuda.synchronize()
            rates.append(nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
        return statistics.median(rates)

    def upload() -> None:
        dev2.copy_(host2, non_blocking=True)

    def reload() -> None:
        dev.copy_(host, non_blocking=True)

    def park() -> None:
        host.copy_(dev, non_blocking=True)

    return {
        "d2h_gbs": timed(d2h, nbytes),
        "h2d_gbs": timed(h2d, nbytes),
        "both_gbs": timed(both, 2 * nbytes),
        "h2d_beside_d2h_gbs": beside(s2, upload, s1, park),
        "d2h_beside_h2d_gbs": beside(s1, park, s2, upload),
        # the same way on another stream: ~half the link where the two share it, far less where the copies of one
        # direction run one after the other (an upload issued after a reload waits for it)
        "h2d_beside_h2d_gbs": beside(s2, upload, s1, reload),
    }
