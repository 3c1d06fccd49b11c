"""The host time of parking one region, piece by piece: where a 1024-token step's extra time per parked region goes.

    python -m memfit_benchmarks.park_cost --out DIR [--mib 6] [--repeats 200]

At 1024 tokens a step is bound by host time, and stepped in turn against the same recompute, parking costs more
per region on a GPU machine than the copy engine's Python costs on a CPU (``host_overhead``, ``interleaved``). This
times, on the host, each call a parked region makes — the stream and event calls, the copy's issue, the device
allocation, the engine's whole park and reload of one tensor — as the mean over ``--repeats`` back-to-back calls
without a sync between them (what a host that runs ahead of the GPU pays). On CUDA one more row times a device
allocation while a freed tensor waits for a copy that still reads it (``record_stream``): the caching allocator then
queries that copy's event at every allocation until it completes, which a step's every op pays while parked
regions' copies are in flight. Each piece is timed in turn, then again
in reverse order, and the two means are averaged so that a drift of the host's speed cancels. On CUDA the engine runs
on real streams; ``--device cpu`` runs the same engine over streams that do nothing (its Python alone). Writes
``park-cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.offload.copy import CopyEngine
from memfit.offload.pool import PinnedBucketPool
from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.host_overhead import null_copy_engine
from memfit_benchmarks.results import write_results

Piece = Callable[[], Any]  # returns what to release once the timed calls are over (None: nothing)
PENDING_ALLOCATION = "a device allocation, a freed tensor's copy in flight (record_stream)"
# GPU cycles the side stream is kept busy for, so that the freed tensor's event stays pending through the timed
# calls (~13 ms at 1.5 GHz; 200 allocations take ~1 ms)
BUSY_CYCLES = 20_000_000


def _pieces(
    engine: CopyEngine, source: torch.Tensor, cuda: bool
) -> tuple[dict[str, Piece], dict[str, Callable[[], None]]]:
    """What one parked region asks of the host, each as a call to time (every piece makes its own tensor), and the
    set-up some need just before their timed calls (after the sync)."""
    api = engine.streams
    compute = api.current_stream(source.device)
    side = api.new_stream()
    ordering = api.new_event()
    host = engine.pool.acquire(source.nbytes)
    host_view = host.strided_view(source.dtype, source.shape, source.stride())
    device_copy = torch.empty_like(source)
    queried = api.new_event()
    queried.record(compute)

    def produce() -> torch.Tensor:
        return source.mul(1)

    def make_tensor() -> None:
        produce()

    def order_side_stream() -> None:
        ordering.record(compute)
        side.wait_event(ordering)

    def new_event_recorded() -> None:
        api.new_event().record(side)

    def query_event() -> None:
        queried.query()

    def copy_on_device() -> None:
        device_copy.copy_(produce())

    def issue_download() -> None:
        tensor = produce()
        with api.use(side, restore=compute):
            host_view.copy_(tensor, non_blocking=cuda)
        api.record_stream(tensor, side)

    def issue_upload() -> None:
        target = torch.empty_like(source)
        with api.use(side, restore=compute):
            target.copy_(host_view, non_blocking=cuda)
        api.record_stream(target, side)

    def device_allocation() -> None:
        torch.empty(source.nbytes, dtype=torch.uint8, device=source.device)

    def park() -> Any:
        return engine.offload_many([produce()])[0]

    def park_and_reload() -> Any:
        parked = engine.offload_many([produce()])[0]
        parked.source = None  # as when the region's tensor died after parking: the reload copies back
        engine.reload_many([parked])
        engine.fetch(parked)
        return parked

    def copy_in_flight() -> None:
        # the side stream busy, then a tensor it reads freed: its block waits for the copy's event
        tensor = produce()
        with api.use(side, restore=compute):
            torch.cuda._sleep(BUSY_CYCLES)
            host_view.copy_(tensor, non_blocking=True)
        api.record_stream(tensor, side)

    setups = {PENDING_ALLOCATION: copy_in_flight} if cuda else {}
    pieces = {
        "make the tensor (a kernel)": make_tensor,
        "order a side stream after compute (record + wait)": order_side_stream,
        "a new event, recorded": new_event_recorded,
        "an event query": query_event,
        "a device allocation of the same size": device_allocation,
        "make the tensor, copy it on the device": copy_on_device,
        "make the tensor, copy it to pinned memory, record_stream": issue_download,
        "copy pinned memory to a new device tensor, record_stream": issue_upload,
        "make the tensor, engine park": park,
        "make the tensor, engine park + reload + fetch": park_and_reload,
    }
    if cuda:
        pieces[PENDING_ALLOCATION] = device_allocation
    return pieces, setups


def _mean_us(
    piece: Piece,
    repeats: int,
    sync: Callable[[], None],
    release: Callable[[Any], None],
    setup: Callable[[], None] | None = None,
) -> float:
    """Mean host µs of ``piece``; what it returns is released after the timed calls, as a step's backward gives its
    parked buffers back long after its forward took them (released at once, the pool would wait for each copy)."""
    sync()
    if setup is not None:
        setup()
    held = []
    start = time.perf_counter()
    for _ in range(repeats):
        held.append(piece())
    elapsed = time.perf_counter() - start
    sync()  # (outside the time: what the host pays to issue, not what the GPU takes)
    for item in held:
        if item is not None:
            release(item)
    return elapsed / repeats * 1e6


def measure(*, device: str, nbytes: int, repeats: int, passes: int = 3) -> list[dict[str, Any]]:
    cuda = torch.device(device).type == "cuda"
    dtype = torch.bfloat16
    source = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
    if cuda:
        engine = CopyEngine(
            PinnedBucketPool(available_host_bytes=lambda: 1 << 40, host_reserve_bytes=0), timing=True
        )
        sync: Callable[[], None] = torch.cuda.synchronize
    else:
        engine = null_copy_engine()
        sync = lambda: None  # noqa: E731
    pieces, setups = _pieces(engine, source, cuda)
    for (
        name,
        piece,
    ) in pieces.items():  # warm up: pool buckets (as many buffers as a pass holds), allocator blocks
        _mean_us(piece, repeats, sync, engine.release, setups.get(name))
    samples: dict[str, list[float]] = {name: [] for name in pieces}
    for i in range(passes * 2):  # forward, then reverse order: a drift of the host's speed cancels
        order = list(pieces) if i % 2 == 0 else list(reversed(pieces))
        for name in order:
            samples[name].append(_mean_us(pieces[name], repeats, sync, engine.release, setups.get(name)))
    base = sum(samples["make the tensor (a kernel)"]) / len(samples["make the tensor (a kernel)"])
    rows = []
    for name, values in samples.items():
        mean = sum(values) / len(values)
        rows.append(
            {
                "piece": name,
                "us": mean,
                "us_min": min(values),
                "us_max": max(values),
                "us_over_making_the_tensor": mean - base if name.startswith("make the tensor,") else None,
            }
        )
    return rows


def render(payload: dict[str, Any]) -> str:
    lines = [
        f"# Host time of parking one region — {payload['device']}, torch {payload['torch']}, {payload['date']}",
        "",
        f"One {payload['mib']:g} MiB bf16 tensor per region; mean host µs per call over {payload['repeats']} calls "
        f"back to back (no sync between them), {payload['passes']} passes each way.",
        "",
        "| piece | host µs | range | over making the tensor |",
        "|---|---|---|---|",
    ]
    for r in payload["rows"]:
        over = "" if r["us_over_making_the_tensor"] is None else f"{r['us_over_making_the_tensor']:.1f}"
        lines.append(f"| {r['piece']} | {r['us']:.1f} | {r['us_min']:.1f}–{r['us_max']:.1f} | {over} |")
    lines += [
        "",
        "The engine rows are the copy engine's whole path for one tensor: parking (pool, ordering event, copy, "
        "completion event, `record_stream`, the bound on copies in flight) and the round trip (with the reload's "
        "device allocation, its events and the fetch's wait); their buffers go back to the pool after the timed "
        "calls, as a step's backward gives them back long after its forward took them. Off CUDA the engine runs "
        "over streams that do nothing: its Python alone, the part a CPU harness sees.",
        *(
            [
                "",
                f"*{PENDING_ALLOCATION}*: the allocation above, timed while one tensor freed after a "
                "`record_stream` waits for its copy (the side stream kept busy): the caching allocator asks that "
                "copy's event at every allocation until it completes.",
            ]
            if any(r["piece"] == PENDING_ALLOCATION for r in payload["rows"])
            else []
        ),
        "",
        f"Commit: {payload.get('git_commit') or 'n/a'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--mib", type=float, default=6.0, help="the parked tensor's size (6: an FFN input at 1024 tokens)"
    )
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.passes < 1 or args.mib <= 0:
        parser.error("--repeats and --passes must be at least 1 and --mib positive")
    cuda = torch.device(args.device).type == "cuda"
    if cuda and not torch.cuda.is_available():  # (before any CUDA call)
        raise SystemExit("needs CUDA (or --device cpu for the engine's Python alone)")
    nbytes = int(args.mib * 2**20)
    rows = measure(device=args.device, nbytes=nbytes, repeats=args.repeats, passes=args.passes)
    payload = {
        **run_stamp("park-cost", torch.cuda.get_device_name() if cuda else "cpu"),
        "mib": args.mib,
        "repeats": args.repeats,
        "passes": args.passes,
        "rows": rows,
    }
    return write_results(args.out, payload, render)


if __name__ == "__main__":
    main()
