"""Plan again, on a CPU, from a profile a GPU run recorded: what ``auto`` chooses now for a target, and what each
policy would cost on each block.

    python -m memfit_benchmarks.replan results/streaming/streaming-wan.json --list
    python -m memfit_benchmarks.replan results/streaming/streaming-wan.json --target 22GiB --blocks 0,5,39
    python -m memfit_benchmarks.replan RESULTS.json --row 2 --target 22GiB --no-park

A results file holds profiles where its rows recorded one (``auto`` rows of ``streaming``, ``budget_promise`` and
``auto_sweep``: ``profile``, the one behind the plan that ran, the optimizer's state included). ``--target`` is what
the search plans for: the budget less the closed loop's margins (a row's ``plan.budget_bytes`` is the target it ran
with). The plan is :func:`memfit.auto.planner.plan_policies` under the streaming search the budget planner runs
(every block with frozen weights may stream; ``--no-stream``: none), with every policy the profile's device
offered. Per block the table gives each policy's extra milliseconds, the bytes it keeps between forward and
backward and the bytes it copies, as the search weighs them, a streamed block's own charge included
(:func:`memfit.auto.planner.priced_options`), the chosen one marked. What a model change would do to a plan can
so be asked of a GPU's profile without the GPU: change the cost model, run this again.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memfit.auto.budget_planner import fit_host_memory
from memfit.auto.planner import Plan, plan_policies, priced_options
from memfit.auto.policy import allowed_policies
from memfit.auto.profile import BlockProfile, ModelProfile
from memfit.auto.streaming import choose_streaming, streamable_counts, streamed_set
from memfit.errors import BudgetError
from memfit.plan import BlockPolicy
from memfit.units import format_bytes, parse_bytes

GIB = 1 << 30


def planned(handle: Any) -> dict[str, Any]:
    """What a results row records of an ``auto`` handle's plan and of the profile it came from, for this module to
    read back (None each for a fixed backend)."""
    plan = getattr(handle, "plan", None)
    profile = getattr(handle, "profile", None)
    return {
        "plan": None if plan is None else plan.to_json(),
        "plan_counts": None if plan is None else plan.counts(),
        "profile": None if profile is None else profile.to_json(),
    }


def profiled_rows(results: Any) -> Iterator[dict[str, Any]]:
    """Every dict in ``results`` (a results file's JSON) that recorded a profile, in document order."""
    if isinstance(results, dict):
        if isinstance(results.get("profile"), dict):
            yield results
        for value in results.values():
            yield from profiled_rows(value)
    elif isinstance(results, list):
        for value in results:
            yield from profiled_rows(value)


def _label(row: dict[str, Any]) -> str:
    mode = row.get("mode") or row.get("name") or "row"
    budget = (row.get("plan") or {}).get("budget_bytes") or row.get("budget_bytes")
    return f"{mode}" + (f" (target {format_bytes(int(budget))})" if budget else "")


def replan(
    profile: ModelProfile,
    target: int,
    *,
    park: bool = True,
    stream: bool = True,
    host_bytes: int | None = None,
) -> tuple[Plan, list[list[Any]]]:
    """The plan for ``target`` and every block's priced choices (see the module's docstring); with ``host_bytes``, a
    plan that parks blocks past it gives way as the budget planner's does (without parking, or its copies priced).

    Raises:
        BudgetError: no plan reaches ``target``.
    """
    can_offload = profile.copy_bytes_per_second is not None

    def allowed(b: BlockProfile) -> tuple[BlockPolicy, ...]:
        policies = allowed_policies(has_ffn=b.has_ffn, has_attention=b.has_attention, can_offload=can_offload)
        return policies if park else tuple(p for p in policies if not p.parks_block)

    # as the budget planner offers it: on CUDA, with frozen weights and a copy engine (host RAM not limited here)
    streams = stream and profile.counts_transient and profile.static_bytes and can_offload
    max_count = (
        streamable_counts(profile, 1 << 62) if streams and any(b.frozen_bytes for b in profile.blocks) else 0
    )
    memo: dict[Any, Any] = {}
    plan = choose_streaming(
        profile,
        lambda streamed: plan_policies(profile, target, allowed=allowed, streamed=streamed, memo=memo),
        seconds=lambda p: p.predicted_extra_seconds,
        max_count=max_count,
    )
    parks = any(policy.parks_block for _, policy in plan.blocks)
    if host_bytes is not None and parks and plan.copied_bytes + plan.streamed_bytes > host_bytes:
        lean = replan(profile, target, park=False, stream=stream)[0]

        fitting = fit_host_memory(profile, plan, host_bytes, allowed=allowed, memo=memo)
        if fitting is None or fitting.predicted_extra_seconds >= lean.predicted_extra_seconds:
            plan = lean
        else:
            plan = fitting
    # the search's sets are built by count: the plan's is the one of its size
    streamed = streamed_set(profile, len(plan.streamed)) if plan.streamed else None
    return plan, priced_options(profile, allowed=allowed, streamed=streamed)


def report(plan: Plan, options: list[list[Any]], profile: ModelProfile, blocks: list[int] | None) -> str:
    """The plan's summary, then a table per block of ``blocks`` (None: every block)."""
    counts = Counter(policy.value for _, policy in plan.blocks)
    lines = [
        f"target {format_bytes(plan.budget_bytes)}: predicted peak {format_bytes(plan.predicted_peak_bytes)}, "
        f"{plan.predicted_extra_seconds * 1e3:.0f} ms over no checkpointing; "
        f"{', '.join(f'{p} {n}' for p, n in counts.most_common())}; "
        f"{len(plan.streamed)} of {len(profile.blocks)} blocks stream ({format_bytes(plan.streamed_bytes)}); "
        f"host memory pinned {format_bytes(plan.copied_bytes + plan.streamed_bytes)} a step, copies in flight at "
        f"most {format_bytes(plan.copies_in_flight_bytes)}",
        "",
        "| block | streams | policy | extra ms | kept GiB | copied GiB |",
        "|---|---|---|---|---|---|",
    ]
    streamed = set(plan.streamed)
    for i, ((name, picked), opts) in enumerate(zip(plan.blocks, options, strict=True)):
        if blocks is not None and i not in blocks:
            continue
        for c in opts:
            mark = "**" if c.policy is picked else ""
            lines.append(
                f"| {name} | {'yes' if name in streamed else ''} | {mark}{c.policy.value}{mark} | "
                f"{c.seconds * 1e3:.1f} | {c.kept / GIB:.3f} | {c.copied / GIB:.3f} |"
            )
    return "\n".join(lines)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, help="a results JSON whose rows recorded a profile")
    parser.add_argument("--list", action="store_true", help="list the rows with a profile, plan nothing")
    parser.add_argument("--row", type=int, default=0, help="which of them (from --list; default the first)")
    parser.add_argument("--target", help="bytes to plan for (24GiB); default: the row's own plan's target")
    parser.add_argument("--blocks", help="block indices to price, comma separated (default: every block)")
    parser.add_argument("--no-park", action="store_true", help="offer no block parking (BlockPolicy.PARK)")
    parser.add_argument("--no-stream", action="store_true", help="stream no block's weights")
    parser.add_argument(
        "--host-ram", help="host RAM the copies and streamed weights may pin (100GiB; default: not limited)"
    )
    ns = parser.parse_args(argv)
    try:
        ns.rows = list(profiled_rows(json.loads(ns.results.read_text())))
    except (OSError, json.JSONDecodeError) as exc:
        parser.error(f"{ns.results}: {exc}")
    if not ns.rows:
        parser.error(f"{ns.results}: no row recorded a profile (auto rows of a run that records them)")
    if not 0 <= ns.row < len(ns.rows):
        parser.error(
            f"--row {ns.row}: the file has {len(ns.rows)} row(s) with a profile (0-{len(ns.rows) - 1})"
        )
    if ns.target is None:
        own = (ns.rows[ns.row].get("plan") or {}).get("budget_bytes")
        if own is None and not ns.list:
            parser.error("--target: the row recorded no plan to take it from; give one (24GiB)")
        ns.target = own
    else:
        try:
            ns.target = parse_bytes(ns.target)
        except ValueError as exc:
            parser.error(f"--target: {exc}")
    try:
        ns.blocks = None if ns.blocks is None else [int(b) for b in ns.blocks.split(",") if b.strip()]
    except ValueError:
        parser.error(f"--blocks {ns.blocks!r}: block indices, comma separated (0,5,39)")
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = _parse(argv)
    if ns.list:
        for i, row in enumerate(ns.rows):
            print(f"{i}: {_label(row)}, {len(row['profile']['blocks'])} blocks")
        return 0
    profile = ModelProfile.from_json(ns.rows[ns.row]["profile"])
    try:
        host = parse_bytes(ns.host_ram) if ns.host_ram else None
        plan, options = replan(
            profile, int(ns.target), park=not ns.no_park, stream=not ns.no_stream, host_bytes=host
        )
    except BudgetError as exc:
        print(f"no plan for {format_bytes(int(ns.target))}: {exc}")
        return 1
    print(report(plan, options, profile, ns.blocks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
