"""Where a step's peak comes from: the caching allocator's history of one step, per mode, and what is alive at its peak.

    python -m memfit_benchmarks.memtimeline --out DIR [--shape 0] [--modes torch,unsloth]

A peak figure alone does not say which tensors make it. Here each mode runs its warm-up steps,
then one step under ``torch.cuda.memory._record_memory_history`` (Python frames); the step's allocations and frees are
replayed to find the peak — in forward or backward (a marker allocation separates them) — and the blocks alive there
that the step allocated are grouped by size and by the innermost frame outside torch. The weights and anything else
allocated before the step are one number, the same for every mode.

Off CUDA there is no allocator history: :func:`replay` (the analysis) is tested on a hand-made trace.
"""

from __future__ import annotations

import argparse
import gc
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.modes import MODES
from memfit_benchmarks.results import write_results
from memfit_benchmarks.shapes import SHAPES
from memfit_benchmarks.synthetic import SYNTHETIC, lora_stack

_MARKER = "_forward_done_marker"
MiB = 1 << 20


def _forward_done_marker(device: torch.device) -> None:
    """An allocation whose frame names the end of forward in the trace (freed at once)."""
    torch.empty(512, dtype=torch.uint8, device=device)


def _frame_label(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside torch's own files (``file:line name``), or ``(autograd engine)`` when the
    allocation has no Python frame of ours (backward's kernels are launched from C++)."""
    for f in frames:
        name = f.get("filename", "")
        if "/torch/" in name or name.startswith("<") or not name.endswith(".py"):
            continue
        return f"{Path(name).parent.name}/{Path(name).name}:{f.get('line')} {f.get('name')}"
    return "(autograd engine)"


def replay(
    trace: list[dict[str, Any]], *, baseline: int, free_action: str = "free_requested"
) -> dict[str, Any]:
    """Replay one step's allocator trace: its peak, where it falls, and what the step allocated is alive there.

    Args:
        trace: the device's trace entries (``alloc``, ``free_requested``, ``free_completed``…), in order.
        baseline: bytes allocated when the recording started (weights, inputs, anything from before the step).
        free_action: the action that gives bytes back (``free_requested``: the allocator's ``allocated`` counter
            drops there; ``free_completed``: when a block used on another stream really returns).
    """
    alive: dict[int, tuple[int, int]] = {}  # addr -> (size, index of its alloc)
    current = peak = baseline
    peak_index, marker_index = -1, None
    peak_alive: dict[int, tuple[int, int]] = {}
    for i, e in enumerate(trace):
        action = e.get("action")
        if action == "alloc":
            if marker_index is None and any(f.get("name") == _MARKER for f in e.get("frames", [])):
                marker_index = i  # ours, not the step's: left out of the count
                continue
            alive[e["addr"]] = (e["size"], i)
            current += e["size"]
            if current > peak:
                peak, peak_index, peak_alive = current, i, dict(alive)
        elif action == free_action and e["addr"] in alive:
            current -= alive.pop(e["addr"])[0]
    groups: Counter[tuple[int, str, str]] = Counter()
    for size, index in peak_alive.values():
        when = "backward" if marker_index is not None and index > marker_index else "forward"
        groups[(size, when, _frame_label(trace[index].get("frames", [])))] += 1
    held_by_memfit = sum(
        size
        for size, index in peak_alive.values()
        if any("/memfit/" in f.get("filename", "") for f in trace[index].get("frames", []))
    )
    phase = "n/a" if marker_index is None else ("forward" if peak_index < marker_index else "backward")
    return {
        "peak": peak,
        "baseline": baseline,
        "events": len(trace),
        "peak_event": peak_index,
        "phase": phase,
        "forward_end_event": marker_index,
        "peak_allocation": _frame_label(trace[peak_index].get("frames", [])) if peak_index >= 0 else None,
        "held_by_memfit_at_peak": held_by_memfit,  # allocated from memfit's own code (reloads, packed buffers)
        "alive_at_peak": [
            {"size": size, "count": n, "bytes": size * n, "when": when, "where": where}
            for (size, when, where), n in sorted(groups.items(), key=lambda kv: -kv[0][0] * kv[1])
        ],
        "end": current,
    }


def record_step(
    model, batch, loss_fn, *, max_entries: int = 500_000
) -> tuple[list[dict[str, Any]], int, int]:
    """One forward+backward under the allocator's history: (trace, bytes allocated before, max allocated)."""
    device = next(model.parameters()).device
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        loss = loss_fn(model(**batch))
        _forward_done_marker(device)
        loss.backward()
        del loss
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return snapshot["device_traces"][index], baseline, torch.cuda.max_memory_allocated()


def render(payload: dict[str, Any], *, rows: int = 14) -> str:
    lines = [
        f"# Memory timeline of one step — {payload['device']}, torch {payload['torch']}, {payload['date']}",
        "",
        f"Synthetic stack {payload['shape']}, LoRA; SDPA: {payload['sdpa_backend']}; after {payload['warmup']} "
        f"warm-up steps. Commit: {payload.get('git_commit') or 'n/a'}. Peak by replay of the allocator's "
        "trace (bytes given back at `free_requested`), checked against `max_memory_allocated`.",
        "",
    ]
    for r in payload["modes"]:
        lines += [
            f"## {r['mode']}",
            "",
            f"- peak {r['peak'] / MiB:.1f} MiB by replay (max_memory_allocated {r['max_allocated'] / MiB:.1f}; "
            f"`free_completed` replay {r['peak_free_completed'] / MiB:.1f}), in **{r['phase']}** (event "
            f"{r['peak_event']} of {r['events']}, forward ends at {r['forward_end_event']}); before the step "
            f"{r['baseline'] / MiB:.1f} MiB",
            f"- the allocation that made the peak: `{r['peak_allocation']}`",
            f"- allocated by the step and alive at the peak: {sum(g['bytes'] for g in r['alive_at_peak']) / MiB:.1f} "
            f"MiB, of which memfit's own allocations (reloads, packed buffers) "
            f"{r.get('held_by_memfit_at_peak', 0) / MiB:.1f} MiB",
            "",
            "| size MiB | count | MiB | allocated in | at |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {g['size'] / MiB:.2f} | {g['count']} | {g['bytes'] / MiB:.1f} | {g['when']} | `{g['where']}` |"
            for g in r["alive_at_peak"][:rows]
        ]
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", type=int, default=0, help="index into the sweep's shapes (0: 1024 tokens)")
    parser.add_argument("--modes", default="torch,unsloth", help="comma-separated mode names (modes.MODES)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    modes = {m.name: m for m in MODES}
    unknown = [m for m in args.modes.split(",") if m not in modes]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; known: {sorted(modes)}")
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: the allocator's history is a CUDA feature")
    torch.backends.cuda.enable_cudnn_sdp(False)
    label = SHAPES[args.shape][0]
    model, batch = lora_stack(SHAPES[args.shape])
    from torch.nn.attention import SDPBackend, sdpa_kernel

    results = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for name in args.modes.split(","):
            mode = modes[name]
            handle = memfit.apply(model, mode.config, adapter=SYNTHETIC) if mode.config else None
            try:
                for _ in range(args.warmup):
                    model.zero_grad(set_to_none=True)
                    SYNTHETIC.loss(model(**batch)).backward()
                trace, baseline, max_allocated = record_step(model, batch, SYNTHETIC.loss)
            finally:
                if handle is not None:
                    handle.remove()
                model.zero_grad(set_to_none=True)
                gc.collect()
            row = replay(trace, baseline=baseline)
            row.update(
                mode=name,
                max_allocated=max_allocated,
                peak_free_completed=replay(trace, baseline=baseline, free_action="free_completed")["peak"],
            )
            results.append(row)
            print(
                f"{name}: peak {row['peak'] / MiB:.1f} MiB ({row['phase']}), max_allocated "
                f"{max_allocated / MiB:.1f} MiB",
                flush=True,
            )
    payload = {
        **run_stamp("memtimeline", torch.cuda.get_device_name()),
        "shape": label,
        "warmup": args.warmup,
        "sdpa_backend": "flash (cuDNN SDPA disabled)",
        "modes": results,
    }
    return write_results(args.out, payload, render)


if __name__ == "__main__":
    main()
