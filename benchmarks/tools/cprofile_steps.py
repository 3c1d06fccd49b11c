"""Python's view of a step's host time: cProfile over training steps of the synthetic stack, one row at a time.

    python3 benchmarks/tools/cprofile_steps.py --out DIR [--shape 0] [--steps 20] ROW [ROW ...]

Each row (a memfit mode, a peer, a variant: :func:`memfit_benchmarks.host_overhead.installed`) is warmed up, timed
unprofiled (``--steps`` steps), then profiled over as many; ``cprofile-<shape tokens>-<row>.txt`` gets the unprofiled
step time, the functions by own time and memfit's functions by cumulative time. Two rows' files side by side show
where one's extra host time goes, memfit's Python and the calls it makes into torch and CUDA alike (the profiler
slows Python, so compare the profiled totals with each other, not with the unprofiled step).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from memfit_benchmarks.environment import run_stamp
from memfit_benchmarks.host_overhead import installed
from memfit_benchmarks.shapes import SHAPES
from memfit_benchmarks.synthetic import lora_stack


def _timed(run, steps: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        run.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--shape", type=int, default=0, help="index into the synthetic shapes (0: 1024 tokens)"
    )
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA: the host time in question is a GPU step's")
    torch.backends.cuda.enable_cudnn_sdp(False)
    label, _, _, tokens = SHAPES[args.shape]
    model, batch = lora_stack(SHAPES[args.shape])
    stamp = run_stamp("cprofile-steps", torch.cuda.get_device_name())
    args.out.mkdir(parents=True, exist_ok=True)
    paths = []
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for row in args.rows:
            with installed(model, batch, row, cuda=True) as run:
                for _ in range(5):
                    run.step()
                plain = _timed(run, args.steps)
                profile = cProfile.Profile()
                profile.enable()
                _timed(run, args.steps)
                profile.disable()
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats("memfit/", 60)
            head = (
                f"# {row}: {label}, LoRA on every linear, flash SDPA; {stamp['device']}, torch {stamp['torch']}, "
                f"{stamp['date']}, commit {stamp.get('git_commit') or 'n/a'}\n"
                f"# unprofiled: {plain * 1e3:.2f} ms a step ({args.steps} steps); profiled below over {args.steps}\n"
            )
            path = args.out / f"cprofile-{tokens}-{row.replace(' ', '_')}.txt"
            path.write_text(head + text.getvalue())
            print(path, f"{plain * 1e3:.2f} ms a step", flush=True)
            paths.append(path)
    return paths


if __name__ == "__main__":
    main()
