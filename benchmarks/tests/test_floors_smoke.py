"""The per-family floors on CPU: tiny presets, both floors from auto's BudgetError (equal off CUDA, where the
budget counts held activations and streaming changes nothing)."""

from __future__ import annotations

import json


def test_floors_tiny_cpu(tmp_path):
    from memfit_benchmarks import floors

    path = floors.main(
        ["--family", "flux,wan", "--preset", "tiny", "--device", "cpu", "--out", str(tmp_path)]
    )
    data = json.loads(path.read_text())
    assert data["suite"] == "floors" and [r["family"] for r in data["rows"]] == ["flux", "wan"]
    for r in data["rows"]:
        assert 0 < r["floor_bytes"] == r["floor_without_streaming_bytes"]
        assert r["weight_bytes"] > 0
    assert "| flux |" in (tmp_path / "floors.md").read_text()


def test_a_passed_deadline_measures_nothing(tmp_path):
    from memfit_benchmarks import floors

    path = floors.main(
        ["--family", "flux", "--preset", "tiny", "--device", "cpu", "--stop-at", "1", "--out", str(tmp_path)]
    )
    row = json.loads(path.read_text())["rows"][0]
    assert "floor_bytes" not in row and "deadline" in row["skipped"]


def test_the_device_part_checks_its_options(capsys):
    from memfit_benchmarks import floors

    assert floors.main(["--tokens", "wan=4680,ltxvideo2=3072", "--dry-run", "--out", "/tmp/unused"]) is None
    assert "would measure the floors" in capsys.readouterr().out
