"""Turn a results JSON into markdown tables (and the issue's target checks)."""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit_benchmarks.rounds import step_ratio

GIB = 2**30
# Issues 3 and 5: (mode, reference, limit): mode's step ≤ limit × the reference's
STEP_TARGETS = (("unsloth", "torch", 1.02), ("unsloth-ffn", "torch-ffn", 1.03))


def run_stamp(suite: str, device: str) -> dict[str, Any]:
    """The fields a results file of the smaller scripts starts with: suite, UTC date, device, torch, commit."""
    return {
        "suite": suite,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": device,
        "torch": torch.__version__,
        "git_commit": os.environ.get("MEMFIT_GIT_COMMIT"),
    }


def write_results(out: Path, payload: dict[str, Any], render: Callable[[dict[str, Any]], str]) -> Path:
    """``<suite>-<date>.json`` and its ``.md`` under ``out`` (the markdown printed too); returns the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{payload['suite']}-{payload['date'][:10]}.json"
    path.write_text(json.dumps(payload, indent=1))
    markdown = render(payload)
    path.with_suffix(".md").write_text(markdown)
    print(markdown, flush=True)
    return path


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
            lines.append(f"| {r['mode']} | {_oom(r)} | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['mode']} | {r['step_s']:.4f} | {_fmt(r, 'x_none')} | {_fmt(r, 'x_torch')} | "
            f"{_gib(r, 'peak_allocated')} | {_gib(r, 'peak_reserved')} | {_fmt(r, 'peak_x_none')} | "
            f"{_fmt(r, 'bytes_offloaded_per_step', 2**20, 1)} | {_fmt(r, 'exposed_copy_ms_per_step', 1, 2)} | "
            f"{_gib(r, 'pinned_bytes_held')} | {r.get('new_pinned_allocations_in_timed_steps', '-')} |"
        )
    return lines


def bug_lines(rows: list[dict[str, Any]], *, optimizer_in_step: bool = False) -> list[str]:
    """One ``BUG`` line per checkpointing/offload row whose peak is at or above the ``none`` row's peak
    (issue 5: such a row is a bug to fix, not a number to publish)."""
    none = next((r for r in rows if r["mode"] == "none" and not r.get("oom")), None)
    if none is None or none.get("peak_allocated") is None:
        return []
    # With an optimizer step in the timed step (full regime) the step's peak can be the optimizer's, after
    # backward freed every activation: checkpointing cannot lower that one. Judge the forward+backward peak
    # where it was measured; older results without it get a NOTE instead of a verdict.
    key = (
        "peak_allocated_before_optimizer" if none.get("peak_allocated_before_optimizer") else "peak_allocated"
    )
    out = []
    for r in rows:
        if r["mode"] == "none" or r.get("oom") or r.get(key) is None:
            continue
        if r[key] >= none[key]:
            label = "NOTE" if optimizer_in_step and key == "peak_allocated" else "BUG"
            out.append(
                f"- {label} {r['mode']}: peak {r[key] / GIB:.3f} GiB ≥ none's {none[key] / GIB:.3f} GiB"
                + (
                    " (the AdamW step's peak; this run predates the forward+backward peak)"
                    if label == "NOTE"
                    else ""
                )
            )
    return out


def _header(payload: dict[str, Any], title: str) -> list[str]:
    bw = payload.get("pinned_bandwidth") or {}
    lines = [
        f"# {title} — {payload['device']}, torch {payload['torch']} (CUDA {payload['cuda']}, diffusers "
        f"{payload.get('diffusers')}), {payload['date']}",
        "",
        f"Regime: {payload.get('regime_description', payload.get('regime'))}. SDPA: {payload.get('sdpa_backend')}. "
        f"Median of {payload['steps']} timed steps after {payload['warmup']} warm-up steps"
        + (
            f", each mode measured in {payload['rounds']} round-robin rounds (the median round's step reported; the "
            "table's × columns divide median rounds; a target's ratio is the median over rounds of the per-round "
            "ratio, round k of one mode / round k of the other, both measured in the same round, so that a slow "
            "drift of the machine cancels)"
            if payload.get("rounds", 1) > 1
            else ""
        )
        + f"; every row of a table measured in one process, side by side. Commit: {payload.get('git_commit') or 'n/a'}.",
    ]
    if bw:
        lines.append(
            f"Pinned bandwidth measured in the same run: D2H {bw.get('d2h_gbs', 0):.1f} GB/s, H2D "
            f"{bw.get('h2d_gbs', 0):.1f} GB/s, both at once {bw.get('both_gbs', 0):.1f} GB/s."
        )
    return [*lines, ""]


def render_markdown(payload: dict[str, Any]) -> str:
    """Markdown for a synthetic-sweep payload (one regime, every shape)."""
    bw = payload.get("pinned_bandwidth") or {}
    regime = payload.get("regime")
    title = f"memfit {payload['suite']} sweep" + (
        f" ({regime})" if regime in ("lora", "frozen", "full") else ""
    )
    lines = _header(payload, title)
    for shape in payload["results"]:
        bugs = bug_lines(shape["rows"], optimizer_in_step=payload.get("regime") == "full")
        lines += [f"## {shape['shape']}", "", *row_table(shape["rows"]), ""]
        if bugs:
            what = "bugs, not results" if any(b.startswith("- BUG") for b in bugs) else "see the notes"
            lines += [f"Peaks at or above no-checkpointing ({what}):", "", *bugs, ""]
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


def step_check(by: dict[str, dict[str, Any]], mode: str, ref: str, limit: float) -> list[str]:
    """The check of ``mode``'s step ≤ ``limit`` × ``ref``'s among the measured rows ``by`` mode, as one line (none
    if either is missing): the paired ratio where both were measured in the same rounds (``rounds.step_ratio``)."""
    if mode not in by or ref not in by:
        return []
    ratio, detail = step_ratio(by[mode], by[ref])
    return [f"- {'PASS' if ratio <= limit else 'FAIL'} {mode} ≤ {limit:.2f}× {ref} step time: {detail}"]


def _family_targets(rows: list[dict[str, Any]]) -> list[str]:
    by = {r["mode"]: r for r in rows if not r.get("oom")}
    out = ["Targets (issue 5):", ""]
    for target in STEP_TARGETS:
        out += step_check(by, *target)
    t, n = by.get("torch-ffn", {}).get("peak_allocated"), by.get("none", {}).get("peak_allocated")
    if t is not None and n is not None:
        out.append(
            f"- {'PASS' if t < n else 'FAIL'} torch-ffn peak below none's: {t / GIB:.3f} vs {n / GIB:.3f} GiB"
        )
    return out if len(out) > 2 else []


def _targets(shape: dict[str, Any], bw: dict[str, float]) -> list[str]:
    by = {r["mode"]: r for r in shape["rows"] if not r.get("oom")}
    out = ["Targets (issue 3):", ""]

    def check(label: str, ok: bool, detail: str) -> None:
        out.append(f"- {'PASS' if ok else 'FAIL'} {label}: {detail}")

    if "unsloth" in by and "torch" in by:
        u, t = by["unsloth"], by["torch"]
        out += step_check(by, *STEP_TARGETS[0])
        parked = u.get("bytes_offloaded_per_step", 0)
        if u.get("peak_allocated") is not None and t.get("peak_allocated") is not None:
            limit = t["peak_allocated"] - 0.9 * parked
            check(
                "unsloth peak ≤ torch peak − 0.9 × offloaded inputs",
                u["peak_allocated"] <= limit,
                f"{u['peak_allocated'] / GIB:.3f} GiB vs limit {limit / GIB:.3f} GiB (offloaded "
                f"{parked / 2**20:.0f} MiB)",
            )
    out += step_check(by, *STEP_TARGETS[1])
    if "offload_attention" in by and "none" in by and bw.get("d2h_gbs"):
        a = by["offload_attention"]
        d = a.get("bytes_offloaded_per_step", 0)
        bound = max(by["none"]["step_s"], d / (bw["d2h_gbs"] * 1e9))
        check(
            "offload_attention ≤ 1.10 × max(none, D/B)",
            a["step_s"] <= 1.10 * bound,
            f"{a['step_s']:.4f} s vs bound {bound:.4f} s (D = {d / 2**20:.0f} MiB, B = {bw['d2h_gbs']:.1f} GB/s)",
        )
    steady = [
        r.get("new_pinned_allocations_in_timed_steps")
        for r in by.values()
        if "new_pinned_allocations_in_timed_steps" in r
    ]
    if steady:
        check("zero new pinned allocations after warm-up", all(n == 0 for n in steady), f"{steady}")
    return out


AUTO_NOISE = 0.02  # step-time noise allowed before auto counts as slower than a fixed mode
AUTO_FASTER = 1.10  # "at least 10% faster": fixed step / auto step


def fmt_bytes(n: float | None) -> str:
    """``n`` bytes in GiB (3 decimals) from 1 GiB up, else in MiB."""
    if n is None:
        return "n/a"
    return f"{n / GIB:.3f} GiB" if abs(n) >= GIB else f"{n / 2**20:.3f} MiB"


def auto_unit(payload: dict[str, Any]) -> tuple[float, str]:
    return (GIB, "GiB") if payload.get("memory_metric") == "peak_allocated" else (2**20, "MiB")


def _at(row: dict[str, Any]) -> str:
    return fmt_bytes(row["budget_bytes"])


def auto_checks(rows: list[dict[str, Any]], noise: float = AUTO_NOISE) -> list[tuple[str, bool, str]]:
    """Issue 6's three criteria over the ``auto`` rows of one target, then whether auto reaches every budget a
    fixed mode fits (the budgets start at the smallest fixed-mode peak): (label, passed, detail) each."""
    ran = [r for r in rows if not r.get("unreachable")]
    compared = [r for r in ran if r.get("best_fixed") is not None]
    timed = [r for r in compared if "speedup" in r]
    worst = min(timed, key=lambda r: r["speedup"], default=None)
    best = max(timed, key=lambda r: r["speedup"], default=None)
    oom = [r for r in compared if r.get("oom")]
    slow = [r for r in timed if r["speedup"] < 1 / (1 + noise)]
    never_slower = (
        f"worst fixed/auto {worst['speedup']:.3f}× at {_at(worst)} vs {worst['best_fixed']['mode']}"
        + _pairs(worst)
        if worst
        else "no auto row timed"
    ) + "".join(f"; OOM at {_at(r)}" for r in oom)
    over = [r for r in ran if not r.get("within_budget")]
    unreachable = [r for r in rows if r.get("unreachable") and r.get("best_fixed") is not None]
    return [
        (
            f"auto never slower than the fastest fixed mode that fits (tolerance {noise:.0%}: auto step ≤ "
            f"{1 + noise:.2f} × fixed step)",
            bool(timed) and not oom and not slow,
            never_slower,
        ),
        (
            f"auto ≥ {AUTO_FASTER - 1:.0%} faster at some budget (fixed step / auto step ≥ {AUTO_FASTER:.2f})",
            best is not None and best["speedup"] >= AUTO_FASTER,
            f"best {best['speedup']:.3f}× at {_at(best)} vs {best['best_fixed']['mode']}" if best else "-",
        ),
        (
            "auto's peak within its budget at every budget it ran (timed steps)",
            bool(ran) and not over,
            f"{len(ran) - len(over)}/{len(ran)} within"
            + "".join(f"; {'OOM' if r.get('oom') else _over(r)} at {_at(r)}" for r in over),
        ),
        (
            "auto reaches every budget where a fixed mode fits",
            not unreachable,
            "; ".join(
                f"unreachable at {_at(r)} (planner's smallest {fmt_bytes(r.get('smallest_peak_bytes'))}) where "
                f"{r['best_fixed']['mode']} fits"
                for r in unreachable
            )
            or "all reached",
        ),
    ]


def _pairs(row: dict[str, Any]) -> str:
    """The alternated runs behind a row's speedup (with ``--pairs`` > 1): how far apart they were says how much
    of a miss is noise."""
    auto, fixed = row.get("step_s_pairs"), row["best_fixed"].get("step_s_pairs")
    if not auto or not fixed or len(auto) < 2:
        return ""
    runs = lambda steps: ", ".join(f"{s:.4f}" for s in steps)  # noqa: E731
    return f" (runs alternated: auto {runs(auto)} s, fixed {runs(fixed)} s)"


def _over(row: dict[str, Any]) -> str:
    memory = row.get("memory_bytes")
    return "no memory figure" if memory is None else f"{fmt_bytes(memory - row['budget_bytes'])} over"


def auto_table(payload: dict[str, Any]) -> list[str]:
    scale, unit = auto_unit(payload)
    cuda = payload.get("memory_metric") == "peak_allocated"
    mem = "peak" if cuda else "held"

    def b(value: Any) -> str:
        return "-" if value is None else f"{value / scale:.3f}"

    columns = [
        f"budget {unit}",
        "fastest fixed mode that fits",
        "its step s",
        "auto step s",
        "speedup",
        f"auto {mem} {unit}",
        "within budget",
        "plan counts",
        f"predicted peak {unit}",
        f"warm-up peak {unit}",
        "predicted extra ms",
        "exposed copy ms",
        "allocator retries",
        "new segments",
        "planned at GB/s",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]

    def short(head: str, cell: str) -> str:  # a row with one cell after the head's three, the rest empty
        return head + f"| {cell} |" + " |" * (len(columns) - 4)

    gaps = set(payload.get("gap_budgets") or ())
    for r in payload.get("auto_rows", []):
        fixed = r.get("best_fixed") or {}
        floor = (
            " (planner's smallest)"
            if r.get("planner_floor")
            else " (gap)"
            if r["budget_bytes"] in gaps
            else ""
        )
        step = _fmt(fixed, "step_s", digits=4)
        if "step_s_adjacent" in fixed:  # measured again right after auto (compared), first measurement after
            step = f"{fixed['step_s_adjacent']:.4f} ({step})"
        head = f"| {b(r['budget_bytes'])}{floor} | {fixed.get('mode', '-')} | {step} "
        if r.get("unreachable"):
            lines.append(short(head, f"unreachable (smallest {b(r.get('smallest_peak_bytes'))})"))
            continue
        if r.get("oom"):
            lines.append(short(head, _oom(r)))
            continue
        plan = r.get("plan") or {}
        extra = plan.get("predicted_extra_seconds")
        counts = ", ".join(f"{k} {v}" for k, v in (r.get("plan_counts") or {}).items()) or "-"
        lines.append(
            head + f"| {r['step_s']:.4f} | {_fmt(r, 'speedup')} | {b(r.get('memory_bytes'))} | "
            f"{'yes' if r.get('within_budget') else 'NO'} | {counts} | "
            f"{b(plan.get('predicted_peak_bytes'))} | {b(r.get('peak_allocated_warmup'))} | "
            f"{'-' if extra is None else f'{extra * 1e3:.1f}'} | "
            f"{_fmt(r, 'exposed_copy_ms_per_step', 1, 1)} | {r.get('alloc_retries_in_timed_steps', '-')} | "
            f"{_fmt(r, 'segments_allocated_in_timed_steps', digits=0)} | "
            f"{_fmt(r.get('profile') or {}, 'copy_bytes_per_second', 1e9, 1)} |"
        )  # the probe's rate
    return lines


def render_auto_markdown(payload: dict[str, Any]) -> str:
    """Markdown for one target of ``python -m memfit_benchmarks.auto_sweep``."""
    scale, unit = auto_unit(payload)
    lines = _header(payload, f"memfit auto planner sweep: {payload['target']} ({payload['preset']})")
    lines += [
        f"Model: {payload.get('description')}; dtype {payload.get('dtype')}; {payload.get('tokens')} tokens; "
        f"batch {payload.get('batch', 1)}; {payload.get('trainable_params', 0) / 1e6:.1f} M trainable of "
        f"{payload.get('total_params', 0) / 1e9:.2f} B parameters.",
        "",
    ]
    if payload.get("memory_metric") != "peak_allocated":
        lines += [
            "Not on CUDA: memory is the activation bytes autograd holds (no peak to read), and the timings "
            "only show that the sweep runs.",
            "",
        ]
    if payload.get("error"):
        lines += [f"**Run failed:** `{payload['error']}`", ""]
    elif payload.get("complete") is False:
        lines += ["**Incomplete:** the run stopped before every budget was measured.", ""]
    if "budgets" in payload:
        gap_set = set(payload.get("gap_budgets") or ())
        gaps, spread = len(gap_set), len([b for b in payload["budgets"] if b not in gap_set])
        lines += [
            f"{spread} budgets evenly spaced from {payload['low_bytes'] / scale:.3f} {unit} "
            f"(smallest fixed-mode figure, `{payload['low_mode']}`, included) to "
            f"{payload['high_bytes'] / scale:.3f} {unit} ({payload['high_source']}, excluded)"
            + (
                f", and {gaps} *gap* budgets, each 1% below a step of the fixed modes' frontier (where a fixed "
                "mode no longer fits and the next slower one must be used)"
                if gaps
                else ""
            )
            + ". `speedup` = "
            "fixed step / auto step, the fixed mode measured again right after the auto row where the run did "
            "(its first measurement in brackets); the warm-up peak includes the planning (profiling) forward. When the "
            "planner refuses a budget, one more row runs at the smallest peak it reported (if below the high "
            "end).",
            "",
        ]
    if payload.get("auto_rows"):
        lines += ["## auto at each budget", "", *auto_table(payload), ""]
        checks = auto_checks(payload["auto_rows"], payload.get("noise_tolerance", AUTO_NOISE))
        lines += [
            "Checks (issue 6's three, then reachability):",
            "",
            *(f"- {'PASS' if ok else 'FAIL'} {label}: {detail}" for label, ok, detail in checks),
            "",
        ]
    if payload.get("fixed_rows"):
        lines += ["## Fixed modes (same process, same model)", "", *row_table(payload["fixed_rows"]), ""]
    held = [r for r in payload.get("fixed_rows", []) if r.get("held_bytes") is not None]
    if held:
        lines += [
            "Held activation bytes: "
            + "; ".join(f"{r['mode']} {fmt_bytes(r['held_bytes'])}" for r in held)
            + ".",
            "",
        ]
    skipped = payload.get("skipped") or {}
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()) + ".", ""]
    return "\n".join(lines)


def _oom(row: dict) -> str:
    """The cell of a row that did not fit: on the GPU, or in host RAM (the offload pool)."""
    return "OOM (host RAM)" if row.get("oom_where") == "host" else "OOM"
