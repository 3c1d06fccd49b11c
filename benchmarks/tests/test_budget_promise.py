"""The budget-promise script runs end to end on CPU (tiny Flux): one child per budget, auto and a fixed mode,
results as JSON and markdown."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("memfit_flux")
pytest.importorskip("peft")


def test_budget_promise_runs_on_cpu(tmp_path):
    from memfit_benchmarks import budget_promise

    rc = budget_promise.main(
        [
            "--preset",
            "tiny",
            "--tokens",
            "64",
            "--device",
            "cpu",
            "--budgets",
            "600KiB,1MiB",
            "--lora-targets",
            "all",
            "--steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "budget-promise-flux.json").read_text())
    assert [b["budget_bytes"] for b in result["budgets"]] == [600 << 10, 1 << 20]
    for entry in result["budgets"]:
        assert [row["mode"] for row in entry["modes"]] == ["auto", "torch"]
        assert all(len(row["steps"]) == 2 for row in entry["modes"])
        auto = entry["modes"][0]
        assert auto["plan"] and auto["shapes"] and "budget_error" not in auto
    assert "| 600.00 KiB | auto |" in (tmp_path / "budget-promise-flux.md").read_text()
