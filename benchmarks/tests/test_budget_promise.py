"""The budget-promise sweep: its verdicts from measured rows (pure), and one tiny run end to end on CPU (a child per
target, a budget below the floor refused before any step, auto and fixed modes in paired rounds at the floor)."""

from __future__ import annotations

import json

import pytest

from memfit_benchmarks.budget_promise import budget_checks, contenders, resolve_budgets, summarize

GIB = 1 << 30


def _row(mode, rounds, peak=10 * GIB, **kw):
    return {
        "mode": mode,
        "oom": False,
        "step_s": sorted(rounds)[len(rounds) // 2],
        "step_s_rounds": rounds,
        "peak_allocated": peak,
        "peak_allocated_warmup": peak,
        **kw,
    }


def _entry(budget_gib, rows, *, below=False, auto_rounds=None):
    entry = {"budget_bytes": budget_gib * GIB, "below_floor": below, "rows": rows}
    if auto_rounds is not None:
        entry["auto_rounds"] = auto_rounds
    return {"config": "attn", **entry, **summarize(entry)}


def test_summarize_picks_the_fastest_fixed_mode_that_fits_and_pairs_by_round():
    auto = _row("auto", [0.90, 0.80, 0.85], within_budget=True)
    entry = _entry(
        24,
        [
            auto,
            _row("torch", [1.0, 1.0, 1.0]),
            _row("torch-ffn", [0.5, 0.5, 0.5], peak=30 * GIB),  # faster, but over the budget: does not fit
            {"mode": "none", "oom": True},
        ],
        auto_rounds=[{"within_budget": True}] * 3,
    )
    assert entry["auto"] == "ok" and entry["within_budget"] is True
    assert entry["best_fixed"] == "torch" and entry["x_fixed_paired"]
    assert entry["x_fixed"] == pytest.approx(0.85)  # the median of 0.90, 0.80, 0.85
    assert entry["x_fixed_rounds"] == pytest.approx([0.9, 0.8, 0.85])


def test_a_fixed_mode_at_the_process_s_limit_is_listed_and_auto_is_compared_with_those_clear_of_it():
    """A fixed mode whose timed steps made the allocator free its cache and retry ran one allocation from out of
    memory (torch-ffn on a full fine-tune at 0.88 of a 32 GiB process): auto treats such a step as over the budget,
    so its comparison is with the fastest mode clear of the limit, and the one at the limit is named."""
    auto = _row("auto", [0.9, 0.9, 0.9], within_budget=True)
    edge = {**_row("torch-ffn", [0.8, 0.8, 0.8]), "alloc_retries_in_timed_steps": 1}
    entry = _entry(
        32, [auto, edge, _row("torch", [1.0, 1.0, 1.0])], auto_rounds=[{"within_budget": True}] * 3
    )
    assert entry["best_fixed"] == "torch" and entry["x_fixed"] == pytest.approx(0.9)
    assert entry["fixed_at_limit"] == ["torch-ffn"]
    clear = _entry(32, [auto, _row("torch-ffn", [0.8, 0.8, 0.8]), _row("torch", [1.0, 1.0, 1.0])])
    assert clear["best_fixed"] == "torch-ffn" and "fixed_at_limit" not in clear


def test_summarize_says_what_auto_did_when_it_did_not_run():
    refused = _entry(
        16, [{"mode": "auto", "oom": False, "budget_error": "below", "failed": "BudgetError"}], below=True
    )
    assert refused["auto"] == "BudgetError" and "best_fixed" not in refused
    oom = _entry(24, [{"mode": "auto", "oom": True}, _row("unsloth", [1.0, 1.0, 1.0])])
    assert oom["auto"] == "OOM" and oom["best_fixed"] == "unsloth" and "x_fixed" not in oom
    over = _entry(
        24, [_row("auto", [1.0, 1.0])], auto_rounds=[{"within_budget": True}, {"within_budget": False}]
    )
    assert over["within_budget"] is False  # one round over the budget is over
    cut = {"config": "attn", "budget_bytes": GIB, "not_measured": "deadline"}
    assert summarize(cut) == {"auto": "not measured"}


def _passing():
    ok = [{"within_budget": True}] * 3
    return [
        _entry(
            16, [{"mode": "auto", "oom": False, "budget_error": "x", "failed": "BudgetError"}], below=True
        ),
        _entry(24, [_row("auto", [0.8] * 3), _row("unsloth", [1.0] * 3)], auto_rounds=ok),
        _entry(32, [_row("auto", [0.85] * 3), _row("torch", [1.0] * 3)], auto_rounds=ok),
        _entry(48, [_row("auto", [1.01] * 3), _row("torch-ffn", [1.0] * 3)], auto_rounds=ok),
    ]


def test_the_checks_pass_when_auto_keeps_its_promise_and_wins_twice():
    checks = budget_checks(_passing())
    assert [ok for _, ok, _ in checks] == [True, True, True], checks
    assert "attn @ 24.00 GiB 1.25× vs unsloth" in checks[2][2]


@pytest.mark.parametrize(
    ("change", "failing"),
    [
        # below the floor auto ran a step over the budget instead of refusing, or ran out of memory
        (lambda e: e[0].update(auto="ok", within_budget=False), 0),
        (lambda e: e[0].update(auto="OOM"), 0),
        # a step over the budget
        (lambda e: e[1].update(within_budget=False), 0),
        # out of memory where a fixed mode fits: breaks the promise and loses to the fixed mode
        (lambda e: e[2].update(auto="OOM", x_fixed=None), 0),
        (lambda e: e[2].update(auto="OOM", x_fixed=None), 1),
        # 5% slower than the fastest fixed mode that fits
        (lambda e: e[3].update(x_fixed=1.05), 1),
        # faster by 10% at one budget only
        (lambda e: e[2].update(x_fixed=0.95), 2),
    ],
)
def test_each_check_fails_on_its_own_miss(change, failing):
    entries = _passing()
    change(entries)
    checks = budget_checks(entries)
    assert not checks[failing][1], checks[failing]


def test_below_the_floor_a_run_within_budget_keeps_the_promise_and_is_named():
    """The floor is what auto suggests with the model on the device; from the host it streams more and can fit
    below it (Flux attention LoRA at 24 GiB on a 24 GiB card, under a 25.3 GiB floor)."""
    entries = _passing()
    entries[0].update(auto="ok", within_budget=True)
    label, ok, detail = budget_checks(entries)[0]
    assert ok and "below the floor and within budget (from the host): attn @ 16.00 GiB" in detail


def test_budgets_not_measured_count_for_no_check_and_are_named():
    entries = [*_passing(), {"config": "all", "budget_bytes": GIB, "auto": "not measured"}]
    assert all(ok for _, ok, _ in budget_checks(entries))
    assert all("1 budget(s) not measured" in detail for *_, detail in budget_checks(entries))
    assert not any(ok for _, ok, _ in budget_checks([entries[-1]]))  # nothing measured proves nothing


def test_the_floor_joins_the_sizes_in_order():
    assert resolve_budgets([3, "floor", 1], 2) == [(1, False), (2, True), (3, False)]
    assert resolve_budgets([3, "floor"], None) == [(3, False)]  # no floor known: only the sizes
    assert resolve_budgets([2, "floor"], 2) == [(2, True)]


def test_budget_promise_runs_on_cpu(tmp_path):
    pytest.importorskip("memfit_flux")
    pytest.importorskip("peft")
    from memfit_benchmarks import budget_promise

    rc = budget_promise.main(
        [
            "--targets",
            "flux",
            "--preset",
            "tiny",
            "--tokens",
            "64",
            "--device",
            "cpu",
            "--configs",
            "attn",
            "--budgets",
            "1KiB,floor",
            "--fixed",
            "none,torch",
            "--rounds",
            "2",
            "--warmup",
            "0",
            "--auto-warmup",
            "1",
            "--steps",
            "1",
            "--floor-steps",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    result = json.loads((tmp_path / "budget-promise.json").read_text())
    (target,) = result["targets"]
    assert "error" not in target, target
    (config,) = target["configs"]
    assert config["config"] == "attn" and config["lora_targets_count"] > 0 and config["floor_bytes"] > 1024
    below, floor = config["budgets"]
    assert below["budget_bytes"] == 1024 and below["below_floor"] and below["auto"] == "BudgetError"
    assert [r["mode"] for r in below["rows"]] == ["auto"]  # no fixed mode below the floor
    assert floor["is_floor"] and floor["budget_bytes"] == config["floor_bytes"] and floor["auto"] == "ok"
    by = {r["mode"]: r for r in floor["rows"]}
    # at the floor every measurement times --floor-steps steps, elsewhere --steps
    assert floor["timed_steps"] == 2 and {r["timed_steps"] for r in floor["rows"]} == {2}
    assert below["timed_steps"] == 1
    assert list(by) == ["auto", "none", "torch"] and len(by["auto"]["step_s_rounds"]) == 2
    assert by["auto"]["plan_counts"]
    # which fixed modes run round 2 depends on round 1's CPU timings (a mode 1.15x behind the fastest is dropped):
    # the comparison is paired exactly when the fastest fixed mode ran both rounds
    best = by[floor["best_fixed"]]
    assert floor["x_fixed_paired"] == (len(best.get("step_s_rounds") or [best]) == 2)
    text = (tmp_path / "budget-promise.md").read_text()
    assert text.startswith("# auto's budget on a card of that size\n\n| target | config | budget |")
    assert "| flux | attn | 1.00 KiB | BudgetError (below the floor) |" in text
    assert "- PASS auto's budget is a promise" in text


def test_a_deadline_in_the_past_starts_no_child(tmp_path):
    from memfit_benchmarks import budget_promise

    args = ["--preset", "tiny", "--device", "cpu", "--stop-at", "1", "--out", str(tmp_path)]
    assert budget_promise.main(args) == 0
    result = json.loads((tmp_path / "budget-promise.json").read_text())
    assert [t["target"] for t in result["targets"]] == ["flux", "synthetic-16384"]
    assert all(t["not_measured"] == "the run's deadline passed first" for t in result["targets"])


def test_only_fixed_modes_that_fit_and_are_near_the_fastest_are_timed_again():
    first = {
        "auto": {"mode": "auto", "step_s": 0.5, "peak_allocated": 10},
        "none": {"mode": "none", "step_s": 0.5, "peak_allocated": 200},  # over the budget
        "torch-ffn": {"mode": "torch-ffn", "step_s": 1.0, "peak_allocated": 90},
        "unsloth-ffn": {"mode": "unsloth-ffn", "step_s": 1.1, "peak_allocated": 80},
        "torch": {"mode": "torch", "step_s": 1.2, "peak_allocated": 50},  # 1.2x the fastest that fits
        "unsloth": {"mode": "unsloth", "oom": True},
    }
    assert contenders(first, 100) == {"torch-ffn", "unsloth-ffn"}
    assert contenders(first, 60) == {"torch"}
    assert contenders({"auto": first["auto"]}, 100) == set()


def test_a_fixed_mode_at_the_process_s_limit_is_not_what_the_contenders_span_is_measured_from():
    # torch-ffn fits but made the allocator retry: the span runs from unsloth-ffn, the fastest clear of the limit,
    # so torch (1.15x unsloth-ffn, 1.4x torch-ffn) is timed again and can be the mode auto is compared with
    first = {
        "auto": {"mode": "auto", "step_s": 0.5, "peak_allocated": 10},
        "torch-ffn": {
            "mode": "torch-ffn",
            "step_s": 1.0,
            "peak_allocated": 90,
            "alloc_retries_in_timed_steps": 2,
        },
        "unsloth-ffn": {"mode": "unsloth-ffn", "step_s": 1.2, "peak_allocated": 80},
        "torch": {"mode": "torch", "step_s": 1.38, "peak_allocated": 50},
    }
    assert contenders(first, 100) == {"unsloth-ffn", "torch"}
    entry = {"budget_bytes": 100, "rows": list(first.values())}
    assert summarize(entry)["best_fixed"] == "unsloth-ffn"
    assert summarize(entry)["fixed_at_limit"] == ["torch-ffn"]


def test_each_config_s_child_joins_its_target_and_a_config_not_measured_says_why():
    from memfit_benchmarks.budget_promise import _merge_child

    entry = {"target": "flux", "configs": []}
    _merge_child(
        entry, {"target": "flux", "description": "d", "configs": [{"config": "full", "budgets": []}]}, "full"
    )
    _merge_child(entry, {"target": "flux", "not_measured": "the run's deadline passed first"}, "attn")
    _merge_child(entry, {"target": "flux", "description": "other", "error": "RuntimeError: boom"}, "all")
    assert entry["description"] == "d" and "not_measured" not in entry and "error" not in entry
    assert [c["config"] for c in entry["configs"]] == ["full", "attn", "all"]
    assert entry["configs"][1]["not_measured"] and entry["configs"][2]["error"] == "RuntimeError: boom"
    late = {"target": "flux", "configs": []}
    _merge_child(late, {"target": "flux", "not_measured": "the run's deadline passed first"}, "full")
    assert late["not_measured"]  # nothing of the target measured: the target says so too


def test_the_headline_says_how_many_of_auto_s_steps_reached_the_process_s_limit():
    from memfit_benchmarks.budget_promise import markdown

    auto = {"mode": "auto", "step_s": 1.0, "peak_allocated": GIB, "corrections": 2, "steps_at_limit": 1}
    budget = {"budget_bytes": 2 * GIB, "rows": [auto], "auto": "ok", "within_budget": True}
    result = {
        "targets": [{"target": "flux", "configs": [{"config": "attn", "budgets": [budget]}]}],
        "modes": ["auto"],
        "environment": {"device": "cuda", "torch": "t", "git_commit": "c"},
        "date": "d",
        **{"rounds": 3, "warmup": 1, "steps": 1, "auto_warmup": 2},
    }
    assert "| 2 (1 step(s) at the process's limit) |" in markdown(result)
    assert "1 timed steps per measurement; auto" in markdown(result)
    assert "1 timed steps per measurement, 3 at the floor; auto" in markdown({**result, "floor_steps": 3})


def _run(commit, configs, rounds=3, steps=None, floor_steps=None):
    return {
        "rounds": rounds,
        **({"steps": steps, "floor_steps": floor_steps} if steps else {}),
        "modes": ["auto", "torch"],
        "environment": {"date": f"day of {commit}", "git_commit": commit},
        "targets": [{"target": "synthetic-16384", "configs": configs}],
    }


def _budgets(config, floor_gib, *sizes_gib, floor_status="ok"):
    budgets = [{"budget_bytes": s * GIB, "is_floor": False, "auto": "ok"} for s in sizes_gib]
    budgets.append({"budget_bytes": int(floor_gib * GIB), "is_floor": True, "auto": floor_status})
    return {"config": config, "floor_bytes": int(floor_gib * GIB), "budgets": budgets}


def test_a_later_run_replaces_the_floor_and_the_sizes_it_measured_and_each_row_names_its_run():
    from memfit_benchmarks.budget_promise import _runs_note, merge_runs

    base = _run("old", [_budgets("full", 25.1, 16, 24, 32), _budgets("attn", 4.3, 16)])
    later = _run(
        "new", [_budgets("full", 23.2, 48, floor_status="BudgetError")], rounds=1, steps=1, floor_steps=3
    )
    merged = merge_runs(base, later)
    full, attn = merged["targets"][0]["configs"]
    assert [(b["budget_bytes"] / GIB, b["run"]["commit"]) for b in full["budgets"]] == [
        (16, "old"),
        (pytest.approx(23.2), "new"),
        (24, "old"),
        (32, "old"),
        (48, "new"),
    ]
    assert full["floor_bytes"] == int(23.2 * GIB)
    # 24 GiB was below the old floor, not below the new one
    assert [b["below_floor"] for b in full["budgets"]] == [True, False, False, False, False]
    # a config the later run left alone
    assert [b["run"]["commit"] for b in attn["budgets"]] == ["old", "old"]
    note = "\n".join(_runs_note(merged))
    # a run that recorded its steps says how many were timed, and how many at the floor
    assert (
        "commit old, 3 round(s), modes" in note
        and "commit new, 1 round(s) of 1 timed step(s) (3 at the floor)" in note
    )
    assert "full @ 48.00 GiB" in note and base["targets"][0]["configs"][0]["floor_bytes"] == int(25.1 * GIB)
    assert _runs_note(base) == []  # one run: nothing to say
