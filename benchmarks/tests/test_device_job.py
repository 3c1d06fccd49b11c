"""The GPU job and the new entry points, on a CPU: the job's every command parses (a dry run), and a tiny sweep
against the peers goes from measurement to headline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memfit_benchmarks import headline

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")

JOB = Path(__file__).resolve().parents[1] / "tools" / "device_job.sh"
ROOT = JOB.parents[2]


def test_the_device_job_dry_run_checks_every_command(tmp_path):
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "DRY_RUN": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    done = subprocess.run(["bash", str(JOB)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    plans = [line for line in done.stdout.splitlines() if line.startswith("would measure")]
    assert len(plans) == 4  # the four synthetic shapes (the families are device_sweeps.sh's parts)
    for plan, tokens in zip(plans, ("1024", "4096", "16384", "3072"), strict=True):
        assert f"{tokens} tok: configs ['lora-all', 'lora-attn'], 3 rounds" in plan
        assert "'ckpt-block'" in plan and "'ckpt-ffn'" in plan
    assert "'save_on_cpu'" in plans[0] and "'save_on_cpu'" not in plans[2]
    # launch-bound 30-90 ms steps: at least 1 s of timed steps per measurement there, the others as before
    assert "2 warm-up + 6 timed steps and at least 1 s of them, modes" in plans[0]
    assert all("at least" not in plan for plan in plans[1:])
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert sorted(p.name for p in files) == [
        "env.txt",
        "summary.md",
    ]  # the device tool returns 8 files at most
    assert headline.NOT_YET in (tmp_path / "summary.md").read_text()


def test_a_tiny_sweep_against_the_peers_reaches_the_headline(tmp_path, is_ratio_cell):
    from memfit_benchmarks.__main__ import main

    (path,) = main(
        [
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--configs",
            "lora-all,lora-attn",
            "--modes",
            "none,torch,ckpt-block,torch-ffn,ckpt-ffn,save_on_cpu,diffusers-ckpt",
            "--rounds",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--no-render",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads(path.read_text())
    assert data["complete"] and [e["config"] for e in data["results"]] == ["lora-all", "lora-attn"]
    for entry in data["results"]:
        by = {r["mode"]: r for r in entry["rows"]}
        assert entry["skipped"] == {"diffusers-ckpt": "the model has no diffusers gradient checkpointing"}
        assert by["torch"]["vs_peer"] == "ckpt-block" and by["torch"]["x_peer_paired"]
        assert len(by["torch"]["x_peer_rounds"]) == 2
        assert by["torch-ffn"]["vs_peer"] == "ckpt-ffn" and by["ckpt-ffn"]["checkpointed_calls_per_step"] == 2
    assert headline.main(["--results", str(tmp_path), "--summary", str(tmp_path / "summary.md")]) == 0
    summary = (tmp_path / "summary.md").read_text()
    row = next(
        line for line in summary.splitlines() if line.startswith("| 64w x2, 64 tok (CPU smoke) | all linears")
    )
    torch_cell = row.split("|")[3].strip()
    assert is_ratio_cell(torch_cell), torch_cell  # a measured ratio (no peak off CUDA)
    assert "## lora-attn — 64w x2, 64 tok (CPU smoke)" in summary  # the full report follows the tables


def test_a_deadline_in_the_past_measures_nothing_and_says_so(tmp_path):
    from memfit_benchmarks.__main__ import main

    (path,) = main(
        [
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--modes",
            "none,torch",
            "--stop-at",
            "1",
            "--no-render",
            "--out",
            str(tmp_path),
        ]
    )
    (entry,) = json.loads(path.read_text())["results"]
    assert entry["rows"] == [] and entry["cut"] == "the deadline passed"
