"""The ``auto`` planner sweep on CPU: tiny Flux + LoRA, two budgets, one timed step, JSON + markdown + PNG.

``test_auto_sweep_tiny_flux_cpu`` needs the real ``auto`` backend (``memfit.auto``) and skips without it.
``test_auto_sweep_with_a_stand_in_planner`` runs the same script with ``memfit.apply`` wrapped so that an
``auto`` config installs a fixed mode instead (a stand-in, not the planner): it checks the sweep's own logic
(budgets, the fastest fitting fixed mode, unreachable rows, the checks, rendering) with or without core's.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")

ARGS = [
    "--device",
    "cpu",
    "--preset",
    "tiny",
    "--targets",
    "flux",
    "--budgets",
    "2",
    "--steps",
    "1",
    "--warmup",
    "1",
]


def _check_output(path, tmp_path, budgets=2):
    data = json.loads(path.read_text())
    assert data["suite"] == "auto" and data["target"] == "flux" and data["preset"] == "tiny"
    assert "error" not in data, data.get("traceback")
    assert data["memory_metric"] == "held_bytes"
    assert [r["mode"] for r in data["fixed_rows"]][:3] == ["none", "torch-ffn", "torch"]
    assert all(r["held_bytes"] > 0 for r in data["fixed_rows"])
    # every timed step kept, in order (here one); the allocator's counters are CUDA's alone
    assert all(len(r["step_times_s"]) == 1 and r["step_times_s"][0] > 0 for r in data["fixed_rows"])
    assert all(r["segments_allocated_in_timed_steps"] is None for r in data["fixed_rows"])
    assert "unsloth" in data["skipped"] and "offload_attention" in data["skipped"]
    none = next(r for r in data["fixed_rows"] if r["mode"] == "none")
    assert data["high_bytes"] == none["held_bytes"] and data["low_bytes"] < data["high_bytes"]
    spread = [b for b in data["budgets"] if b not in data["gap_budgets"]]
    assert len(spread) == budgets and data["budgets"][0] == data["low_bytes"]
    # the gaps follow the frontier of the measured rows (on a loaded CPU the fastest mode can also be the
    # leanest, and then there is no step to fall back over: the count depends on timing, the rule does not)
    from memfit_benchmarks.auto_sweep import gap_budgets

    assert data["gap_budgets"] == gap_budgets(data["fixed_rows"], data["low_bytes"], data["high_bytes"])
    assert set(data["gap_budgets"]) <= set(data["budgets"])
    for gap in data["gap_budgets"]:  # each 1% below a fixed mode's memory: that mode does not fit it
        assert any(gap == int(r["held_bytes"] * 0.99) for r in data["fixed_rows"])
    assert [r["budget_bytes"] for r in data["auto_rows"] if not r.get("planner_floor")] == data["budgets"]
    assert [r["budget_bytes"] for r in data["auto_rows"]] == sorted(
        r["budget_bytes"] for r in data["auto_rows"]
    )
    for r in data["auto_rows"]:
        assert r["best_fixed"] is not None and r["best_fixed"]["memory_bytes"] <= r["budget_bytes"]
        if not r.get("unreachable"):
            assert r["step_s"] > 0 and isinstance(r["within_budget"], bool) and r["plan_counts"]
            # each auto run's timed steps, and the adjacent fixed runs' (one pair by default)
            assert [len(t) for t in r["step_times_s_runs"]] == [1]
            assert [len(t) for t in r["best_fixed"]["step_times_s_adjacent"]] == [1]
    assert data["complete"] and len(data["checks"]) == 4
    md = (tmp_path / f"{path.stem}.md").read_text()
    assert "| budget MiB |" in md and md.count("PASS") + md.count("FAIL") == 4
    table = md.split("## auto at each budget")[1].split("\n\n")[1].splitlines()
    assert "allocator retries" in table[0] and "new segments" in table[0] and "planned at GB/s" in table[0]
    assert {line.count("|") for line in table} == {table[0].count("|")}  # every row has the header's cells
    assert (tmp_path / f"{path.stem}.png").stat().st_size > 1000
    return data


def test_auto_sweep_tiny_flux_cpu(tmp_path):
    pytest.importorskip("memfit.auto")
    from memfit_benchmarks import auto_sweep

    written = auto_sweep.main([*ARGS, "--out", str(tmp_path)])
    assert [p.name for p in written] == ["auto-flux-tiny.json"]
    data = _check_output(written[0], tmp_path)
    for r in data["auto_rows"]:
        if not r.get("unreachable"):
            assert {"policies", "predicted_peak_bytes", "budget_bytes"} <= set(r["plan"])
    # the fixed rows are also the family sweep's results for flux (same builder, inputs and modes)
    family = json.loads((tmp_path / "families" / "family-flux-tiny.json").read_text())
    (entry,) = family["results"]
    assert family["suite"] == "families" and family["family"] == "flux" and entry["config"] == "lora-all"
    assert entry["rows"] == data["fixed_rows"] and entry["skipped"] == data["skipped"]
    assert family["tokens"] == entry["tokens"] == data["tokens"]
    assert (tmp_path / "families" / "family-flux-tiny.md").read_text().count("| none |") == 1


class _StandInBudgetError(RuntimeError):
    def __init__(self, smallest: int) -> None:
        super().__init__(f"budget below the smallest reachable peak {smallest}")
        self.smallest_peak_bytes = smallest


class _StandInPlan:
    def __init__(self, budget: int) -> None:
        self.budget = budget

    def to_json(self):
        return {
            "policies": {"transformer_blocks.0": "block"},
            "predicted_peak_bytes": self.budget,
            "budget_bytes": self.budget,
            "predicted_extra_seconds": 0.0,
        }

    def counts(self):
        return {"block": 1}


class _StandInHandle:
    def __init__(self, handle, budget: int) -> None:
        self._handle, self.plan = handle, _StandInPlan(budget)

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_auto_sweep_with_a_stand_in_planner(tmp_path, monkeypatch):
    import memfit
    import memfit.errors
    from memfit_benchmarks import auto_sweep

    real_apply = memfit.apply
    refused: list[int] = []

    def apply(model, config, **kw):
        if (config or {}).get("gradient_checkpointing_backend") != "auto":
            return real_apply(model, config, **kw)
        budget = config["gradient_checkpointing_memory_budget"]
        if not refused:  # the first budget (the lowest) is refused, the others run `torch`
            refused.append(budget)
            raise _StandInBudgetError(budget + 1)
        fixed = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
        return _StandInHandle(real_apply(model, fixed, **kw), budget)

    monkeypatch.setattr(memfit, "apply", apply)
    monkeypatch.setattr(memfit.errors, "BudgetError", _StandInBudgetError, raising=False)
    written = auto_sweep.main([*ARGS, "--budgets", "3", "--out", str(tmp_path)])
    data = _check_output(written[0], tmp_path, budgets=3)
    low, floor, *rest = data["auto_rows"]
    assert low["unreachable"] and low["smallest_peak_bytes"] == refused[0] + 1
    assert (
        floor["planner_floor"] and floor["budget_bytes"] == refused[0] + 1
    )  # one more row at the planner's floor
    assert all("speedup" in r and r["plan_counts"] == {"block": 1} for r in [floor, *rest])
    for r in [floor, *rest]:  # compared with the fixed mode measured again right after the auto row
        assert r["speedup"] == pytest.approx(r["best_fixed"]["step_s_adjacent"] / r["step_s"])
        assert r["speedup_vs_first_fixed_run"] == pytest.approx(r["best_fixed"]["step_s"] / r["step_s"])
    torch_held = next(r["held_bytes"] for r in data["fixed_rows"] if r["mode"] == "torch")
    assert all(r["memory_bytes"] == torch_held for r in [floor, *rest])
    reaches = data["checks"][3]
    assert not reaches["ok"] and "unreachable at" in reaches["detail"]


def test_pairs_alternate_auto_and_the_fixed_mode_and_compare_medians(tmp_path, monkeypatch):
    import memfit
    from memfit_benchmarks import auto_sweep

    real_apply = memfit.apply

    def apply(model, config, **kw):
        if (config or {}).get("gradient_checkpointing_backend") != "auto":
            return real_apply(model, config, **kw)
        fixed = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
        return _StandInHandle(real_apply(model, fixed, **kw), config["gradient_checkpointing_memory_budget"])

    monkeypatch.setattr(memfit, "apply", apply)
    args = [*ARGS, "--budgets", "1", "--no-gaps", "--pairs", "3", "--no-render", "--out", str(tmp_path)]
    data = json.loads(auto_sweep.main(args)[0].read_text())
    (row,) = data["auto_rows"]
    assert len(row["step_s_pairs"]) == len(row["best_fixed"]["step_s_pairs"]) == 3
    assert row["step_s"] == sorted(row["step_s_pairs"])[1]
    assert row["best_fixed"]["step_s_adjacent"] == sorted(row["best_fixed"]["step_s_pairs"])[1]
    assert row["speedup"] == pytest.approx(row["best_fixed"]["step_s_adjacent"] / row["step_s"])
    with pytest.raises(SystemExit):  # pairs without the adjacent fixed runs would be ignored: refused
        auto_sweep.main([*ARGS, "--pairs", "2", "--no-adjacent", "--out", str(tmp_path)])


def test_gap_range_measures_one_share_of_the_gaps(tmp_path, monkeypatch):
    import memfit
    from memfit_benchmarks import auto_sweep

    real_apply = memfit.apply

    def apply(model, config, **kw):  # auto stands in as `torch`: this test is about which budgets run
        if (config or {}).get("gradient_checkpointing_backend") != "auto":
            return real_apply(model, config, **kw)
        fixed = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "torch"}
        return _StandInHandle(real_apply(model, fixed, **kw), config["gradient_checkpointing_memory_budget"])

    monkeypatch.setattr(memfit, "apply", apply)
    # the frontier's gaps depend on measured times (noisy on a CPU): three fixed ones, to see which run
    monkeypatch.setattr(auto_sweep, "gap_budgets", lambda rows, low, high: [1000, 2000, 3000])
    args = [*ARGS, "--budgets", "0", "--gap-range", "1500:3000", "--no-render", "--out", str(tmp_path)]
    data = json.loads(auto_sweep.main(args)[0].read_text())
    assert data["gap_budgets"] == data["budgets"] == [2000]
    assert [r["budget_bytes"] for r in data["auto_rows"]] == [2000]
    for bad in (
        ["--gap-range", "1GiB:", "--no-gaps"],
        ["--gap-range", "a:"],
        ["--gap-range", "2GiB:1GiB"],
        ["--gap-range", "1GiB"],
    ):
        with pytest.raises(SystemExit):
            auto_sweep.main([*ARGS, *bad, "--out", str(tmp_path)])


def test_budgets_and_fastest_fitting_fixed_mode():
    from memfit_benchmarks.auto_sweep import best_fixed, frontier, gap_budgets, spread_budgets

    assert spread_budgets(100, 200, 4) == [100, 125, 150, 175]
    rows = [
        {"mode": "none", "step_s": 1.0, "peak_allocated": 200, "oom": False},
        {"mode": "torch-ffn", "step_s": 1.1, "peak_allocated": 150, "oom": False},
        {"mode": "torch interval 2", "step_s": 1.5, "peak_allocated": 160, "oom": False},  # beaten twice
        {"mode": "torch", "step_s": 1.4, "peak_allocated": 100, "oom": False},
        {"mode": "unsloth", "oom": True},
    ]
    assert best_fixed(rows, 120)["mode"] == "torch" and best_fixed(rows, 150)["mode"] == "torch-ffn"
    assert best_fixed(rows, 99) is None
    assert [r["mode"] for r in frontier(rows)] == ["torch", "torch-ffn", "none"]
    # 1% below each step but the lowest; where none fits, its step is the high end itself
    assert gap_budgets(rows, 100, 200) == [148, 198]
    # none out of memory: the card's size (the high end) is the last step
    assert gap_budgets([r for r in rows if r["mode"] != "none"], 100, 1000) == [148, 990]


def test_checks_tolerance_and_peaks():
    from memfit_benchmarks.auto_report import auto_checks

    def row(budget, auto_s, fixed_s, peak):
        return {
            "budget_bytes": budget,
            "step_s": auto_s,
            "speedup": fixed_s / auto_s,
            "memory_bytes": peak,
            "within_budget": peak <= budget,
            "best_fixed": {"mode": "torch", "step_s": fixed_s},
        }

    ok = auto_checks([row(100, 1.015, 1.0, 90), row(150, 1.0, 1.2, 140)])
    assert [c[1] for c in ok] == [True, True, True, True]
    bad = auto_checks([row(100, 1.03, 1.0, 101), row(150, 1.0, 1.05, 140)])
    assert [c[1] for c in bad] == [False, False, False, True]
    assert "0.000 MiB over at" in bad[2][2]
    assert "runs alternated" not in bad[0][2]  # one run each: nothing to show
    noisy = row(100, 0.76, 0.707, 90)
    noisy["step_s_pairs"], noisy["best_fixed"]["step_s_pairs"] = [0.645, 0.875], [0.70, 0.714]
    assert "(runs alternated: auto 0.6450, 0.8750 s, fixed 0.7000, 0.7140 s)" in auto_checks([noisy])[0][2]
