"""The ``auto`` planner against the fixed modes, at memory budgets between the smallest and the no-checkpoint peak.

    python -m memfit_benchmarks.auto_sweep --out DIR                                   # GPU: the default targets
    python -m memfit_benchmarks.auto_sweep --out DIR --device cpu --preset tiny --targets flux   # CPU smoke

Per target, in one process on one model: (1) every fixed mode of ``runner.MODES`` the target supports
(``families.skip_reason``: no offload off CUDA, ...), each with ``runner.measure_mode``; (2) ``--budgets``
budgets evenly spaced from the smallest fixed-mode peak (included) up to the ``none`` peak (excluded; the
device's memory when ``none`` runs out of memory), and one budget 1% below each step of the fixed modes'
frontier (``gap_budgets``: where fixed modes fall back to a slower one; ``--no-gaps`` to skip); (3) at each budget, ``measure_mode`` with
``gradient_checkpointing_backend: auto`` at that budget (its first warm-up step makes the plan, with one
profiling forward), recording step time, peak, whether the peak is within the budget, the plan, and the
fastest fixed mode whose peak fits the same budget. A budget the planner cannot reach is an ``unreachable``
row (``memfit.errors.BudgetError``), and one more row then runs at the smallest peak the planner reported (its
own floor, when below the high end). On CUDA "peak" is ``torch.cuda.max_memory_allocated`` over the timed
steps; off CUDA there is no peak to read, so every memory figure (fixed modes, budgets, auto) is the
activation bytes autograd holds (``memfit.measure.measure_step``) and timings only show that the script runs.

Targets (default order: the most important first, so a run cut by a deadline keeps them):
``synthetic-4096`` (3072 wide × 15 blocks, 4096 tokens, PEFT LoRA r16, flash SDPA), ``flux`` and ``wan``
(the family preset with PEFT LoRA r16 on every block linear, the preset's default tokens),
``synthetic-16384``. Any installed family name is a target. ``--preset tiny``: each family's tiny preset,
the synthetic stack's CPU smoke shape. Writes ``auto-<target>-<preset>.json`` (rewritten after every
row; ``complete`` turns true at the end), then its markdown (table + the checks) and PNG as soon as the
target is done.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.adapters.spec import FamilyAdapter
from memfit.units import parse_bytes
from memfit_benchmarks.auto_report import AUTO_NOISE, auto_checks, fmt_bytes
from memfit_benchmarks.environment import environment
from memfit_benchmarks.families import _progress, build_lora_model, family_payload, skip_reason
from memfit_benchmarks.modes import MODES, Mode
from memfit_benchmarks.options import benchmark_device
from memfit_benchmarks.replan import planned
from memfit_benchmarks.results import write_json
from memfit_benchmarks.runner import add_ratios, measure_mode
from memfit_benchmarks.shapes import SYNTHETIC_TARGETS
from memfit_benchmarks.training import TrainingConfig, describe, prepare

DEFAULT_TARGETS = ["synthetic-4096", "flux", "wan", "synthetic-16384"]
SDPA = "default dispatch, cuDNN SDPA disabled (flash on the synthetic stack)"


def auto_config(budget: int) -> dict[str, Any]:
    return {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_memory_budget": int(budget),
    }


def spread_budgets(low: int, high: int, n: int) -> list[int]:
    """``n`` budgets evenly spaced from ``low`` (included) to ``high`` (excluded)."""
    return [int(low + (high - low) * i / n) for i in range(n)]


GAP_MARGIN = 0.01  # a gap budget sits this share of the fixed mode's memory below it


def frontier(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fixed modes no other mode beats on both memory and time, by memory (each faster than the last)."""
    out: list[dict[str, Any]] = []
    for r in sorted((r for r in rows if memory_of(r) is not None), key=lambda r: (memory_of(r), r["step_s"])):
        if not out or r["step_s"] < out[-1]["step_s"]:
            out.append(r)
    return out


def gap_budgets(rows: list[dict[str, Any]], low: int, high: int) -> list[int]:
    """Budgets just below each step of the fixed modes' frontier (and below ``high``): where a user of fixed
    modes must fall back to the next slower one, so a per-block plan has the most to win. A job that *almost*
    fits is the common case, and this is exactly it."""
    edges = [memory_of(r) for r in frontier(rows)[1:]]
    if not any(r["mode"] == "none" and memory_of(r) is not None for r in rows):
        edges.append(high)  # none ran out of memory: the card's size is the last step
    return sorted({int(m * (1 - GAP_MARGIN)) for m in edges if low < int(m * (1 - GAP_MARGIN)) < high})


def memory_of(row: dict[str, Any]) -> int | None:
    """The row's memory figure: peak allocated on CUDA, held activation bytes elsewhere."""
    if row.get("oom"):
        return None
    return row["peak_allocated"] if row.get("peak_allocated") is not None else row.get("held_bytes")


def best_fixed(rows: list[dict[str, Any]], budget: int) -> dict[str, Any] | None:
    """The fastest measured fixed-mode row whose memory figure is within ``budget``."""
    fits = [r for r in rows if memory_of(r) is not None and memory_of(r) <= budget]
    return min(fits, key=lambda r: r["step_s"], default=None)


def build_target(name: str, preset: str, device: torch.device, dtype: torch.dtype, rank: int):
    """(model, inputs, adapter, info) of one target; ``info`` goes into the payload."""
    if name.startswith("synthetic"):
        from memfit_benchmarks.shapes import SHAPES, TINY_SHAPE
        from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs

        label, width, depth, tokens = TINY_SHAPE if preset == "tiny" else SHAPES[SYNTHETIC_TARGETS[name]]
        model = build(dim=width, depth=depth, dtype=dtype, device=str(device))
        batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
        prepare(model, batch, TrainingConfig.LORA_ALL, SYNTHETIC, dtype=dtype, rank=rank)
        return (
            model,
            batch,
            SYNTHETIC,
            {
                "description": f"synthetic {label}",
                "width": width,
                "depth": depth,
                "tokens": tokens,
                "config": TrainingConfig.LORA_ALL.value,
                "config_description": describe(TrainingConfig.LORA_ALL, dtype=dtype, rank=rank),
                "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
                "total_params": sum(p.numel() for p in model.parameters()),
            },
        )
    adapter = memfit.available_adapters()[name]
    tokens = adapter.presets[preset].default_tokens
    model, batch, info = build_lora_model(
        adapter, preset, dtype=dtype, device=device, rank=rank, tokens=tokens
    )
    return (
        model,
        batch,
        adapter,
        {
            "description": adapter.presets[preset].description,
            "tokens": tokens,
            "lora_rank": rank,
            **info,
            "config": TrainingConfig.LORA_ALL.value,
            "config_description": describe(TrainingConfig.LORA_ALL, dtype=dtype, rank=rank),
        },
    )


def _held_bytes(model, batch, adapter: FamilyAdapter, config: dict[str, Any] | None) -> int:
    """Activation bytes autograd holds between forward and backward (one step after one warm-up step)."""
    from memfit.measure import measure_step

    return measure_step(
        model, batch, adapter.loss, config=config, adapter=adapter, warmup=1, steps=1
    ).held_bytes


class _Measure:
    """Measures rows on one built target (model, inputs, adapter) with the run's steps/warm-up."""

    def __init__(self, model, batch, adapter: FamilyAdapter, args: argparse.Namespace, cuda: bool) -> None:
        self.model, self.batch, self.adapter, self.args, self.cuda = model, batch, adapter, args, cuda

    def row(self, mode: Mode, **kw: Any) -> dict[str, Any]:
        row = measure_mode(
            self.model,
            self.batch,
            self.adapter.loss,
            mode,
            adapter=self.adapter,
            warmup=self.args.warmup,
            steps=self.args.steps,
            **kw,
        )
        if not self.cuda and not row.get("oom"):
            row["held_bytes"] = _held_bytes(self.model, self.batch, self.adapter, mode.config)
        return row

    def fixed(self, device: torch.device) -> tuple[list[dict[str, Any]], dict[str, str]]:
        rows, skipped = [], {}
        for mode in _progress(MODES, desc="fixed modes", unit="mode"):
            reason = skip_reason(mode, self.adapter, device)
            if reason is not None:
                skipped[mode.name] = reason
                continue
            rows.append(self.row(mode))
            _print_row(rows[-1])
        add_ratios(rows)
        return rows, skipped

    def auto(self, budget: int, fixed_rows: list[dict[str, Any]]) -> dict[str, Any]:
        from memfit.errors import BudgetError

        try:
            row = self.row(Mode("auto", auto_config(budget)), inspect=planned)
        except BudgetError as exc:
            row = {
                "mode": "auto",
                "unreachable": True,
                "oom": False,
                "error": str(exc),
                "smallest_peak_bytes": getattr(exc, "smallest_peak_bytes", None),
            }
        row["budget_bytes"] = budget
        best = best_fixed(fixed_rows, budget)
        row["best_fixed"] = (
            None
            if best is None
            else {"mode": best["mode"], "step_s": best["step_s"], "memory_bytes": memory_of(best)}
        )
        memory = memory_of(row) if not row.get("unreachable") else None
        row["memory_bytes"] = memory
        row["within_budget"] = None if memory is None else memory <= budget
        if best is not None and row.get("step_s"):
            # Step times of one mode drift by several % over a run: compare against the fixed mode measured again
            # right after, and
            # with --pairs N > 1 alternate the two N times and compare medians.
            fixed_steps: list[float] = []
            auto_steps = [row["step_s"]]
            # every timed step of each run, in order (is a run's first step slower: warm-up left over?)
            auto_times, fixed_times = [row.get("step_times_s")], []
            for i in range(self.args.pairs if self.args.adjacent else 0):
                if i:
                    again_auto = self.row(Mode("auto", auto_config(budget)))
                    if again_auto.get("step_s"):
                        auto_steps.append(again_auto["step_s"])
                        auto_times.append(again_auto.get("step_times_s"))
                again = self.row(Mode(best["mode"], best["config"]))
                if again.get("step_s"):
                    fixed_steps.append(again["step_s"])
                    fixed_times.append(again.get("step_times_s"))
            row["step_times_s_runs"] = auto_times
            if fixed_steps:
                row["best_fixed"]["step_s_adjacent"] = statistics.median(fixed_steps)
                row["best_fixed"]["step_times_s_adjacent"] = fixed_times
            if len(auto_steps) > 1:
                row["step_s_pairs"], row["best_fixed"]["step_s_pairs"] = auto_steps, fixed_steps
                row["step_s"] = statistics.median(auto_steps)
            fixed_step = row["best_fixed"].get("step_s_adjacent") or best["step_s"]
            row["speedup"] = fixed_step / row["step_s"]
            row["speedup_vs_first_fixed_run"] = best["step_s"] / row["step_s"]
        _print_row(row)
        return row


def _print_row(row: dict[str, Any]) -> None:
    head = f"[{row['mode']}" + (f" @ {fmt_bytes(row['budget_bytes'])}]" if "budget_bytes" in row else "]")
    if row.get("unreachable"):
        print(f"{head} unreachable: {row['error']}", flush=True)
    elif row.get("oom"):
        print(f"{head} OOM", flush=True)
    else:
        memory = memory_of(row)
        extra = f", speedup {row['speedup']:.3f}" if "speedup" in row else ""
        print(
            f"{head} {row['step_s']:.4f} s, memory {fmt_bytes(memory)}"
            + extra
            + (f", plan {row['plan_counts']}" if row.get("plan_counts") else ""),
            flush=True,
        )


def budget_range(fixed_rows: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """Low end (smallest fixed-mode memory, included) and high end (``none``'s, excluded) of the budgets."""
    measured = [r for r in fixed_rows if memory_of(r) is not None]
    if not measured:
        raise RuntimeError("no fixed mode was measured: nothing to spread the budgets between")
    low = min(measured, key=memory_of)
    none = next((r for r in measured if r["mode"] == "none"), None)
    if none is not None:
        return {
            "low_bytes": memory_of(low),
            "low_mode": low["mode"],
            "high_bytes": memory_of(none),
            "high_source": "none",
        }
    if device.type != "cuda":
        raise RuntimeError("the none row was not measured: no high end for the budgets")
    total = torch.cuda.get_device_properties(device).total_memory
    return {
        "low_bytes": memory_of(low),
        "low_mode": low["mode"],
        "high_bytes": total,
        "high_source": "device memory (none ran out of memory)",
    }


def planner_floor(rows: list[dict[str, Any]], high: int) -> int | None:
    """The smallest peak the planner reported when it refused a budget, if below ``high`` and not yet measured."""
    floors = {r["smallest_peak_bytes"] for r in rows if r.get("unreachable") and r.get("smallest_peak_bytes")}
    floor = max(floors, default=None)
    measured = {r["budget_bytes"] for r in rows}
    return floor if floor is not None and floor < high and floor not in measured else None


def run_target(
    name: str,
    args: argparse.Namespace,
    device: torch.device,
    env: dict[str, Any],
    save: Callable[[dict[str, Any]], None],
    fixed_done: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Fixed modes, then ``auto`` at each budget; ``save`` is called with the payload after the fixed modes and
    after every budget (``complete`` stays False until the last), so a run cut by a deadline keeps its rows.
    ``fixed_done`` gets the payload once the fixed modes are measured."""
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    synthetic = name.startswith("synthetic")
    payload: dict[str, Any] = {
        **env,
        "target": name,
        "preset": args.preset,
        "dtype": str(dtype).removeprefix("torch."),
        "batch": 1,
        "steps": args.steps,
        "warmup": args.warmup,
        "memory_metric": "peak_allocated" if cuda else "held_bytes",
        "fixed_rows": [],
        "skipped": {},
        "auto_rows": [],
        "complete": False,
    }
    if cuda and synthetic:
        payload["sdpa_backend"] = "flash (cuDNN SDPA disabled)"
    model = batch = None
    try:
        model, batch, adapter, info = build_target(name, args.preset, device, dtype, args.rank)
        payload.update(info)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        pin = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if cuda and synthetic else contextlib.nullcontext()
        measure = _Measure(model, batch, adapter, args, cuda)
        with pin:
            payload["fixed_rows"], payload["skipped"] = measure.fixed(device)
            if fixed_done is not None:
                fixed_done(payload)
            payload.update(budget_range(payload["fixed_rows"], device))
            budgets = spread_budgets(payload["low_bytes"], payload["high_bytes"], args.budgets)
            payload["gap_budgets"] = (
                gap_budgets(payload["fixed_rows"], payload["low_bytes"], payload["high_bytes"])
                if args.gaps
                else []
            )
            if args.gap_range is not None:  # one share of the gaps: another run measures the rest
                low, high = args.gap_range
                payload["gap_budgets"] = [b for b in payload["gap_budgets"] if low <= b < high]
            payload["budgets"] = sorted({*budgets, *payload["gap_budgets"]})
            save(payload)
            for budget in _progress(payload["budgets"], desc=f"{name} auto", unit="budget"):
                payload["auto_rows"].append(measure.auto(budget, payload["fixed_rows"]))
                save(payload)
            floor = planner_floor(payload["auto_rows"], payload["high_bytes"])
            if (
                floor is not None
            ):  # auto at its own smallest reachable peak, between the refused budgets and the rest
                payload["auto_rows"].append(
                    {**measure.auto(floor, payload["fixed_rows"]), "planner_floor": True}
                )
                payload["auto_rows"].sort(key=lambda r: r["budget_bytes"])
        payload["complete"] = True
        payload["checks"] = [
            {"label": label, "ok": ok, "detail": detail}
            for label, ok, detail in auto_checks(payload["auto_rows"])
        ]
    except Exception as exc:  # one broken target must not cost the others their GPU time
        payload["error"] = f"{type(exc).__name__}: {exc}"
        payload["traceback"] = traceback.format_exc()
        print(payload["traceback"], flush=True)
    finally:
        del model, batch
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return payload


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--targets",
        default=",".join(DEFAULT_TARGETS),
        help=f"comma-separated: {', '.join(SYNTHETIC_TARGETS)} or installed family names",
    )
    parser.add_argument("--budgets", type=int, default=6, help="evenly spaced budgets per target")
    parser.add_argument(
        "--no-gaps",
        dest="gaps",
        action="store_false",
        help="skip the budgets just below each step of the fixed modes' frontier",
    )
    parser.add_argument(
        "--gap-range",
        default=None,
        metavar="LOW:HIGH",
        help="only the frontier-gap budgets from LOW up to (not including) HIGH, either may be left "
        "out (40GiB: or :40GiB): a target whose gaps take longer than one run may have is split "
        "over runs by size (the gaps' order depends on measured times, their sizes do not)",
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="warm-up steps per row (with auto, the first one includes the profiling forward)",
    )
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--preset", default="full", choices=("full", "tiny"))
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank of the family targets")
    parser.add_argument("--no-render", action="store_true", help="write JSON only")
    parser.add_argument(
        "--pairs",
        type=int,
        default=1,
        help="alternate auto and the fastest fitting fixed mode this many times per budget and "
        "compare medians (default 1: auto, then the fixed mode once)",
    )
    parser.add_argument(
        "--no-adjacent",
        dest="adjacent",
        action="store_false",
        help="compare auto with the fixed modes' first measurement only (default: the fastest "
        "fitting fixed mode is measured again right after each auto row)",
    )
    args = parser.parse_args(argv)
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    installed = memfit.available_adapters()
    unknown = [t for t in args.targets if t not in SYNTHETIC_TARGETS and t not in installed]
    if unknown:
        parser.error(
            f"unknown target(s) {unknown}: {sorted(SYNTHETIC_TARGETS)} or one of {sorted(installed)}"
        )
    if args.gap_range is not None:
        if not args.gaps:
            parser.error("--gap-range selects among the frontier-gap budgets: drop --no-gaps")
        text = args.gap_range
        low, sep, high = text.partition(":")
        try:
            args.gap_range = (parse_bytes(low) if low else 0, parse_bytes(high) if high else float("inf"))
        except ValueError:
            sep = ""
        if not sep or args.gap_range[0] >= args.gap_range[1]:
            parser.error(
                f"--gap-range takes LOW:HIGH sizes, LOW below HIGH (e.g. 40GiB: or :40GiB), not {text!r}"
            )
    if args.budgets < 0 or (args.budgets == 0 and not args.gaps):
        parser.error("--budgets must be at least 1 (or 0 with the frontier-gap budgets)")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    if args.pairs > 1 and not args.adjacent:
        parser.error(
            "--pairs alternates auto with the fixed mode measured again: it needs the adjacent runs "
            "(drop --no-adjacent)"
        )
    if args.warmup < 1:
        parser.error("--warmup must be at least 1 (auto plans during the first warm-up step)")
    return args


def main(argv: list[str] | None = None) -> list[Path]:
    args = _parse(argv)
    device = benchmark_device(
        args.device, without_cuda="--device cuda needs CUDA (use --device cpu --preset tiny for a smoke run)"
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {**environment("auto", device, sdpa=SDPA), "noise_tolerance": AUTO_NOISE}
    print(json.dumps(env, indent=1), flush=True)
    written: list[Path] = []
    family_files: list[Path] = []  # a family target's fixed rows, also written as that family's results
    for name in args.targets:
        path = out / f"auto-{name}-{args.preset}.json"

        def save(payload: dict[str, Any], path: Path = path) -> None:
            path.write_text(json.dumps(payload, indent=1, default=str))

        def save_family_rows(payload: dict[str, Any], name: str = name) -> None:
            if name not in SYNTHETIC_TARGETS:
                family_files.append(write_family_rows(payload, args, env, out))

        save(run_target(name, args, device, env, save, save_family_rows))
        written.append(path)
        print(f"wrote {path}", flush=True)
    if not args.no_render:
        from memfit_benchmarks.render import render_files

        render_files([*written, *family_files])
    return written


def write_family_rows(
    payload: dict[str, Any], args: argparse.Namespace, env: dict[str, Any], out: Path
) -> Path:
    """A family target's fixed rows are the family sweep's rows (same builder, inputs, modes and timing):
    write them as that family's results too (its ``lora-all`` entry), so one run serves both tables."""
    name = payload["target"]
    dtype = getattr(torch, payload["dtype"])
    family = family_payload(
        name,
        args.preset,
        {k: v for k, v in env.items() if k != "noise_tolerance"},
        dtype=dtype,
        tokens=payload["tokens"],
        rank=args.rank,
    )
    entry = {
        "config": TrainingConfig.LORA_ALL.value,
        "config_description": describe(TrainingConfig.LORA_ALL, dtype=dtype, rank=args.rank),
        "label": family["preset_description"] or args.preset,
        "tokens": payload["tokens"],
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": payload["fixed_rows"],
        "skipped": payload["skipped"],
    }
    for key in ("lora_targets_count", "trainable_params", "total_params"):
        if key in payload:
            entry[key] = payload[key]
    family.update(
        configs=[entry["config"]],
        results=[entry],
        input_shapes=payload.get("input_shapes"),
        measured_by="memfit_benchmarks.auto_sweep (its fixed modes, before the auto rows)",
    )
    path = write_json(out / "families" / f"family-{name}-{args.preset}.json", family)
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    main()
