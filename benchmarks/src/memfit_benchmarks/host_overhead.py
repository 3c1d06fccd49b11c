"""memfit's own host time per step, without a GPU: the cost a launch-bound step (1024 tokens on an H200) feels.

    python -m memfit_benchmarks.host_overhead --out DIR [--rounds 5] [--steps 30] [--modes unsloth,torch-ffn]

A small synthetic stack (width 64, 15 blocks, 64 tokens, LoRA r16 on CPU, one thread) makes every kernel nearly
free, so a step's time is host time: Python, dispatch, autograd and memfit's hooks. The offload modes run the
CUDA copy engine over streams and events that do nothing (:class:`NullStreams`) and park every saved tensor
(``min_offload_bytes=0``, as at 1024 tokens on the GPU, where each is ≥ 1 MiB): what is measured is memfit's
Python, not CUDA's calls, which a GPU adds on top. ``none + no-op hooks`` runs saved-tensor hooks that return
what they get: the floor any per-tensor Python hook costs.

The peers run with the same harness, installed as the sweeps install them (:func:`memfit_benchmarks.peers.install`):
``ckpt-block`` and ``ckpt-ffn`` (``torch.utils.checkpoint``, non-reentrant, around each block / each declared FFN
region) and ``save_on_cpu`` (without CUDA its ``pin_memory=True`` path makes a pageable copy per saved tensor).
Each memfit row reports its extra time over its peer (``vs_peer_ms``: median of the per-round differences, with
their range) besides the extra over its baseline.

Every mode is measured ``--rounds`` times round-robin; each row reports its median round and the extra time
over its baseline (``unsloth`` over ``torch``, ``offload_attention`` over ``none``…) as the median of the
per-round differences, per step and per saved tensor parked. Writes ``host-overhead.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import memfit
from memfit.adapters import FamilyAdapter
from memfit.offload.copy import CopyEngine, StreamApi
from memfit.offload.pool import PinnedBucketPool
from memfit_benchmarks import peers
from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.modes import MODES, PEERS_OF, Mode, Peer, is_offload
from memfit_benchmarks.results import write_results
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
from memfit_benchmarks.training import TrainingConfig, prepare
from memfit_benchmarks.variants import CPU_VARIANTS, VARIANTS, variant_keywords

NOOP_HOOKS = "none + no-op hooks"
BASELINES = {
    "unsloth": "torch",
    "unsloth-ffn": "torch-ffn",
    "offload_attention": "none",
    "torch-ffn + offload_attention": "torch-ffn",
    "torch": "none",
    "torch-ffn": "none",
    NOOP_HOOKS: "none",
    Peer.CHECKPOINT_BLOCK.value: "none",
    Peer.CHECKPOINT_FFN.value: "none",
    Peer.SAVE_ON_CPU.value: "none",
}
NAMES = [
    "none",
    NOOP_HOOKS,
    Peer.CHECKPOINT_BLOCK.value,
    "torch",
    "unsloth",
    Peer.CHECKPOINT_FFN.value,
    "torch-ffn",
    "unsloth-ffn",
    Peer.SAVE_ON_CPU.value,
    "offload_attention",
    "torch-ffn + offload_attention",
]
_PEERS = {p.value: p for p in Peer}
# memfit mode -> its peer: the first of the sweeps' peers (``modes.PEERS_OF``) this harness measures
PEER_OF = {name: next(p for p in PEERS_OF[name] if p in NAMES) for name in NAMES if name in PEERS_OF}


class _NullEvent:
    def record(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NullStream:
    def wait_event(self, event: Any) -> None:
        return None


class NullStreams(StreamApi):
    """Streams and events that do nothing and are always complete: the copy engine's Python, on CPU tensors."""

    def __init__(self) -> None:
        self._stream = _NullStream()

    def new_stream(self) -> _NullStream:
        return self._stream

    def current_stream(self, device: torch.device) -> _NullStream:
        return self._stream

    def new_event(self, *, timing: bool = False) -> _NullEvent:
        return _NullEvent()

    def use(self, stream: Any, *, restore: Any) -> contextlib.nullcontext:
        return contextlib.nullcontext()

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        return None


class _CpuCopyEngine(CopyEngine):
    parks_cpu_tensors = True  # CPU tensors stand for device tensors here


def null_copy_engine() -> CopyEngine:
    """The CUDA copy engine over :class:`NullStreams`, parking into pageable CPU buffers."""
    pool = PinnedBucketPool(
        allocate=lambda n, pinned: torch.empty(n, dtype=torch.uint8),
        available_host_bytes=lambda: 1 << 40,
        host_reserve_bytes=0,
    )
    return _CpuCopyEngine(pool, streams=NullStreams())


def offload_on_cpu(mode: Mode) -> dict[str, Any]:
    """``memfit.apply`` keywords that run an offload mode on CPU tensors: the copy engine over streams that do
    nothing, every saved tensor parked (nothing for the other modes)."""
    return {"copy_engine": null_copy_engine(), "min_offload_bytes": 0} if is_offload(mode) else {}


class Installed:
    """One row's mode installed on a model: ``step()`` runs a training step (``forward_backward()`` without
    clearing the gradients first, for a caller that times only that), ``hooked_tensors()`` counts the saved tensors
    its hooks handled since the last ``reset()``."""

    def __init__(
        self,
        model: torch.nn.Module,
        batch: dict[str, Any],
        handle: Any,
        context: Any,
        loss: Callable[[Any], torch.Tensor] = SYNTHETIC.loss,
    ) -> None:
        self.model, self.batch, self.handle, self.context, self.loss = model, batch, handle, context, loss
        self.packed = [0]  # saved tensors through the no-op hooks
        # a peer's checkpointed forward calls so far (None: not a checkpointing peer, or one that does not count)
        self.checkpointed_calls: Callable[[], int | None] = lambda: None

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.forward_backward()

    def forward_backward(self) -> None:
        with self.context():
            loss = self.loss(self.model(**self.batch))
        loss.backward()

    def reset(self) -> None:
        self.packed[0] = 0
        if self.handle is not None:
            self.handle.reset_stats()

    def hooked_tensors(self) -> int:
        stats = self.handle.stats() if self.handle is not None else {}
        return (
            stats.get("attention_tensors_parked", 0) + stats.get("saved_tensors_replaced", 0) + self.packed[0]
        )


@contextlib.contextmanager
def installed(
    model: torch.nn.Module,
    batch: dict[str, Any],
    name: str,
    *,
    cuda: bool = False,
    adapter: FamilyAdapter = SYNTHETIC,
) -> Iterator[Installed]:
    """Install row ``name`` (a memfit mode, a peer, ``none`` or the no-op hooks) on ``model``, the synthetic stack
    or a family's model (``adapter``: its blocks, FFN regions and loss); removed after. Off CUDA (``cuda=False``)
    an offload mode parks through the copy engine over streams that do nothing."""
    base = VARIANTS[name][0] if name in VARIANTS else name
    config = {m.name: m.config for m in MODES}.get(base)
    if name in VARIANTS and not cuda and name not in CPU_VARIANTS:
        raise ValueError(f"variant {name!r} needs CUDA; off CUDA only {sorted(CPU_VARIANTS)} run")
    context: Any = contextlib.nullcontext
    # a peer goes on as the sweeps put it on (save_on_cpu without CUDA: a pageable copy per saved tensor)
    installation = peers.install(_PEERS[name], model, adapter) if name in _PEERS else None
    if installation is not None:
        context = installation.step_context
    handle = None
    if config:
        keywords = {} if cuda else offload_on_cpu(Mode(base, config))
        keywords.update(variant_keywords(name, config))  # (a variant's own keywords win)
        handle = memfit.apply(model, config, adapter=adapter, **keywords)
    run = Installed(model, batch, handle, context, adapter.loss)
    if installation is not None:
        run.checkpointed_calls = installation.checkpointed_calls
    if name == NOOP_HOOKS:

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            run.packed[0] += 1
            return tensor

        run.context = lambda: torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    try:
        yield run
    finally:
        if handle is not None:
            handle.remove()
        if installation is not None:
            installation.remove()


def stack(*, depth: int = 15, width: int = 64, tokens: int = 64) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The harness's stack (fp32, LoRA r16 on every linear, CPU, one thread) and its batch."""
    torch.set_num_threads(1)
    model = build(dim=width, depth=depth, dtype=torch.float32, device="cpu")
    batch = inputs(model, tokens=tokens)
    prepare(model, batch, TrainingConfig.LORA_ALL, SYNTHETIC, dtype=torch.float32)
    return model, batch


def _measure(model, batch, name: str, steps: int) -> dict[str, Any]:
    with installed(model, batch, name) as run:
        for _ in range(3):
            run.step()
        run.reset()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            run.step()
            times.append(time.perf_counter() - t0)
        tensors = run.hooked_tensors()
    return {
        "mode": name,
        "step_ms": statistics.median(times) * 1e3,
        "hooked_tensors_per_step": tensors / steps,
    }


def _differences(ms: list[float], other: list[dict[str, Any]]) -> list[float]:
    return [a - b["step_ms"] for a, b in zip(ms, other, strict=True)]


def _paired_extra(ms: list[float], other: list[dict[str, Any]]) -> float:
    """Median of the per-round differences (each round measures both within seconds)."""
    return statistics.median(_differences(ms, other))


def _paired_range(ms: list[float], other: list[dict[str, Any]]) -> list[float]:
    differences = _differences(ms, other)
    return [min(differences), max(differences)]


def row_names(*, diffusers: bool = False) -> set[str]:
    """Every row :func:`installed` can put on a model: the memfit modes, the peers (diffusers' checkpointing only
    where ``diffusers``: the synthetic stack is no diffusers model), the no-op hooks, the variants
    (:mod:`memfit_benchmarks.variants`; off CUDA only those that change what is parked)."""
    peer_rows = set(_PEERS) if diffusers else set(_PEERS) - {Peer.DIFFUSERS.value}
    return {m.name for m in MODES} | peer_rows | {NOOP_HOOKS} | set(VARIANTS)


def selected(modes: str | None) -> list[str]:
    """The rows ``modes`` (comma-separated names, ``None``: every row) needs, with their baselines and peers, in
    :data:`NAMES` order.

    Raises:
        ValueError: an unknown name, listing the known ones.
    """
    if modes is None:
        return list(NAMES)
    wanted = {n.strip() for n in modes.split(",") if n.strip()}
    unknown = sorted(wanted - set(NAMES))
    if unknown or not wanted:
        raise ValueError(f"unknown host-overhead mode(s) {unknown or [modes]}: choose from {NAMES}")
    for name in list(wanted):
        wanted.update(n for n in (BASELINES.get(name), PEER_OF.get(name)) if n is not None)
    for name in list(wanted):  # a peer's own baseline
        wanted.update(n for n in (BASELINES.get(name),) if n is not None)
    return [n for n in NAMES if n in wanted]


def run(
    *,
    rounds: int,
    steps: int,
    depth: int = 15,
    width: int = 64,
    tokens: int = 64,
    names: list[str] | None = None,
) -> dict[str, Any]:
    model, batch = stack(depth=depth, width=width, tokens=tokens)
    names = list(NAMES) if names is None else names
    per_round: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for _ in range(rounds):
        for name in names:
            per_round[name].append(_measure(model, batch, name, steps))
    rows = []
    for name in names:
        ms = [r["step_ms"] for r in per_round[name]]
        row = {
            "mode": name,
            "step_ms": statistics.median(ms),
            "step_ms_rounds": ms,
            "hooked_tensors_per_step": per_round[name][-1]["hooked_tensors_per_step"],
        }
        base = BASELINES.get(name)
        if base is not None:
            row["baseline"], row["extra_ms"] = base, _paired_extra(ms, per_round[base])
        peer = PEER_OF.get(name)
        if peer is not None:
            row["peer"], row["vs_peer_ms"] = peer, _paired_extra(ms, per_round[peer])
            row["vs_peer_ms_range"] = _paired_range(ms, per_round[peer])
        rows.append(row)
    return {
        "shape": {"width": width, "depth": depth, "tokens": tokens},
        "rounds": rounds,
        "steps": steps,
        "rows": rows,
    }


def render(payload: dict[str, Any]) -> str:
    shape = payload["shape"]
    rows = {r["mode"]: r for r in payload["rows"]}
    lines = [
        f"# memfit host time per step — {payload['device']}, torch {payload['torch']}, {payload['date']}",
        "",
        "| memfit mode | step ms | peer | peer step ms | memfit − peer ms, median [min, max] |",
        "|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        if "vs_peer_ms" in r:
            low, high = r["vs_peer_ms_range"]
            lines.append(
                f"| {r['mode']} | {r['step_ms']:.2f} | {r['peer']} | {rows[r['peer']]['step_ms']:.2f} | "
                f"{r['vs_peer_ms']:+.2f} [{low:+.2f}, {high:+.2f}] |"
            )
    lines += [
        "",
        f"Synthetic stack {shape['width']}w x{shape['depth']}, {shape['tokens']} tokens, fp32 + LoRA r16, one "
        f"CPU thread: kernels nearly free, a step is host time. Offload modes: the CUDA copy engine over "
        f"streams and events that do nothing, every saved tensor parked. Peers: ckpt-block / ckpt-ffn = "
        f"torch.utils.checkpoint (non-reentrant) around each block / each declared FFN region; save_on_cpu = "
        f"torch.autograd.graph.save_on_cpu(pin_memory=True), a pageable copy per saved tensor without CUDA. "
        f"Median of {payload['steps']} steps, {payload['rounds']} round-robin rounds; differences are medians "
        f"of per-round differences (both rows measured seconds apart in each round). "
        f"Commit: {payload.get('git_commit') or 'n/a'}.",
        "",
        "| mode | step ms | baseline | extra ms | hooked tensors / step |",
        "|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        extra = f"{r['extra_ms']:+.2f}" if "extra_ms" in r else ""
        lines.append(
            f"| {r['mode']} | {r['step_ms']:.2f} | {r.get('baseline', '')} | {extra} | "
            f"{r['hooked_tensors_per_step']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument(
        "--modes",
        default=None,
        help="comma-separated rows (their baselines and peers come along); default: all",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.steps < 1 or args.depth < 1:
        parser.error("--rounds, --steps and --depth must be at least 1")
    names = selected_or_exit(parser, args.modes)
    measured = run(rounds=args.rounds, steps=args.steps, depth=args.depth, names=names)
    return write_cpu_results(args.out, "host-overhead", measured, render)


def selected_or_exit(parser: argparse.ArgumentParser, modes: str | None) -> list[str]:
    """:func:`selected`, an unknown name ending the command with the parser's usage error."""
    try:
        return selected(modes)
    except ValueError as e:
        parser.error(str(e))


def write_cpu_results(
    out: Path, suite: str, measured: dict[str, Any], render: Callable[[dict[str, Any]], str]
) -> Path:
    """``measured`` stamped with this CPU, torch, Python, date and commit, written as ``<suite>.json`` and ``.md``."""
    payload = {
        **run_stamp(suite, f"cpu ({platform.machine()}, {platform.processor() or 'unknown'})"),
        "python": platform.python_version(),
        **measured,
    }
    return write_results(out, payload, render)


if __name__ == "__main__":
    main()
