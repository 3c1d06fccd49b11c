"""The FSDP2 script on CPU: 2 gloo ranks, tiny Flux + LoRA, smallest run (tokens 16, one step)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")


def test_fsdp2_script_tiny_gloo(tmp_path):
    from memfit_benchmarks import fsdp2

    fsdp2.main(
        [
            "--nproc",
            "2",
            "--preset",
            "tiny",
            "--tokens",
            "16",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads((tmp_path / "fsdp2.json").read_text())
    assert data["meta"]["backend"] == "gloo" and data["meta"]["skipped_modes"] == ["unsloth-ffn", "unsloth"]
    assert list(data["modes"]) == ["none", "none (repeat)", "torch-ffn", "torch"]
    for mode, r in data["modes"].items():
        assert r["loss_equal"] and r["grads_equal"] and r["within_noise"], (mode, r)
        assert r["lora_params"] > 0 and len(r["per_rank"]) == 2
    assert data["modes"]["torch"]["recomputes"] > 0
    assert "| torch-ffn |" in (tmp_path / "fsdp2.md").read_text()
