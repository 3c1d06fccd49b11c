"""memfit's host work per step counted in CPU instructions: the host-overhead harness, without the timing noise.

    python -m memfit_benchmarks.host_instructions --out DIR [--modes offload_attention,unsloth] [--steps 3]

Each row runs the stack of :mod:`memfit_benchmarks.host_overhead` (same modes, baselines and peers) in its own
process under ``valgrind --tool=callgrind``, with instrumentation switched on only around the measured steps (a
small C helper issues callgrind's start/stop requests; it needs a C compiler and valgrind's headers). The count
of a step is the same from run to run within ~0.4M instructions of ~150M, where the step's wall time on a shared
machine moves by tens of percent, so a change of a few percent in memfit's own Python shows. It counts work, not
time: a CUDA call that the null streams stand for costs nothing here. Writes ``host-instructions.json`` and
``.md``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from memfit_benchmarks.host_overhead import (
    BASELINES,
    PEER_OF,
    installed,
    selected_or_exit,
    stack,
    write_cpu_results,
)

WARMUP_STEPS = 3
_MARKS_SOURCE = """
#include <valgrind/callgrind.h>
void memfit_marks_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_ZERO_STATS; }
void memfit_marks_stop(void) { CALLGRIND_DUMP_STATS; CALLGRIND_STOP_INSTRUMENTATION; }
"""


class ToolMissing(RuntimeError):
    """valgrind, a C compiler or valgrind's headers are not installed."""


def marks_library(directory: Path) -> Path:
    """Build the helper that switches callgrind's instrumentation on and off from Python.

    Raises:
        ToolMissing: no C compiler, or no ``valgrind/callgrind.h`` (Debian: ``apt install valgrind``).
    """
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise ToolMissing("no C compiler (cc or gcc) to build the callgrind start/stop helper; install gcc")
    source, library = directory / "marks.c", directory / "libmarks.so"
    source.write_text(_MARKS_SOURCE)
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-o", str(library), str(source)], capture_output=True, text=True
    )
    if built.returncode != 0:
        raise ToolMissing(
            f"could not build the callgrind start/stop helper ({built.stderr.strip()[:300]}); it needs "
            f"valgrind's headers (valgrind/callgrind.h, Debian package valgrind)"
        )
    return library


def instructions(dump: str) -> int:
    """The instruction count of a callgrind dump (its ``summary:`` line).

    Raises:
        ValueError: the text is not a callgrind dump.
    """
    found = re.search(r"^summary:\s+(\d+)", dump, re.MULTILINE)
    if found is None:
        raise ValueError("not a callgrind dump: no 'summary:' line")
    return int(found.group(1))


def child(name: str, *, steps: int, depth: int, library: str | None) -> None:
    """Run row ``name``'s warm-up steps, then ``steps`` measured steps between the helper's marks (none given:
    unmarked, as a check that the row runs)."""
    model, batch = stack(depth=depth)
    marks = ctypes.CDLL(library) if library else None
    with installed(model, batch, name) as run:
        for _ in range(WARMUP_STEPS):
            run.step()
        if marks is not None:
            marks.memfit_marks_start()
        for _ in range(steps):
            run.step()
        if marks is not None:
            marks.memfit_marks_stop()


def count(name: str, *, steps: int, depth: int, library: Path, directory: Path) -> int:
    """Instructions per measured step of row ``name``, counted in a process of its own under callgrind."""
    stem = re.sub(r"[^A-Za-z0-9]+", "-", name)
    command = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={directory / stem}.%p",
        sys.executable,
        "-m",
        "memfit_benchmarks.host_instructions",
        "--child",
        name,
        "--steps",
        str(steps),
        "--depth",
        str(depth),
        "--library",
        str(library),
    ]
    # a fixed hash seed: set and dict orders, and with them the interpreter's work, repeat from run to run
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    ran = subprocess.run(command, capture_output=True, text=True, env=env)
    if ran.returncode != 0:
        raise RuntimeError(f"row {name!r} failed under callgrind:\n{ran.stderr[-2000:]}")
    dumps = sorted(directory.glob(f"{stem}.*.1"))
    if not dumps:
        raise RuntimeError(f"row {name!r} left no callgrind dump of its measured steps in {directory}")
    return instructions(dumps[-1].read_text()) // steps


def run(*, names: list[str], steps: int, depth: int, jobs: int) -> dict[str, Any]:
    if shutil.which("valgrind") is None:
        raise ToolMissing("valgrind is not installed (Debian: apt install valgrind)")
    with tempfile.TemporaryDirectory(prefix="memfit-callgrind-") as tmp:
        directory = Path(tmp)
        library = marks_library(directory)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            per_step = dict(
                zip(
                    names,
                    pool.map(
                        lambda n: count(n, steps=steps, depth=depth, library=library, directory=directory),
                        names,
                    ),
                    strict=True,
                )
            )
    rows = []
    for name in names:
        row: dict[str, Any] = {"mode": name, "instructions_per_step": per_step[name]}
        for key, other in (("baseline", BASELINES.get(name)), ("peer", PEER_OF.get(name))):
            if other is not None:
                row[key], row[f"over_{key}"] = other, per_step[name] - per_step[other]
        rows.append(row)
    return {"shape": {"width": 64, "depth": depth, "tokens": 64}, "steps": steps, "rows": rows}


def render(payload: dict[str, Any]) -> str:
    shape = payload["shape"]
    lines = [
        f"# memfit host work per step, in instructions — {payload['device']}, torch {payload['torch']}, "
        f"{payload['date']}",
        "",
        "| mode | M instructions / step | baseline | over baseline (M) | peer | over peer (M) |",
        "|---|---|---|---|---|---|",
    ]
    for r in payload["rows"]:
        cells = [r["mode"], f"{r['instructions_per_step'] / 1e6:.2f}"]
        for key in ("baseline", "peer"):
            cells += [r[key], f"{r[f'over_{key}'] / 1e6:+.2f}"] if key in r else ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Synthetic stack {shape['width']}w x{shape['depth']}, {shape['tokens']} tokens, fp32 + LoRA r16, one CPU "
        f"thread, as in host-overhead.md. Instructions of {payload['steps']} steps after {WARMUP_STEPS} of warm-up, "
        f"counted by valgrind's callgrind in a process per row (PYTHONHASHSEED=0), divided by the steps; the same "
        f"row repeats within ~0.4M. Offload modes park every saved tensor through the CUDA copy engine over streams "
        f"that do nothing: CUDA's own calls are not counted. Commit: {payload.get('git_commit') or 'n/a'}.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> Path | None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--jobs", type=int, default=2, help="rows counted at once (one process each)")
    parser.add_argument(
        "--modes",
        default="offload_attention,unsloth,unsloth-ffn",
        help="comma-separated rows (their baselines and peers come along)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.depth < 1 or args.jobs < 1:
        parser.error("--steps, --depth and --jobs must be at least 1")
    if args.child is not None:
        child(args.child, steps=args.steps, depth=args.depth, library=args.library)
        return None
    if args.out is None:
        parser.error("--out is required")
    names = selected_or_exit(parser, args.modes)
    measured = run(names=names, steps=args.steps, depth=args.depth, jobs=args.jobs)
    return write_cpu_results(args.out, "host-instructions", measured, render)


if __name__ == "__main__":
    main()
