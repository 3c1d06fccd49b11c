"""Run a batch of GPU jobs inside one device lease: phases in order, GPU lanes in parallel, one deadline.

    python3 benchmarks/tools/lease.py --budget 570 --out "$OUT" fsdp2 "0:gpu 0:bench-frozen 1:families"

Each positional argument is a *phase*; phases run one after the other. A phase is a space-separated list of
``[GPU:]JOB[@SECONDS]`` items (``@SECONDS`` caps that job below the deadline): items on the same GPU run one after the other (a lane), lanes on different GPUs run at the
same time, each pinned to its GPU with ``CUDA_VISIBLE_DEVICES``; an item without ``GPU:`` sees every GPU (used
for the 2-rank FSDP2 run). Every job is cut at the deadline (``--budget`` seconds from the start), so there is
always time left to pack the results: everything under ``--out`` ends up in ``results.tar.gz`` plus a
``summary.txt`` (the device tool returns at most 8 files). Jobs:

- ``gpu`` / ``gpu-<adapter>``: ``nox -s gpu`` (all adapters) or one adapter's GPU half of the kit
- ``bench-<config>[,<config>][,rounds=<n>][,shapes=<i>+<j>][,steps=<s>]``: the synthetic sweep in those
  training configs (lora-all, lora-attn, frozen, full), ``n`` round-robin rounds per mode, only the shapes of
  those indices (``bench-lora-all,rounds=3``, ``bench-lora-all,rounds=5,shapes=0``: the 1024-token shape
  alone), ``s`` timed steps per measurement
- ``families[=<f1>,<f2>][,rounds=<n>]``: every family (or those named) at its published size (``n`` round-robin
  rounds per mode)
- ``fsdp2``: ``memfit_benchmarks.fsdp2 --nproc 2 --preset full``
- ``auto[=<t1>,<t2>,<n>][,pairs=<k>][,steps=<s>][,warmup=<w>][,gaps=<low>:<high>][,no-adjacent][,no-gaps]``: the
  ``auto``-planner sweep (``memfit_benchmarks.auto_sweep``), default or named targets, ``n`` spread budgets each
  (default 6) plus the gap budgets (``no-gaps``: without them; ``n`` = 0: the gap budgets alone, so two lanes can
  share one target's budgets; ``gaps=40GiB:``: only the gap budgets from 40 GiB up, ``gaps=:40GiB`` those below:
  Wan's gaps with two warm-up steps take longer than one lease's call, ``auto=wan,0,gaps=40GiB:,steps=2,warmup=2``),
  ``k`` alternations of auto and the fixed mode per budget, ``s`` timed and ``w`` warm-up
  steps per row, ``no-adjacent``: compare with the fixed modes' first measurement (a 14B Wan step takes ~5 s:
  ``auto=wan,3,no-gaps,steps=2,warmup=2`` fits one lane; auto plans during its first warm-up step, so give it
  two); a family target's fixed rows are also written as that family's results
- ``interleaved[=<shape>][,steps=<n>][,compile=<backend>]``: the offload step-time ratios with the two modes' steps
  alternating on two copies of the synthetic stack (``memfit_benchmarks.interleaved``; shape 0 = 1024 tokens, the
  default); ``compile=inductor`` compiles every block first
- ``memtimeline[=<mode1>+<mode2>][,shape=<i>]``: one step per mode under the allocator's history, what is alive at
  its peak (``memfit_benchmarks.memtimeline``; default ``torch`` and ``unsloth`` at 1024 tokens)
- ``diagnose[=<family>][,modes=<m1>+<m2>][,steps=<s>][,warmup=<w>]``: host vs GPU time and a profile per mode
  (``memfit_benchmarks.diagnose``), e.g. ``diagnose=wan,modes=offload_attention+auto@103.8GiB,steps=2,warmup=2``
  (mode names with spaces cannot be given here)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

RUN_NOX = Path(__file__).with_name("run_nox.py")  # nox on a machine that has it only as carried wheels


def _split_options(spec: str, *keys: str) -> tuple[list[str], dict[str, str | None]]:
    """``"a,b,rounds=3"`` → ``(["a", "b"], {"rounds": "3"})``: the plain comma-separated items, and the last
    value of each ``key=`` (None without one)."""
    items = [i for i in spec.split(",") if i]
    values: dict[str, str | None] = dict.fromkeys(keys)
    plain = []
    for item in items:
        key, sep, value = item.partition("=")
        if sep and key in values:
            values[key] = value
        else:
            plain.append(item)
    return plain, values


def _flag(flag: str, value: str | None) -> list[str]:
    """``[flag, value]``, or nothing without a value (None or empty)."""
    return [flag, value] if value else []


def job_slug(job: str) -> str:
    """``"auto=wan,3,steps=2"`` → ``"auto_wan_3_steps_2"``: a job's name for files and folders."""
    return job.replace("=", "_").replace(",", "_").replace("+", "_").replace(":", "_")


def job_command(job: str, out: Path) -> list[str]:
    """The command line of one named job, writing its results under ``out``."""
    py = sys.executable
    nox = [py, str(RUN_NOX), "-s"]  # nox from the carried wheels (the machine has none)
    if job == "gpu":
        return [*nox, "gpu"]
    if job.startswith("gpu-"):
        return [*nox, f"gpu(adapter='{job.removeprefix('gpu-')}')"]
    if job.startswith("bench-"):
        configs, opts = _split_options(job.removeprefix("bench-"), "rounds", "shapes", "steps")
        return [
            *nox,
            "bench",
            "--",
            "--configs",
            ",".join(configs),
            "--out",
            str(out / "synthetic"),
            *_flag("--rounds", opts["rounds"]),
            *_flag("--shapes", (opts["shapes"] or "").replace("+", ",")),
            *_flag("--steps", opts["steps"]),
        ]
    if job == "families" or job.startswith("families="):
        families, opts = _split_options(job.partition("=")[2], "rounds")
        return [
            *nox,
            "bench",
            "--",
            "--suite",
            "families",
            "--family",
            ",".join(families) or "all",
            "--out",
            str(out / "families"),
            *_flag("--rounds", opts["rounds"]),
        ]
    if job == "fsdp2":
        return [
            py,
            "-m",
            "memfit_benchmarks.fsdp2",
            "--nproc",
            "2",
            "--preset",
            "full",
            "--out",
            str(out / "fsdp2"),
        ]
    if job == "diagnose" or job.startswith("diagnose="):
        items, opts = _split_options(job.partition("=")[2], "modes", "steps", "warmup")
        return [
            py,
            "-m",
            "memfit_benchmarks.diagnose",
            "--family",
            items[0] if items else "flux",
            *_flag("--modes", (opts["modes"] or "").replace("+", ",")),
            *_flag("--steps", opts["steps"]),
            *_flag("--warmup", opts["warmup"]),
            "--out",
            str(out / "diagnose" / job_slug(job)),
        ]
    if job == "interleaved" or job.startswith("interleaved="):
        items, opts = _split_options(job.partition("=")[2], "steps", "compile")
        return [
            py,
            "-m",
            "memfit_benchmarks.interleaved",
            "--shape",
            items[0] if items else "0",
            *_flag("--steps", opts["steps"]),
            *_flag("--compile", opts["compile"]),
            "--out",
            str(out / "interleaved"),
        ]
    if job == "memtimeline" or job.startswith("memtimeline="):
        items, opts = _split_options(job.partition("=")[2], "shape")
        return [
            py,
            "-m",
            "memfit_benchmarks.memtimeline",
            *_flag("--modes", "+".join(items).replace("+", ",")),
            *_flag("--shape", opts["shape"]),
            "--out",
            str(out / "memtimeline"),
        ]
    if job == "auto" or job.startswith("auto="):
        items, opts = _split_options(job.partition("=")[2], "pairs", "steps", "warmup", "gaps")
        opts["gap-range"] = opts.pop("gaps")
        flags = {"no-adjacent": "--no-adjacent", "no-gaps": "--no-gaps"}
        chosen = [flags[i] for i in items if i in flags]
        items = [i for i in items if i not in flags]
        targets = [i for i in items if not i.isdigit()]
        budgets = [i for i in items if i.isdigit()]
        args = [
            *_flag("--targets", ",".join(targets)),
            *_flag("--budgets", budgets[-1] if budgets else None),
            *(flag for key in opts for flag in _flag(f"--{key}", opts[key])),
            *chosen,
        ]
        # a folder per job: two lanes sharing one target's budgets would otherwise write the same file
        return [py, "-m", "memfit_benchmarks.auto_sweep", *args, "--out", str(out / "auto" / job_slug(job))]
    raise SystemExit(f"unknown job {job!r} (see benchmarks/tools/lease.py --help)")


def parse_phase(phase: str) -> dict[str | None, list[str]]:
    """``"0:gpu 1:families fsdp2"`` → ``{"0": ["gpu"], "1": ["families"], None: ["fsdp2"]}``."""
    lanes: dict[str | None, list[str]] = {}
    for item in phase.split():
        gpu, sep, job = item.partition(":")
        lanes.setdefault(gpu if sep else None, []).append(job if sep else gpu)
    return lanes


class Lease:
    """Runs phases against one deadline and keeps a line per job for the summary."""

    def __init__(self, out: Path, budget_s: float, *, min_job_s: float = 5.0) -> None:
        self.out = out
        self.min_job_s = min_job_s  # a job that would get less than this is not started
        self.deadline = time.monotonic() + budget_s
        self.summary: list[str] = []
        self._lock = threading.Lock()

    def _run_job(self, item: str, gpu: str | None) -> None:
        job, _, cap = item.partition("@")
        left = self.deadline - time.monotonic()
        if cap:
            left = min(left, float(cap))
        if left < self.min_job_s:
            self._note(f"SKIPPED {job} (gpu {gpu or 'all'}): no time left")
            return
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        log = self.out / "logs" / f"{job_slug(job)}-gpu{gpu or 'all'}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with log.open("w") as fh:
            proc = subprocess.Popen(job_command(job, self.out), stdout=fh, stderr=subprocess.STDOUT, env=env)
            try:
                rc = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                rc = "timeout"
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        self._note(
            f"{job} (gpu {gpu or 'all'}): rc={rc} in {time.monotonic() - start:.0f} s | " + " / ".join(tail)
        )

    def _note(self, line: str) -> None:
        with self._lock:
            self.summary.append(line)
            print(line, flush=True)

    def run_phase(self, phase: str) -> None:
        def lane(gpu: str | None, jobs: list[str]) -> None:
            for job in jobs:
                self._run_job(job, gpu)

        threads = [threading.Thread(target=lane, args=item) for item in parse_phase(phase).items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def pack(self) -> Path:
        (self.out / "summary.txt").write_text("\n".join(self.summary) + "\n")
        archive = self.out / "results.tar.gz"
        members = [p for p in self.out.iterdir() if p.name not in {archive.name, "summary.txt", "env.txt"}]
        with tarfile.open(archive, "w:gz") as tar:
            for path in members:
                tar.add(path, arcname=path.name)
        for path in members:  # only the archive, summary and env travel back (8 files at most)
            subprocess.run(["rm", "-rf", str(path)], check=False)
        return archive


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--budget", type=float, required=True, help="seconds until every job is cut")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("phases", nargs="+")
    args = parser.parse_args(argv)
    for phase in args.phases:  # fail on a typo before any GPU time is spent
        for jobs in parse_phase(phase).values():
            for job in jobs:
                job_command(job.partition("@")[0], args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    lease = Lease(args.out, args.budget)
    for phase in args.phases:
        lease.run_phase(phase)
    print(f"packed {lease.pack()}", flush=True)


if __name__ == "__main__":
    main()
