"""The weight-streaming benchmark on CPU: tiny Flux + LoRA under ``torch``, streaming none, some and every block."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")


def test_streaming_tiny_flux_cpu(tmp_path):
    from memfit_benchmarks import streaming

    path = streaming.main(
        [
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--backend",
            "torch",
            "--blocks",
            "0,2,200KiB,7",
            "--budgets",
            "1GiB",
            "--steps",
            "1",
        ]
        + ["--out", str(tmp_path)]
    )
    data = json.loads(path.read_text())
    assert path.name == "streaming.json" and (tmp_path / "streaming.md").exists()
    assert data["suite"] == "streaming" and data["family"] == "flux" and data["tokens"] == 64
    rows = {r["mode"]: r for r in data["rows"]}
    assert list(rows) == [
        "torch",
        "torch + stream 2",
        "torch + stream 200KiB",
        "torch + stream 7",
        "auto 1GiB",
    ]
    # off CUDA the budget counts held activations: auto streams nothing, and 1 GiB holds the tiny model's
    assert rows["auto 1GiB"]["streamed_blocks"] == 0 and rows["auto 1GiB"]["budget_bytes"] == 1 << 30
    assert rows["torch"]["streamed_blocks"] == 0 and rows["torch"]["weight_bytes_uploaded_per_step"] == 0
    for name, streamed in (("torch + stream 2", 2), ("torch + stream 200KiB", 2), ("torch + stream 7", 7)):
        r = rows[name]
        assert r["streamed_blocks"] == streamed and r["resident_blocks"] == 7 - streamed
        # one upload for each streamed block's forward and one for its recompute, every step
        assert r["weight_uploads_per_step"] == 2 * streamed and r["weight_uploads_on_demand_per_step"] == 0
        assert r["weight_bytes_uploaded_per_step"] == 2 * r["streamed_weight_bytes"] > 0
        assert r["weight_held_after_forward"] == 0 and r["x_unconstrained"] > 0
    assert rows["torch + stream 200KiB"]["streamed_weight_bytes"] >= 200 * 1024
    markdown = (tmp_path / "streaming.md").read_text()
    assert "| torch + stream 7 | 7 of 7 |" in markdown


def test_bad_blocks_are_a_usage_error(capsys):
    from memfit_benchmarks import streaming

    with pytest.raises(SystemExit):
        streaming.main(["--blocks", "0,lots", "--out", "/tmp/unused"])
    assert "--blocks" in capsys.readouterr().err
