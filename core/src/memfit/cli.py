"""``memfit`` command line: ``memfit fit`` (find the configuration that fits) and ``memfit list``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from memfit.adapters.discovery import available_adapters, get_adapter
from memfit.errors import MemfitError

# Wide enough for the ladder table when output is a file or CI log (rich defaults to 80 columns there).
console = Console(width=None if sys.stdout.isatty() else 120)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="memfit", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    fit = sub.add_parser("fit", help="measure the decision ladder and recommend a config that fits a budget")
    fit.add_argument("--family", default="flux", help="installed adapter family (default: flux)")
    fit.add_argument("--preset", default="tiny", help="adapter preset: tiny (default, CPU-friendly) or full")
    fit.add_argument(
        "--tokens", type=int, default=None, help="image tokens per sample (default: the preset's)"
    )
    fit.add_argument("--batch", type=int, default=1)
    fit.add_argument(
        "--budget",
        default=None,
        help="memory budget, e.g. 24GiB or 3MiB (default on CUDA: the card's free memory; on CPU: none)",
    )
    fit.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    fit.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: bfloat16 on CUDA, float32 on CPU",
    )
    fit.add_argument(
        "--regime",
        default="frozen",
        choices=["frozen", "full"],
        help="frozen base weights with input gradients (default), or full fine-tuning",
    )
    fit.add_argument("--steps", type=int, default=3, help="timed steps per rung (after one warm-up)")
    fit.add_argument("--json", dest="json_path", default=None, help="write the report as JSON to this path")
    fit.add_argument("--plot", dest="plot_path", default=None, help="write a memory/time PNG to this path")

    sub.add_parser("list", help="show installed adapters, their model classes and declared scopes")

    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return _cmd_list()
        return _cmd_fit(args)
    except MemfitError as exc:
        console.print(f"[bold red]error:[/] {exc}")
        return 2


def _cmd_list() -> int:
    adapters = available_adapters()
    if not adapters:
        console.print("No memfit adapters installed. Install one, e.g. `pip install memfit-flux`.")
        return 0
    table = Table(title="installed memfit adapters")
    for col in ("family", "model classes", "block lists", "scopes", "verified diffusers", "presets"):
        table.add_column(col)
    for name, a in sorted(adapters.items()):
        table.add_row(
            name,
            ", ".join(a.model_classes),
            ", ".join(a.block_lists),
            ", ".join(a.scopes()),
            ", ".join(a.verified_diffusers) or "-",
            ", ".join(a.presets),
        )
    console.print(table)
    return 0


def _cmd_fit(args: argparse.Namespace) -> int:
    from memfit.fit import find_fit
    from memfit.units import format_bytes, parse_bytes

    adapter = get_adapter(args.family)
    if args.preset not in adapter.presets:
        raise MemfitError(
            f"family {args.family!r} has no preset {args.preset!r}; available: {', '.join(adapter.presets)}"
        )
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MemfitError("--device cuda was asked for but CUDA is not available; use --device cpu")
    dtype = (
        getattr(torch, args.dtype)
        if args.dtype
        else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    )
    preset = adapter.presets[args.preset]
    try:
        budget = parse_bytes(args.budget) if args.budget else None
    except ValueError:
        raise MemfitError(
            f"--budget {args.budget!r} is not a size; write e.g. 24GiB, 512MiB or a number of bytes"
        ) from None
    if budget is None and device.type == "cuda":
        budget = torch.cuda.mem_get_info(device)[0]

    console.print(
        f"[bold]memfit fit[/] family={adapter.name} preset={args.preset} ({preset.description}) "
        f"device={device} dtype={str(dtype).removeprefix('torch.')} regime={args.regime}"
    )
    if device.type == "cpu":
        console.print(
            "No GPU: measuring activation bytes held for backward (saved-tensor accounting) and CPU "
            "step time; peaks on a GPU add weights, gradients and workspace."
        )
    model = preset.build(dtype=dtype, device=device)
    for p in model.parameters():
        p.requires_grad_(args.regime == "full")
    g = torch.Generator().manual_seed(0)
    inputs = preset.inputs(model, tokens=args.tokens or preset.default_tokens, batch=args.batch, generator=g)
    if args.regime == "frozen":
        inputs["hidden_states"] = inputs["hidden_states"].requires_grad_(True)

    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring rungs", total=None)

        def on_rung(result: Any) -> None:
            progress.update(task, description=f"measured {result.rung.name}")

        report = find_fit(
            model,
            inputs,
            adapter.loss,
            adapter=adapter,
            budget_bytes=budget,
            steps=args.steps,
            on_rung=on_rung,
        )

    table = Table(
        title=f"decision ladder ({report.metric}; budget {format_bytes(budget) if budget else 'none'})"
    )
    for col in ("rung", "held activations", "peak allocated", "step", "× none", "fits"):
        table.add_column(col, justify="right" if col not in ("rung", "fits") else "left")
    for r in report.results:
        m = r.measurement
        table.add_row(
            r.rung.name,
            format_bytes(m.held_bytes),
            format_bytes(m.peak_bytes),
            f"{m.step_seconds * 1e3:.1f} ms",
            f"{r.ratio_to_none:.2f}" if r.ratio_to_none else "-",
            "yes" if r.fits else "no",
        )
    console.print(table)
    if report.recommended is None:
        smallest = min(r.budget_bytes_used for r in report.results)
        console.print(
            f"[bold red]Nothing fits[/] the budget of {format_bytes(budget)}: the smallest measured is "
            f"{format_bytes(smallest)}. Lower the resolution/batch, or raise the budget."
        )
        code = 1
    else:
        fastest = min((r for r in report.results if r.fits), key=lambda r: r.measurement.step_seconds)
        if fastest is not report.recommended:  # see memfit.fit, "Ties"
            console.print(
                f"{fastest.rung.name} measured fastest, but within the spread of the step times: the "
                f"leaner {report.recommended.rung.name} is as fast and leaves more headroom."
            )
        console.print(
            f"Recommended: [bold]{report.recommended.rung.name}[/] — paste into your trainer config:"
        )
        console.print_json(json.dumps(report.recommended_config()))
        code = 0
    if args.json_path:
        payload = {
            "family": adapter.name,
            "preset": args.preset,
            "torch": torch.__version__,
            "dtype": str(dtype),
            "regime": args.regime,
            **report.to_json(),
        }
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
    if args.plot_path:
        _plot(report, args.plot_path)
    return code


def _plot(report: Any, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MemfitError("--plot needs matplotlib: `pip install memfit[plot]`") from exc
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in report.results:
        used = r.budget_bytes_used / 2**20
        ax.scatter(r.measurement.step_seconds * 1e3, used, color="tab:green" if r.fits else "tab:red")
        ax.annotate(r.rung.name, (r.measurement.step_seconds * 1e3, used), fontsize=8)
    if report.budget_bytes:
        ax.axhline(report.budget_bytes / 2**20, linestyle="--", color="gray", label="budget")
        ax.legend()
    ax.set_xlabel("step time (ms)")
    ax.set_ylabel(f"{report.metric} (MiB)")
    ax.set_title("memfit: memory vs step time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
