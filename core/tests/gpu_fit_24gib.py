"""`memfit fit` on Flux.1-dev size in a process limited to a 24 GiB card (GPU; run explicitly).

Not collected by a plain `pytest` run (the file name does not start with ``test_``): each test builds the
12B model and walks the ladder, a minute or more apiece. Run on a CUDA machine with at least 24 GiB free:

    MEMFIT_REQUIRE_CUDA=1 MEMFIT_FIT_LOG_DIR=benchmarks/results/fit-24gib \\
        python -m pytest core/tests/gpu_fit_24gib.py -v -s

Each test runs ``python -m memfit.cli fit …`` in a subprocess, exactly as a user would; ``--gpu-memory 24GiB``
caps what the measuring process may reserve (``torch.cuda.set_per_process_memory_fraction``), i.e. what a
24 GB card gives. With ``MEMFIT_FIT_LOG_DIR`` set, each test leaves its command, console output and JSON
report there.

What they check:
* ``--sdpa flash``: the model builds within the limit (seconds: weights are created in bf16 on the card),
  rungs that run out of memory are "does not fit" rows, the recommendation's peak (allocated and reserved) is
  within 24 GiB, exit code 0, no traceback.
* the default SDPA dispatch: no traceback whatever happens; rungs that crash (cuDNN's SDPA backward on
  torch 2.11 + cu130 corrupts memory) are "crashed" rows and the output suggests ``--sdpa flash`` and
  ``torch.backends.cuda.enable_cudnn_sdp(False)``.
* the job of issue "a budget is a promise": 1024x1024 px, LoRA r16 on the attention projections, 24 GiB:
  a recommendation within budget in under 3 minutes.
* a 16 GiB card, smaller than the weights: built on the host, placed per rung, a recommendation that streams
  weights and stays within 16 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
pytest.importorskip("memfit_flux")

LIMIT = 24 * 2**30


def fit(
    name: str, *flags: str, tmp_path: Path, timeout: float = 900
) -> tuple[subprocess.CompletedProcess, dict, float]:
    report = tmp_path / f"{name}.json"
    cmd = [sys.executable, "-m", "memfit.cli", "fit", "--preset", "full", *flags, "--json", str(report)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    seconds = time.perf_counter() - start
    log_dir = os.environ.get("MEMFIT_FIT_LOG_DIR")
    if log_dir:
        out = Path(log_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.log").write_text(
            f"$ {' '.join(cmd[1:])}\n# exit code {proc.returncode}, {seconds:.0f} s\n\n{proc.stdout}\n{proc.stderr}"
        )
        if report.exists():
            (out / f"{name}.json").write_text(report.read_text())
    print(proc.stdout, proc.stderr, sep="\n")
    data = json.loads(report.read_text()) if report.exists() else {}
    return proc, data, seconds


def assert_no_traceback(proc: subprocess.CompletedProcess) -> None:
    for stream in (proc.stdout, proc.stderr):
        assert "Traceback" not in stream and "terminate called" not in stream


def assert_recommendation_within(data: dict, limit: int) -> dict:
    rows = {row["name"]: row for row in data["rows"]}
    chosen = rows[data["recommended"]]
    assert chosen["fits"] and chosen["peak_bytes"] <= limit, chosen
    assert chosen["peak_reserved_bytes"] <= limit, chosen  # what the 24 GB card would have had to hold
    return chosen


def test_flux_full_size_on_a_24gib_card_with_flash_attention(tmp_path):
    proc, data, seconds = fit(
        "flux-full-24gib-flash",
        "--budget",
        "24GiB",
        "--gpu-memory",
        "24GiB",
        "--sdpa",
        "flash",
        tmp_path=tmp_path,
    )
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["built"]["build_seconds"] < 60, (
        "weights are created in bf16 on the card: seconds, not minutes"
    )
    assert data["built"]["weights_bytes"] > 20 * 2**30  # Flux.1-dev: 22.2 GiB of bf16 weights
    assert data["sdpa"] == "flash (pinned)"
    oom = [row for row in data["rows"] if row["failure"] and row["failure"]["kind"] == "out of memory"]
    assert oom, "at 24 GiB the unmodified step cannot fit: expected out-of-memory rows"
    assert all(row["status"].startswith("does not fit (out of memory") for row in oom)
    assert_recommendation_within(data, LIMIT)


def test_flux_full_size_with_the_default_attention_dispatch_never_prints_a_traceback(tmp_path):
    proc, data, seconds = fit(
        "flux-full-24gib-default-sdpa", "--budget", "24GiB", "--gpu-memory", "24GiB", tmp_path=tmp_path
    )
    assert_no_traceback(proc)
    assert proc.returncode in (0, 1), proc.stdout[-3000:]
    crashed = [row for row in data["rows"] if row["failure"] and row["failure"]["kind"] == "crashed"]
    print(f"{len(crashed)} of {len(data['rows'])} rungs crashed with the default dispatch ({data['sdpa']})")
    if crashed:  # torch 2.11 + cu130: cuDNN's SDPA backward faults
        assert "--sdpa flash" in proc.stdout and "enable_cudnn_sdp(False)" in proc.stdout
        assert data["crash_advice"] and "--sdpa flash" in data["crash_advice"]
        assert all(row["status"].startswith("crashed") for row in crashed)
    if proc.returncode == 0:
        assert_recommendation_within(data, LIMIT)
    else:
        assert all(row["failure"] for row in data["rows"]), (
            "exit 1 without a recommendation: every rung failed"
        )
        assert "Every rung crashed" in proc.stdout or "Nothing fits" in proc.stdout


def test_a_lora_job_at_1024px_on_a_24gib_card_in_under_three_minutes(tmp_path):
    proc, data, seconds = fit(
        "flux-full-24gib-lora-r16-attn-1024px",
        "--resolution",
        "1024x1024",
        "--lora-rank",
        "16",
        "--lora-targets",
        "attn",
        "--budget",
        "24GiB",
        "--gpu-memory",
        "24GiB",
        "--sdpa",
        "flash",
        tmp_path=tmp_path,
    )
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["job"]["tokens"] == 4096 and data["job"]["regime"] == "lora"
    assert_recommendation_within(data, LIMIT)
    assert seconds < 180, f"took {seconds:.0f} s"


def test_flux_full_size_on_a_16gib_card_builds_on_the_host_and_recommends_a_config_that_fits(tmp_path):
    """A card smaller than Flux's 22 GiB of weights: fit builds the model on the CPU, every rung places it with
    ``memfit.apply(..., device=)``, the rungs that keep every weight on the card do not fit, and the
    recommendation (weights streamed from host memory) is within the 16 GiB the card gives."""
    limit = 16 * 2**30
    proc, data, _ = fit(
        "flux-full-16gib-from-host",
        "--budget",
        "16GiB",
        "--gpu-memory",
        "16GiB",
        "--sdpa",
        "flash",
        "--lora-rank",
        "16",
        "--lora-targets",
        "attn",
        tmp_path=tmp_path,
        timeout=1500,
    )
    assert_no_traceback(proc)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["built"]["weights_on_host"] and data["weights_on_host"]
    assert "memfit.apply(transformer, config, device='cuda')" in proc.stdout
    chosen = assert_recommendation_within(data, limit)
    assert chosen["streamed_blocks"] > 0, chosen
