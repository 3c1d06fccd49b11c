"""Fold a new stepped-in-turn run into the committed file of the same model, shape and LoRA config.

    python -m memfit_benchmarks.stepped_merge NEW.json [NEW.json ...] --into benchmarks/results/interleaved

A run of :mod:`memfit_benchmarks.interleaved` measures the pairs it is asked for; a later run of other pairs of the
same model (say the FFN modes, after the block modes) writes a file of the same name. Merged, the file keeps one
row per pair: the new run's rows, then the committed rows of pairs the new run did not measure, each of those
stamped with the run it came from (``run``: date, commit, steps). The report marks them. Runs of different
devices are not merged: their ratios need not agree, and one file names one device.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from memfit_benchmarks.interleaved import RUN_STAMP_KEYS, render
from memfit_benchmarks.results import write_results

# what must agree for two runs to be one file's rows (the file name says most of it; the device is not in it)
SAME_RUN_KEYS = (
    "suite",
    "device",
    "family",
    "preset",
    "shape",
    "tokens",
    "config",
    "compile",
    "sdpa_backend",
)

# a file written before the LoRA-config axis has no "config": those runs put LoRA on every linear of the blocks
CONFIG_BEFORE_THE_AXIS = "lora-all"


def _what_it_holds(run: dict[str, Any], key: str) -> Any:
    value = run.get(key)
    return CONFIG_BEFORE_THE_AXIS if key == "config" and value is None else value


def merge(committed: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the rows of ``committed`` whose pair it did not measure, each stamped with its own run.

    Raises:
        ValueError: the two runs differ in what a file holds (device, model, shape, config, SDPA backend).
    """
    differ = [k for k in SAME_RUN_KEYS if _what_it_holds(committed, k) != _what_it_holds(new, k)]
    if differ:
        detail = ", ".join(f"{k}: {committed.get(k)!r} vs {new.get(k)!r}" for k in differ)
        raise ValueError(
            f"cannot merge these stepped runs, they differ in {detail}; keep them as separate files (another "
            "device or shape is another run, not more rows of this one)"
        )
    measured = {(r["a"], r["b"]) for r in new["pairs"]}
    stamp = {k: committed.get(k) for k in RUN_STAMP_KEYS}
    kept = [{**r, "run": r.get("run", stamp)} for r in committed["pairs"] if (r["a"], r["b"]) not in measured]
    return {**new, "pairs": [*new["pairs"], *kept]}


def merge_into(new_path: Path, into: Path) -> Path:
    """Merge ``new_path`` into the file of the same name under ``into`` (or copy it there); returns the path."""
    new = json.loads(new_path.read_text())
    target = into / new_path.name
    payload = merge(json.loads(target.read_text()), new) if target.exists() else new
    return write_results(into, payload, render, stem=new_path.stem)


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, nargs="+", help="results files of memfit_benchmarks.interleaved")
    parser.add_argument("--into", type=Path, required=True, help="the committed results folder")
    args = parser.parse_args(argv)
    try:
        paths = [merge_into(path, args.into) for path in args.runs]
    except ValueError as err:
        parser.error(str(err))
    for path in paths:
        print(path)
    return paths


if __name__ == "__main__":
    main()
