"""Weight streaming at a family's full size: a backend unconstrained against the same backend streaming N blocks.

    python -m memfit_benchmarks.streaming --out DIR                                  # GPU: Flux full, 4096 tokens
    python -m memfit_benchmarks.streaming --blocks 0,8GiB,57 --rounds 2 --out DIR    # counts or sizes
    python -m memfit_benchmarks.streaming --blocks 0,19,27 --budgets 16GiB,12GiB --out DIR   # and auto
    python -m memfit_benchmarks.streaming --preset tiny --device cpu --backend torch --blocks 0,2,7 --out DIR
    python -m memfit_benchmarks.streaming --family wan --backend torch-ffn --blocks 0 --fixed offload_attention \
        --budgets 24GiB --out DIR                                                    # against the fastest fixed mode

One model (the preset's, random weights, bf16 on CUDA), LoRA r16 on every ``nn.Linear`` of the declared blocks,
inputs at ``--tokens`` (default: the preset's), flash SDPA (cuDNN SDPA disabled). Per entry of ``--blocks`` one
row: ``--backend`` (default ``unsloth``) with ``gradient_checkpointing_stream_blocks`` set to that entry (``0``:
the unconstrained row every other row is compared with); per entry of ``--budgets`` one row of ``auto`` at that
budget, which chooses what streams itself (it is measured after ``--warmup`` steps: use at least 4, so that its
closed loop has settled; a row is "within budget" when its peak allocated over the timed steps is); per entry of
``--card-budgets`` one row of ``auto`` on a card of that size: the process limited to it
(``torch.cuda.set_per_process_memory_fraction``), the model moved to the CPU first and given to
``memfit.apply(..., device=)``, as a trainer whose card cannot hold the weights loads it. ``--fixed`` adds other
fixed modes, unconstrained (their sweep names, :data:`memfit_benchmarks.modes.MODES`): each ``auto`` row is then
also compared with the fastest row that streams nothing, "the fastest fixed mode on an unconstrained card". Each
row reports the median step, the peak allocated, the frozen bytes streaming took off the device, the bytes uploaded
per step, the exposed upload wait (compute waiting for a copy) and the upload stream's copy time per step. Writes
``streaming.json`` and ``streaming.md`` to ``--out``.

Time on an H200 (Flux full, the default 0,12,24,36,57 and one round of 1 warm-up + 3 timed steps): ~50 s to build
the model, per row ~5 s of steps plus pinning its host masters (~2 GB/s the first time: ~11 s for all 57 blocks),
about 2.5 minutes in all.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import torch

import memfit
from memfit.auto import planner
from memfit.offload import weights
from memfit.units import parse_bytes
from memfit_benchmarks.card import card_of
from memfit_benchmarks.environment import environment
from memfit_benchmarks.families import build_lora_model
from memfit_benchmarks.modes import MODES, Mode
from memfit_benchmarks.options import deadline
from memfit_benchmarks.replan import planned
from memfit_benchmarks.results import write_results
from memfit_benchmarks.rounds import measured, paired_ratio, round_robin
from memfit_benchmarks.runner import measure_mode

SDPA = "flash (cuDNN SDPA disabled)"
KEY = "gradient_checkpointing_stream_blocks"
NO_CHECKPOINTING = "none"
DEFAULT_BLOCKS = "0,12,24,36,57"


def parse_blocks(text: str) -> list[int | str]:
    """``"0,12,8GiB"`` as stream targets: a block count (digits) or a size (``memfit`` validates it).

    Raises:
        ValueError: an empty list, or an entry that is neither.
    """
    targets: list[int | str] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        value = memfit.MemfitConfig.from_dict({"gradient_checkpointing": True, KEY: part}).stream_blocks
        targets.append(value or 0)
    if not targets:
        raise ValueError("give at least one entry (0: the unconstrained row)")
    return targets


def mode_for(backend: str, target: int | str) -> Mode:
    """The row streaming ``target`` (a count or a size; 0: none) under ``backend`` (``none``: the model as it is,
    no checkpointing and nothing streamed)."""
    if backend == NO_CHECKPOINTING:
        if target:
            raise ValueError("--backend none streams nothing: give --blocks 0")
        return Mode(NO_CHECKPOINTING, {})
    config = {"gradient_checkpointing": True, "gradient_checkpointing_backend": backend}
    if target:
        return Mode(f"{backend} + stream {target}", {**config, KEY: target})
    return Mode(backend, config)


def auto_mode(budget: str, optimizer: str = "adamw") -> Mode:
    """The row of ``auto`` at ``budget`` (it plans weight streaming with the activation policies, and the state of
    the ``optimizer`` every row steps)."""
    return Mode(
        f"auto {budget}",
        {
            "gradient_checkpointing": True,
            "gradient_checkpointing_backend": "auto",
            "gradient_checkpointing_memory_budget": budget,
            "gradient_checkpointing_optimizer_state": optimizer,
        },
    )


@dataclass(frozen=True)
class AutoVariant:
    """``auto`` with one of the planner's terms or one of the engine's behaviours off (a module constant of
    ``module`` patched for that row only: a benchmark's switch, not a user's), paired with the ``auto`` row of its
    budget."""

    suffix: str  # after the auto row's name
    constant: str
    value: Any
    against: str  # what the auto row's ratio is against, for the report
    module: Any = planner


# by the option that adds them (--per-block, --reloads-alone, --uploads-late, --reloads-one-ahead) and the ratio's
# key (x_per_block …)
AUTO_VARIANTS = {
    "per_block": AutoVariant(
        " [copies per block]",
        "QUEUE_LEVELS",
        0,
        "planned with each block's copies charged against its own forward",
    ),
    "reloads_alone": AutoVariant(
        " [reloads behind a backward]",
        "RELOAD_CREDIT",
        False,
        "planned with each reload hidden behind a backward alone (not the recompute of the block after it)",
    ),
    "uploads_late": AutoVariant(
        " [uploads after the reloads]",
        "UPLOADS_AT_BACKWARD_START",
        False,
        "run with each backward upload issued when the block after it recomputes or reads its first weight (after "
        "the reloads its backward starts)",
        weights,
    ),
    "reloads_one_ahead": AutoVariant(
        " [reloads one ahead]",
        "RELOAD_EQUAL_AHEAD",
        False,
        "planned with its reloads ahead by the bytes rule alone (never two equal regions ahead)",
    ),
}


def variant_mode(key: str, budget: str, optimizer: str = "adamw") -> Mode:
    """The row of ``auto`` at ``budget`` planned or run as :data:`AUTO_VARIANTS` ``[key]`` says, to pair with
    :func:`auto_mode`'s."""
    auto = auto_mode(budget, optimizer)
    return Mode(auto.name + AUTO_VARIANTS[key].suffix, auto.config)


def _variant_of(name: str) -> AutoVariant | None:
    return next((v for v in AUTO_VARIANTS.values() if name.endswith(v.suffix)), None)


def card_mode(budget: str, optimizer: str = "adamw") -> Mode:
    """The row of ``auto`` at ``budget`` on a card of that size, the model starting on the host."""
    auto = auto_mode(budget, optimizer)
    return Mode(f"{auto.name} on a {budget} card", auto.config, options={"device": "cuda"})


FIXED_MODES = {m.name: m for m in MODES}  # what --fixed may name


def fixed_modes(text: str) -> list[Mode]:
    """``"offload_attention,torch-ffn"`` as the modes of :data:`FIXED_MODES` they name.

    Raises:
        ValueError: a name that is not a fixed mode, listing them.
    """
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FIXED_MODES]
    if unknown:
        raise ValueError(f"unknown fixed mode {unknown[0]!r}: choose from {sorted(FIXED_MODES)}")
    return [FIXED_MODES[n] for n in names]


def weight_row(handle: memfit.MemfitHandle, steps: int) -> dict[str, Any]:
    """What a row records about weight streaming (``handle.stats()`` counts the timed steps only)."""
    if handle is None:  # the model as it is
        zero = (
            "weight_bytes_uploaded_per_step",
            "weight_exposed_wait_ms_per_step",
            "weight_exposed_wait_backward_ms_per_step",
            "weight_copy_ms_per_step",
        )
        return {"streamed_blocks": 0, "resident_blocks": None, "streamed_weight_bytes": 0, "streamed": []} | {
            key: 0.0 for key in zero
        }
    s = handle.stats()
    return {
        "streamed_blocks": s["streamed_blocks"],
        "resident_blocks": s["resident_blocks"],
        "streamed_weight_bytes": s["weight_streamed_bytes"],
        "streamed": [b.name for b in handle.region_plan.streamed],
        "policies": dict(Counter(b.policy.value for b in handle.region_plan.blocks)),
        "forward_uploads_ahead": handle.region_plan.forward_uploads_ahead,
        "uploads_kept_first": handle.region_plan.uploads_kept_first,
        # auto: what its cost and peak models predicted for the plan it ran (None for a fixed backend)
        "predicted_extra_seconds": getattr(handle.plan, "predicted_extra_seconds", None),
        "predicted_peak_bytes": getattr(handle.plan, "predicted_peak_bytes", None),
        "planning_seconds": s.get("planning_seconds"),  # auto: its searches since apply, calibration included
        **planned(handle),
        "weight_pinned_bytes": s["weight_pinned_bytes"],
        "weight_bytes_uploaded_per_step": s["weight_bytes_uploaded"] / steps,
        "weight_uploads_per_step": s["weight_uploads"] / steps,
        "weight_uploads_on_demand_per_step": s["weight_uploads_on_demand"] / steps,
        "weight_uploads_kept_per_step": s["weight_uploads_kept"] / steps,
        "weight_exposed_wait_ms_per_step": s["weight_upload_wait_ms"] / steps,
        "weight_exposed_wait_backward_ms_per_step": s["weight_upload_wait_ms_backward"] / steps,
        "weight_copy_ms_per_step": s["weight_upload_copy_ms"] / steps,
        "weight_uploads_alive_max": s["weight_uploads_alive_max"],
        "weight_held_after_forward": s["weight_held_after_forward"],
    }


def _in_backward(row: dict[str, Any]) -> str:
    """`` (x)``: the part of a row's exposed upload wait in backward ('' where the row did not record it)."""
    backward = row.get("weight_exposed_wait_backward_ms_per_step")
    return "" if backward is None else f" ({backward:.1f})"


def add_comparisons(rows: list[dict[str, Any]]) -> None:
    """Each measured row's step and peak against the unconstrained row (the first, streaming nothing)."""
    base = next((r for r in rows if measured(r) and not r.get("streamed_blocks")), None)
    if base is None:
        return
    fastest = _fastest_unconstrained(rows)
    for r in rows:
        if not measured(r):
            continue
        r["unpaired"] = []
        _ratio(r, base, "x_unconstrained")
        if r.get("peak_allocated") and base.get("peak_allocated"):
            r["peak_saved_bytes"] = base["peak_allocated"] - r["peak_allocated"]
        if r.get("budget_bytes") and r.get("peak_allocated"):
            r["within_budget"] = r["peak_allocated"] <= r["budget_bytes"]
            fixed = _fewest_fitting(rows, r["budget_bytes"])
            if fixed is not None:
                r["fixed_knob"] = fixed["mode"]
                _ratio(r, fixed, "x_fixed_knob")
        if "budget_bytes" in r and fastest is not None:
            r["fastest_fixed"] = fastest["mode"]
            _ratio(r, fastest, "x_fastest_fixed")
        for key, variant in AUTO_VARIANTS.items():
            other = next((p for p in rows if p["mode"] == r["mode"] + variant.suffix and measured(p)), None)
            if other is not None:
                _ratio(r, other, f"x_{key}")


def _ratio(row: dict[str, Any], other: dict[str, Any], key: str) -> None:
    """``row[key]``: its step over ``other``'s, paired by round where the two share two rounds or more; else the
    ratio of their median steps, and ``key`` joins ``row["unpaired"]``."""
    paired = paired_ratio(row, other)
    if paired is None:
        row["unpaired"].append(key)
    row[key] = paired if paired is not None else row["step_s"] / other["step_s"]


def _pairing(row: dict[str, Any], key: str) -> str:
    """How the ratio ``key`` of ``row`` was taken, for the report."""
    if key in row.get("unpaired", ()):
        return "not paired: the two rows share fewer than two rounds, the ratio of their median steps"
    return "paired by round"


def _unconstrained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The measured rows of fixed modes that stream nothing (neither ``auto`` nor the fixed knob)."""
    return [r for r in rows if measured(r) and "budget_bytes" not in r and not r.get("streamed_blocks")]


def _fastest_unconstrained(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest fixed mode on a card with room for it."""
    return min(_unconstrained(rows), key=lambda r: r["step_s"], default=None)


def _fewest_fitting(rows: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    """The fixed-knob row streaming the fewest blocks whose peak is within ``budget`` (the hand-set alternative)."""
    fitting = [
        r
        for r in rows
        if measured(r) and KEY in r["config"] and r.get("peak_allocated", budget + 1) <= budget
    ]
    return min(fitting, key=lambda r: r["streamed_blocks"], default=None)


# what runs must share to merge (their rounds pair)
SAME_RUN_KEYS = (
    "git_commit",
    "device",
    "family",
    "preset",
    "tokens",
    "backend",
    "optimizer",
    "steps",
    "warmup",
)


def merge_runs(*runs: dict[str, Any]) -> dict[str, Any]:
    """Runs of one commit and the same rows, on one kind of device, as one run of all their rounds: per row the
    rounds one after the other, so that round k of every row stays paired (a run's last round, where a deadline
    left some row without it, is dropped); the median step and the largest peaks of all; the per-step upload
    figures (each run's from its first round) averaged over the runs. ``merged_from`` lists each run's date and
    rounds.

    Raises:
        ValueError: fewer than two runs, or runs of different commits, devices, shapes or rows.
    """
    if len(runs) < 2:
        raise ValueError("give two runs or more to merge")
    first = runs[0]
    for run in runs[1:]:
        differ = [k for k in SAME_RUN_KEYS if run.get(k) != first.get(k)]
        if differ or [r["mode"] for r in run["rows"]] != [r["mode"] for r in first["rows"]]:
            raise ValueError(
                f"runs differ in {', '.join(differ) or 'their rows'}: only runs of one commit, on one kind of "
                "device, of the same rows merge (their rounds pair)"
            )
    rounds = [
        min(len(r.get("step_s_rounds") or [r["step_s"]]) for r in run["rows"] if measured(r)) for run in runs
    ]
    rows = []
    for k, row in enumerate(first["rows"]):
        versions = [run["rows"][k] for run in runs]
        if not all(measured(r) for r in versions):
            rows.append(next(r for r in versions if not measured(r)))
            continue
        steps = [
            s
            for r, n in zip(versions, rounds, strict=True)
            for s in (r.get("step_s_rounds") or [r["step_s"]])[:n]
        ]
        merged = {**row, "step_s_rounds": steps, "step_s": statistics.median(steps)}
        plans = [_plan_of(r) for r in versions]
        if any(plan != plans[0] for plan in plans):  # auto planned differently in some run: say so
            merged["run_plans"] = plans
        for key in ("peak_allocated", "peak_reserved", "peak_allocated_warmup"):
            values = [r[key] for r in versions if r.get(key) is not None]
            if values:
                merged[key] = max(values)
        for name in [name for name, value in row.items() if name.endswith("_per_step")]:
            if isinstance(row[name], int | float):
                merged[name] = statistics.fmean(r[name] for r in versions)
        rows.append(merged)
    add_comparisons(rows)
    return {
        **runs[-1],
        "rounds": sum(rounds),
        "rows": rows,
        "merged_from": [{"date": run["date"], "rounds": n} for run, n in zip(runs, rounds, strict=True)],
    }


PLAN_KEYS = ("policies", "streamed", "forward_uploads_ahead", "uploads_kept_first")


def _plan_of(row: dict[str, Any]) -> dict[str, Any]:
    return {key: row.get(key) for key in PLAN_KEYS}


def _plan_text(plan: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in (plan.get("policies") or {}).items()) + _uploads_note(plan)


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _uploads_note(row: dict[str, Any]) -> str:
    """How a row's uploads ran: led ahead in forward, kept from backward for the next forward (rows of older runs
    do not say)."""
    if row.get("uploads_kept_first") is None or not row.get("streamed", row.get("streamed_blocks")):
        return ""
    ahead, kept = row["forward_uploads_ahead"], row["uploads_kept_first"]
    return f"; uploads led {ahead} ahead, {kept} kept for the next forward"


def fixed_knob_note(row: dict[str, Any]) -> str:
    """The line under the table for an ``auto`` row compared with the fixed knob: its plan (each run's, where a
    merged run's plans differ) and the paired ratio."""
    plans = row.get("run_plans")
    planned = (
        "plans per run: " + "; ".join(f"{k}) {_plan_text(p)}" for k, p in enumerate(plans, 1))
        if plans
        else _plan_text(_plan_of(row))
    )
    return (
        f"- {row['mode']} ({planned}): {row['x_fixed_knob']:.3f}× the step of `{row['fixed_knob']}`, the fewest "
        f"blocks of the fixed knob measured here that fit the same budget ({_pairing(row, 'x_fixed_knob')}; counts "
        "not measured may fit too)"
    )


def render(payload: dict[str, Any]) -> str:
    """The results as markdown: one headline table, then what ran."""
    lines = [
        f"# Weight streaming: {payload['family']} {payload['preset']}, {payload['tokens']} tokens",
        "",
        "| row | streamed blocks | streamed GiB | step s | × unconstrained | peak GiB | peak saved GiB "
        "| uploaded GiB/step | exposed wait ms/step (in backward) | copy ms/step | copy GB/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        if "within_budget" in r and measured(r):
            verdict = "within" if r.get("within_budget") else "OVER"
            r = {**r, "mode": f"{r['mode']} ({verdict} budget)"}
        if not measured(r):
            lines.append(
                f"| {r['mode']} | {'out of memory' if r.get('oom') else 'not measured'} |" + " |" * 9
            )
            continue
        copy_ms = r.get("weight_copy_ms_per_step") or 0.0
        bandwidth = r["weight_bytes_uploaded_per_step"] / (copy_ms / 1e3) / 1e9 if copy_ms else None
        n, resident = r["streamed_blocks"], r["resident_blocks"]
        blocks = "none" if resident is None else f"{n} of {n + resident}"
        lines.append(
            f"| {r['mode']} | {blocks} "
            f"| {_gib(r['streamed_weight_bytes'])} | {r['step_s']:.3f} | {r.get('x_unconstrained', 1.0):.3f} "
            f"| {_gib(r.get('peak_allocated'))} | {_gib(r.get('peak_saved_bytes'))} "
            f"| {_gib(r['weight_bytes_uploaded_per_step'])} | {r['weight_exposed_wait_ms_per_step']:.1f}"
            f"{_in_backward(r)} "
            f"| {copy_ms:.1f} | {'-' if bandwidth is None else f'{bandwidth:.1f}'} |"
        )
    for r in payload["rows"]:
        if r.get("fixed_knob"):
            lines.append(fixed_knob_note(r))
        for key, variant in AUTO_VARIANTS.items():
            if r.get(f"x_{key}"):
                lines.append(
                    f"- {r['mode']}: {r[f'x_{key}']:.3f}× the step of the same budget {variant.against} "
                    f"({_pairing(r, f'x_{key}')})"
                )
        if r.get("fastest_fixed") and len(_unconstrained(payload["rows"])) > 1:
            lines.append(
                f"- {r['mode']}: {r['x_fastest_fixed']:.3f}× the step of `{r['fastest_fixed']}`, the fastest fixed "
                f"mode measured here unconstrained ({_pairing(r, 'x_fastest_fixed')})"
            )
    lines += [
        "",
        f"{payload['training']}; backend `{payload['backend']}`; {payload['steps']} timed steps after "
        f"{payload['warmup']} warm-up (auto: then up to {payload.get('settle', 0)} more until its closed loop "
        f"settled), median of {payload['rounds']} round(s); SDPA: {payload['sdpa_backend']}."
        + (
            " Merged from runs of this commit on the same kind of device, their rounds one after the other: "
            + ", ".join(f"{m['date']} ({m['rounds']} rounds)" for m in payload["merged_from"])
            + "; the upload figures per step are the runs' mean."
            if payload.get("merged_from")
            else ""
        ),
        "",
        "Peak saved: the unconstrained row's peak minus this row's. Streaming N blocks takes their frozen weights "
        "off the device except the one or two uploaded at a time. Exposed wait: time the compute stream waited for "
        "an upload (copy time not hidden behind compute); in brackets its part in backward (for a recompute's or a "
        "backward's upload).",
        "",
        f"Device: {payload['device']}; torch {payload['torch']}, diffusers {payload.get('diffusers')}; "
        f"pinned bandwidth {json.dumps(payload.get('pinned_bandwidth'))}; caching allocator: "
        f"{payload.get('allocator_conf', 'default')}; commit {payload.get('git_commit')}; {payload['date']}.",
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    adapter = memfit.get_adapter(args.family)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens = args.tokens or adapter.presets[args.preset].default_tokens
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
    env = environment("streaming", device, sdpa=SDPA if cuda else "default (CPU)")
    model, batch, info = build_lora_model(
        adapter, args.preset, dtype=dtype, device=device, rank=args.rank, tokens=tokens
    )
    modes = [mode_for(args.backend, t) for t in args.blocks] + args.fixed
    modes += [auto_mode(b, args.optimizer) for b in args.budgets]
    budgets = {auto_mode(b).name: parse_bytes(b) for b in args.budgets}
    for key in AUTO_VARIANTS:
        if getattr(args, key):
            modes += [variant_mode(key, b, args.optimizer) for b in args.budgets]
            budgets |= {variant_mode(key, b).name: parse_bytes(b) for b in args.budgets}
    cards = {card_mode(b).name: parse_bytes(b) for b in args.card_budgets}
    modes += [card_mode(b, args.optimizer) for b in args.card_budgets]
    budgets |= cards
    optimizer_factory = None
    if (
        args.optimizer == "adamw"
    ):  # every row trains as a trainer does: its state is on the card for every mode

        def optimizer_factory() -> torch.optim.Optimizer:
            return torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad], lr=1e-6, foreach=True
            )

    def measure(mode: Mode) -> dict[str, Any]:
        row = weight_row(None, args.steps) if mode.config is None else {}
        card = card_of(model, cards[mode.name], device) if mode.name in cards else contextlib.nullcontext()
        variant = _variant_of(mode.name)
        switch = (
            mock.patch.object(variant.module, variant.constant, variant.value)
            if variant is not None
            else contextlib.nullcontext()
        )
        with card, switch:
            row |= measure_mode(
                model,
                batch,
                adapter.loss,
                mode,
                adapter=adapter,
                warmup=args.warmup,
                steps=args.steps,
                inspect=lambda handle: weight_row(handle, args.steps),  # with a memfit handle only
                settle=args.settle if mode.name in budgets else 0,
                optimizer_factory=optimizer_factory,
            )
        if mode.name in cards:
            row["card_bytes"] = cards[mode.name]
        if mode.name in budgets:
            row["budget_bytes"] = budgets[mode.name]
        summary = (
            "OOM" if not measured(row) else f"{row['step_s']:.3f} s, peak {_gib(row['peak_allocated'])} GiB"
        )
        print(f"[streaming] {mode.name}: {summary}", flush=True)
        return row

    sdpa = contextlib.nullcontext()
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa = sdpa_kernel([SDPBackend.FLASH_ATTENTION])
    with sdpa:
        rows = round_robin(modes, args.rounds, measure, iter, deadline(args.stop_at))
    add_comparisons(rows)
    return {
        **env,
        "family": args.family,
        "preset": args.preset,
        "tokens": tokens,
        "backend": args.backend,
        "training": (
            f"{str(dtype).removeprefix('torch.')} base, PEFT LoRA r{args.rank} on every block nn.Linear, batch 1"
            + (
                ", a foreach AdamW step over the LoRA weights in every step"
                if args.optimizer == "adamw"
                else ""
            )
        ),
        "optimizer": args.optimizer,
        **info,
        "steps": args.steps,
        "warmup": args.warmup,
        "settle": args.settle,
        "rounds": args.rounds,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="folder for streaming.json and streaming.md")
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--tokens", type=int, default=None, help="default: the preset's default_tokens")
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--backend",
        default="unsloth",
        choices=[NO_CHECKPOINTING, *(b.value for b in memfit.Backend if b.value != "auto")],
    )
    parser.add_argument(
        "--blocks", default=DEFAULT_BLOCKS, help=f"stream targets, counts or sizes (default {DEFAULT_BLOCKS})"
    )
    parser.add_argument(
        "--budgets",
        default="",
        help="comma-separated budgets for rows of auto (e.g. 16GiB,12GiB; default none)",
    )
    parser.add_argument(
        "--per-block",
        action="store_true",
        help="for each of --budgets also a row of auto planned with each block's device-to-host copies charged "
        "against its own forward (the planner's copy queue off), paired with the auto row",
    )
    parser.add_argument(
        "--reloads-alone",
        action="store_true",
        help="for each of --budgets also a row of auto planned with each reload hidden behind a backward alone "
        "(no credit for the recompute of the block after it), paired with the auto row",
    )
    parser.add_argument(
        "--uploads-late",
        action="store_true",
        help="for each of --budgets also a row of auto whose backward uploads are issued when the block after "
        "recomputes or reads its first weight (after the reloads its backward starts), paired with the auto row",
    )
    parser.add_argument(
        "--reloads-one-ahead",
        action="store_true",
        help="for each of --budgets also a row of auto whose backward reloads one of two equal regions ahead (the "
        "bytes rule alone, never two equal regions), paired with the auto row",
    )
    parser.add_argument(
        "--card-budgets",
        default="",
        help="comma-separated budgets for rows of auto on a card of that size, the model starting on the host "
        "(CUDA; default none)",
    )
    parser.add_argument(
        "--fixed",
        default="",
        help="comma-separated fixed modes measured unconstrained besides --backend (e.g. offload_attention)",
    )
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument(
        "--settle",
        type=int,
        default=6,
        help="auto rows: at most this many more warm-up steps until auto settled",
    )
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "none"],
        help="every row steps a foreach AdamW over the trainable weights after each backward, and auto plans for "
        "its state (adamw, default); none: no optimizer step, auto told so",
    )
    parser.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME")
    parser.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="write the rounds of these runs (one commit, the same rows) as one run to --out; measures nothing",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="check the options, print the rows, measure nothing"
    )
    args = parser.parse_args(argv)
    if args.merge:
        try:
            payload = merge_runs(*(json.loads(Path(f).read_text()) for f in args.merge))
        except (OSError, ValueError) as exc:
            parser.error(f"--merge: {exc}")
        return write_results(Path(args.out), payload, render)
    try:
        args.blocks = parse_blocks(args.blocks)
        for target in args.blocks:
            mode_for(args.backend, target)
    except (ValueError, memfit.ConfigError) as exc:
        parser.error(f"--blocks: {exc}")
    try:
        args.budgets = [b.strip() for b in args.budgets.split(",") if b.strip()]
        args.card_budgets = [b.strip() for b in args.card_budgets.split(",") if b.strip()]
        for b in [*args.budgets, *args.card_budgets]:
            if parse_bytes(b) <= 0:
                raise ValueError(f"{b!r} is not a positive size")
    except ValueError as exc:
        parser.error(f"--budgets / --card-budgets: {exc}")
    try:
        args.fixed = fixed_modes(args.fixed)
        rows = {mode_for(args.backend, t).name for t in args.blocks}
        twice = [m.name for m in args.fixed if m.name in rows]
        if twice:
            raise ValueError(f"{twice[0]!r} is already a row of --backend/--blocks; leave it out of --fixed")
    except ValueError as exc:
        parser.error(f"--fixed: {exc}")
    if args.card_budgets and torch.device(args.device).type != "cuda":
        parser.error(
            "--card-budgets: a card's size limits a CUDA process; give --device cuda or leave it out"
        )
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    if args.family not in memfit.available_adapters():
        parser.error(f"--family {args.family!r} is not installed ({sorted(memfit.available_adapters())})")
    if args.dry_run:
        rows = [mode_for(args.backend, t).name for t in args.blocks] + [m.name for m in args.fixed]
        rows += [auto_mode(b).name for b in args.budgets]
        rows += [card_mode(b).name for b in args.card_budgets]
        print(f"would measure {args.family} {args.preset}: {rows}, {args.rounds} round(s)", flush=True)
        return None
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda needs CUDA (use --device cpu --preset tiny --backend torch for a smoke run)"
        )
    payload = run(args)
    return write_results(Path(args.out), payload, render)


if __name__ == "__main__":
    main()
