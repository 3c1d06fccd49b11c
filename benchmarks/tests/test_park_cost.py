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


def test_park_cost_refuses_nonsense(tmp_path):
    from memfit_benchmarks import park_cost

    with pytest.raises(SystemExit):
        park_cost.main(["--out", str(tmp_path), "--device", "cpu", "--repeats", "0"])
