"""Round-robin rounds and paired step-time ratios, shared by the synthetic and the family sweeps.

Step times of one mode drift by ~10% over minutes on the shared GPU host. Measuring every mode once per round
(mode A, B, …, then A, B, … again) makes that drift touch every mode alike; comparing two modes round by round
(round k of A / round k of B, measured minutes apart at most) cancels a slow drift, which the ratio of the two
modes' median rounds does not. Pure Python (no torch): the report imports it too.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import Any

from memfit_benchmarks.modes import Mode

Row = dict[str, Any]
NOT_MEASURED = "not_measured"  # a row's key: why no round of the mode ran (the value says)
FAILED = "failed"  # a row's key: the error a peer raised (memfit's own errors are raised, not recorded)


def measured(row: Row) -> bool:
    """Whether the row has a step time (not out of memory, failed or left out)."""
    return not row.get("oom") and "step_s" in row


def stopped(row: Row) -> bool:
    """A round after which the mode is not measured again: out of memory, or a peer that failed."""
    return bool(row.get("oom") or row.get(FAILED))


def merge_rounds(rows: list[Row]) -> Row:
    """One mode's rows from several rounds as one row: the median step time (each round's kept in
    ``step_s_rounds``, and its count of timed steps in ``timed_steps_rounds``), the largest peaks; the rest from
    the first round. A mode out of memory in any round is that round's ``oom`` row."""
    if not rows:
        raise ValueError("merge_rounds needs at least one measured round")
    oom = next((r for r in rows if stopped(r)), None)
    if oom is not None:
        return oom
    if len(rows) == 1:
        return rows[0]
    merged = dict(rows[0])
    merged["step_s_rounds"] = [r["step_s"] for r in rows]
    merged["step_s"] = statistics.median(merged["step_s_rounds"])
    if any("timed_steps" in r for r in rows):
        merged["timed_steps_rounds"] = [r.get("timed_steps") for r in rows]
    for key in ("peak_allocated", "peak_reserved", "peak_allocated_before_optimizer"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            merged[key] = max(values)
    return merged


def round_robin(
    modes: list[Mode],
    rounds: int,
    measure: Callable[[Mode], Row],
    progress: Callable[[Iterable[int]], Iterable[int]] = iter,
    stop: Callable[[], bool] = lambda: False,
    keep: Callable[[Mode], bool] = lambda mode: True,
) -> list[Row]:
    """``measure`` every mode ``rounds`` times, round-robin (every mode once per round, in ``modes`` order), and
    merge each mode's rounds (``merge_rounds``): one row per mode, in ``modes`` order. A mode out of memory once
    is not measured again. ``progress`` wraps the iteration over all measurements (e.g. a progress bar). Once
    ``stop()`` is true no further measurement starts: a mode with fewer rounds keeps those it has, a mode with
    none is a ``not_measured`` row. From the second round on a mode for which ``keep(mode)`` is false is not
    measured again (its first round stays)."""
    measured: dict[str, list[Row]] = {m.name: [] for m in modes}
    for i in progress(range(rounds * len(modes))):
        if stop():
            break
        mode = modes[i % len(modes)]
        done = measured[mode.name]
        if done and (stopped(done[-1]) or not keep(mode)):
            continue  # out of memory once is out of memory; a mode out of the race is not timed again
        done.append(measure(mode))
    return [
        merge_rounds(measured[m.name])
        if measured[m.name]
        else {
            "mode": m.name,
            "config": m.config,
            "peer": m.peer.value if m.peer else None,
            NOT_MEASURED: "the run's deadline passed first",
        }
        for m in modes
    ]


def per_round_ratios(row: Row, ref: Row) -> list[float] | None:
    """Round k of ``row`` / round k of ``ref`` for every round both were measured in (a run cut by its deadline
    can leave one mode a round short), when that is more than one round; else None."""
    steps, ref_steps = row.get("step_s_rounds") or [], ref.get("step_s_rounds") or []
    common = min(len(steps), len(ref_steps))
    if common < 2:
        return None
    return [s / r for s, r in zip(steps[:common], ref_steps[:common], strict=True)]


def inside_spread(ratios: list[float] | None, limit: float) -> bool:
    """Whether ``limit`` lies inside the per-round ratios' range: some round at or under it, some over. A verdict
    of the paired median against ``limit`` is then a tie within the run's own round-to-round noise.

    Example:
        >>> inside_spread([1.335, 0.983, 1.113], 1.00), inside_spread([1.011, 1.001, 1.006], 1.00)
        (True, False)
    """
    return bool(ratios) and min(ratios) <= limit < max(ratios)


def paired_ratio(row: Row, ref: Row) -> float | None:
    """The median of the per-round ratios of ``row`` to ``ref`` (None without rounds to pair)."""
    ratios = per_round_ratios(row, ref)
    return None if ratios is None else statistics.median(ratios)


def step_ratio(row: Row, ref: Row) -> tuple[float, str]:
    """The step-time ratio a target checks, and how to show it: the paired ratio (median of per-round ratios)
    where both rows have the same rounds, with the per-round ratios and the ratio of the median rounds beside it;
    else the ratio of the two steps."""
    medians = row["step_s"] / ref["step_s"]
    ratios = per_round_ratios(row, ref)
    if ratios is None:
        return medians, f"{medians:.3f}×"
    paired = statistics.median(ratios)
    listed = ", ".join(f"{r:.3f}" for r in ratios)
    return (
        paired,
        f"{paired:.3f}× (median of per-round ratios {listed}; ratio of median rounds {medians:.3f})",
    )
