"""Markdown for one ``auto`` planner sweep target: its table per budget and its checks."""

from __future__ import annotations

from typing import Any

from memfit_benchmarks.report import GIB, fmt, header, oom_cell, row_table

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
    """The planner's three criteria over the ``auto`` rows of one target (never slower than the fastest fixed mode
    that fits, clearly faster somewhere, within its budget), then whether auto reaches every budget a fixed mode fits (the budgets start at the smallest fixed-mode peak): (label, passed, detail) each."""
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
        step = fmt(fixed, "step_s", digits=4)
        if "step_s_adjacent" in fixed:  # measured again right after auto (compared), first measurement after
            step = f"{fixed['step_s_adjacent']:.4f} ({step})"
        head = f"| {b(r['budget_bytes'])}{floor} | {fixed.get('mode', '-')} | {step} "
        if r.get("unreachable"):
            lines.append(short(head, f"unreachable (smallest {b(r.get('smallest_peak_bytes'))})"))
            continue
        if r.get("oom"):
            lines.append(short(head, oom_cell(r)))
            continue
        plan = r.get("plan") or {}
        extra = plan.get("predicted_extra_seconds")
        counts = ", ".join(f"{k} {v}" for k, v in (r.get("plan_counts") or {}).items()) or "-"
        lines.append(
            head + f"| {r['step_s']:.4f} | {fmt(r, 'speedup')} | {b(r.get('memory_bytes'))} | "
            f"{'yes' if r.get('within_budget') else 'NO'} | {counts} | "
            f"{b(plan.get('predicted_peak_bytes'))} | {b(r.get('peak_allocated_warmup'))} | "
            f"{'-' if extra is None else f'{extra * 1e3:.1f}'} | "
            f"{fmt(r, 'exposed_copy_ms_per_step', 1, 1)} | {r.get('alloc_retries_in_timed_steps', '-')} | "
            f"{fmt(r, 'segments_allocated_in_timed_steps', digits=0)} | "
            f"{fmt(r.get('profile') or {}, 'copy_bytes_per_second', 1e9, 1)} |"
        )  # the probe's rate
    return lines


def render_auto_markdown(payload: dict[str, Any]) -> str:
    """Markdown for one target of ``python -m memfit_benchmarks.auto_sweep``."""
    scale, unit = auto_unit(payload)
    lines = header(payload, f"memfit auto planner sweep: {payload['target']} ({payload['preset']})")
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
            "Checks (the planner's three, then reachability):",
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
