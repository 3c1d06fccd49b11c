"""The per-piece host time of parking one region: a CPU smoke run (the engine over streams that do nothing)."""

from __future__ import annotations

import json

import pytest


def test_park_cost_smoke_cpu(tmp_path):
    from memfit_benchmarks import park_cost

    path = park_cost.main(
        ["--out", str(tmp_path), "--device", "cpu", "--mib", "0.25", "--repeats", "3", "--passes", "1"]
    )
    payload = json.loads(path.read_text())
    rows = {r["piece"]: r for r in payload["rows"]}
    assert len(rows) == 10 and all(
        r["us"] > 0 and r["us_min"] <= r["us"] <= r["us_max"] for r in rows.values()
    )
    # the engine's rows are priced over making the tensor they park; the stream and event rows are not
    assert rows["make the tensor, engine park"]["us_over_making_the_tensor"] is not None
    assert rows["an event query"]["us_over_making_the_tensor"] is None
    assert "| make the tensor, engine park + reload + fetch |" in path.with_suffix(".md").read_text()
    # off CUDA there is no caching allocator whose events a freed tensor could leave pending
    assert park_cost.PENDING_ALLOCATION not in rows


def test_a_pieces_set_up_runs_after_the_sync_and_before_its_timed_calls():
    from memfit_benchmarks import park_cost

    calls = []
    park_cost._mean_us(
        lambda: calls.append("piece"),
        2,
        lambda: calls.append("sync"),
        lambda item: None,
        lambda: calls.append("setup"),
    )
    assert calls == ["sync", "setup", "piece", "piece", "sync"]


def test_the_pending_allocation_row_is_explained_where_it_was_measured():
    from memfit_benchmarks import park_cost

    row = {"us": 5.0, "us_min": 4.0, "us_max": 6.0, "us_over_making_the_tensor": None}
    payload = {
        "device": "NVIDIA H100",
        "torch": "2.11",
        "date": "2026-12-06",
        "mib": 6,
        "repeats": 200,
        "passes": 3,
    }
    text = park_cost.render({**payload, "rows": [{**row, "piece": park_cost.PENDING_ALLOCATION}]})
    assert f"| {park_cost.PENDING_ALLOCATION} | 5.0 | 4.0–6.0 |  |" in text
    assert "asks that copy's event at every allocation" in text
    assert "asks that copy's event" not in park_cost.render(
        {**payload, "rows": [{**row, "piece": "an event query"}]}
    )


def test_park_cost_refuses_nonsense(tmp_path):
    from memfit_benchmarks import park_cost

    with pytest.raises(SystemExit):
        park_cost.main(["--out", str(tmp_path), "--device", "cpu", "--repeats", "0"])


def test_the_step_profiler_needs_cuda(tmp_path):
    """``benchmarks/tools/cprofile_steps.py`` profiles a GPU step's host time: off CUDA it says so."""
    import importlib.util
    from pathlib import Path

    import torch

    path = Path(__file__).resolve().parents[1] / "tools" / "cprofile_steps.py"
    spec = importlib.util.spec_from_file_location("memfit_benchmarks_tools_cprofile_steps", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the profiler itself")
    with pytest.raises(SystemExit, match="needs CUDA"):
        module.main(["--out", str(tmp_path), "torch-ffn"])
