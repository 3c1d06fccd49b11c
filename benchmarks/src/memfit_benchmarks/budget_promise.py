"""Does ``auto`` keep its budget on a card of that size, and is it faster there than the fixed modes that fit?

    python -m memfit_benchmarks.budget_promise --out DIR                                  # GPU: the issue's sweep
    python -m memfit_benchmarks.budget_promise --targets flux --configs attn --budgets 24GiB --out DIR
    python -m memfit_benchmarks.budget_promise --preset tiny --device cpu --budgets 600KiB,floor --out DIR

Per target (``flux`` or any installed family: its preset at ``--tokens``, default the preset's; ``synthetic-16384``
and the other names of ``shapes.SYNTHETIC_TARGETS``: the synthetic stack at that shape, flash SDPA; at 16384 tokens
the budgets 16-48 GiB fall between its modes' peaks) and training config of ``--configs``, one child process
builds the model (random weights, bf16 on CUDA) and measures the config on it (a process each, so that nothing a
config's out-of-memory rows leave behind reaches the next) (``all``: PEFT LoRA r16 on every block linear; ``attn``: on the linears of the declared attention regions, the
peers sweep's ``lora-attn``; ``full``: every weight trains, a foreach AdamW step inside each step;
``memfit_benchmarks.training``). Per config:

1. The floor: ``auto`` at a 1-byte budget raises ``BudgetError`` naming the smallest peak any plan reaches
   (one profiling forward, no step).
2. Per budget of ``--budgets`` (sizes, and ``floor``), in increasing order, the process is limited to the budget
   with ``torch.cuda.set_per_process_memory_fraction`` (what the caching allocator may reserve, as on a card of
   that size). Below the floor only ``auto`` runs,
   once: the expected row is a ``BudgetError`` before any step. At or above it ``auto`` and every mode of
   ``--fixed`` run in ``--rounds`` round-robin rounds (``auto`` with ``--auto-warmup`` warm-up steps: its first
   step profiles and plans, the next ones may correct the plan); a mode out of memory is an ``OOM`` row and is
   not measured again at that budget, and after the first round only ``auto`` and the fixed modes that fit
   within ``CONTENDER_SPAN`` of the fastest one that fits are timed again (:func:`contenders`).
   Where what is resident before a step (weights, inputs) already exceeds the budget, no fixed mode could fit
   and only ``auto`` runs, as a trainer on such a card runs it: the model moved to the CPU first and
   ``memfit.apply(..., device=)`` placing it (the frozen weights it streams go straight to host memory).

Per budget the report gives auto's status, whether every step (warm-up, planning forward and timed steps, every
round) stayed within the budget, peak allocated and reserved, the median step, the fastest fixed mode that fits
clear of the process's limit (a mode whose timed steps made the caching allocator free its cache and retry is
listed as at the limit: auto steps back from such steps) and auto's step over it paired by round; per target three checks (:func:`budget_checks`). A child that crashes
keeps what it wrote after each budget. ``--stop-at``: no measurement starts later (rows left out say so). Off
CUDA nothing limits memory: the CPU run proves the script (auto's budget counts held activation bytes there).
Writes ``<stem>.json`` and ``<stem>.md`` (default stem ``budget-promise``) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import statistics
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.units import format_bytes, parse_bytes
from memfit_benchmarks.auto_report import AUTO_FASTER, AUTO_NOISE
from memfit_benchmarks.card import card_of
from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.modes import MODES, Mode
from memfit_benchmarks.options import deadline
from memfit_benchmarks.replan import planned
from memfit_benchmarks.rounds import FAILED, NOT_MEASURED, measured, per_round_ratios, round_robin
from memfit_benchmarks.shapes import SYNTHETIC_TARGETS
from memfit_benchmarks.training import TrainingConfig, prepare

GIB = 1 << 30
CONFIGS = {"all": TrainingConfig.LORA_ALL, "attn": TrainingConfig.LORA_ATTENTION, "full": TrainingConfig.FULL}
FLOOR = "floor"
FLOOR_PROBE_BYTES = 1  # a budget no plan reaches: auto's BudgetError then names the smallest peak
DEFAULT_FIXED = "none,torch-ffn,torch,unsloth-ffn,unsloth"
DEADLINE = "the run's deadline passed first"
CONTENDER_SPAN = (
    1.15  # after round 1 a fixed mode slower than this x the fastest that fits is not timed again
)
LEFT_BYTES = (
    256 << 20
)  # more than this left allocated after a row is reported (it would skew every later row)
RESIDENT_OVER = "the weights alone exceed the budget: no fixed mode can fit; auto starts from the host (memfit.apply(..., device=))"


# -- the child: one target, every config and budget -------------------------------------------------------------


def _build(target: str, preset: str, tokens: int | None, device: torch.device, dtype: torch.dtype):
    """(model, batch, adapter, info) of a target (no training config applied yet)."""
    if target in SYNTHETIC_TARGETS:
        from memfit_benchmarks.shapes import SHAPES, TINY_SHAPE
        from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs

        label, width, depth, shape_tokens = (
            TINY_SHAPE if preset == "tiny" else SHAPES[SYNTHETIC_TARGETS[target]]
        )
        model = build(dim=width, depth=depth, dtype=dtype, device=str(device))
        batch = inputs(model, tokens=tokens or shape_tokens, generator=torch.Generator().manual_seed(0))
        return (
            model,
            batch,
            SYNTHETIC,
            {"description": f"synthetic {label}", "tokens": tokens or shape_tokens},
        )
    adapter = memfit.get_adapter(target)
    tokens = tokens or adapter.presets[preset].default_tokens
    model = adapter.presets[preset].build(dtype=dtype, device=device)
    batch = adapter.presets[preset].inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    return model, batch, adapter, {"description": adapter.presets[preset].description, "tokens": tokens}


def _auto(budget: int, **options: Any) -> Mode:
    return Mode(
        "auto",
        {
            "gradient_checkpointing": True,
            "gradient_checkpointing_backend": "auto",
            "gradient_checkpointing_memory_budget": int(budget),
        },
        options=options,
    )


def _auto_fields(handle: Any) -> dict[str, Any]:
    plan = getattr(handle, "plan", None)
    stats = handle.stats()
    shapes = stats.get("shapes") or []
    return {
        **planned(handle),  # the plan and its profile, to plan again offline (memfit_benchmarks.replan)
        "predicted_peak_bytes": None if plan is None else plan.predicted_peak_bytes,
        "shapes": shapes,
        "corrections": sum(s.get("corrections", 0) for s in shapes),
        "steps_at_limit": sum(s.get("steps_at_limit", 0) for s in shapes),
    }


class _Target:
    """One built target in the child: measures rows on it under the job's options."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.device = torch.device(job["device"])
        self.cuda = self.device.type == "cuda"
        if self.cuda and self.device.index is None:  # the memory-fraction limit needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.stop = deadline(job["stop_at"])
        started = time.perf_counter()
        self.model, self.batch, self.adapter, self.info = _build(
            job["target"], job["preset"], job["tokens"], self.device, self.dtype
        )
        if self.cuda:
            torch.cuda.synchronize()
        self.info["build_seconds"] = time.perf_counter() - started
        self.optimizer_factory = None

    def limit(self, budget: int | None) -> bool:
        """Limit the process to ``budget`` bytes (None: lift the limit); False when the weights and inputs already
        resident exceed it (then the process is left unlimited: nothing could run on such a card)."""
        if not self.cuda:
            return False
        gc.collect()  # what an earlier row's exception left in reference cycles is no resident weight
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        fits = budget is not None and torch.cuda.memory_reserved(self.device) < budget
        fraction = min(1.0, budget / total) if fits else 1.0
        torch.cuda.set_per_process_memory_fraction(fraction, self.device)
        return fits

    def runs(self, mode: Mode) -> bool:
        from memfit_benchmarks.families import skip_reason

        return skip_reason(mode, self.adapter, self.device) is None

    def measure(self, mode: Mode, budget: int | None = None, *, steps: int | None = None) -> dict[str, Any]:
        from memfit_benchmarks.runner import measure_mode

        is_auto = mode.name == "auto"
        try:
            row = measure_mode(
                self.model,
                self.batch,
                self.adapter.loss,
                mode,
                adapter=self.adapter,
                warmup=self.job["auto_warmup"] if is_auto else self.job["warmup"],
                steps=steps or self.job["steps"],
                optimizer_factory=self.optimizer_factory,
                inspect=_auto_fields if is_auto else None,
                settle=self.job.get("auto_settle", 0) if is_auto else 0,
            )
        except memfit.BudgetError as exc:  # a row (and not measured again: FAILED stops its rounds)
            row = {"mode": mode.name, "oom": False, "budget_error": str(exc), FAILED: "BudgetError"}
            row["smallest_peak_bytes"] = exc.smallest_peak_bytes
            row["suggested_budget_bytes"] = exc.suggested_budget_bytes
        if self.cuda:  # memory a row leaves allocated poisons every later one: recorded to be seen
            gc.collect()
            row["allocated_after_bytes"] = torch.cuda.memory_allocated(self.device)
        if budget is not None and measured(row) and row.get("peak_allocated") is not None:
            peaks = [row["peak_allocated"], row.get("peak_allocated_warmup") or 0]
            row["within_budget"] = max(peaks) <= budget
        print(
            f"  [{self.job['target']} {budget and format_bytes(budget)}] {mode.name}: {_cell(row)}",
            flush=True,
        )
        return row

    def floor(self) -> dict[str, Any]:
        row = self.measure(_auto(FLOOR_PROBE_BYTES))
        if "suggested_budget_bytes" in row:  # the floor is the budget the BudgetError suggests
            return {"floor_bytes": row["suggested_budget_bytes"]}
        return {"floor_error": f"auto at {FLOOR_PROBE_BYTES} byte did not raise BudgetError: {_cell(row)}"}

    def budget(self, budget: int, *, is_floor: bool, floor: int | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"budget_bytes": budget, "is_floor": is_floor}
        if self.stop():
            entry[NOT_MEASURED] = DEADLINE
            return entry
        below = floor is not None and budget < floor
        entry["below_floor"] = below
        fixed = [] if below else [m for m in MODES if m.name in self.job["fixed"] and self.runs(m)]
        modes = [_auto(budget), *fixed]
        rounds: dict[str, list[dict[str, Any]]] = {m.name: [] for m in modes}
        steps = self.job.get("floor_steps") if is_floor else None  # near the limit one step is noise
        entry["timed_steps"] = steps or self.job["steps"]

        def one(mode: Mode) -> dict[str, Any]:
            with card_of(self.model, budget, self.device) if mode.options else contextlib.nullcontext():
                row = self.measure(mode, budget, steps=steps)
            rounds[mode.name].append(row)
            return row

        def keep(mode: Mode) -> bool:
            return mode.name == "auto" or mode.name in contenders(
                {m: r[0] for m, r in rounds.items() if r}, budget
            )

        try:
            entry["process_limited"] = self.limit(budget)
            entry["resident_bytes"] = torch.cuda.memory_allocated(self.device) if self.cuda else None
            if self.cuda and not entry["process_limited"]:  # weights alone exceed it: no fixed mode fits
                entry["fixed_left_out"] = RESIDENT_OVER
                entry["process_limited"] = entry["host_start"] = True  # as a trainer on such a card runs auto
                modes = [_auto(budget, device=self.device)]
            entry["rows"] = round_robin(
                modes, 1 if below else self.job["rounds"], one, stop=self.stop, keep=keep
            )
        except Exception as exc:  # a broken budget is a row; the next budget may still run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
            print(entry["traceback"], flush=True)
        finally:
            self.limit(None)
        entry["auto_rounds"] = rounds["auto"]
        after = [
            r["allocated_after_bytes"] for rs in rounds.values() for r in rs if "allocated_after_bytes" in r
        ]
        if (
            after
            and entry.get("resident_bytes") is not None
            and max(after) - entry["resident_bytes"] > LEFT_BYTES
        ):
            entry["left_allocated_bytes"] = max(after) - entry["resident_bytes"]
        entry.update(summarize(entry))
        return entry


def _one_target(job: dict[str, Any]) -> dict[str, Any]:
    """Runs in a child process: every config and budget of one target; ``job["progress"]`` is rewritten after
    each budget (the parent reads it if the child dies)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = job["device"] == "cuda"
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN's SDPA backward fails on this stack (README)
    result: dict[str, Any] = {"target": job["target"], "configs": []}
    progress = Path(job["progress"])

    def save() -> None:
        progress.write_text(json.dumps(result, default=str))

    synthetic = job["target"] in SYNTHETIC_TARGETS
    pin = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda and synthetic else contextlib.nullcontext()
    with pin:
        target = _Target(job)
        result.update(target.info)
        result["device_name"] = torch.cuda.get_device_name(target.device) if cuda else "cpu"
        result["sdpa"] = (
            "flash, cuDNN SDPA disabled" if synthetic and cuda else "default dispatch, cuDNN SDPA disabled"
        )
        for name in job["configs"]:
            entry: dict[str, Any] = {"config": name, "budgets": []}
            result["configs"].append(entry)
            if target.stop():
                entry[NOT_MEASURED] = DEADLINE
                continue
            training = prepare(target.model, target.batch, CONFIGS[name], target.adapter, dtype=target.dtype)
            entry.update(training.info(), config=name)
            target.optimizer_factory = training.optimizer_factory
            try:
                entry.update(target.floor())
                floor = entry.get("floor_bytes")
                for budget, is_floor in resolve_budgets(job["budgets"], floor):
                    entry["budgets"].append(target.budget(budget, is_floor=is_floor, floor=floor))
                    save()
            finally:
                training.undo()
                target.optimizer_factory = None
            save()
    return result


# -- what a budget's rows say ------------------------------------------------------------------------------------


def _floor_steps(record: dict[str, Any]) -> int | None:
    """Timed steps per measurement at a floor (a run recorded before the key: as many as elsewhere)."""
    return record.get("floor_steps") or record.get("steps")


def _floor_steps_note(result: dict[str, Any], *, lead: str = ", ", tail: str = "") -> str:
    """``", N at the floor"`` where a floor was measured over another number of timed steps than the rest."""
    floor = _floor_steps(result)
    return f"{lead}{floor} at the floor{tail}" if floor != result["steps"] else ""


def resolve_budgets(spec: list[int | str], floor: int | None) -> list[tuple[int, bool]]:
    """``(bytes, is_floor)`` per budget of ``spec`` (sizes, and ``"floor"`` as ``floor`` when known), increasing,
    each once."""
    out: dict[int, bool] = {}
    for item in spec:
        if item == FLOOR:
            if floor is not None:
                out[floor] = True
        else:
            out.setdefault(int(item), False)
    return sorted(out.items())


def _fits(row: dict[str, Any], budget: int) -> bool:
    """A fixed mode's row that ran and stayed within ``budget`` (off CUDA, with no peak to read: ran)."""
    if not measured(row):
        return False
    peaks = [row.get("peak_allocated"), row.get("peak_allocated_warmup")]
    return all(p is None or p <= budget for p in peaks)


def _clear(row: dict[str, Any], budget: int) -> bool:
    """A fixed mode's row that fits ``budget`` and whose timed steps never made the allocator free its cache and
    retry: one allocation from running out is at the limit, and auto treats that as over the budget."""
    return _fits(row, budget) and not row.get("alloc_retries_in_timed_steps")


def contenders(first: dict[str, dict[str, Any]], budget: int, span: float = CONTENDER_SPAN) -> set[str]:
    """The fixed modes worth timing again after the first round: those clear of the limit (:func:`_clear`) with
    a first-round step within ``span`` x the fastest of them (a mode over the budget or at the limit cannot be
    the one auto is compared with, and one far behind cannot be the fastest; its first round is its row)."""
    steps = {m: r["step_s"] for m, r in first.items() if m != "auto" and _clear(r, budget)}
    fastest = min(steps.values(), default=None)
    return {m for m, step in steps.items() if step <= span * fastest}


def summarize(entry: dict[str, Any]) -> dict[str, Any]:
    """A budget's verdict from its rows: ``auto`` (ok / OOM / BudgetError / not measured / error), ``within_budget``
    (every step of every auto round), the fastest fixed mode that fits, and ``x_fixed`` = auto's step over it
    (the median of per-round ratios where both ran in two rounds or more; ``x_fixed_paired`` says which)."""
    budget = entry["budget_bytes"]
    rows = {r["mode"]: r for r in entry.get("rows", [])}
    auto = rows.get("auto")
    out: dict[str, Any] = {}
    if entry.get(NOT_MEASURED) or auto is None or auto.get(NOT_MEASURED):
        out["auto"] = "error" if entry.get("error") else "not measured"
        return out
    if auto.get("budget_error"):
        out["auto"] = "BudgetError"
    elif auto.get("oom"):
        out["auto"] = "OOM"
    else:
        out["auto"] = "ok"
        auto_rounds = entry.get("auto_rounds") or [auto]
        checked = [r for r in auto_rounds if "within_budget" in r]
        out["within_budget"] = all(r["within_budget"] for r in checked) if checked else None
    fits = [r for m, r in rows.items() if m != "auto" and _fits(r, budget)]
    at_limit = sorted(r["mode"] for r in fits if not _clear(r, budget))
    if at_limit:
        out["fixed_at_limit"] = at_limit
    best = min((r for r in fits if _clear(r, budget)), key=lambda r: r["step_s"], default=None)
    if best is not None:
        out["best_fixed"] = best["mode"]
        out["best_fixed_step_s"] = best["step_s"]
        if out["auto"] == "ok":
            ratios = per_round_ratios(auto, best)
            out["x_fixed"] = statistics.median(ratios) if ratios else auto["step_s"] / best["step_s"]
            out["x_fixed_paired"] = ratios is not None
            out["x_fixed_rounds"] = ratios
    return out


def budget_checks(entries: list[dict[str, Any]], noise: float = AUTO_NOISE) -> list[tuple[str, bool, str]]:
    """The three checks of one target over its (config, budget) entries, each ``(label, passed, detail)``:

    1. auto's promise: below the floor a ``BudgetError`` before any step, or (the floor is what auto suggests
       with the model on the device; from the host it can stream more) every step within the budget; from the
       floor up every step of every round within the budget and nothing out of memory;
    2. auto never slower than the fastest fixed mode that fits (paired ratio ≤ 1 + ``noise``), and never failing
       where a fixed mode fits;
    3. auto at least 10% faster than the fastest fixed mode that fits (ratio ≤ 1/1.10) at two budgets or more.

    Each entry carries ``config``, ``budget_bytes``, ``below_floor`` and :func:`summarize`'s keys; entries not
    measured count for no check (the detail says how many).
    """
    ran = [e for e in entries if e.get("auto") not in ("not measured", None)]
    skipped = len(entries) - len(ran)
    tail = f"; {skipped} budget(s) not measured" if skipped else ""

    def at(e: dict[str, Any]) -> str:
        return f"{e['config']} @ {format_bytes(e['budget_bytes'])}"

    def kept(e: dict[str, Any]) -> bool:
        within = e["auto"] == "ok" and e.get("within_budget") is not False
        return within or (e.get("below_floor") and e["auto"] == "BudgetError")

    broken = [e for e in ran if not kept(e)]
    under = [e for e in ran if e.get("below_floor") and e["auto"] == "ok" and kept(e)]
    promise = (
        "auto's budget is a promise: below the floor BudgetError before any step (or every step within the "
        "budget), from the floor up every step within the budget and none out of memory",
        bool(ran) and not broken,
        (
            "; ".join(
                f"{at(e)}: {e['auto']}" + (", over budget" if e.get("within_budget") is False else "")
                for e in broken
            )
            or f"{len(ran)}/{len(ran)} as promised"
        )
        + (
            f"; below the floor and within budget (from the host): {', '.join(at(e) for e in under)}"
            if under
            else ""
        )
        + tail,
    )
    compared = [e for e in ran if e.get("x_fixed") is not None]
    failed_where_fixed_fits = [e for e in ran if e.get("best_fixed") and e["auto"] != "ok"]
    slow = [e for e in compared if e["x_fixed"] > 1 + noise]
    worst = max(compared, key=lambda e: e["x_fixed"], default=None)
    never_slower = (
        f"auto never slower than the fastest fixed mode that fits (paired, auto ÷ fixed ≤ {1 + noise:.2f})",
        bool(compared) and not slow and not failed_where_fixed_fits,
        (
            f"worst {worst['x_fixed']:.3f}× at {at(worst)} vs {worst['best_fixed']}"
            if worst
            else "no budget where auto and a fixed mode both ran"
        )
        + "".join(
            f"; {at(e)}: auto {e['auto']} where {e['best_fixed']} fits" for e in failed_where_fixed_fits
        )
        + tail,
    )
    fast = [e for e in compared if e["x_fixed"] <= 1 / AUTO_FASTER]
    faster = (
        f"auto ≥ {AUTO_FASTER - 1:.0%} faster than the fastest fixed mode that fits at ≥ 2 budgets",
        len(fast) >= 2,
        (", ".join(f"{at(e)} {1 / e['x_fixed']:.2f}× vs {e['best_fixed']}" for e in fast) or "at none")
        + f" ({len(fast)} of {len(compared)} compared)"
        + tail,
    )
    return [promise, never_slower, faster]


# -- report ------------------------------------------------------------------------------------------------------


def _cell(row: dict[str, Any]) -> str:
    if row.get(NOT_MEASURED):
        return "not measured"
    if row.get("budget_error"):
        return "BudgetError"
    if row.get("oom"):
        return "OOM"
    peak = row.get("peak_allocated")
    return f"{row['step_s']:.4f} s" + ("" if peak is None else f", peak {peak / GIB:.2f} GiB")


def _gib(value: Any) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def _entries(result: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any], dict[str, Any]]]:
    return [(t, c, b) for t in result["targets"] for c in t.get("configs", []) for b in c.get("budgets", [])]


def _at_limit(entry: dict[str, Any]) -> str:
    modes = entry.get("fixed_at_limit")
    return f" ({', '.join(modes)}: at the process's limit)" if modes else ""


def markdown(result: dict[str, Any]) -> str:
    """The sweep as markdown: the headline table, the checks per target, then every budget's fixed modes."""
    lines = [
        "# auto's budget on a card of that size",
        "",
        "| target | config | budget | auto | every step within budget | peak allocated GiB | peak reserved GiB | "
        "auto step s | fastest fixed mode that fits | its step s | auto ÷ fixed (paired) | corrections | plan |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for target, config, b in _entries(result):
        rows = {r["mode"]: r for r in b.get("rows", [])}
        auto = rows.get("auto", {})
        budget = format_bytes(b["budget_bytes"]) + (" (floor)" if b.get("is_floor") else "")
        status = b.get("auto", "not measured")
        if status == "BudgetError" and b.get("below_floor"):
            status = "BudgetError (below the floor)"
        within = {True: "yes", False: "**NO**", None: "-"}[b.get("within_budget")]
        ratio = "-"
        if b.get("x_fixed") is not None:
            ratio = f"{b['x_fixed']:.3f}" + ("" if b.get("x_fixed_paired") else " (unpaired)")
        plan = ", ".join(f"{k} {v}" for k, v in (auto.get("plan_counts") or {}).items()) or "-"
        step = f"{auto['step_s']:.4f}" if measured(auto) else "-"
        fixed_step = "-" if b.get("best_fixed_step_s") is None else f"{b['best_fixed_step_s']:.4f}"
        corrections = str(auto.get("corrections", "-"))
        if auto.get("steps_at_limit"):
            corrections += f" ({auto['steps_at_limit']} step(s) at the process's limit)"
        lines.append(
            f"| {target['target']} | {config['config']} | {budget} | {status} | {within} | "
            f"{_gib(auto.get('peak_allocated'))} | {_gib(auto.get('peak_reserved'))} | {step} | "
            f"{b.get('best_fixed', '-')}{_at_limit(b)} | {fixed_step} | {ratio} | {corrections} | {plan} |"
        )
    lines += ["", "## Checks", ""]
    for target in result["targets"]:
        flat = [
            {
                "config": c["config"],
                "budget_bytes": b["budget_bytes"],
                "below_floor": b.get("below_floor"),
                **b,
            }
            for c in target.get("configs", [])
            for b in c.get("budgets", [])
        ]
        lines += [f"{target['target']}:", ""]
        if target.get(NOT_MEASURED):
            lines += [f"- not measured ({target[NOT_MEASURED]})", ""]
            continue
        lines += [
            f"- {'PASS' if ok else 'FAIL'} {label}: {detail}" for label, ok, detail in budget_checks(flat)
        ]
        lines.append("")
    lines += ["## Per target and config", ""]
    for target in result["targets"]:
        if target.get(NOT_MEASURED):
            lines += [f"**{target['target']}: not measured ({target[NOT_MEASURED]}).**", ""]
        if target.get("error"):
            lines += [f"**{target['target']}: {target['error']}**", ""]
        for config in target.get("configs", []):
            head = f"### {target['target']} ({target.get('description', '')}, {target.get('tokens')} tokens), {config['config']}"
            lines += [head, ""]
            if config.get(NOT_MEASURED) or config.get("error"):
                lines += [f"Not measured: {config.get(NOT_MEASURED) or config['error']}.", ""]
                continue
            lines.append(
                f"{config.get('config_description', '')}; {config.get('trainable_params', 0) / 1e6:.1f} M trainable. "
                + (
                    f"Floor (the budget auto's BudgetError suggests at 1 byte with the model on the device; on CUDA a "
                    f"card that holds its smallest plan, docs/cost-model.md; from the host auto may fit below it): "
                    f"{format_bytes(config['floor_bytes'])}."
                    if config.get("floor_bytes")
                    else f"Floor unknown: {config.get('floor_error', 'not probed')}."
                )
            )
            lines += [
                "",
                "| budget | process limited | resident GiB | " + " | ".join(result["modes"]) + " | note |",
            ]
            lines.append("|---|---|---|" + "---|" * (len(result["modes"]) + 1))
            for b in config.get("budgets", []):
                rows = {r["mode"]: r for r in b.get("rows", [])}
                cells = [_cell(rows[m]) if m in rows else "-" for m in result["modes"]]
                note = b.get(NOT_MEASURED) or b.get("error") or b.get("fixed_left_out") or ""
                if b.get("left_allocated_bytes"):
                    note += f" {_gib(b['left_allocated_bytes'])} GiB left allocated after its rows"
                lines.append(
                    f"| {format_bytes(b['budget_bytes'])}{' (floor)' if b.get('is_floor') else ''} | "
                    f"{'yes' if b.get('process_limited') else 'no'} | {_gib(b.get('resident_bytes'))} | "
                    + " | ".join(cells)
                    + f" | {note.strip()} |"
                )
            lines.append("")
    env = result["environment"]
    names = sorted({t.get("device_name") for t in result["targets"] if t.get("device_name")})
    lines += [
        f"Device: {', '.join(names) or env.get('device')}; torch {env.get('torch')}; {result['date']}; "
        f"commit {env.get('git_commit')}; caching allocator: {env.get('allocator_conf', 'default')}. {result['rounds']} round-robin rounds per budget ({result['warmup']} "
        f"warm-up + {result['steps']} timed steps per measurement{_floor_steps_note(result)}; auto {result['auto_warmup']} warm-up steps, the "
        f"first with its planning forward, then up to {result.get('auto_settle', 0)} more until its closed loop "
        "settled); a mode out of memory is not measured again at that budget, and after the first round only "
        f"auto and the fixed modes that fit within {CONTENDER_SPAN:.2f}x of the fastest one that fits are timed "
        "again (the others' rows are their first round). "
        "`every step within budget`: in a process limited to the budget a step over it runs out of memory, so "
        "`ok` means no step of any round did; the peaks shown are of the timed steps (every round) and must be "
        "within the budget too (auto's closed loop resets the allocator's peak at each forward, so the warm-up "
        "peak is its last warm-up step's). "
        "`auto ÷ fixed`: the median over rounds of auto's step over the fixed mode's in the same round. Each "
        "target and config ran in its own process, limited to each budget with torch.cuda.set_per_process_memory_fraction "
        "(where the weights alone exceed the budget, the model is moved to the CPU first and auto given "
        "`device=`: a trainer whose card cannot load the model loads it so). SDPA: cuDNN disabled; flash on the "
        "synthetic stack.",
    ]
    lines += _runs_note(result)
    return "\n".join(lines) + "\n"


def _steps_of(run: dict[str, Any]) -> str:
    if not run.get("steps"):  # a run recorded before the steps were
        return ""
    return f" of {run['steps']} timed step(s)" + _floor_steps_note(run, lead=" (", tail=")")


def _runs_note(result: dict[str, Any]) -> list[str]:
    """Where :func:`merge_runs` joined several runs: which budgets each one measured, and how."""
    runs: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for target, config, budget in _entries(result):
        if "run" in budget:
            key = json.dumps(budget["run"], sort_keys=True, default=str)
            where = f"{config['config']} @ {format_bytes(budget['budget_bytes'])}"
            runs.setdefault(key, (budget["run"], []))[1].append(f"{target['target']} {where}")
    if len(runs) < 2:
        return []
    return [
        "",
        "Merged from several runs, each budget from one (rounds and modes as that run measured them):",
        *(
            f"- {run['date']}, commit {run['commit']}, {run['rounds']} round(s){_steps_of(run)}, modes "
            f"{', '.join(run.get('modes') or [])}: {', '.join(where)}"
            for run, where in runs.values()
        ),
    ]


# -- parent ------------------------------------------------------------------------------------------------------


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--targets",
        default="flux,synthetic-16384",
        help=f"family names or the synthetic stack's ({', '.join(SYNTHETIC_TARGETS)})",
    )
    parser.add_argument("--preset", default="full", choices=("full", "tiny"))
    parser.add_argument("--tokens", type=int, default=None, help="default: the target's own (4096 for these)")
    parser.add_argument("--configs", default="attn,all,full", help=f"comma-separated: {', '.join(CONFIGS)}")
    parser.add_argument("--budgets", default="16GiB,24GiB,32GiB,48GiB,floor", help="sizes and 'floor'")
    parser.add_argument("--fixed", default=DEFAULT_FIXED, help="fixed modes measured beside auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps of each fixed-mode measurement")
    parser.add_argument("--auto-warmup", type=int, default=2, help="auto's (the first one plans)")
    parser.add_argument(
        "--auto-settle",
        type=int,
        default=6,
        help="then at most this many more auto warm-up steps, until its closed loop has settled",
    )
    parser.add_argument("--steps", type=int, default=1, help="timed steps per measurement")
    parser.add_argument(
        "--floor-steps",
        type=int,
        default=None,
        help="timed steps per measurement at the floor, where every mode runs near the process's limit and one "
        "step's time varies most (default: --steps)",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--stop-at", type=float, default=None, metavar="UNIX_TIME")
    parser.add_argument("--stem", default="budget-promise", help="file name of the results, without suffix")
    parser.add_argument(
        "--dry-run", action="store_true", help="check the options, print the plan, measure nothing"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="measure nothing: the first run's results with the later runs' budgets in place of its own (same "
        "size, or the floor), written as <out>/<stem>.{json,md}",
    )
    ns = parser.parse_args(argv)
    ns.targets = [t.strip() for t in ns.targets.split(",") if t.strip()]
    installed = memfit.available_adapters()
    unknown = [t for t in ns.targets if t not in SYNTHETIC_TARGETS and t not in installed]
    if unknown or not ns.targets:
        parser.error(
            f"--targets: unknown {unknown}; choose from {sorted(SYNTHETIC_TARGETS)} or {sorted(installed)}"
        )
    ns.configs = [c.strip() for c in ns.configs.split(",") if c.strip()]
    if not ns.configs or set(ns.configs) - set(CONFIGS):
        parser.error(f"--configs {ns.configs}: choose from {list(CONFIGS)}")
    budgets: list[int | str] = []
    for text in ns.budgets.split(","):
        text = text.strip()
        try:
            budgets.append(FLOOR if text == FLOOR else parse_bytes(text))
        except ValueError:
            parser.error(f"--budgets: {text!r} is neither a size (24GiB) nor 'floor'")
    ns.budgets = budgets
    names = {m.name for m in MODES}
    ns.fixed = [m.strip() for m in ns.fixed.split(",") if m.strip()]
    if set(ns.fixed) - names:
        parser.error(f"--fixed: unknown {sorted(set(ns.fixed) - names)}; choose from {sorted(names)}")
    if ns.device != "cuda":
        ns.fixed = [m for m in ns.fixed if not m.startswith("unsloth")]  # offload needs CUDA
    elif not ns.dry_run and not torch.cuda.is_available():
        parser.error("--device cuda needs CUDA (use --device cpu --preset tiny for a smoke run)")
    if ns.rounds < 1 or ns.steps < 1 or ns.warmup < 0 or ns.auto_warmup < 1:
        parser.error("--rounds and --steps at least 1, --warmup at least 0, --auto-warmup at least 1")
    if ns.floor_steps is not None and ns.floor_steps < 1:
        parser.error("--floor-steps at least 1")
    return ns


def _run_child(context: Any, job: dict[str, Any]) -> dict[str, Any]:
    """One target's child (none once the deadline passed: not worth a process and a model build)."""
    target, progress = job["target"], Path(job["progress"])
    if job["stop_at"] is not None and time.time() >= job["stop_at"]:
        return {"target": target, NOT_MEASURED: DEADLINE}
    with context.Pool(1) as pool:
        try:
            return pool.apply(_one_target, (job,))
        except Exception as exc:  # a crashed child keeps what it saved; the next target still runs
            entry = json.loads(progress.read_text()) if progress.exists() else {"target": target}
            entry["error"] = f"{type(exc).__name__}: {exc}"
            return entry


def _merge_child(entry: dict[str, Any], part: dict[str, Any], config: str) -> None:
    """One config's child result into its target's entry: the target's fields from the first child that has
    them, the config's entry (or, where the child measured none, why) after the others."""
    configs = part.pop("configs", None) or [
        {"config": config, **{k: part[k] for k in (NOT_MEASURED, "error") if k in part}}
    ]
    for key, value in part.items():
        if key not in (NOT_MEASURED, "error"):
            entry.setdefault(key, value)
    entry["configs"] += configs
    if all(c.get(NOT_MEASURED) for c in entry["configs"]):
        entry[NOT_MEASURED] = entry["configs"][0][NOT_MEASURED]
    else:
        entry.pop(NOT_MEASURED, None)


def _run_of(result: dict[str, Any]) -> dict[str, Any]:
    env = result.get("environment", {})
    return {
        "date": env.get("date", result.get("date")),
        "commit": env.get("git_commit"),
        "rounds": result.get("rounds"),
        "steps": result.get("steps"),
        "floor_steps": _floor_steps(result),
        "modes": result.get("modes"),
    }


def merge_runs(base: dict[str, Any], *later: dict[str, Any]) -> dict[str, Any]:
    """``base`` with the budgets of ``later`` runs (same target and config) in place of its budgets of the same size
    and, where a later run has a floor, of its floor (the floor moves with the code). Every budget entry records
    the run it came from (``run``: date, commit, rounds, modes), so that a report merged from several runs says
    which row is whose; the modes of every run are listed."""
    merged = json.loads(json.dumps(base, default=str))
    for entry in _entries(merged):
        entry[2].setdefault("run", _run_of(base))
    for result in later:
        run = _run_of(result)
        for target in result.get("targets", []):
            into = next((t for t in merged["targets"] if t["target"] == target["target"]), None)
            if into is None:
                merged["targets"].append(into := {**target, "configs": []})
            for config in target.get("configs", []):
                have = next((c for c in into["configs"] if c["config"] == config["config"]), None)
                if have is None:
                    into["configs"].append(have := {**config, "budgets": []})
                new = [{**b, "run": run} for b in config.get("budgets", [])]
                floor = any(b.get("is_floor") for b in new)
                sizes = {b["budget_bytes"] for b in new}
                kept = [
                    b
                    for b in have["budgets"]
                    if b["budget_bytes"] not in sizes and not (floor and b.get("is_floor"))
                ]
                have["budgets"] = sorted(kept + new, key=lambda b: b["budget_bytes"])
                if floor and "floor_bytes" in config:
                    have["floor_bytes"] = config["floor_bytes"]
                for b in have["budgets"]:  # below the floor as it now stands
                    b["below_floor"] = (
                        have.get("floor_bytes") is not None and b["budget_bytes"] < have["floor_bytes"]
                    )
        merged["modes"] = list(dict.fromkeys([*merged.get("modes", []), *result.get("modes", [])]))
    return merged


def main(argv: list[str] | None = None) -> int:
    ns = _parse(argv)
    if ns.merge:
        base, *later = (json.loads(Path(f).read_text()) for f in ns.merge)
        result = merge_runs(base, *later)
        ns.out.mkdir(parents=True, exist_ok=True)
        stem = ns.out / ns.stem
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
        stem.with_suffix(".md").write_text(markdown(result))
        return 0
    plan = (
        f"would measure {ns.targets} ({ns.preset}): configs {ns.configs}, budgets "
        f"{[b if b == FLOOR else format_bytes(b) for b in ns.budgets]}, auto and fixed {ns.fixed} in {ns.rounds} "
        f"rounds of {ns.warmup} warm-up (auto {ns.auto_warmup}) + {ns.steps} timed steps"
        f"{f' ({ns.floor_steps} at the floor)' if ns.floor_steps else ''}, one process per target "
        "and config"
    )
    if ns.dry_run:
        print(plan, flush=True)
        return 0
    ns.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "suite": "budget-promise",
        "preset": ns.preset,
        "configs": ns.configs,
        "budgets": [b if b == FLOOR else int(b) for b in ns.budgets],
        "modes": ["auto", *ns.fixed],
        "rounds": ns.rounds,
        "warmup": ns.warmup,
        "auto_warmup": ns.auto_warmup,
        "auto_settle": ns.auto_settle,
        "steps": ns.steps,
        "floor_steps": ns.floor_steps or ns.steps,
        "noise_tolerance": AUTO_NOISE,
        "date": time.strftime("%Y-%m-%d"),
        # no CUDA in this process: each target's child has the card to itself (it reports the device name)
        "environment": run_stamp("budget-promise", ns.device),
        "targets": [],
    }
    stem = ns.out / ns.stem
    context = multiprocessing.get_context("spawn")  # a fresh CUDA context and allocator per target
    with tempfile.TemporaryDirectory() as scratch:
        for target in ns.targets:
            entry: dict[str, Any] = {"target": target, "configs": []}
            result["targets"].append(entry)
            for config in ns.configs:  # a process per config: nothing one leaves behind reaches the next
                progress = Path(scratch) / f"{target}-{config}.json"
                job = {
                    **vars(ns),
                    "out": str(ns.out),
                    "target": target,
                    "configs": [config],
                    "progress": str(progress),
                }
                _merge_child(entry, _run_child(context, job), config)
                stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
                stem.with_suffix(".md").write_text(markdown(result))
    text = markdown(result)
    stem.with_suffix(".md").write_text(text)
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
