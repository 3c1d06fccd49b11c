"""Where a profiled step's GPU sat idle, and what the host was doing meanwhile.

    python -m memfit_benchmarks.trace_gaps TRACE.json.gz [TRACE ...] [--out gaps.md] [--min-gap-us 20]

Reads the Chrome traces ``torch.profiler`` exports (``diagnose`` writes one per mode, with Python frames) and
reports, per trace:

- the compute stream's busy time (kernels, copies and memsets on the stream with the most kernel time) and its
  idle gaps of at least ``--min-gap-us``, split by cause: **host** (the op after the gap was launched after the
  GPU had run dry: the GPU waited for the host to issue work) or **dependency** (it was launched earlier and
  still waited: an event wait on a copy, or another stream);
- the host-bound gap time attributed to the outermost memfit frame and to the innermost Python frame running on
  the launching thread while the GPU waited (what to make cheaper);
- the CUDA runtime calls by total time (a long ``cudaMemcpyAsync`` is a copy the host waited for; a
  ``cudaEventSynchronize``/``cudaStreamSynchronize`` a host sync);
- memfit's own Python time (the union of its frames' intervals), by function (inclusive, and its own lines less
  the calls under them), and the C calls its code makes (built-in methods, torch ops) by count and time: on the
  GPU's host these are what a region costs, where a CPU count of instructions sees no CUDA dispatch.

A step whose gaps are mostly host-bound gains only from fewer host calls; one whose gaps are dependencies gains
from copies that start earlier or wait less.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
MEMFIT_FRAME = "memfit/"  # a frame of memfit's own code (memfit_benchmarks' frames are the harness)


@dataclass
class Interval:
    start: float  # µs, the trace's clock
    end: float
    name: str


@dataclass
class TraceGaps:
    """One trace's summary; times in µs."""

    name: str
    span_us: float = 0.0
    compute_stream: int | None = None
    busy_us: float = 0.0
    host_gap_us: float = 0.0
    dependency_gap_us: float = 0.0
    gaps: int = 0
    host_gap_by_memfit_frame: dict[str, float] = field(default_factory=dict)
    host_gap_by_innermost_frame: dict[str, float] = field(default_factory=dict)
    runtime_calls: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # count, total, max
    memfit_python_us: float = 0.0
    memfit_inclusive_us: dict[str, float] = field(default_factory=dict)  # per function, a recursion once
    memfit_own_us: dict[str, float] = field(default_factory=dict)  # its lines, less the calls under them
    calls_from_memfit: dict[str, tuple[int, float]] = field(default_factory=dict)  # C call -> count, µs


def load_events(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _is_memfit(frame: str) -> bool:
    return MEMFIT_FRAME in frame and "memfit_benchmarks" not in frame


def _short(frame: str) -> str:
    """``/tmp/site/memfit/offload/copy.py(321): _offload_coalesced`` -> ``memfit/offload/copy.py: _offload_coalesced``."""
    path, _, func = frame.partition(": ")
    path = path.rsplit("(", 1)[0]
    for marker in (MEMFIT_FRAME, "torch/"):
        if marker in path:
            path = marker + path.split(marker, 1)[1]
            break
    return f"{path}: {func}" if func else path


def _stacks_at(frames: list[Interval], times: list[float]) -> list[list[Interval]]:
    """The Python frames running at each of ``times`` (ascending), outermost first: one sweep over frames sorted
    by start, which nest, so the running ones form a stack."""
    stacks, stack, i = [], [], 0
    for t in times:
        while i < len(frames) and frames[i].start <= t:
            while stack and stack[-1].end <= frames[i].start:
                stack.pop()
            stack.append(frames[i])
            i += 1
        while stack and stack[-1].end <= t:
            stack.pop()
        stacks.append([f for f in stack if f.end > t])
    return stacks


@dataclass
class _Open:
    item: Interval
    is_frame: bool  # a Python frame (else a torch op)
    children_us: float = 0.0


def _is_builtin(frame: str) -> bool:
    return frame.startswith("<built-in")


def _call_name(name: str) -> str:
    """A C call's name without the object address (``<built-in method query of torch.Event object at 0x7f..>``)."""
    return re.sub(r" at 0x[0-9a-f]+", "", name)


def memfit_breakdown(
    frames: list[Interval], ops: list[Interval]
) -> tuple[dict[str, float], dict[str, float], dict[str, tuple[int, float]]]:
    """One thread's memfit time: per function, inclusive µs (a recursion counted once) and own µs (less every
    Python call and torch op under it); per C call memfit's own code makes directly (a built-in method, or a torch
    op called without one), its count and µs."""
    items = sorted(
        [(f, True) for f in frames] + [(o, False) for o in ops], key=lambda p: (p[0].start, -p[0].end)
    )
    inclusive: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)
    calls: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    stack: list[_Open] = []

    def close(entry: _Open) -> None:
        if entry.is_frame and _is_memfit(entry.item.name):
            own[_short(entry.item.name)] += entry.item.end - entry.item.start - entry.children_us

    for item, is_frame in items:
        while stack and stack[-1].item.end <= item.start:
            close(stack.pop())
        dur = item.end - item.start
        parent = stack[-1] if stack else None
        if parent is not None:
            parent.children_us += dur
        if is_frame and _is_memfit(item.name):
            short = _short(item.name)
            if all(not (e.is_frame and _short(e.item.name) == short) for e in stack):
                inclusive[short] += dur
        elif (
            parent is not None
            and parent.is_frame
            and _is_memfit(parent.item.name)
            and (not is_frame or _is_builtin(item.name))
        ):
            call = calls[_call_name(item.name)]
            call[0] += 1
            call[1] += dur
        stack.append(_Open(item, is_frame))
    while stack:
        close(stack.pop())
    return dict(inclusive), dict(own), {k: (int(n), us) for k, (n, us) in calls.items()}


def summarize(name: str, events: list[dict[str, Any]], *, min_gap_us: float = 20.0) -> TraceGaps:
    out = TraceGaps(name)
    if not events:
        return out
    out.span_us = max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
    launches: dict[Any, dict[str, Any]] = {}
    calls: dict[str, list[float]] = defaultdict(list)
    frames_by_thread: dict[Any, list[Interval]] = defaultdict(list)
    ops_by_thread: dict[Any, list[Interval]] = defaultdict(list)
    gpu_by_stream: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver"):
            calls[e["name"]].append(e["dur"])
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launches[corr] = e
        elif cat == "python_function":
            frames_by_thread[e.get("tid")].append(Interval(e["ts"], e["ts"] + e["dur"], e["name"]))
        elif cat == "cpu_op":
            ops_by_thread[e.get("tid")].append(Interval(e["ts"], e["ts"] + e["dur"], e["name"]))
        elif cat in GPU_CATEGORIES:
            gpu_by_stream[e.get("args", {}).get("stream", e.get("tid"))].append(e)
    out.runtime_calls = {k: (len(v), sum(v), max(v)) for k, v in calls.items()}
    memfit_frames = [(f.start, f.end) for fs in frames_by_thread.values() for f in fs if _is_memfit(f.name)]
    out.memfit_python_us = _union_us(memfit_frames)
    inclusive: dict[str, float] = defaultdict(float)
    own: dict[str, float] = defaultdict(float)
    calls_from: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for tid, fs in frames_by_thread.items():
        inc, mine, made = memfit_breakdown(fs, ops_by_thread.get(tid, []))
        for k, v in inc.items():
            inclusive[k] += v
        for k, v in mine.items():
            own[k] += v
        for k, (n, us) in made.items():
            calls_from[k][0] += n
            calls_from[k][1] += us
    out.memfit_inclusive_us, out.memfit_own_us = dict(inclusive), dict(own)
    out.calls_from_memfit = {k: (int(n), us) for k, (n, us) in calls_from.items()}
    for fs in frames_by_thread.values():
        fs.sort(key=lambda f: (f.start, -f.end))
    if not gpu_by_stream:
        return out

    def kernel_time(stream: int) -> float:
        return sum(e["dur"] for e in gpu_by_stream[stream] if e.get("cat") == "kernel")

    out.compute_stream = max(gpu_by_stream, key=kernel_time)
    ops = sorted(gpu_by_stream[out.compute_stream], key=lambda e: e["ts"])
    out.busy_us = _union_us([(e["ts"], e["ts"] + e["dur"]) for e in ops])
    host_gaps: dict[Any, list[tuple[float, float]]] = defaultdict(list)  # thread -> (midpoint, gap)
    ran_until = ops[0]["ts"] + ops[0]["dur"]
    for op in ops[1:]:
        gap = op["ts"] - ran_until
        if gap >= min_gap_us:
            out.gaps += 1
            launch = launches.get(op.get("args", {}).get("correlation"))
            if launch is not None and launch["ts"] >= ran_until:
                out.host_gap_us += gap
                host_gaps[launch.get("tid")].append((ran_until + gap / 2, gap))
            else:
                out.dependency_gap_us += gap
        ran_until = max(ran_until, op["ts"] + op["dur"])
    # a host-bound gap is charged to what the launching thread ran at its midpoint
    by_memfit: dict[str, float] = defaultdict(float)
    by_inner: dict[str, float] = defaultdict(float)
    for tid, gaps in host_gaps.items():
        stacks = _stacks_at(frames_by_thread.get(tid, []), [mid for mid, _ in gaps])
        for (_, gap), stack in zip(gaps, stacks, strict=True):
            memfit = [f for f in stack if _is_memfit(f.name)]
            by_memfit[_short(memfit[0].name) if memfit else "(outside memfit)"] += gap
            by_inner[_short(stack[-1].name) if stack else "(no Python frame)"] += gap
    out.host_gap_by_memfit_frame = dict(by_memfit)
    out.host_gap_by_innermost_frame = dict(by_inner)
    return out


def _top(d: dict[str, float], n: int) -> list[tuple[str, float]]:
    return sorted(d.items(), key=lambda kv: -kv[1])[:n]


def render(results: list[TraceGaps], *, min_gap_us: float, rows: int = 12) -> str:
    lines = [
        "# Where the GPU waited",
        "",
        f"Compute-stream gaps of at least {min_gap_us:g} µs, one profiled step per trace. *host*: the op after "
        "the gap was launched after the GPU ran dry; *dependency*: launched before, still waiting (an event "
        "wait or another stream).",
        "",
        "| trace | span ms | compute busy ms | host-bound gaps ms | dependency gaps ms | gaps | memfit Python ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r.name} | {r.span_us / 1e3:.1f} | {r.busy_us / 1e3:.1f} | {r.host_gap_us / 1e3:.1f} "
            f"| {r.dependency_gap_us / 1e3:.1f} | {r.gaps} | {r.memfit_python_us / 1e3:.1f} |"
        )
    for r in results:
        lines += ["", f"## {r.name}", "", "Host-bound gap time by the outermost memfit frame running:", ""]
        lines += [f"- {ms / 1e3:.2f} ms  {frame}" for frame, ms in _top(r.host_gap_by_memfit_frame, rows)]
        lines += ["", "By the innermost Python frame:", ""]
        lines += [f"- {ms / 1e3:.2f} ms  {frame}" for frame, ms in _top(r.host_gap_by_innermost_frame, rows)]
        if r.memfit_inclusive_us:
            lines += ["", "| memfit function | inclusive ms | own ms |", "|---|---|---|"]
            lines += [
                f"| {f} | {us / 1e3:.2f} | {r.memfit_own_us.get(f, 0.0) / 1e3:.2f} |"
                for f, us in _top(r.memfit_inclusive_us, rows)
            ]
        if r.calls_from_memfit:
            lines += ["", "| C call made by memfit's code | count | ms |", "|---|---|---|"]
            ranked_calls = sorted(r.calls_from_memfit.items(), key=lambda kv: -kv[1][1])[:rows]
            lines += [f"| {k} | {n} | {us / 1e3:.2f} |" for k, (n, us) in ranked_calls]
        lines += ["", "| CUDA runtime call | count | total ms | max µs |", "|---|---|---|---|"]
        ranked = sorted(r.runtime_calls.items(), key=lambda kv: -kv[1][1])[:rows]
        lines += [f"| {k} | {n} | {tot / 1e3:.2f} | {mx:.0f} |" for k, (n, tot, mx) in ranked]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("traces", type=Path, nargs="+")
    parser.add_argument("--min-gap-us", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=None, help="write the report here (default: print it)")
    args = parser.parse_args(argv)
    results = [
        summarize(
            p.name.removesuffix(".gz").removesuffix(".json"), load_events(p), min_gap_us=args.min_gap_us
        )
        for p in args.traces
    ]
    text = render(results, min_gap_us=args.min_gap_us)
    if args.out is not None:
        args.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
