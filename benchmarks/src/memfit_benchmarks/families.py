"""Every family at its published size: memfit against its peers, per training config.

    python -m memfit_benchmarks.families --family all --out benchmarks/results            # GPU, preset full
    python -m memfit_benchmarks.families --family flux --configs lora-all,lora-attn --modes torch,diffusers-ckpt
    python -m memfit_benchmarks.families --family flux --preset tiny --device cpu --out /tmp/f   # CPU smoke
    python -m memfit_benchmarks.families --tokens wan=4680,ltxvideo2=3072 --family-seconds 45 --require-peer ...
    python -m memfit_benchmarks --suite families ...                                      # same, via nox bench

``--family all`` is every installed diffusion family (the ``hf-decoder*`` LLM adapters only when named).
One process runs all requested families one after the other, freeing each model before the next. Per
family: the preset's model with random weights (nothing downloaded), inputs at ``--tokens`` (default: the
preset's ``default_tokens``), and per training config (``--configs``, default ``lora-all``;
``memfit_benchmarks.training``: LoRA on every ``nn.Linear`` of the declared blocks, LoRA on the declared
attention regions only, frozen base with input gradients, full fine-tune) every mode of ``--modes`` the
family supports: memfit's (``*-ffn`` only with an FFN boundary, offload modes only on CUDA, intervals where
the family supports them) and the peers' (``diffusers-ckpt`` where the model has diffusers' checkpointing);
the others are listed under ``skipped``. A mode that runs out of memory is an ``oom`` row. Writes
``family-<name>-<preset>.json`` per family to ``--out`` (rewritten after each config), then renders markdown
and a plot unless ``--no-render``.

``--steps N --min-seconds S``: each measurement times at least N steps and keeps timing until they add up to S
seconds (with one timed step per measurement, the paired ratios of a full-size family spread by ~1% between
rounds). ``--tokens`` takes one
count for every family or ``name=N`` pairs (the others keep their preset's default);
``--family-seconds S`` stops starting measurements of a family S seconds after its model was built (on top
of ``--stop-at``), so one slow family cannot take the others' time; ``--require-peer`` measures nothing for a
family on which none of the requested peers can run (its entries say why): memfit's rows would have nothing
to be compared with.
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

import memfit
from memfit import FamilyAdapter
from memfit_benchmarks import peers
from memfit_benchmarks.environment import environment
from memfit_benchmarks.modes import Mode, is_offload, select_modes
from memfit_benchmarks.options import add_sweep_options, benchmark_device, seconds, step_count
from memfit_benchmarks.results import write_json
from memfit_benchmarks.runner import measure_modes
from memfit_benchmarks.training import TrainingConfig, prepare

SDPA = "default dispatch, cuDNN SDPA disabled"


def _progress(iterable, **kw):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # progress is a nicety; plain prints below still show it
        return iterable
    return tqdm(iterable, **kw)


def default_families() -> list[str]:
    return sorted(n for n in memfit.available_adapters() if not n.startswith("hf-decoder"))


def skip_reason(
    mode: Mode, adapter: FamilyAdapter, device: torch.device, model: nn.Module | None = None
) -> str | None:
    """Why ``mode`` is not run for ``adapter`` on ``device`` (None: it runs). A peer needs ``model``."""
    if mode.peer is not None:
        if model is None:
            raise ValueError(f"skip_reason: the peer {mode.name!r} needs the model to judge")
        return peers.unsupported(mode.peer, model, adapter)
    cfg = mode.config or {}
    backend = str(cfg.get("gradient_checkpointing_backend", ""))
    if backend.endswith("-ffn") and not adapter.has_ffn:
        return "no FFN boundary declared"
    if cfg.get("gradient_checkpointing_offload_attention") and not adapter.has_attention:
        return "no attention region declared"
    if "gradient_checkpointing_interval" in cfg and not adapter.supports_interval:
        return "family does not support intervals"
    if is_offload(mode) and device.type != "cuda":
        return "offload needs CUDA"
    return None


def batch_on(adapter: FamilyAdapter, preset_name: str, model: nn.Module, tokens: int, device: torch.device):
    """The preset's inputs for ``model`` at ``tokens`` (batch 1, seed 0) on ``device``, and their shapes."""
    batch = adapter.presets[preset_name].inputs(
        model, tokens=tokens, batch=1, generator=torch.Generator().manual_seed(0)
    )
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    shapes = {k: list(v.shape) for k, v in batch.items() if isinstance(v, torch.Tensor)}
    return batch, shapes


def build_lora_model(
    adapter: FamilyAdapter,
    preset_name: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    rank: int,
    tokens: int,
) -> tuple[nn.Module, dict[str, Any], dict[str, Any]]:
    """The preset's model (random weights) with LoRA on every block linear (``lora-all``), its inputs on
    ``device`` (seed 0), and what to record: ``lora_targets_count``, ``trainable_params``, ``total_params``,
    ``input_shapes``."""
    model = adapter.presets[preset_name].build(dtype=dtype, device=device)
    batch, shapes = batch_on(adapter, preset_name, model, tokens, device)
    training = prepare(model, batch, TrainingConfig.LORA_ALL, adapter, dtype=dtype, rank=rank)
    info = {k: v for k, v in training.info().items() if not k.startswith("config")}
    return model, batch, {**info, "input_shapes": shapes}


def family_payload(
    name: str, preset: str, env: dict[str, Any], *, dtype: torch.dtype, tokens: int, rank: int
) -> dict[str, Any]:
    """The header of one family's results (no entries yet); the auto sweep, whose fixed rows are measured the
    same way, writes its family targets' rows under this header too."""
    return {
        **env,
        "suite": "families",
        "family": name,
        "preset": preset,
        "preset_description": memfit.get_adapter(name).presets[preset].description,
        "dtype": str(dtype).removeprefix("torch."),
        "tokens": tokens,
        "batch": 1,
        "lora_rank": rank,
        "configs": [],
        "results": [],
    }


def run_family(
    name: str, args: argparse.Namespace, device: torch.device, env: dict[str, Any], path: Path
) -> dict[str, Any]:
    """Build the family's model once and measure every config on it; ``path`` is rewritten after each config."""
    adapter = memfit.get_adapter(name)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = family_tokens(args.tokens, name) or adapter.presets[args.preset].default_tokens
    payload = family_payload(name, args.preset, env, dtype=dtype, tokens=tokens, rank=args.rank)
    payload.update(rounds=args.rounds, configs=[c.value for c in args.configs], complete=False)
    if tokens != adapter.presets[args.preset].default_tokens:
        payload["default_tokens"] = adapter.presets[args.preset].default_tokens
    if args.stop_at is not None and time.time() >= args.stop_at:  # not even worth building the model
        payload["cut"] = "the run's deadline passed first"
        return payload
    model = batch = None
    try:
        started = time.perf_counter()
        model = adapter.presets[args.preset].build(dtype=dtype, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        payload["build_seconds"] = time.perf_counter() - started
        stop = family_deadline(args.stop_at, args.family_seconds)
        batch, payload["input_shapes"] = batch_on(adapter, args.preset, model, tokens, device)
        skipped = {
            m.name: reason
            for m in args.modes
            if (reason := skip_reason(m, adapter, device, model)) is not None
        }
        modes = [m for m in args.modes if m.name not in skipped]
        no_peer = args.require_peer and not any(m.peer is not None for m in modes)
        for config in args.configs:
            entry = {
                "config": config.value,
                "label": payload["preset_description"] or args.preset,
                "tokens": tokens,
                "steps": args.steps,
                "min_seconds": args.min_seconds,
                "warmup": args.warmup,
                "skipped": skipped,
                "rows": [],
            }
            if no_peer:  # what memfit's rows would be compared with cannot run here: say so, measure nothing
                entry["no_peer"] = {m.name: skipped[m.name] for m in args.modes if m.peer is not None}
                payload["results"].append(entry)
                write_json(path, payload)
                continue
            try:
                training = prepare(model, batch, config, adapter, dtype=dtype, rank=args.rank)
            except ValueError as exc:  # e.g. lora-attn on a family without attention regions
                entry["error"] = str(exc)
            else:
                entry.update(training.info())
                try:
                    entry["rows"] = measure_modes(
                        model,
                        batch,
                        adapter.loss,
                        modes,
                        adapter=adapter,
                        rounds=args.rounds,
                        warmup=args.warmup,
                        steps=args.steps,
                        min_seconds=args.min_seconds,
                        optimizer_factory=training.optimizer_factory,
                        tag=f"[{name}] [{config.value}]",
                        progress=lambda it, label=config.value: _progress(
                            it, desc=f"{name} {label}", unit="row"
                        ),
                        stop=stop,
                    )
                finally:
                    training.undo()
            payload["results"].append(entry)
            write_json(path, payload)
    except torch.OutOfMemoryError as exc:  # the model or its inputs do not fit at all
        payload["error"] = f"OOM before the modes ran: {str(exc).splitlines()[0]}"
    except Exception as exc:  # one broken family must not cost the others their GPU time
        payload["error"] = f"{type(exc).__name__}: {exc}"
        payload["traceback"] = traceback.format_exc()
        print(payload["traceback"], flush=True)
    finally:
        del model, batch
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    payload["complete"] = "error" not in payload
    return payload


def parse_tokens(text: str | None) -> int | dict[str, int] | None:
    """``--tokens``: one count for every family (``"4096"``), or ``name=N`` pairs (``"wan=4680,ltxvideo2=3072"``).

    Raises:
        ValueError: not a positive count, or a pair without ``=``.
    """
    if text is None or not text.strip():
        return None
    if "=" not in text:
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"--tokens {text!r}: give one count of at least 1, or name=N pairs")
        return int(text)
    pairs: dict[str, int] = {}
    for part in text.split(","):
        name, sep, count = part.partition("=")
        if not sep or not name.strip() or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"--tokens {text!r}: give one count, or name=N pairs separated by commas")
        pairs[name.strip()] = int(count)
    return pairs


def family_tokens(tokens: int | dict[str, int] | None, name: str) -> int | None:
    """The token count ``--tokens`` asks for ``name`` (None: the preset's default)."""
    return tokens.get(name) if isinstance(tokens, dict) else tokens


def family_deadline(stop_at: float | None, family_seconds: float | None) -> Callable[[], bool]:
    """``stop()`` for one family: true once ``stop_at`` (Unix time) or ``family_seconds`` from now has passed."""
    ends = [t for t in (stop_at, None if family_seconds is None else time.time() + family_seconds) if t]
    end = min(ends, default=None)
    return (lambda: False) if end is None else (lambda: time.time() >= end)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", default="all", help="comma-separated family names, or 'all'")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument(
        "--tokens",
        default=None,
        help="one count for every family, or name=N pairs (wan=4680,ltxvideo2=3072); default: each preset's "
        "default_tokens",
    )
    parser.add_argument(
        "--family-seconds",
        type=float,
        default=None,
        help="no measurement of a family starts later than this many seconds after its model was built",
    )
    parser.add_argument(
        "--require-peer",
        action="store_true",
        help="measure nothing on a family where none of the requested peers runs (its entries say why)",
    )
    parser.add_argument("--preset", default="full")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rank", type=int, default=16)
    # save_on_cpu only when named: a video family's activations at full size would not fit in pinned host RAM
    add_sweep_options(
        parser,
        default_config="lora-all",
        default_modes="memfit,ckpt-block,ckpt-ffn,diffusers-ckpt",
        per_shape=False,
    )
    parser.add_argument("--no-render", action="store_true", help="write JSON only")
    args = parser.parse_args(argv)
    try:
        args.modes = select_modes(args.modes)
        args.steps, args.warmup = step_count(args.steps), step_count(args.warmup)
        args.min_seconds = seconds(args.min_seconds)
        args.tokens = parse_tokens(args.tokens)
    except ValueError as exc:
        parser.error(str(exc))
    if args.family_seconds is not None and args.family_seconds <= 0:
        parser.error("--family-seconds must be positive")
    if args.steps < 1:
        parser.error("--steps: at least one timed step per measurement")
    families = default_families() if args.family == "all" else [f.strip() for f in args.family.split(",")]
    installed = memfit.available_adapters()
    missing = [f for f in families if f not in installed]
    if missing:
        raise SystemExit(f"not installed: {missing} (installed: {sorted(installed)})")
    unknown = [f for f in families if args.preset not in installed[f].presets]
    if unknown:
        parser.error(f"--preset {args.preset!r}: {unknown} have no such preset")
    if isinstance(args.tokens, dict) and set(args.tokens) - set(families):
        parser.error(
            f"--tokens names {sorted(set(args.tokens) - set(families))}, which --family does not run"
        )
    if args.dry_run:
        tokens = {
            f: family_tokens(args.tokens, f) or installed[f].presets[args.preset].default_tokens
            for f in families
        }
        print(
            f"would measure {families} ({args.preset}): configs {[c.value for c in args.configs]}, {args.rounds} "
            f"rounds of {args.warmup} warm-up + {args.steps} timed steps"
            + (f" and at least {args.min_seconds:g} s of them" if args.min_seconds else "")
            + f", modes {[m.name for m in args.modes]} (less those a family does not support); tokens {tokens}"
            + (f"; at most {args.family_seconds:g} s per family" if args.family_seconds else "")
            + ("; a family without any of the peers is not measured" if args.require_peer else ""),
            flush=True,
        )
        return []
    device = benchmark_device(
        args.device, without_cuda="--device cuda needs CUDA (use --device cpu --preset tiny for a smoke run)"
    )
    out = Path(args.out)
    env = environment("families", device, sdpa=SDPA)
    print(json.dumps(env, indent=1), flush=True)
    written = []
    for name in families:
        path = out / f"family-{name}-{args.preset}.json"
        write_json(path, run_family(name, args, device, env, path))
        written.append(path)
        print(f"wrote {path}", flush=True)
    if not args.no_render:
        from memfit_benchmarks.render import render_files

        render_files(written)
    return written


if __name__ == "__main__":
    main()
