"""Turn a results JSON into markdown tables (and the issue's target checks)."""

from __future__ import annotations

from typing import Any

GIB = 2**30


def _fmt(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 3) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value / scale:.{digits}f}"


def _gib(row: dict[str, Any], key: str) -> str:
    return _fmt(row, key, GIB, 2)


def row_table(rows: list[dict[str, Any]]) -> list[str]:
    """The per-mode table shared by the synthetic and the families reports."""
    lines = [
        "| mode | step s | × none | × torch | peak alloc GiB | peak reserved GiB | peak × none | offloaded MiB/step "
        "| exposed copy ms/step | pinned GiB | new pinned allocs (timed) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['mode']} | OOM | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['mode']} | {r['step_s']:.4f} | {_fmt(r, 'x_none')} | {_fmt(r, 'x_torch')} | "
            f"{_gib(r, 'peak_allocated')} | {_gib(r, 'peak_reserved')} | {_fmt(r, 'peak_x_none')} | "
            f"{_fmt(r, 'bytes_offloaded_per_step', 2**20, 1)} | {_fmt(r, 'exposed_copy_ms_per_step', 1, 2)} | "
            f"{_gib(r, 'pinned_bytes_held')} | {r.get('new_pinned_allocations_in_timed_steps', '-')} |"
        )
    return lines


def bug_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One ``BUG`` line per checkpointing/offload row whose peak is at or above the ``none`` row's peak
    (issue 5: such a row is a bug to fix, not a number to publish)."""
    none = next((r for r in rows if r["mode"] == "none" and not r.get("oom")), None)
    if none is None or none.get("peak_allocated") is None:
        return []
    out = []
    for r in rows:
        if r["mode"] == "none" or r.get("oom") or r.get("peak_allocated") is None:
            continue
        if r["peak_allocated"] >= none["peak_allocated"]:
            out.append(f"- BUG {r['mode']}: peak {r['peak_allocated'] / GIB:.3f} GiB ≥ none's "
                       f"{none['peak_allocated'] / GIB:.3f} GiB")
    return out


def _header(payload: dict[str, Any], title: str) -> list[str]:
    bw = payload.get("pinned_bandwidth") or {}
    lines = [
        f"# {title} — {payload['device']}, torch {payload['torch']} (CUDA {payload['cuda']}, diffusers "
        f"{payload.get('diffusers')}), {payload['date']}",
        "",
        f"Regime: {payload.get('regime_description', payload.get('regime'))}. SDPA: {payload.get('sdpa_backend')}. "
        f"Median of {payload['steps']} timed steps after {payload['warmup']} warm-up steps; every row of a table "
        f"measured in one process, side by side. Commit: {payload.get('git_commit') or 'n/a'}.",
    ]
    if bw:
        lines.append(f"Pinned bandwidth measured in the same run: D2H {bw.get('d2h_gbs', 0):.1f} GB/s, H2D "
                     f"{bw.get('h2d_gbs', 0):.1f} GB/s, both at once {bw.get('both_gbs', 0):.1f} GB/s.")
    return [*lines, ""]


def render_markdown(payload: dict[str, Any]) -> str:
    """Markdown for a synthetic-sweep payload (one regime, every shape)."""
    bw = payload.get("pinned_bandwidth") or {}
    regime = payload.get("regime")
    title = f"memfit {payload['suite']} sweep" + (f" ({regime})" if regime in ("lora", "frozen", "full") else "")
    lines = _header(payload, title)
    for shape in payload["results"]:
        bugs = bug_lines(shape["rows"])
        lines += [f"## {shape['shape']}", "", *row_table(shape["rows"]), ""]
        if bugs:
            lines += ["Peaks at or above no-checkpointing (bugs, not results):", "", *bugs, ""]
        lines += [*_targets(shape, bw), ""]
    return "\n".join(lines)


def render_family_markdown(payload: dict[str, Any]) -> str:
    """Markdown for one family's payload (``python -m memfit_benchmarks.families``)."""
    lines = _header(payload, f"memfit family {payload['family']} ({payload['preset']})")
    shapes = ", ".join(f"`{k}` {tuple(v)}" for k, v in (payload.get("input_shapes") or {}).items())
    lines += [
        f"Model: {payload.get('preset_description') or payload['preset']}; dtype {payload.get('dtype')}; "
        f"{payload['tokens']} tokens (inputs: {shapes}); batch {payload.get('batch', 1)}.",
        f"LoRA r{payload.get('lora_rank')} on {payload.get('lora_targets_count')} block linears "
        f"({payload.get('trainable_params', 0) / 1e6:.1f} M trainable of {payload.get('total_params', 0) / 1e9:.2f} B).",
        "",
    ]
    if payload.get("error"):
        lines += [f"**Run failed:** `{payload['error']}`", ""]
    rows = payload.get("rows", [])
    if rows:
        lines += [*row_table(rows), ""]
    skipped = payload.get("skipped") or {}
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()) + ".", ""]
    bugs = bug_lines(rows)
    if bugs:
        lines += ["Peaks at or above no-checkpointing (bugs, not results):", "", *bugs, ""]
    lines += [*_family_targets(rows), ""]
    return "\n".join(lines)


def _family_targets(rows: list[dict[str, Any]]) -> list[str]:
    by = {r["mode"]: r for r in rows if not r.get("oom")}
    out = ["Targets (issue 5):", ""]
    if "unsloth" in by and "torch" in by:
        ratio = by["unsloth"]["step_s"] / by["torch"]["step_s"]
        out.append(f"- {'PASS' if ratio <= 1.02 else 'FAIL'} unsloth ≤ 1.02× torch step time: {ratio:.3f}×")
    if "unsloth-ffn" in by and "torch-ffn" in by:
        ratio = by["unsloth-ffn"]["step_s"] / by["torch-ffn"]["step_s"]
        out.append(f"- {'PASS' if ratio <= 1.03 else 'FAIL'} unsloth-ffn ≤ 1.03× torch-ffn step time: {ratio:.3f}×")
    t, n = by.get("torch-ffn", {}).get("peak_allocated"), by.get("none", {}).get("peak_allocated")
    if t is not None and n is not None:
        out.append(f"- {'PASS' if t < n else 'FAIL'} torch-ffn peak below none's: {t / GIB:.3f} vs {n / GIB:.3f} GiB")
    return out if len(out) > 2 else []


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
        if u.get("peak_allocated") is None or t.get("peak_allocated") is None:
            return out
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
