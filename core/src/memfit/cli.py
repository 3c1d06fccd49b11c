"""``memfit`` command line: ``memfit fit`` (find the configuration that fits) and ``memfit list``.

Every flag is checked before anything is built; a bad one is a one-line error on stderr and exit code 2.
``memfit fit`` exits 0 with a recommendation, 1 when nothing fits (or every rung crashed).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.progress import Progress

from memfit.errors import MemfitError

# Wide enough for the ladder table when output is a file or CI log (rich defaults to 80 columns there).
console = Console(width=None if sys.stdout.isatty() else 120)
errors = Console(stderr=True, soft_wrap=True)

PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "tif", "tiff", "eps", "ps")
PLOT_HINT = "install the plot extra: pip install 'memfit[plot]'"


class UsageError(Exception):
    """A command-line mistake: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # argparse would print the usage block and exit
        raise UsageError(f"{self.prog}: error: {message}")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _size(text: str) -> int:
    from memfit.units import parse_bytes

    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size; write e.g. 24GiB, 512MiB or a number of bytes"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a size must be positive")
    return value


def _resolution(text: str) -> tuple[int, int]:
    from memfit.job import parse_resolution

    try:
        return parse_resolution(text)
    except MemfitError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _lora_targets(text: str) -> str | tuple[str, ...]:
    value = text.strip()
    if value.lower() in ("attn", "all"):
        return value.lower()
    names = tuple(n.strip() for n in value.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give attn, all, or module names separated by commas")
    return names


def build_parser() -> argparse.ArgumentParser:
    import memfit
    from memfit.job import Regime
    from memfit.measure import SDPA_CHOICES

    parser = _Parser(prog="memfit", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, help="fit or list")

    fit = sub.add_parser(
        "fit",
        help="measure the decision ladder and recommend a config that fits a budget",
        description="Measure SPEC's decision ladder (none, torch-ffn, torch, unsloth-ffn, unsloth, auto) on "
        "real training steps of a model with random weights, and print the configuration to paste into "
        "your trainer. Nothing is downloaded.",
    )
    what = fit.add_argument_group("the model")
    what.add_argument(
        "--family", help="adapter family, case-insensitive (default: flux, or the one --model/--config names)"
    )
    what.add_argument(
        "--preset", help="adapter preset: tiny (default, CPU-friendly) or full (published size)"
    )
    what.add_argument(
        "--model",
        metavar="PATH",
        help="build from a local diffusers config instead of a preset: a config.json, a model folder or a "
        "pipeline folder (its transformer/); random weights, nothing downloaded",
    )
    what.add_argument(
        "--config",
        metavar="FILE",
        help="a trainer's JSON config: its gradient_checkpointing* keys (measured as 'your config') and the "
        "job's shape (model_family, resolution, train_batch_size, lora_rank, …); flags override it",
    )
    shape = fit.add_argument_group("the job")
    shape.add_argument(
        "--tokens",
        type=_positive_int,
        help="image tokens per sample (default: the preset's); or --resolution",
    )
    shape.add_argument(
        "--resolution",
        type=_resolution,
        metavar="WxH",
        help="training resolution in pixels, e.g. 1024x1024; the family converts it into tokens",
    )
    shape.add_argument(
        "--frames",
        type=_positive_int,
        metavar="N",
        help="video families: frames per clip (with --resolution), e.g. 81",
    )
    shape.add_argument("--batch", type=_positive_int, metavar="N", help="samples per step (default 1)")
    shape.add_argument(
        "--lora-rank", type=_positive_int, metavar="R", help="train PEFT LoRA of rank R on frozen weights"
    )
    shape.add_argument(
        "--lora-targets",
        type=_lora_targets,
        metavar="attn|all|NAMES",
        help="LoRA modules: attn (attention projections, default), all (every linear of every block) or "
        "module names separated by commas (PEFT's target_modules)",
    )
    shape.add_argument(
        "--regime",
        choices=[Regime.FROZEN.value, Regime.FULL.value],
        help="without LoRA: frozen weights with input gradients (default), or full fine-tuning (every measured "
        "step ends with an AdamW step, whose state a full fine-tune holds)",
    )
    shape.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weight dtype (default: bfloat16 on CUDA, float32 on CPU)",
    )
    how = fit.add_argument_group("the measurement")
    how.add_argument(
        "--budget",
        type=_size,
        metavar="SIZE",
        help="memory budget, e.g. 24GiB (default on CUDA: --gpu-memory, else the card's free memory; on CPU: "
        "none)",
    )
    how.add_argument(
        "--gpu-memory",
        type=_size,
        metavar="SIZE",
        help="measure as on a card of SIZE: the measuring process may reserve no more "
        "(torch.cuda.set_per_process_memory_fraction)",
    )
    how.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    how.add_argument(
        "--sdpa",
        choices=SDPA_CHOICES,
        default="default",
        help="pin the attention backend (default: torch's own dispatch); flash avoids cuDNN's SDPA backward",
    )
    how.add_argument(
        "--steps", type=_positive_int, default=3, metavar="N", help="timed steps per rung, after one warm-up"
    )
    out = fit.add_argument_group("output")
    out.add_argument("--json", dest="json_path", metavar="PATH", help="write the report as JSON to this path")
    out.add_argument(
        "--plot", dest="plot_path", metavar="PATH", help="write a memory/time plot (.png, .svg, .pdf …)"
    )

    sub.add_parser(
        "list",
        help="show installed adapters, their model classes and declared scopes",
        description="Show installed adapters, their model classes, block lists, scopes and presets.",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        errors.print(escape(str(exc)), highlight=False)
        return 2
    except SystemExit as exc:  # --help, --version
        return exc.code if isinstance(exc.code, int) else 0
    try:
        if args.command == "list":
            return _cmd_list()
        return _cmd_fit(args)
    except MemfitError as exc:
        errors.print(f"memfit {args.command}: error: {escape(str(exc))}", highlight=False)
        return 2


def _cmd_list() -> int:
    from memfit.adapters.discovery import available_adapters

    adapters = available_adapters()
    if not adapters:
        console.print("No memfit adapters installed. Install one, e.g. `pip install memfit-flux`.")
        return 0
    # one block per family, not a table: a table narrower than its content cuts names; lines wrap between
    # words, so a model class name is never cut whatever the terminal's width
    console.print(f"[bold]{len(adapters)} memfit adapters installed[/]")
    for name, a in sorted(adapters.items()):
        console.print()
        console.print(f"[bold]{escape(name)}[/]: {escape(', '.join(a.model_classes))}")
        for label, value in (
            ("block lists", ", ".join(a.block_lists)),
            ("scopes", ", ".join(a.scopes())),
            (
                "verified with",
                ", ".join(f"{lib} {v}" for lib, versions in a.verified_versions.items() for v in versions)
                or "-",
            ),
            (
                "presets",
                "; ".join(f"{k} ({p.description})" if p.description else k for k, p in a.presets.items()),
            ),
        ):
            console.print(Padding(f"{label}: {escape(value)}", (0, 0, 0, 2)))
    return 0


# -- memfit fit: flags -> job ------------------------------------------------------------------------------------


@dataclass
class FitPlan:
    """Everything ``memfit fit`` will do, checked before anything is built."""

    job: Any  # memfit.job.FitJob
    budget: int | None
    steps: int
    sdpa: str
    json_path: str | None
    plot_path: str | None
    description: str
    resolution: tuple[int, int] | None = None
    frames: int | None = None
    user_config: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def plan_fit(args: argparse.Namespace) -> FitPlan:
    """Check every flag (and the trainer config) and describe the job; nothing is built here.

    Raises:
        MemfitError: a flag or config value is wrong (the message names it and the fix).
    """
    from memfit.config import Backend, MemfitConfig
    from memfit.job import (
        FitJob,
        adapter_for_class,
        family_adapter,
        inputs_preset,
        job_keys_from_trainer_config,
        preset_of,
        read_model_path,
        read_trainer_config,
    )
    from memfit.measure import SDPA_ON_CPU

    device = _device(args.device)  # before anything is imported or built (adapters may import diffusers)
    from_file: dict[str, Any] = {}
    notes: list[str] = []
    user_config = None
    memory_budget = None
    if args.config:
        data = read_trainer_config(args.config)
        cfg = MemfitConfig.from_dict(data, strict=False)
        if cfg.installs_anything:
            user_config = cfg.to_dict()
            if cfg.backend is not Backend.AUTO:  # the budget is fit's own; a fixed backend cannot keep it
                user_config.pop("gradient_checkpointing_memory_budget", None)
        memory_budget = cfg.memory_budget
        from_file, notes = job_keys_from_trainer_config(data)

    def pick(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else from_file.get(name, default)

    model_path = pick("model")
    family = pick("family")
    if model_path is not None:
        _, class_name = read_model_path(model_path)
        adapter = adapter_for_class(class_name)
        if family is not None and family_adapter(family) is not adapter:
            raise MemfitError(
                f"--model {model_path} is a {class_name} ({adapter.name}), not family {family!r}"
            )
        if args.preset is not None:
            raise MemfitError("--model and --preset both choose the model; give one")
        description = f"{class_name} from {model_path} (random weights)"
    else:
        adapter = family_adapter(family or "flux")
        preset = preset_of(adapter, args.preset or "tiny")
        description = f"preset {args.preset or 'tiny'}: {preset.description}"
    job = FitJob(family=adapter.name, preset=args.preset or "tiny", model_path=model_path)
    preset = inputs_preset(adapter, job)

    dtype = pick("dtype") or ("bfloat16" if device.type == "cuda" else "float32")
    regime, rank, targets = _regime(args, from_file)
    tokens, resolution, frames = _tokens(args, from_file, preset, adapter.name)
    if device.type != "cuda":
        if args.sdpa not in SDPA_ON_CPU:
            raise MemfitError(f"--sdpa {args.sdpa} needs CUDA; on CPU use one of {', '.join(SDPA_ON_CPU)}")
        if args.gpu_memory is not None:
            raise MemfitError("--gpu-memory caps a CUDA card's memory; it means nothing with --device cpu")
    budget = args.budget if args.budget is not None else memory_budget
    if budget is None and args.gpu_memory is not None:
        budget = args.gpu_memory
    if budget is not None and args.gpu_memory is not None and budget > args.gpu_memory:
        raise MemfitError(
            f"--budget is larger than --gpu-memory ({budget / 2**30:.2f} > {args.gpu_memory / 2**30:.2f} GiB); "
            f"a budget above what the card gives cannot be kept"
        )
    _check_output(args.json_path, "--json", None)
    _check_output(args.plot_path, "--plot", PLOT_FORMATS)
    if args.plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise MemfitError(f"--plot needs matplotlib: {PLOT_HINT}") from None
    job = replace(
        job,
        tokens=tokens,
        batch=pick("batch", 1),
        regime=regime,
        lora_rank=rank,
        lora_targets=targets,
        dtype=dtype,
        device=str(device),
        gpu_memory=args.gpu_memory,
    )
    return FitPlan(
        job=job,
        budget=budget,
        steps=args.steps,
        sdpa=args.sdpa,
        json_path=args.json_path,
        plot_path=args.plot_path,
        description=description,
        resolution=resolution,
        frames=frames,
        user_config=user_config,
        notes=notes,
    )


def _device(text: str | None) -> torch.device:
    if text is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cuda", "cpu"):
        raise MemfitError(f"--device {text!r}: memfit fit measures on cuda, cuda:N or cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise MemfitError("--device cuda was asked for but CUDA is not available; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise MemfitError(f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _regime(args: argparse.Namespace, from_file: dict[str, Any]) -> tuple[Any, int | None, Any]:
    from memfit.job import LoraTargets, Regime

    rank = args.lora_rank if args.lora_rank is not None else from_file.get("lora_rank")
    targets = args.lora_targets if args.lora_targets is not None else from_file.get("lora_targets")
    regime = args.regime or from_file.get("regime")
    if args.lora_rank is not None and args.regime == Regime.FULL.value:
        raise MemfitError(
            "--lora-rank trains LoRA on frozen weights; --regime full trains every weight: give one"
        )
    if regime == Regime.FULL.value and args.lora_rank is None:
        return Regime.FULL, None, LoraTargets.ATTENTION.value
    if rank is None:
        if args.lora_targets is not None:
            raise MemfitError("--lora-targets needs --lora-rank (e.g. --lora-rank 16)")
        if regime == "lora":
            raise MemfitError("model_type is lora but no lora_rank is given; add --lora-rank")
        return Regime(regime or Regime.FROZEN.value), None, LoraTargets.ATTENTION.value
    return Regime.LORA, rank, targets or LoraTargets.ATTENTION.value


def _tokens(
    args: argparse.Namespace, from_file: dict[str, Any], preset: Any, family: str
) -> tuple[int | None, tuple[int, int] | None, int | None]:
    """``(tokens, resolution, frames)``: explicit tokens, or the family's conversion of a resolution."""
    resolution = args.resolution if args.resolution is not None else from_file.get("resolution")
    frames = args.frames if args.frames is not None else from_file.get("frames")
    if args.tokens is not None:
        if args.resolution is not None:
            raise MemfitError("--tokens and --resolution both set the image size; give one")
        return args.tokens, None, None
    if resolution is None:
        if args.frames is not None:
            raise MemfitError("--frames needs --resolution (e.g. --resolution 832x480 --frames 81)")
        return None, None, None
    if preset.pixels is None:
        raise MemfitError(f"family {family!r} takes --tokens (its inputs are not images), not --resolution")
    width, height = resolution
    if frames is not None and not preset.pixels.video:
        raise MemfitError(f"family {family!r} trains on images: --frames does not apply")
    try:
        tokens = preset.pixels.tokens(width, height, frames)
    except ValueError as exc:
        flag = "--frames" if "frame" in str(exc) and frames is not None else "--resolution"
        raise MemfitError(f"{flag} for {family}: {exc}") from None
    return tokens, resolution, frames


def _check_output(path: str | None, flag: str, formats: tuple[str, ...] | None) -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise MemfitError(f"{flag} {path}: is a folder; give a file name")
    folder = p.parent if str(p.parent) else Path(".")
    if not folder.is_dir():
        raise MemfitError(f"{flag} {path}: the folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise MemfitError(f"{flag} {path}: the folder {folder} is not writable")
    if formats is not None:
        suffix = p.suffix.lower().lstrip(".")
        if suffix not in formats:
            raise MemfitError(
                f"{flag} {path}: {('.' + suffix) if suffix else 'no extension'} is not an image format; use "
                f"one of {', '.join('.' + f for f in formats)}"
            )


# -- memfit fit: run ---------------------------------------------------------------------------------------------


def _cmd_fit(args: argparse.Namespace) -> int:
    from memfit.fit import InProcessRunner, Rung, run_ladder
    from memfit.fit_output import (
        crash_line,
        ladder_table,
        rung_line,
        write_plot,
    )
    from memfit.isolation import ChildRunner, SetupError
    from memfit.job import build_workload, family_adapter
    from memfit.measure import sdpa_description
    from memfit.units import format_bytes

    plan = plan_fit(args)
    job = plan.job
    adapter = family_adapter(job.family)
    shape = f"{job.tokens or 'default'} tokens"
    if plan.resolution:
        shape = f"{plan.resolution[0]}x{plan.resolution[1]} px" + (
            f", {plan.frames} frames" if plan.frames else ""
        )
        shape += f" = {job.tokens} tokens"
    training = {
        "lora": f"LoRA r{job.lora_rank} on {_targets_text(job.lora_targets)}",
        "full": "full fine-tuning",
        "frozen": "frozen weights, input gradients",
    }[job.regime.value]
    console.print(
        f"[bold]memfit fit[/] {adapter.name}, {escape(plan.description)}\n"
        f"job: {shape}, batch {job.batch}, {training}, {job.dtype} on {job.device}"
    )
    for note in plan.notes:
        console.print(f"note: {escape(note)}")

    on_cuda = job.device.startswith("cuda")
    runner: Any
    try:
        if measure_in_child(job):
            console.print(
                "building the model in a measuring process (a CUDA fault there ends one rung only)…"
            )
            runner = ChildRunner(functools.partial(build_workload, job), steps=plan.steps, sdpa=plan.sdpa)
            info = runner.start()
        else:
            workload = build_workload(job)
            info = {**workload.info, "sdpa": sdpa_description(plan.sdpa, torch.device(job.device))}
            runner = InProcessRunner.of(workload, steps=plan.steps, sdpa=plan.sdpa)
    except (SetupError, torch.OutOfMemoryError) as exc:
        if isinstance(exc, torch.OutOfMemoryError) or exc.out_of_memory:
            where = f"the {format_bytes(job.gpu_memory)} limit" if job.gpu_memory else "the card"
            console.print(
                f"[bold red]The model's weights do not fit[/] in {where}: out of memory while building it. "
                f"Nothing about activations can help; use a smaller model, a larger card, or weight streaming."
            )
            return 1
        raise
    try:
        budget = plan.budget
        if budget is None and on_cuda:
            budget = info.get("limit_bytes") or info.get("free_bytes")
        console.print(
            f"built: {_count(info['parameters'])} parameters ({format_bytes(info['weights_bytes'])}), "
            f"{_count(info['trainable_parameters'])} trainable, in {info['build_seconds']:.1f} s; "
            f"attention: {info['sdpa']}"
            + (f"; each measured step ends with an {info['optimizer']} step" if info.get("optimizer") else "")
        )
        if info.get("weights_on_host"):
            console.print(
                "The weights would fill the card: the model is built on the CPU and every rung places it with "
                "memfit.apply(..., device=) (the frozen weights a rung streams go straight to pinned host "
                "memory); rungs that keep every weight on the card do not fit."
            )
        if not on_cuda:
            console.print(
                "No GPU: memfit ranks by the activation bytes held for backward (saved-tensor accounting); CPU "
                "step times are shown with their spread and do not rank. Peaks on a GPU add weights, gradients "
                "and workspace."
            )
        extra = [Rung("your config", plan.user_config)] if plan.user_config else []
        report = _run_with_progress(
            run_ladder,
            runner,
            adapter=adapter,
            budget_bytes=budget,
            device_type="cuda" if on_cuda else "cpu",
            extra=extra,
            sdpa=info["sdpa"],
            line=rung_line,
        )
        report.weights_on_host = bool(info.get("weights_on_host"))
    finally:
        if isinstance(runner, ChildRunner):
            runner.close()

    console.print(ladder_table(report, budget))
    advice = report.crash_advice()
    if report.recommended is None:
        if report.all_crashed:
            console.print(crash_line(advice or ""))
        else:
            used = [r.budget_bytes_used for r in report.results if r.budget_bytes_used is not None]
            smallest = f"the smallest measured is {format_bytes(min(used))}. " if used else ""
            console.print(
                f"[bold red]Nothing fits[/] the budget of {format_bytes(budget)}: {smallest}"
                f"Lower the resolution/batch, or raise the budget."
            )
            if advice:
                console.print(crash_line(advice))
        code = 1
    else:
        if advice:
            console.print(crash_line(advice))
        _print_recommendation(report, plan)
        code = 0
    allocator = report.allocator_advice()
    if allocator:
        console.print(f"[yellow]Note:[/] {allocator}")
    if plan.json_path:
        _write_json(plan, report, info, budget)
    if plan.plot_path:
        write_plot(report, plan.plot_path)
    return code


def measure_in_child(job: Any) -> bool:
    """Whether rungs run in a measuring child: on CUDA, where a fault kills the process's context (on CPU
    nothing can, and a child would only cost its start)."""
    return job.device.startswith("cuda")


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _targets_text(targets: Any) -> str:
    if targets == "attn":
        return "the attention projections"
    if targets == "all":
        return "every linear of every block"
    return ", ".join(targets)


def _run_with_progress(run_ladder: Any, runner: Any, *, line: Any, **kwargs: Any) -> Any:
    """Run the ladder with a live "rung k/N" line on a terminal and one printed line per rung everywhere."""
    position: dict[str, Any] = {}
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("starting", total=None)

        def on_start(k: int, n: int, rung: Any) -> None:
            position.update(k=k, n=n, name=rung.name)
            progress.update(task, description=f"rung {k}/{n}: {rung.name}")

        def on_phase(phase: str) -> None:
            progress.update(
                task, description=f"rung {position['k']}/{position['n']}: {position['name']} ({phase})"
            )

        def on_rung(result: Any) -> None:
            console.print(line(position["k"], position["n"], result), soft_wrap=True)

        return run_ladder(runner, on_start=on_start, on_phase=on_phase, on_rung=on_rung, **kwargs)


def _print_recommendation(report: Any, plan: FitPlan) -> None:
    rec = report.recommended
    fitting = [r for r in report.results if r.fits and r.measurement is not None]
    if report.ranking == "step time":
        fastest = min(fitting, key=lambda r: r.measurement.step_seconds)
        if fastest is not rec:  # see memfit.fit, "Ranking"
            console.print(
                f"{fastest.rung.name} measured fastest, but within the spread of the step times: the leaner "
                f"{rec.rung.name} is as fast and leaves more headroom."
            )
    else:
        console.print(
            f"{rec.rung.name} keeps the most activations within the budget (the least recompute); on a GPU, "
            f"`memfit fit` ranks by measured step time."
        )
    console.print(f"Recommended: [bold]{escape(rec.rung.name)}[/] — paste into your trainer config:")
    console.print_json(json.dumps(report.recommended_config()))
    if report.weights_on_host:
        console.print(
            "Load the transformer on the CPU and let memfit place it: "
            "memfit.apply(transformer, config, device='cuda') (moving it to the card first runs out of memory)."
        )
    if plan.sdpa != "default":
        console.print(
            f"Measured with SDPA pinned to {plan.sdpa}: train the same way (e.g. "
            f"`torch.backends.cuda.enable_cudnn_sdp(False)` keeps cuDNN attention out)."
        )


def _write_json(plan: FitPlan, report: Any, info: dict[str, Any], budget: int | None) -> None:
    import memfit

    job = plan.job
    payload = {
        "memfit": memfit.__version__,
        "torch": torch.__version__,
        "family": job.family,
        "preset": None if job.model_path else job.preset,
        "model": job.model_path,
        "job": {
            "tokens": info.get("tokens"),
            "resolution": list(plan.resolution) if plan.resolution else None,
            "frames": plan.frames,
            "batch": job.batch,
            "regime": job.regime.value,
            "lora_rank": job.lora_rank,
            "lora_targets": job.lora_targets if isinstance(job.lora_targets, str) else list(job.lora_targets),
            "dtype": job.dtype,
            "gpu_memory_bytes": job.gpu_memory,
        },
        "built": info,
        "notes": plan.notes,
        **report.to_json(),
        "budget_bytes": budget,
    }
    with open(plan.json_path, "w", encoding="utf-8") as fh:  # type: ignore[arg-type]
        json.dump(payload, fh, indent=2, default=str)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
