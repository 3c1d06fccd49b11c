"""Turn a results JSON into markdown tables (and the issue's target checks)."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def _fmt(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 3) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value / scale:.{digits}f}"


def render_markdown(payload: dict[str, Any]) -> str:
    bw = payload.get("pinned_bandwidth", {})
    lines = [
        f"# memfit {payload['suite']} sweep — {payload['device']}, torch {payload['torch']} (CUDA "
        f"{payload['cuda']}), {payload['date']}",
        "",
        f"Regime: {payload['regime']}. SDPA: {payload['sdpa_backend']}. Median of {payload['steps']} timed steps "
        f"after {payload['warmup']} warm-up steps; every row of a table measured in one process, side by side. "
        f"Commit: {payload.get('git_commit') or 'n/a'}.",
        f"Pinned bandwidth measured in the same run: D2H {bw.get('d2h_gbs', 0):.1f} GB/s, H2D "
        f"{bw.get('h2d_gbs', 0):.1f} GB/s, both at once {bw.get('both_gbs', 0):.1f} GB/s.",
        "",
    ]
    for shape in payload["results"]:
        lines += [
            f"## {shape['shape']}",
            "",
            "| mode | step s | × none | × torch | peak alloc GiB | peak reserved GiB | offloaded MiB/step "
            "| exposed copy ms/step | pinned GiB | new pinned allocs (timed) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in shape["rows"]:
            if r.get("oom"):
                lines.append(f"| {r['mode']} | OOM | | | | | | | | |")
                continue
            lines.append(
                f"| {r['mode']} | {r['step_s']:.4f} | {_fmt(r, 'x_none', digits=3)} | {_fmt(r, 'x_torch')} | "
                f"{r['peak_allocated'] / GIB:.2f} | {r['peak_reserved'] / GIB:.2f} | "
                f"{_fmt(r, 'bytes_offloaded_per_step', 2**20, 1)} | {_fmt(r, 'exposed_copy_ms_per_step', 1, 2)} | "
                f"{_fmt(r, 'pinned_bytes_held', GIB, 2)} | {r.get('new_pinned_allocations_in_timed_steps', '-')} |"
            )
        lines += ["", *_targets(shape, bw), ""]
    return "\n".join(lines)


def _targets(shape: dict[str, Any], bw: dict[str, float]) -> list[str]:
    by = {r["mode"]: r for r in shape["rows"] if not r.get("oom")}
    out = ["Targets (issue 3):", ""]

    def check(label: str, ok: bool, detail: str) -> None:
        out.append(f"- {'PASS' if ok else 'FAIL'} {label}: {detail}")

    if "unsloth" in by and "torch" in by:
        u, t = by["unsloth"], by["torch"]
        ratio = u["step_s"] / t["step_s"]
        check("unsloth ≤ 1.02× torch step time", ratio <= 1.02, f"{ratio:.3f}×")
        parked = u.get("bytes_offloaded_per_step", 0)
        limit = t["peak_allocated"] - 0.9 * parked
        check("unsloth peak ≤ torch peak − 0.9 × offloaded inputs", u["peak_allocated"] <= limit,
              f"{u['peak_allocated'] / GIB:.3f} GiB vs limit {limit / GIB:.3f} GiB (offloaded {parked / 2**20:.0f} MiB)")
    if "unsloth-ffn" in by and "torch-ffn" in by:
        ratio = by["unsloth-ffn"]["step_s"] / by["torch-ffn"]["step_s"]
        check("unsloth-ffn ≤ 1.03× torch-ffn step time", ratio <= 1.03, f"{ratio:.3f}×")
    if "offload_attention" in by and "none" in by and bw.get("d2h_gbs"):
        a = by["offload_attention"]
        d = a.get("bytes_offloaded_per_step", 0)
        bound = max(by["none"]["step_s"], d / (bw["d2h_gbs"] * 1e9))
        check("offload_attention ≤ 1.10 × max(none, D/B)", a["step_s"] <= 1.10 * bound,
              f"{a['step_s']:.4f} s vs bound {bound:.4f} s (D = {d / 2**20:.0f} MiB, B = {bw['d2h_gbs']:.1f} GB/s)")
    steady = [r.get("new_pinned_allocations_in_timed_steps") for r in by.values()
              if "new_pinned_allocations_in_timed_steps" in r]
    if steady:
        check("zero new pinned allocations after warm-up", all(n == 0 for n in steady), f"{steady}")
    return out
