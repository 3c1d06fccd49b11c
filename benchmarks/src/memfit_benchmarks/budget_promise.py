"""Does ``auto`` keep its budget on a card of that size? Each budget runs in its own process whose CUDA memory is
limited to the budget (``torch.cuda.set_per_process_memory_fraction``: the caching allocator cannot reserve
more, as on a card of that size), and every step's peak allocated and peak reserved are recorded.

    python -m memfit_benchmarks.budget_promise --family flux --budgets 24GiB,32GiB --out DIR     # GPU
    python -m memfit_benchmarks.budget_promise --family flux --preset tiny --device cpu --budgets 2MiB --out DIR

Per budget: the family's preset (random weights; bf16 on CUDA), PEFT LoRA r16 on the linears named by
``--lora-targets`` (default: ``to_q,to_k,to_v,to_out.0``, the common Flux recipe; ``all`` for every linear of
the blocks), inputs at ``--tokens``; then ``auto`` at the budget for ``--steps`` steps, and each mode of
``--fixed`` for comparison in the same process. A step that runs out of memory is recorded (``oom``), never
raised. Off CUDA nothing limits memory: the CPU run only proves the script (the budget counts held bytes).
Writes ``budget-promise-<family>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.units import format_bytes, parse_bytes
from memfit_benchmarks.environment import run_stamp

FLUX_ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")
GIB = 1 << 30


def _targets(model: torch.nn.Module, adapter: memfit.FamilyAdapter, spec: str) -> list[str]:
    names = {id(m): n for n, m in model.named_modules()}
    wanted = None if spec == "all" else tuple(s.strip() for s in spec.split(","))
    out = []
    for _path, _index, block in adapter.iter_blocks(model):
        for name, module in block.named_modules():
            if isinstance(module, torch.nn.Linear) and (wanted is None or name.endswith(wanted)):
                out.append(f"{names[id(block)]}.{name}")
    if not out:
        raise ValueError(f"no nn.Linear in the blocks matches --lora-targets {spec!r}")
    return out


def _one_budget(args: dict[str, Any]) -> dict[str, Any]:
    """Runs in a child process: everything for one budget."""
    from peft import LoraConfig, inject_adapter_in_model

    device = torch.device(args["device"])
    cuda = device.type == "cuda"
    budget = args["budget"]
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)  # cuDNN's SDPA backward fails on this stack (README)
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), torch.cuda.current_device())
    adapter = memfit.get_adapter(args["family"])
    preset = adapter.presets[args["preset"]]
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.perf_counter()
    model = preset.build(dtype=dtype, device=device)
    build_s = time.perf_counter() - started
    targets = _targets(model, adapter, args["lora_targets"])
    inject_adapter_in_model(LoraConfig(r=16, lora_alpha=16, target_modules=targets), model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name:
            p.data = p.data.to(dtype)
    batch = preset.inputs(model, tokens=args["tokens"], generator=torch.Generator().manual_seed(0))
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    out = {
        "budget_bytes": budget,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "build_seconds": build_s,
        "lora_targets": len(targets),
        "modes": [],
    }
    configs = [
        ("auto", {"gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": budget})
    ]
    configs += [(m, {"gradient_checkpointing_backend": m}) for m in args["fixed"]]
    for name, cfg in configs:
        out["modes"].append(
            _run_mode(model, adapter, batch, name, {"gradient_checkpointing": True, **cfg}, args)
        )
    return out


def _run_mode(model, adapter, batch, name: str, cfg: dict, args: dict) -> dict[str, Any]:
    cuda = next(model.parameters()).is_cuda
    row: dict[str, Any] = {"mode": name, "steps": []}
    handle = None
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", memfit.MemfitWarning)
            handle = memfit.apply(model, cfg, adapter=adapter)
            for _ in range(args["steps"]):
                model.zero_grad(set_to_none=True)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                adapter.loss(model(**batch)).backward()
                if cuda:
                    torch.cuda.synchronize()
                step = {"seconds": time.perf_counter() - t0}
                if cuda:
                    step["peak_allocated"] = torch.cuda.max_memory_allocated()
                    step["peak_reserved"] = torch.cuda.max_memory_reserved()
                row["steps"].append(step)
            model(**batch)  # the last step's measurement (auto reads it at the next forward's start)
            stats = handle.stats()
            row["shapes"] = stats.get("shapes")
            row["plan"] = handle.plan.describe() if handle.plan is not None else None
        row["warnings"] = [str(w.message) for w in caught if issubclass(w.category, memfit.MemfitWarning)]
    except torch.OutOfMemoryError as exc:
        row["oom"] = str(exc).splitlines()[0]
    except memfit.BudgetError as exc:
        row["budget_error"] = str(exc)
    finally:
        if handle is not None:
            handle.remove()
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()
    peaks = [s.get("peak_allocated") for s in row["steps"] if s.get("peak_allocated") is not None]
    row["within_budget_every_step"] = bool(peaks) and all(p <= args["budget"] for p in peaks)
    return row


def _markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"# auto's budget on a card of that size: {result['family']} ({result['preset']}), "
        f"LoRA r16 on {result['lora_targets']}, {result['tokens']} tokens",
        "",
        "| budget | mode | steps within budget | peak allocated per step (GiB) | peak reserved (max, GiB) | "
        "median step (s) | corrections |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in result["budgets"]:
        for row in entry.get("modes", []):
            steps = row["steps"]
            allocated = " ".join(f"{s['peak_allocated'] / GIB:.2f}" for s in steps if "peak_allocated" in s)
            reserved = max((s.get("peak_reserved", 0) for s in steps), default=0) / GIB
            times = sorted(s["seconds"] for s in steps[1:]) or [0.0]
            note = row.get("oom") and "OOM" or row.get("budget_error") and "BudgetError" or ""
            within = sum(1 for s in steps if s.get("peak_allocated", 0) <= entry["budget_bytes"])
            corrections = sum(s.get("corrections", 0) for s in row.get("shapes") or [])
            lines.append(
                f"| {format_bytes(entry['budget_bytes'])} | {row['mode']} | {within}/{len(steps)} {note} | "
                f"{allocated} | {reserved:.2f} | {times[len(times) // 2]:.3f} | {corrections} |"
            )
        if "error" in entry:
            lines.append(f"| {format_bytes(entry['budget_bytes'])} | (process) | {entry['error']} | | | | |")
    names = {entry.get("device_name") for entry in result["budgets"] if entry.get("device_name")}
    lines += [
        "",
        f"Device: {', '.join(sorted(names)) or env.get('device')}; torch {env.get('torch')}; "
        f"{result['date']}. SDPA: default dispatch with cuDNN SDPA disabled. Each budget ran in its own process "
        "limited to the budget with torch.cuda.set_per_process_memory_fraction.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="flux")
    parser.add_argument("--preset", default="full")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--budgets", default="24GiB", help="comma-separated sizes")
    parser.add_argument("--lora-targets", default=",".join(FLUX_ATTENTION))
    parser.add_argument(
        "--fixed", default="torch,unsloth", help="fixed backends measured beside auto ('' for none)"
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args(argv)
    ns.out.mkdir(parents=True, exist_ok=True)
    fixed = [m for m in ns.fixed.split(",") if m]
    if ns.device != "cuda":
        fixed = [m for m in fixed if not m.startswith("unsloth")]
    result: dict[str, Any] = {
        "family": ns.family,
        "preset": ns.preset,
        "tokens": ns.tokens,
        "lora_targets": ns.lora_targets,
        "date": time.strftime("%Y-%m-%d"),
        # no CUDA in this process: each budget's child has the card to itself (it reports the device name)
        "environment": run_stamp("budget-promise", ns.device),
        "budgets": [],
    }
    context = multiprocessing.get_context("spawn")  # a fresh CUDA context and allocator per budget
    for text in ns.budgets.split(","):
        budget = parse_bytes(text.strip())
        job = {**vars(ns), "budget": budget, "fixed": fixed, "out": str(ns.out)}
        with context.Pool(1) as pool:
            try:
                entry = pool.apply(_one_budget, (job,))
            except Exception as exc:  # a crashed child is a row, not the end of the sweep
                entry = {"budget_bytes": budget, "error": f"{type(exc).__name__}: {exc}"}
        result["budgets"].append(entry)
        print(json.dumps({"budget": text, **{k: v for k, v in entry.items() if k != "modes"}}), flush=True)
        for row in entry.get("modes", []):
            print(
                f"  {row['mode']}: within budget every step = {row['within_budget_every_step']}", flush=True
            )
    stem = ns.out / f"budget-promise-{ns.family}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    stem.with_suffix(".md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
