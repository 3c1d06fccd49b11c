"""Step-time ratios measured step by step: two copies of the model, one row each, stepped in turn.

    python -m memfit_benchmarks.interleaved --out DIR [--shape 0] [--steps 200] [--pairs A/B,...]
        [--configs lora-all,lora-attn] [--compile inductor]
    python -m memfit_benchmarks.interleaved --out DIR --family flux [--tokens 4096] [--steps 30]

At 1024 tokens the step is bound by host time, and the host's speed wanders: the `none` step's median over a
20-step round can move by half between rounds, so ratios of rounds measured seconds apart spread widely. Here row
A runs on one copy of the model and row B on another (same weights, each installed once), and their steps
alternate A, B, A, B…; each A step is compared with the mean of the B steps on either side of it, so a drift
slower than one step cancels. The copies swap rows halfway, so a difference between the copies cancels too.
Reported per pair: the median of those per-step ratios with its interquartile range, and each row's median step.

Pairs (``--pairs`` picks others; a side is a memfit mode, a peer or ``none``, installed as
:func:`memfit_benchmarks.host_overhead.installed` installs rows): each memfit mode against its peer
(``torch.utils.checkpoint`` per block or per FFN region), target 1.00 at 1024 tokens (longer: the sweeps' peer
limits, ``report.pair_limit``); ``unsloth`` / ``torch`` and ``unsloth-ffn`` / ``torch-ffn`` (what parking adds to
the same recompute); ``offload_attention`` / ``none``, whose target is 1.10 × max(no checkpointing's step, bytes
parked per step ÷ the pinned bandwidth measured in the run): its row reports that bound's ratio too. Off CUDA (a
smoke run) steps are timed with ``perf_counter`` and the offload modes park through streams that do nothing
(``host_overhead.NullStreams``): their host time only.

A family's model (``--family``, its preset's size, random weights) is measured the same way, where round-robin
rounds of a second or more each leave ties of a few tenths of a percent (a machine's speed moves that much between
rounds): each memfit mode against the peer its headline column names, per LoRA config, one results file each
(``interleaved-<family>-<tokens>-<config>.json``). Both copies must fit on the device at once.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import memfit
from memfit.adapters import FamilyAdapter
from memfit_benchmarks import peers
from memfit_benchmarks.environment import pinned_bandwidth, run_stamp
from memfit_benchmarks.families import batch_on
from memfit_benchmarks.host_overhead import Installed, installed, row_names
from memfit_benchmarks.modes import Peer
from memfit_benchmarks.options import benchmark_device
from memfit_benchmarks.report import attention_offload_bound_s, pair_limit
from memfit_benchmarks.results import write_results
from memfit_benchmarks.shapes import SHAPES, TINY_SHAPE
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
from memfit_benchmarks.training import TrainingConfig, parse_configs, prepare

BOUND = "offload_attention"  # its target is on the bound, not on the ratio to its baseline
# each pair's target is the sweeps' own (``report.pair_limit``) at the run's tokens
PAIRS = [
    ("torch", "ckpt-block"),
    ("torch-ffn", "ckpt-ffn"),
    ("unsloth", "ckpt-block"),
    ("unsloth-ffn", "ckpt-ffn"),
    ("unsloth", "torch"),  # what parking adds to the same recompute (no target of its own)
    ("unsloth-ffn", "torch-ffn"),
    (BOUND, "none"),
]
# what identifies the run a row was measured in (a row kept from an earlier run carries these as ``run``)
RUN_STAMP_KEYS = ("date", "git_commit", "steps", "warmup")
# a family's pairs: its headline's columns (the block peer falls back to ckpt-block, see :func:`family_pairs`)
FAMILY_PAIRS = [
    ("torch", Peer.DIFFUSERS),
    ("torch-ffn", Peer.CHECKPOINT_FFN),
    ("unsloth", Peer.DIFFUSERS),
    ("unsloth-ffn", Peer.CHECKPOINT_FFN),
]


def _timed_step(run: Installed, cuda: bool) -> float:
    """One forward+backward, in seconds (CUDA events around it, then a sync: the next step starts idle); the
    gradients are cleared before, outside the time."""
    run.model.zero_grad(set_to_none=True)
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run.forward_backward()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    run.forward_backward()
    return time.perf_counter() - t0


def compile_blocks(model, backend: str) -> None:
    """Compile each block on its own (regional compilation, as diffusers' ``compile_repeated_blocks`` does)."""
    for block in model.blocks:
        block.compile(backend=backend)


def per_step_ratios(a: list[float], b: list[float]) -> list[float]:
    """``a[i]`` over the mean of the ``b`` steps run just before and just after it (``b[i]`` ran after ``a[i]``,
    ``b[i-1]`` before): a drift slower than a step cancels. The first ``a`` step has only its later neighbour."""
    out = []
    for i, t in enumerate(a):
        neighbours = [b[j] for j in (i - 1, i) if 0 <= j < len(b)]
        out.append(t / statistics.fmean(neighbours))
    return out


def measure_pair(
    models: tuple[Any, Any],
    batch: dict,
    a: str,
    b: str,
    *,
    steps: int,
    warmup: int,
    cuda: bool,
    compiled: bool = False,
    adapter: FamilyAdapter = SYNTHETIC,
) -> dict[str, Any]:
    """Rows ``a`` and ``b`` stepped in turn on the two copies (``steps`` each), swapping copies halfway.

    ``compiled``: the blocks are compiled; after the rows go on, Dynamo's caches are reset so that the blocks are
    traced again with their hooks (code traced before does not see the hooks on their submodules)."""
    times: dict[str, list[float]] = {a: [], b: []}
    per_step: dict[str, dict[str, float]] = {}  # row -> its memfit handle's counters per timed step
    ratios: list[float] = []
    for half, (model_a, model_b) in enumerate((models, models[::-1])):
        n = steps // 2 if half == 0 else steps - steps // 2
        with (
            installed(model_a, batch, a, cuda=cuda, adapter=adapter) as run_a,
            installed(model_b, batch, b, cuda=cuda, adapter=adapter) as run_b,
        ):
            if compiled:
                torch._dynamo.reset()  # the warm-up steps compile again
            for _ in range(warmup):
                _timed_step(run_a, cuda)
                _timed_step(run_b, cuda)
            run_a.reset()
            run_b.reset()
            calls_before = {name: run.checkpointed_calls() for name, run in ((a, run_a), (b, run_b))}
            ta, tb = [], []
            for _ in range(n):
                ta.append(_timed_step(run_a, cuda))
                tb.append(_timed_step(run_b, cuda))
            for name, run in ((a, run_a), (b, run_b)):
                if run.handle is not None:
                    _add_per_step(per_step.setdefault(name, {}), run.handle.stats(), steps)
                if calls_before[name] is not None:  # a peer's regions, to tell a peer that checkpoints fewer
                    calls = run.checkpointed_calls() - calls_before[name]
                    into = per_step.setdefault(name, {})
                    into["checkpointed_calls"] = into.get("checkpointed_calls", 0.0) + calls / steps
        times[a] += ta
        times[b] += tb
        ratios += per_step_ratios(ta, tb)
    q1, median, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
    return {
        "a": a,
        "b": b,
        "steps": steps,
        "ratio_median": median,
        "ratio_q1": q1,
        "ratio_q3": q3,
        "a_step_s": statistics.median(times[a]),
        "b_step_s": statistics.median(times[b]),
        "a_step_times_s": times[a],
        "b_step_times_s": times[b],
        "stats_per_step": per_step,
    }


def bound_ratio(row: dict[str, Any], d2h_gbs: float | None) -> float | None:
    """``offload_attention``'s step over max(its baseline's step, bytes parked per step ÷ pinned bandwidth), the
    per-step ratio's median scaled by the bound: where the copies take longer than the baseline's step, the bound
    is the copies' time (None without a measured bandwidth)."""
    if not d2h_gbs:
        return None
    parked = row.get("stats_per_step", {}).get(row["a"], {}).get("bytes_offloaded", 0.0)
    return row["ratio_median"] * row["b_step_s"] / attention_offload_bound_s(row["b_step_s"], parked, d2h_gbs)


# what each mode did per timed step (so a ratio near 1 can be told from a mode that did nothing)
PER_STEP_STATS = (
    "frames",  # regions checkpointed (a peer's ``checkpointed_calls``, counted by the peer)
    "recomputes",
    "bytes_offloaded",
    "bytes_reloaded",
    "attention_calls_offloaded",
    "attention_tensors_parked",
    "stall_ms",
    "pinned_allocations",
    "pool_waits",  # the host waited for a copy before reusing a pinned buffer (a sync the step feels)
    "inflight_waits",
)


def _add_per_step(into: dict[str, float], stats: dict[str, Any], steps: int) -> None:
    """Add one half's counters to ``into``, divided by the pair's ``steps`` per mode (both halves: per step)."""
    for key in PER_STEP_STATS:
        if key in stats:
            into[key] = into.get(key, 0.0) + stats[key] / steps


def _describe_per_step(stats: dict[str, float]) -> str:
    parts = []
    if stats.get("recomputes"):
        parts.append(f"{stats['recomputes']:.0f} recomputes")
    if stats.get("checkpointed_calls"):
        parts.append(f"{stats['checkpointed_calls']:.0f} regions checkpointed")
    if stats.get("bytes_offloaded"):
        parts.append(f"{stats['bytes_offloaded'] / 2**20:.0f} MiB parked")
    if stats.get("attention_tensors_parked"):
        parts.append(f"{stats['attention_tensors_parked']:.0f} attention tensors")
    if "stall_ms" in stats:
        parts.append(f"{stats['stall_ms']:.2f} ms stall")
    if stats.get("pool_waits"):
        parts.append(f"{stats['pool_waits']:.1f} host waits for a pinned buffer")
    return ", ".join(parts) or "-"


def _target_cell(r: dict[str, Any]) -> str:
    """The pair's check: its median ratio (for ``offload_attention``, the bound's) against its target."""
    limit = r.get("target")
    if not limit:
        return "-"
    if r["a"] == BOUND:
        value = r.get("bound_ratio")
        if value is None:
            return f"÷ bound ≤ {limit:.2f}× (no bandwidth measured)"
        return f"÷ bound {value:.3f} ≤ {limit:.2f}× ({'PASS' if value <= limit else 'FAIL'})"
    return f"≤ {limit:.2f}× ({'PASS' if r['ratio_median'] <= limit else 'FAIL'})"


def _model_label(payload: dict[str, Any]) -> str:
    return "Model" if payload.get("family") else "Synthetic stack"


def render(payload: dict[str, Any]) -> str:
    lines = [
        f"# Interleaved step-time ratios — {payload['device']}, torch {payload['torch']}, {payload['date']}",
        "",
        f"{_model_label(payload)} {payload['shape']}, {payload['regime']}; SDPA: {payload['sdpa_backend']}. "
        "Two copies of "
        f"the model, one per mode, stepped in turn ({payload['steps']} steps each after {payload['warmup']} "
        f"warm-up steps, the copies swapping modes halfway); each A step over the mean of its neighbouring B "
        f"steps. Commit: {payload.get('git_commit') or 'n/a'}.",
        "",
        "| A / B | median ratio | interquartile | A step ms | B step ms | A per step | B per step | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    earlier: dict[tuple, str] = {}  # a merged row's run (``stepped_merge``) -> its mark
    for r in payload["pairs"]:
        target = _target_cell(r)
        mark = ""
        if r.get("run"):
            stamp = tuple(r["run"].get(k) for k in RUN_STAMP_KEYS)
            mark = " " + earlier.setdefault(stamp, "†" * (len(earlier) + 1))
        lines.append(
            f"| {r['a']} / {r['b']}{mark} | {r['ratio_median']:.3f} | {r['ratio_q1']:.3f}–{r['ratio_q3']:.3f} | "
            f"{r['a_step_s'] * 1e3:.1f} | {r['b_step_s'] * 1e3:.1f} | "
            f"{_describe_per_step(r.get('stats_per_step', {}).get(r['a'], {}))} | "
            f"{_describe_per_step(r.get('stats_per_step', {}).get(r['b'], {}))} | {target} |"
        )
    for (date, commit, steps, warmup), mark in earlier.items():
        lines += [
            "",
            f"{mark} From an earlier run of the same model: {date}, commit {commit or 'n/a'}, {steps} steps each "
            f"after {warmup} warm-up steps.",
        ]
    if any(r["a"] == BOUND and r.get("target") for r in payload["pairs"]):
        gbs = (payload.get("pinned_bandwidth") or {}).get("d2h_gbs")
        measured = f"{gbs:.1f} GB/s, measured in the run" if gbs else "not measured in this run"
        lines += [
            "",
            f"`{BOUND}`'s target is on its bound: its step ÷ max(the `none` step, bytes parked per step ÷ the pinned "
            f"device-to-host bandwidth: {measured}).",
        ]
    return "\n".join(lines) + "\n"


def _parse_pairs(text: str, parser: argparse.ArgumentParser, *, diffusers: bool) -> list[tuple[str, str]]:
    """``"offload_attention/none,unsloth/ckpt-block"`` -> (A, B) pairs; a typo stops here."""
    names = row_names(diffusers=diffusers)
    pairs = []
    for item in text.split(","):
        a, slash, b = (part.strip() for part in item.partition("/"))
        if not slash or a not in names or b not in names:
            parser.error(f"pair {item!r}: write A/B with A and B among {sorted(names)}")
        pairs.append((a, b))
    return pairs


def family_pairs(model: torch.nn.Module, adapter: FamilyAdapter) -> list[tuple[str, str]]:
    """A family's default pairs, as its headline columns compare them: each memfit mode against diffusers'
    checkpointing (whole-block modes; ``ckpt-block`` where the family's own checkpointing cannot run) or against
    ``ckpt-ffn`` (FFN modes, where the family declares an FFN)."""
    block_peer = (
        Peer.DIFFUSERS if peers.unsupported(Peer.DIFFUSERS, model, adapter) is None else Peer.CHECKPOINT_BLOCK
    )
    out = []
    for mode, peer in FAMILY_PAIRS:
        peer = block_peer if peer is Peer.DIFFUSERS else peer
        if peers.unsupported(peer, model, adapter) is None:
            out.append((mode, peer.value))
    return out


def stem(args: argparse.Namespace, *, tokens: int, config: TrainingConfig) -> str:
    """The results file of one run (``args``: :func:`parse_args`'): ``interleaved`` for the synthetic stack's first
    shape (1024 tokens; its tiny smoke shape too) with LoRA on every linear, eager; the family, another shape's
    tokens, the config and compilation named where they differ."""
    if args.family is not None:
        return f"interleaved-{args.family}-{tokens}-{config.value}"
    parts = ["interleaved"] + (["compiled"] if args.compile else [])
    parts += [] if args.shape in ("0", "tiny") else [str(tokens)]
    parts += [] if config is TrainingConfig.LORA_ALL else [config.value]
    return "-".join(parts)


def _dtype(device: torch.device) -> torch.dtype:
    """The dtype the model is built in and its LoRA weights take (not its first parameter's: a family may keep
    some modules in float32, as Wan does its norms and time embedding)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _model(args: argparse.Namespace, device: torch.device) -> tuple[Any, dict, FamilyAdapter, dict[str, Any]]:
    """The model (random weights) and its batch, the adapter that declares it, and what the results record
    about it."""
    dtype = _dtype(device)
    if args.family is None:
        label, width, depth, tokens = TINY_SHAPE if args.shape == "tiny" else SHAPES[int(args.shape)]
        model = build(dim=width, depth=depth, dtype=dtype, device=device)
        batch = inputs(model, tokens=tokens, generator=torch.Generator().manual_seed(0))
        return model, batch, SYNTHETIC, {"shape": label, "tokens": tokens}
    adapter = memfit.get_adapter(args.family)
    preset = adapter.presets[args.preset]
    tokens = args.tokens or preset.default_tokens
    model = preset.build(dtype=dtype, device=device)
    batch, _ = batch_on(adapter, args.preset, model, tokens, device)
    shape = f"{args.family} {args.preset}, {tokens} tokens"
    return (
        model,
        batch,
        adapter,
        {"shape": shape, "tokens": tokens, "family": args.family, "preset": args.preset},
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, checked: steps, family, configs and pairs (``configs`` and ``chosen`` parsed; ``chosen``
    None for the default pairs). Exits with the parser's message on a mistake."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--shape", default="0", help="index into the sweep's shapes (0: 1024 tokens), or 'tiny'"
    )
    parser.add_argument("--family", default=None, help="a family's model instead of the synthetic stack")
    parser.add_argument("--preset", default="full", help="the family's preset (with --family)")
    parser.add_argument(
        "--tokens", type=int, default=None, help="the family's tokens (default: its preset's)"
    )
    parser.add_argument(
        "--configs",
        default=None,
        help="training configs, one results file each (default: lora-all; a family: lora-all,lora-attn)",
    )
    parser.add_argument("--steps", type=int, default=200, help="timed steps per mode and pair")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--pairs",
        default=None,
        help="comma-separated A/B mode pairs (default: "
        + ", ".join(f"{a}/{b}" for a, b in PAIRS)
        + "; a family: each memfit mode against its headline peer); each has the sweeps' target for its two "
        "rows, if any",
    )
    parser.add_argument(
        "--compile",
        default=None,
        metavar="BACKEND",
        help="compile every block with torch.compile (regional, as diffusers' compile_repeated_blocks "
        "does), e.g. 'inductor'; Dynamo is reset after the rows go on, so the blocks are traced with "
        "their hooks",
    )
    args = parser.parse_args(argv)
    if args.steps < 2 or args.warmup < 1:
        parser.error("--steps must be at least 2 and --warmup at least 1")
    if args.compile and args.family:
        parser.error("--compile compiles the synthetic stack's blocks; it does not take --family")
    if args.family is not None and args.family not in memfit.available_adapters():
        parser.error(f"unknown family {args.family!r}: choose from {sorted(memfit.available_adapters())}")
    try:
        configs = parse_configs(args.configs or ("lora-all,lora-attn" if args.family else "lora-all"))
    except ValueError as exc:
        parser.error(str(exc))
    args.configs = configs
    args.chosen = (
        None if args.pairs is None else _parse_pairs(args.pairs, parser, diffusers=bool(args.family))
    )
    return args


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    configs, chosen = args.configs, args.chosen
    device = benchmark_device(
        args.device, without_cuda="needs CUDA (or --device cpu --shape tiny / --preset tiny for a smoke run)"
    )
    cuda = device.type == "cuda"
    model, batch, adapter, described = _model(args, device)
    if chosen is None:
        chosen = PAIRS if args.family is None else family_pairs(model, adapter)
    # the synthetic stack pins flash; a family runs the default dispatch its sweep runs (its masks and
    # variable-length batches may have no flash kernel)
    pin_flash = cuda and args.family is None
    sdpa = (
        "flash (cuDNN SDPA disabled)"
        if pin_flash
        else ("default dispatch, cuDNN SDPA disabled" if cuda else "default (CPU)")
    )
    bandwidth = (
        pinned_bandwidth() if cuda and any(a == BOUND for a, _ in chosen) else None
    )  # the bound's copies
    paths = []
    for config in configs:
        training = prepare(model, batch, config, adapter, dtype=_dtype(device))
        models = (model, copy.deepcopy(model))
        if args.compile:
            for m in models:
                compile_blocks(m, args.compile)
        pairs = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION) if pin_flash else contextlib.nullcontext():
            for a, b in chosen:
                row = measure_pair(
                    models,
                    batch,
                    a,
                    b,
                    steps=args.steps,
                    warmup=args.warmup,
                    cuda=cuda,
                    compiled=bool(args.compile),
                    adapter=adapter,
                )
                row["target"] = pair_limit(a, b, described["tokens"])
                if a == BOUND:
                    row["bound_ratio"] = bound_ratio(row, (bandwidth or {}).get("d2h_gbs"))
                pairs.append(row)
                print(
                    f"[{config.value}] {a} / {b}: {row['ratio_median']:.3f} "
                    f"({row['ratio_q1']:.3f}-{row['ratio_q3']:.3f})",
                    flush=True,
                )
                gc.collect()
        del models
        training.undo()
        gc.collect()
        # a family's runs are one sweep (each family a file of its own); the compiled stack's run sits next to the
        # eager one
        suite = (
            "interleaved-families"
            if args.family
            else ("interleaved-compiled" if args.compile else "interleaved")
        )
        payload = {
            **run_stamp(suite, torch.cuda.get_device_name() if cuda else "cpu"),
            **described,
            "config": config.value,
            "regime": training.description
            + (f", blocks compiled ({args.compile})" if args.compile else ", eager"),
            "compile": args.compile,
            "sdpa_backend": sdpa,
            "steps": args.steps,
            "warmup": args.warmup,
            "pinned_bandwidth": bandwidth,
            "pairs": pairs,
        }
        name = stem(args, tokens=described["tokens"], config=config)
        paths.append(write_results(args.out, payload, render, stem=name))
    return paths


if __name__ == "__main__":
    main()
