"""Does an asynchronous host-to-device copy leave the host free? Per kind of host memory, the host time of issuing
one ``copy_(non_blocking=True)`` on a side stream against the copy's own time.

    python -m memfit_benchmarks.pinning --out DIR            # CUDA only

Kinds: memory registered with ``cudaHostRegister`` (memfit's exact pinning, ``memfit.offload.hostmem``), memory
from PyTorch's pinned allocator (``pin_memory=True``, ``cudaHostAlloc``), and pageable memory (the copy is staged
and the host waits: the reference for "blocks"). A kind whose issue time approaches its copy time makes every
upload a host stall: in a step whose host barely keeps ahead of the GPU (a LoRA forward), that is step time.
Then, whether the host itself slows while copies run: a few kinds of host work (kernel launches, a Python
loop, a pass over host memory) timed alone and beside a queue of uploads, then of downloads. Writes
``pinning.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.offload.hostmem import allocate_host
from memfit_benchmarks.environment import environment

KINDS = ("cudaHostRegister (memfit)", "pin_memory=True (cudaHostAlloc)", "pageable")


def _sources(nbytes: int) -> dict[str, torch.Tensor]:
    made = (
        allocate_host(nbytes, True),
        torch.empty(nbytes, dtype=torch.uint8, pin_memory=True),
        torch.empty(nbytes, dtype=torch.uint8),
    )
    return dict(zip(KINDS, made, strict=True))


def measure(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """Per kind: the median host milliseconds to issue the copy, and the copy's milliseconds (CUDA events)."""
    device = torch.device("cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    rows = []
    for name, source in _sources(nbytes).items():
        source.fill_(1)
        issue, copy = [], []
        for _ in range(repeats + 1):  # the first warms up
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before = time.perf_counter()
            with torch.cuda.stream(side):
                start.record(side)
                target.copy_(source, non_blocking=True)
                end.record(side)
            issued = time.perf_counter()
            end.synchronize()
            issue.append((issued - before) * 1e3)
            copy.append(start.elapsed_time(end))
        issue_ms, copy_ms = statistics.median(issue[1:]), statistics.median(copy[1:])
        rows.append(
            {
                "kind": name,
                "is_pinned": source.is_pinned(),
                "issue_ms": issue_ms,
                "copy_ms": copy_ms,
                "issue_share": issue_ms / copy_ms if copy_ms else None,
                "gbs": nbytes / (copy_ms / 1e3) / 1e9 if copy_ms else None,
            }
        )
    return rows


# -- does the host slow down while copies run? -------------------------------------------------------------------

COPIES_IN_FLIGHT = 24  # back-to-back copies queued on the side stream: ~0.25 s of copies at 600 MiB


def _launches(device: torch.device, count: int = 2000) -> Callable[[], None]:
    """Tiny kernels issued back to back: the host issues them slower than the device runs them."""
    x = torch.zeros(16, device=device)

    def work() -> None:
        for _ in range(count):
            x.add_(1.0)

    return work


def _python_loop(count: int = 200_000) -> Callable[[], None]:
    def work() -> None:
        sum(i * i for i in range(count))

    return work


def _host_memory(nbytes: int = 256 << 20) -> Callable[[], None]:
    """A pass over host memory (a CPU add of two ``nbytes`` tensors): what contends with the copies' reads."""
    a, b = torch.ones(nbytes // 4), torch.ones(nbytes // 4)

    def work() -> None:
        torch.add(a, b, out=a)

    return work


def workloads(device: torch.device) -> dict[str, Callable[[], None]]:
    """The host work timed with and without uploads running, by name."""
    return {
        "2000 kernel launches": _launches(device),
        "a Python loop": _python_loop(),
        "a 256 MiB pass over host memory": _host_memory(),
    }


def _seconds(work: Callable[[], None]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


DIRECTIONS = ("uploads", "downloads")  # host-to-device (streamed weights, reloads), device-to-host (parking)


def contention(nbytes: int, repeats: int) -> list[dict[str, Any]]:
    """Per direction and workload: its median host seconds alone and while :data:`COPIES_IN_FLIGHT` copies of
    ``nbytes`` between registered host memory and the device run on a side stream (issued first; the work ends well
    inside them)."""
    device = torch.device("cuda")
    host = allocate_host(nbytes, True)
    on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)
    rows = []
    for direction in DIRECTIONS:
        target, source = (on_device, host) if direction == "uploads" else (host, on_device)
        for name, work in workloads(device).items():
            work()  # warm-up
            alone, loaded = [], []
            for _ in range(repeats):
                torch.cuda.synchronize(device)
                alone.append(_seconds(work))
                torch.cuda.synchronize(device)
                with torch.cuda.stream(side):
                    for _ in range(COPIES_IN_FLIGHT):
                        target.copy_(source, non_blocking=True)
                loaded.append(_seconds(work))
                busy = not side.query()  # the copies outlasted the work: it ran beside them all along
                torch.cuda.synchronize(device)
                if not busy:
                    loaded.pop()
            rows.append(
                {
                    "direction": direction,
                    "workload": name,
                    "alone_ms": statistics.median(alone) * 1e3,
                    "with_copies_ms": statistics.median(loaded) * 1e3 if loaded else None,
                    "beside_copies": len(loaded),
                }
            )
    return rows


def render(payload: dict[str, Any]) -> str:
    lines = [
        f"# Host time of an asynchronous upload, {payload['nbytes'] / 2**20:.0f} MiB",
        "",
        "| host memory | is_pinned() | host ms to issue | copy ms | issue ÷ copy | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        lines.append(
            f"| {r['kind']} | {r['is_pinned']} | {r['issue_ms']:.2f} | {r['copy_ms']:.2f} "
            f"| {r['issue_share']:.2f} | {r['gbs']:.1f} |"
        )
    lines += [
        "",
        f"Median of {payload['repeats']} copies each, one `copy_(non_blocking=True)` on a side stream.",
    ]
    if payload.get("contention"):
        lines += [
            "",
            "## Host work while copies run",
            "",
            "| copies | host work | ms alone | ms beside the copies | × | runs beside the copies |",
            "|---|---|---|---|---|---|",
        ]
        for r in payload["contention"]:
            loaded = r["with_copies_ms"]
            ratio = "-" if loaded is None else f"{loaded / r['alone_ms']:.2f}"
            lines.append(
                f"| {r['direction']} | {r['workload']} | {r['alone_ms']:.2f} "
                f"| {'-' if loaded is None else f'{loaded:.2f}'} | {ratio} | {r['beside_copies']} of {payload['repeats']} |"
            )
        lines += [
            "",
            f"Beside the copies: {COPIES_IN_FLIGHT} copies of the size above queued first on a side stream, to "
            "(uploads) or from (downloads, as parking does) registered host memory; a run counts only where the "
            "copies were still running when the work ended.",
        ]
    lines += [
        "",
        f"Device: {payload['device']}; torch {payload['torch']}; commit {payload.get('git_commit')}; "
        f"{payload['date']}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--mib", type=int, default=600, help="bytes per copy, in MiB (a Flux double block: ~600)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("pinning measures CUDA copies: run it on a machine with a GPU")
    nbytes = args.mib << 20
    payload = {
        **environment("pinning", torch.device("cuda"), sdpa="-"),
        "nbytes": nbytes,
        "repeats": args.repeats,
        "rows": measure(nbytes, args.repeats),
        "contention": contention(nbytes, args.repeats),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pinning.json").write_text(json.dumps(payload, indent=2) + "\n")
    md = args.out / "pinning.md"
    md.write_text(render(payload))
    print(md.read_text())
    return md


if __name__ == "__main__":
    main()
