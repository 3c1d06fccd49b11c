"""The budget-promise and families device job, on a CPU: every command parses (a dry run) and what comes back fits
the device tool's limits; the families sweep's new options (tokens per family, a deadline per family, no peer)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memfit_benchmarks import families, headline

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")

JOB = Path(__file__).resolve().parents[1] / "tools" / "device_sweeps.sh"
ROOT = JOB.parents[2]


def _dry_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        "DRY_RUN": "1",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        **env,
    }
    return subprocess.run(["bash", str(JOB)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def _plans(done: subprocess.CompletedProcess) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("would measure")]


def test_the_budget_part_dry_run_checks_its_command(tmp_path):
    done = _dry_run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (budget,) = _plans(done)
    assert "['synthetic-16384', 'flux'] (full): configs ['full', 'attn', 'all']" in budget
    assert "['16.00 GiB', '24.00 GiB', '32.00 GiB', '48.00 GiB', 'floor']" in budget
    assert "fixed ['none', 'torch-ffn', 'torch', 'unsloth-ffn', 'unsloth'] in 3 rounds" in budget
    assert "+ 1 timed steps (3 at the floor)" in budget
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["budget.log", "env.txt"]  # + budget-promise.json/.md on the GPU


def test_the_family_parts_cover_every_family_and_every_column(tmp_path):
    done = _dry_run(tmp_path, PARTS="families-image families-video families-rest")
    assert done.returncode == 0, done.stdout + done.stderr
    plans = _plans(done)
    every_column = "modes ['torch-ffn', 'ckpt-ffn', 'unsloth-ffn', 'torch', 'diffusers-ckpt', 'unsloth']"
    timing = "3 rounds of 1 warm-up + 1 timed steps and at least 2 s of them"
    by_families = {plan.split(" (full)")[0].removeprefix("would measure "): plan for plan in plans}
    assert set(by_families) == {
        "['flux']",
        "['krea2']",
        "['wan', 'ltxvideo2']",
        "['mageflow', 'z-image']",
        "['chroma']",
    }
    measured = {name for names in by_families for name in ast.literal_eval(names)}
    assert measured == set(families.default_families())
    for names, plan in by_families.items():
        assert "configs ['lora-all', 'lora-attn']" in plan and timing in plan
        assert "at most 300 s per family" in plan and "without any of the peers is not measured" in plan
        if names not in ("['chroma']", "['krea2']"):
            assert every_column in plan
    # diffusers' checkpointing skips Krea 2's text-fusion blocks: the per-block checkpoint peer does memfit's work
    krea2_modes = (
        "['torch-ffn', 'ckpt-ffn', 'unsloth-ffn', 'torch', 'ckpt-block', 'diffusers-ckpt', 'unsloth']"
    )
    assert f"modes {krea2_modes}" in by_families["['krea2']"]
    assert "ckpt-block" not in by_families["['flux']"]
    # Chroma has no diffusers peer: its FFN modes only, diffusers-ckpt listed so that its cells say why
    assert "modes ['torch-ffn', 'ckpt-ffn', 'unsloth-ffn', 'diffusers-ckpt']" in by_families["['chroma']"]
    video = by_families["['wan', 'ltxvideo2']"]
    assert "'wan': 4680" in video and "'ltxvideo2': 3072" in video
    assert "'flux': 4096" in by_families["['flux']"]
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    parts = ("families-image", "families-rest", "families-video")
    assert files == ["env.txt", *sorted(f"{part}{end}" for part in parts for end in ("-summary.md", ".log"))]
    # on the GPU each part adds <part>.tar.gz: env.txt + two parts' three files fit the device tool's 8 files
    assert 1 + 2 * 3 <= 8
    rest_log = (tmp_path / "families-rest.log").read_text()
    assert "['mageflow', 'z-image']" in rest_log and "['chroma']" in rest_log  # both of its sweeps logged


def test_the_parts_settings_and_an_unknown_part(tmp_path):
    done = _dry_run(
        tmp_path, PARTS="families-image bogus", FAMILY_MIN_S="0", FAMILY_MODES="torch,diffusers-ckpt"
    )
    plan, _krea2 = _plans(done)  # that part alone
    assert "1 timed steps, modes ['torch', 'diffusers-ckpt']" in plan and "at least" not in plan
    assert done.returncode == 1 and "unknown part bogus (choose from: budget families-image" in done.stderr


def test_the_video_families_at_their_default_tokens(tmp_path):
    done = _dry_run(tmp_path, PARTS="families-video-full", FAMILY_MIN_S="0")
    assert done.returncode == 0, done.stdout + done.stderr
    (plan,) = _plans(done)
    assert plan.startswith("would measure ['wan', 'ltxvideo2'] (full)")
    assert "'wan': 14040" in plan and "'ltxvideo2': 6144" in plan  # each preset's own default
    assert "modes ['torch', 'diffusers-ckpt']" in plan and "1 timed steps" in plan


def test_tokens_per_family_and_their_errors():
    assert families.parse_tokens("wan=4680, ltxvideo2=3072") == {"wan": 4680, "ltxvideo2": 3072}
    assert families.parse_tokens("1024") == 1024 and families.parse_tokens(None) is None
    assert families.family_tokens({"wan": 4680}, "wan") == 4680
    assert families.family_tokens({"wan": 4680}, "flux") is None and families.family_tokens(64, "flux") == 64
    for bad in ("0", "wan=0", "wan", "wan=x", "=5"):
        with pytest.raises(ValueError, match="--tokens"):
            families.parse_tokens(bad)
    with pytest.raises(SystemExit):
        families.main(["--family", "flux", "--tokens", "wan=4680", "--dry-run"])  # wan is not run


def test_a_family_deadline_ends_at_the_earlier_of_its_share_and_the_run():
    assert not families.family_deadline(None, None)()
    assert families.family_deadline(time.time() - 1, 100)()  # the run's deadline passed
    stop = families.family_deadline(None, 0.005)
    time.sleep(0.02)
    assert stop()
    assert not families.family_deadline(time.time() + 100, 100)()


def test_a_family_without_the_peer_is_a_row_saying_so(tmp_path):
    pytest.importorskip("memfit_chroma")
    (path,) = families.main(
        [
            "--family",
            "chroma",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--configs",
            "lora-all,lora-attn",
            "--modes",
            "torch,diffusers-ckpt",
            "--require-peer",
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
    assert data["complete"] and data["build_seconds"] >= 0
    for entry in data["results"]:
        assert entry["rows"] == [] and "diffusers-ckpt" in entry["no_peer"]
        assert "call its blocks" in entry["no_peer"]["diffusers-ckpt"]
    found, _ = headline.collect(tmp_path)
    row = next(
        line for line in headline.family_table(found, {"chroma": {"64"}}) if line.startswith("| chroma")
    )
    assert "no diffusers-ckpt (the family's checkpointing branch" in row
    from memfit_benchmarks.report import render_markdown

    assert "**Not measured:** no peer to compare memfit with (diffusers-ckpt)." in render_markdown(data)


def test_a_family_after_the_deadline_is_not_built(tmp_path):
    (path,) = families.main(
        [
            "--family",
            "flux",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--modes",
            "torch",
            "--stop-at",
            "1",
            "--tokens",
            "32",
            "--no-render",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads(path.read_text())
    assert data["cut"] == "the run's deadline passed first" and not data["complete"] and data["tokens"] == 32
    assert "build_seconds" not in data and data["results"] == []
