"""Markdown for a synthetic or a families results file: per training config and shape, the rows and the checks.

The checks: every memfit mode against its peer (``x_peer``, paired by round; a mode whose step must not exceed its
peer's has a limit in :data:`PEER_LIMITS`, and at :data:`SHORT_SEQUENCE_TOKENS` tokens or fewer every mode
must be at least as fast), with the same or a lower peak; ``offload_attention`` within 1.10 × max(its ``none``
step, the bytes it parks per step / the pinned bandwidth measured in the run); the offload modes against memfit's
own checkpointing; no new pinned allocations after warm-up; no peak at or above no checkpointing's. And the floor
under each peak: what was allocated when the step began plus the gradients alive when backward ended.
"""

from __future__ import annotations

from typing import Any

from memfit_benchmarks.modes import PEER_DESCRIPTIONS, Peer
from memfit_benchmarks.results import entries
from memfit_benchmarks.rounds import (
    FAILED,
    NOT_MEASURED,
    inside_spread,
    measured,
    per_round_ratios,
    step_ratio,
)

GIB = 2**30
MIB = 2**20
# memfit mode -> its step may be at most this × its peer's (paired)
PEER_LIMITS = {"torch": 1.00, "torch-ffn": 1.00, "unsloth": 1.01, "unsloth-ffn": 1.02}
# At this many tokens or fewer the step is launch-bound: every memfit mode must be at least as fast as its peer.
SHORT_SEQUENCE_TOKENS = 1024
ATTENTION_OFFLOAD_SLACK = 1.10  # offload_attention's step ≤ this × max(none's step, parked bytes / bandwidth)
# Offload against memfit's own checkpointing: (mode, reference, limit), mode's step ≤ limit × the reference's
STEP_TARGETS = (("unsloth", "torch", 1.02), ("unsloth-ffn", "torch-ffn", 1.03))


def fmt(row: dict[str, Any], key: str, scale: float = 1.0, digits: int = 3) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value / scale:.{digits}f}"


def region_counts(row: dict[str, Any], peer_row: dict[str, Any] | None) -> tuple[float, float] | None:
    """(memfit's, the peer's) regions checkpointed per step where both are known and differ (a model may route only
    some of its blocks through its own checkpointing: the two rows then do different work); None otherwise."""
    ours = row.get("frames_per_step")
    theirs = (peer_row or {}).get("checkpointed_calls_per_step")
    if ours is None or theirs is None or ours == theirs:
        return None
    return ours, theirs


def oom_cell(row: dict[str, Any]) -> str:
    """The cell of a row that did not run: out of memory (GPU or host RAM), or not measured."""
    if row.get(NOT_MEASURED):
        return f"not measured ({row[NOT_MEASURED]})"
    if row.get(FAILED):
        return f"failed ({row[FAILED]})"
    return "OOM (host RAM)" if row.get("oom_where") == "host" else "OOM"


def row_table(rows: list[dict[str, Any]]) -> list[str]:
    """The per-mode table shared by every report."""
    columns = [
        "mode",
        "step s",
        "× peer",
        "× none",
        "× torch",
        "peak alloc GiB",
        "peak × peer",
        "floor GiB",
        "offloaded MiB/step",
        "exposed copy ms/step",
        "pinned GiB",
        "new pinned allocs (timed)",
    ]
    lines = ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in rows:
        if not measured(r):
            lines.append(f"| {r['mode']} | {oom_cell(r)} |" + " |" * (len(columns) - 2))
            continue
        vs = ""
        if r.get("peer_oom") or r.get("peer_failed"):
            vs = f"{r['vs_peer']} {'OOM' if r.get('peer_oom') else 'failed'}"
        elif r.get("vs_peer"):
            vs = f"{r['x_peer']:.3f} ({r['vs_peer']})"
        lines.append(
            f"| {r['mode']} | {r['step_s']:.4f} | {vs or '-'} | {fmt(r, 'x_none')} | {fmt(r, 'x_torch')} | "
            f"{fmt(r, 'peak_allocated', GIB, 2)} | {fmt(r, 'peak_x_peer')} | {fmt(r, 'peak_floor_bytes', GIB, 2)} | "
            f"{fmt(r, 'bytes_offloaded_per_step', MIB, 1)} | {fmt(r, 'exposed_copy_ms_per_step', 1, 2)} | "
            f"{fmt(r, 'pinned_bytes_held', GIB, 2)} | {r.get('new_pinned_allocations_in_timed_steps', '-')} |"
        )
    return lines


def bug_lines(rows: list[dict[str, Any]], *, optimizer_in_step: bool = False) -> list[str]:
    """One ``BUG`` line per checkpointing/offload row whose peak is at or above the ``none`` row's peak (such a
    row is a bug to fix, not a number to publish)."""
    none = next((r for r in rows if r["mode"] == "none" and measured(r)), None)
    if none is None or none.get("peak_allocated") is None:
        return []
    # With an optimizer step in the timed step (full config) the step's peak can be the optimizer's, after
    # backward freed every activation: checkpointing cannot lower that one. Judge the forward+backward peak
    # where it was measured; older results without it get a NOTE instead of a verdict.
    key = (
        "peak_allocated_before_optimizer" if none.get("peak_allocated_before_optimizer") else "peak_allocated"
    )
    out = []
    for r in rows:
        if r["mode"] == "none" or r.get("peer") or not measured(r) or r.get(key) is None:
            continue
        if r[key] >= none[key]:
            label = "NOTE" if optimizer_in_step and key == "peak_allocated" else "BUG"
            note = (
                " (the AdamW step's peak; this run predates the forward+backward peak)"
                if label == "NOTE"
                else ""
            )
            out.append(
                f"- {label} {r['mode']}: peak {r[key] / GIB:.3f} GiB ≥ none's {none[key] / GIB:.3f} GiB{note}"
            )
    return out


def header(payload: dict[str, Any], title: str) -> list[str]:
    """Title, environment, timing method and the measured pinned bandwidth."""
    bw = payload.get("pinned_bandwidth") or {}
    rounds = payload.get("rounds") or 1
    single = not entries(payload)  # an auto target: one model, one training config, one steps setting
    lines = [
        f"# {title} — {payload['device']}, torch {payload['torch']} (CUDA {payload.get('cuda')}, diffusers "
        f"{payload.get('diffusers')}), {payload['date']}",
        "",
        f"SDPA: {payload.get('sdpa_backend')}. Commit: {payload.get('git_commit') or 'n/a'}."
        + (
            f" Median of {payload['steps']} timed steps after {payload['warmup']} warm-up steps."
            if single and "steps" in payload
            else ""
        )
        + (
            f" Each mode measured in {rounds} round-robin rounds (the median round's step reported; a target's "
            "ratio is the median over rounds of the per-round ratio, round k of one mode / round k of the other, "
            "both measured in the same round, so that a slow drift of the machine cancels)."
            if rounds > 1
            else ""
        )
        + " Every row of a table measured in one process, side by side.",
    ]
    training = payload.get("config_description") or payload.get("regime_description")
    if single and training:
        lines.append(f"Training: {training}.")
    if payload.get("complete") is False:
        lines += ["", "**Incomplete:** the run stopped before every entry was measured."]
    if bw:
        lines.append(
            f"Pinned bandwidth measured in the same run: D2H {bw.get('d2h_gbs', 0):.1f} GB/s, H2D "
            f"{bw.get('h2d_gbs', 0):.1f} GB/s, both at once {bw.get('both_gbs', 0):.1f} GB/s."
        )
    return [*lines, ""]


def peer_limit(mode: str, tokens: int | None) -> float | None:
    """The most ``mode``'s step may be × its peer's (None: no target, the ratio is shown)."""
    if tokens is not None and tokens <= SHORT_SEQUENCE_TOKENS:
        return 1.00
    return PEER_LIMITS.get(mode)


def step_check(by: dict[str, dict[str, Any]], mode: str, ref: str, limit: float | None) -> list[str]:
    """The check of ``mode``'s step ≤ ``limit`` × ``ref``'s among the measured rows ``by`` mode, as one line (none
    if either is missing): the paired ratio where both were measured in the same rounds (``rounds.step_ratio``).
    A failure whose per-round ratios straddle the limit says so (``rounds.inside_spread``): the check still fails,
    and the line shows that the difference is inside the run's own round-to-round spread. Without a limit the
    ratio is shown as ``INFO``."""
    if mode not in by or ref not in by:
        return []
    ratio, detail = step_ratio(by[mode], by[ref])
    if limit is None:
        return [f"- INFO {mode} / {ref} step time: {detail}"]
    line = f"- {'PASS' if ratio <= limit else 'FAIL'} {mode} ≤ {limit:.2f}× {ref} step time: {detail}"
    rounds = per_round_ratios(by[mode], by[ref])
    if ratio > limit and inside_spread(rounds, limit):
        line += (
            f"; a tie within this run's spread (rounds {min(rounds):.3f}–{max(rounds):.3f} straddle "
            f"{limit:.2f})"
        )
    return [line]


def peer_checks(rows: list[dict[str, Any]], tokens: int | None) -> list[str]:
    """Each memfit row against its peer: step time (within its limit) and peak (the same or lower)."""
    by = {r["mode"]: r for r in rows if measured(r)}
    out = []
    for r in rows:
        peer = r.get("vs_peer")
        if not peer or not measured(r):
            continue
        if r.get("peer_oom"):
            out.append(f"- PASS {r['mode']} fits where {peer} runs out of memory")
            continue
        if r.get("peer_failed"):
            out.append(f"- INFO {peer} failed on this model ({r['peer_failed']}): no comparison")
            continue
        out += step_check(by, r["mode"], peer, peer_limit(r["mode"], tokens))
        mine, theirs = r.get("peak_allocated"), by[peer].get("peak_allocated")
        if mine is None or theirs is None:
            continue
        if peer == Peer.SAVE_ON_CPU.value:  # a different trade, not a replacement: no promise on the peak
            out.append(
                f"- INFO {r['mode']}'s peak is not a promise against {peer}'s ({r['mode']} parks attention's "
                f"saved tensors only, {peer} every one): {mine / GIB:.3f} vs {theirs / GIB:.3f} GiB"
            )
            continue
        out.append(
            f"- {'PASS' if mine <= theirs else 'FAIL'} {r['mode']} peak ≤ {peer}'s: {mine / GIB:.3f} vs "
            f"{theirs / GIB:.3f} GiB"
        )
    return out


def attention_offload_bound_s(none_step_s: float, parked_bytes: float, d2h_gbs: float) -> float:
    """``offload_attention``'s bound: max(no checkpointing's step, bytes parked per step / D2H bandwidth)."""
    return max(none_step_s, parked_bytes / (d2h_gbs * 1e9))


def pair_limit(mode: str, ref: str, tokens: int | None) -> float | None:
    """The most ``mode``'s step may be × ``ref``'s: a memfit mode against its peer (:func:`peer_limit`),
    ``offload_attention`` against ``none`` on its bound (:data:`ATTENTION_OFFLOAD_SLACK`); None for any other pair."""
    if ref in {p.value for p in Peer}:
        return peer_limit(mode, tokens)
    if mode == "offload_attention" and ref == "none":
        return ATTENTION_OFFLOAD_SLACK
    return None


def attention_offload_check(by: dict[str, dict[str, Any]], bw: dict[str, float]) -> list[str]:
    """``offload_attention``'s step ≤ 1.10 × max(none's step, bytes parked per step / measured D2H bandwidth)."""
    if "offload_attention" not in by or "none" not in by or not bw.get("d2h_gbs"):
        return []
    a = by["offload_attention"]
    parked = a.get("bytes_offloaded_per_step", 0)
    bound = attention_offload_bound_s(by["none"]["step_s"], parked, bw["d2h_gbs"])
    ok = a["step_s"] <= ATTENTION_OFFLOAD_SLACK * bound
    return [
        f"- {'PASS' if ok else 'FAIL'} offload_attention ≤ {ATTENTION_OFFLOAD_SLACK:.2f} × max(none, D/B): "
        f"{a['step_s']:.4f} s vs bound {bound:.4f} s (D = {parked / MIB:.0f} MiB parked per step, B = "
        f"{bw['d2h_gbs']:.1f} GB/s D2H measured in this run)"
    ]


def floor_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Each memfit row's peak over its floor: allocated when the step began (weights, inputs, optimizer state)
    plus the gradients alive when backward ended (LoRA's, under LoRA). No plan can go below it."""
    out = []
    for r in rows:
        if (
            not measured(r)
            or r.get("peer")
            or r.get("peak_floor_bytes") is None
            or r.get("peak_allocated") is None
        ):
            continue
        floor = r["peak_floor_bytes"]
        out.append(
            f"- {r['mode']}: peak {r['peak_allocated'] / GIB:.3f} GiB, floor {floor / GIB:.3f} GiB (allocated at "
            f"step start {r['resident_bytes_at_step_start'] / GIB:.3f} GiB + gradients {r['grad_bytes'] / MIB:.1f} "
            f"MiB), {(r['peak_allocated'] - floor) / MIB:.0f} MiB above it"
        )
    return out


def entry_checks(entry: dict[str, Any], bw: dict[str, float]) -> list[str]:
    rows = entry.get("rows", [])
    by = {r["mode"]: r for r in rows if measured(r)}
    lines = peer_checks(rows, entry.get("tokens")) + attention_offload_check(by, bw)
    for mode, ref, limit in STEP_TARGETS:
        lines += step_check(by, mode, ref, limit)
    steady = [
        r.get("new_pinned_allocations_in_timed_steps")
        for r in by.values()
        if "new_pinned_allocations_in_timed_steps" in r
    ]
    if steady:
        lines.append(
            f"- {'PASS' if all(n == 0 for n in steady) else 'FAIL'} zero new pinned allocations after warm-up: {steady}"
        )
    out = ["Checks:", "", *lines, ""] if lines else []
    floors = floor_lines(rows)
    if floors:
        out += ["Peak floor (no plan's peak can be below it):", "", *floors, ""]
    return out


def timing_sentence(entry: dict[str, Any]) -> str:
    """How each measurement of ``entry`` was timed: its warm-up and timed steps, and with a minimum timed duration
    (``min_seconds``) how many timed steps the measurements took."""
    steps, warmup, least = entry["steps"], entry.get("warmup"), entry.get("min_seconds") or 0
    if not least:
        return f"Median of {steps} timed steps after {warmup} warm-up steps."
    counts = [
        n
        for r in entry.get("rows", [])
        for n in (r.get("timed_steps_rounds") or [r.get("timed_steps")])
        if n is not None
    ]
    taken = ""
    if counts:
        taken = (
            f"; {min(counts)}–{max(counts)} taken" if min(counts) != max(counts) else f"; {counts[0]} taken"
        )
    return (
        f"Median of the timed steps after {warmup} warm-up steps: at least {steps} and at least {least:g} s of "
        f"them{taken}."
    )


def _entry_section(entry: dict[str, Any], bw: dict[str, float], optimizer_in_step: bool) -> list[str]:
    lines = [f"## {entry.get('config')} — {entry.get('label')}", ""]
    what = [f"Training: {entry.get('config_description') or entry.get('config')}."]
    if entry.get("lora_targets_count"):
        what.append(
            f"LoRA on {entry['lora_targets_count']} linears ({entry.get('trainable_params', 0) / 1e6:.1f} M trainable of "
            f"{entry.get('total_params', 0) / 1e9:.2f} B)."
        )
    if entry.get("steps") is not None:
        what.append(timing_sentence(entry))
    lines += [" ".join(what), ""]
    for problem in ("error", "cut"):
        if entry.get(problem):
            lines += [f"**Not measured:** {entry[problem]}", ""]
    if entry.get("no_peer"):
        lines += [
            "**Not measured:** no peer to compare memfit with (" + ", ".join(entry["no_peer"]) + ").",
            "",
        ]
    rows = entry.get("rows", [])
    if rows:
        lines += [*row_table(rows), ""]
    skipped = entry.get("skipped") or {}
    if skipped:
        lines += ["Skipped: " + "; ".join(f"{m} ({why})" for m, why in skipped.items()) + ".", ""]
    bugs = bug_lines(rows, optimizer_in_step=optimizer_in_step)
    if bugs:
        what = "bugs, not results" if any(b.startswith("- BUG") for b in bugs) else "see the notes"
        lines += [f"Peaks at or above no-checkpointing ({what}):", "", *bugs, ""]
    return lines + entry_checks(entry, bw)


def peer_legend(payload: dict[str, Any]) -> list[str]:
    """What each peer that ran is, and what ``× peer`` means."""
    ran = {r["mode"] for e in entries(payload) for r in e.get("rows", [])}
    peers = [p for p in Peer if p.value in ran]
    if not peers:
        return []
    return [
        "Peers: "
        + "; ".join(f"`{p.value}` = {PEER_DESCRIPTIONS[p]}" for p in peers)
        + ". `× peer`: a memfit "
        "row's step over its peer's (paired by round where both ran in the same rounds); `floor`: allocated at "
        "step start + gradients alive at the end of backward.",
        "",
    ]


def render_markdown(payload: dict[str, Any]) -> str:
    """Markdown for a synthetic or a families payload (every training config, every shape)."""
    if payload.get("suite") == "families":
        lines = header(payload, f"memfit family {payload['family']} ({payload['preset']})")
        shapes = ", ".join(f"`{k}` {tuple(v)}" for k, v in (payload.get("input_shapes") or {}).items())
        lines += [
            f"Model: {payload.get('preset_description') or payload['preset']}; dtype {payload.get('dtype')}; "
            f"{payload.get('tokens')} tokens (inputs: {shapes}); batch {payload.get('batch', 1)}.",
            "",
        ]
        if payload.get("error"):
            lines += [f"**Run failed:** `{payload['error']}`", ""]
    else:
        lines = header(payload, "memfit synthetic sweep")
    lines += peer_legend(payload)
    bw = payload.get("pinned_bandwidth") or {}
    for entry in entries(payload):
        lines += _entry_section(entry, bw, optimizer_in_step=entry.get("config") == "full")
    return "\n".join(lines)
