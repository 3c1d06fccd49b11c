"""Round-robin rounds (shared by the synthetic and the family sweeps) and the paired step-time ratios the reports
check: round k of one mode / round k of the other, the median over rounds."""

from __future__ import annotations

import json

import pytest

from memfit_benchmarks.modes import Mode
from memfit_benchmarks.report import render_markdown
from memfit_benchmarks.rounds import merge_rounds, paired_ratio, per_round_ratios, round_robin, step_ratio
from memfit_benchmarks.runner import add_ratios

# Per-round steps where the two ratios disagree. unsloth/torch: per round 1.040, 1.036, 0.925 (median 1.036, over
# 1.02) while the median rounds give 1.11 / 1.10 = 1.009. unsloth-ffn/torch-ffn: per round 1.000, 1.000, 1.136
# (median 1.000) while the median rounds give 1.20 / 1.10 = 1.091 (over 1.03).
ROUNDS = {
    "none": [0.80, 0.90, 0.85],
    "torch-ffn": [1.00, 1.20, 1.10],
    "unsloth-ffn": [1.00, 1.20, 1.25],
    "torch": [1.00, 1.10, 1.20],
    "unsloth": [1.04, 1.14, 1.11],
}


def _rows(rounds: dict[str, list[float]]) -> list[dict]:
    rows = [
        merge_rounds([{"mode": mode, "step_s": s, "oom": False} for s in steps])
        for mode, steps in rounds.items()
    ]
    add_ratios(rows)
    return rows


def _target(md: str, label: str) -> str:
    return next(line for line in md.splitlines() if label in line)


def test_per_round_ratios_need_the_same_rounds_on_both_rows():
    a, b = {"step_s_rounds": [2.0, 3.0, 4.0]}, {"step_s_rounds": [1.0, 2.0, 2.0]}
    assert per_round_ratios(a, b) == [2.0, 1.5, 2.0] and paired_ratio(a, b) == 2.0
    # a run cut by its deadline leaves one mode a round short: the rounds both ran in still pair
    assert per_round_ratios(a, {"step_s_rounds": [1.0, 2.0]}) == [2.0, 1.5]
    assert (
        per_round_ratios({"step_s_rounds": [2.0]}, {"step_s_rounds": [1.0]}) is None
    )  # one round: nothing to pair
    assert per_round_ratios({"step_s": 2.0}, {"step_s": 1.0}) is None
    assert step_ratio({"step_s": 2.0}, {"step_s": 1.6}) == (1.25, "1.250×")


def test_merge_rounds_median_step_largest_peak_and_oom_in_any_round():
    rows = [
        {"mode": "torch", "step_s": s, "peak_allocated": p, "oom": False}
        for s, p in ((3, 10), (1, 30), (2, 20))
    ]
    merged = merge_rounds(rows)
    assert merged["step_s"] == 2 and merged["step_s_rounds"] == [3, 1, 2] and merged["peak_allocated"] == 30
    oom = {"mode": "torch", "oom": True}
    assert merge_rounds([rows[0], oom]) is oom  # out of memory once: the mode does not fit


def test_add_ratios_stores_the_paired_ratio_next_to_the_median_ratio():
    by = {r["mode"]: r for r in _rows(ROUNDS)}
    assert by["unsloth"]["x_torch"] == pytest.approx(1.11 / 1.10)
    assert by["unsloth"]["x_torch_paired"] == pytest.approx(1.14 / 1.10)
    assert by["unsloth-ffn"]["x_torch_ffn"] == pytest.approx(1.20 / 1.10)
    assert by["unsloth-ffn"]["x_torch_ffn_paired"] == pytest.approx(1.0)
    one_round = _rows({mode: steps[:1] for mode, steps in ROUNDS.items()})
    assert not any(key.endswith("_paired") for row in one_round for key in row)


def test_synthetic_targets_check_the_paired_ratio():
    payload = {
        "suite": "synthetic",
        "date": "2026-01-01",
        "device": "test",
        "torch": "x",
        "cuda": None,
        "regime": "lora",
        "steps": 5,
        "warmup": 2,
        "rounds": 3,
        "results": [{"shape": "s", "rows": _rows(ROUNDS)}],
    }
    md = render_markdown(payload)
    assert _target(md, "unsloth ≤ 1.02× torch step time") == (
        "- FAIL unsloth ≤ 1.02× torch step time: 1.036× (median of per-round ratios 1.040, 1.036, 0.925; "
        "ratio of median rounds 1.009); a tie within this run's spread (rounds 0.925–1.040 straddle 1.02)"
    )
    assert _target(md, "unsloth-ffn ≤ 1.03× torch-ffn").startswith(
        "- PASS unsloth-ffn ≤ 1.03× torch-ffn step time: 1.000× (median of per-round ratios 1.000, 1.000, 1.136;"
    )
    assert "3 round-robin rounds" in md and "median over rounds of the per-round ratio" in md


def test_family_targets_check_the_paired_ratio_and_one_round_is_unchanged():
    payload = {
        "suite": "families",
        "family": "flux",
        "preset": "full",
        "date": "2026-01-01",
        "device": "test",
        "torch": "x",
        "cuda": None,
        "steps": 5,
        "warmup": 2,
        "tokens": 64,
        "rounds": 3,
        "rows": _rows(ROUNDS),
    }
    md = render_markdown(payload)
    assert _target(md, "unsloth ≤ 1.02× torch").startswith("- FAIL unsloth ≤ 1.02× torch step time: 1.036× (")
    assert _target(md, "unsloth-ffn ≤ 1.03×").startswith(
        "- PASS unsloth-ffn ≤ 1.03× torch-ffn step time: 1.000× ("
    )
    payload.update(rounds=1, rows=_rows({mode: steps[2:] for mode, steps in ROUNDS.items()}))
    md = render_markdown(payload)
    assert _target(md, "unsloth ≤ 1.02× torch") == "- PASS unsloth ≤ 1.02× torch step time: 0.925×"
    assert _target(md, "unsloth-ffn ≤ 1.03×") == "- FAIL unsloth-ffn ≤ 1.03× torch-ffn step time: 1.136×"
    assert "round-robin" not in md


def test_synthetic_rounds_measure_every_mode_round_robin(tmp_path, monkeypatch):
    from memfit_benchmarks import __main__ as bench
    from memfit_benchmarks import runner

    order: list[str] = []
    steps = {"none": iter([1.0, 1.2, 1.1]), "torch": iter([1.3, 1.5, 1.6])}

    def fake_measure(model, batch, loss, mode, **kw):
        order.append(mode.name)
        return {
            "mode": mode.name,
            "config": mode.config,
            "step_s": next(steps.get(mode.name, iter([2.0]))),
            "oom": False,
            "peak_allocated": None,
            "peak_reserved": None,
        }

    monkeypatch.setattr(runner, "measure_mode", fake_measure)
    written = bench.main(
        [
            "--configs",
            "frozen",
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--rounds",
            "3",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads(written[0].read_text())
    modes = [r["mode"] for r in data["results"][0]["rows"]]
    assert data["results"][0]["config"] == "frozen" and "ckpt-block" in modes
    assert order == modes * 3 and data["rounds"] == 3
    by = {r["mode"]: r for r in data["results"][0]["rows"]}
    assert by["torch"]["step_s_rounds"] == [1.3, 1.5, 1.6] and by["torch"]["step_s"] == 1.5
    assert by["torch"]["x_none"] == pytest.approx(1.5 / 1.1)
    assert by["torch"]["x_none_paired"] == pytest.approx(1.3)  # median of 1.3, 1.25, 1.4545
    assert "3 round-robin rounds" in (tmp_path / f"{written[0].stem}.md").read_text()
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--shapes", "tiny", "--rounds", "0", "--out", str(tmp_path)])


def test_round_robin_stops_timing_a_mode_keep_turns_down():
    modes = [Mode("a", None), Mode("b", None), Mode("c", None)]
    calls = []

    def measure(mode):
        calls.append(mode.name)
        return {"mode": mode.name, "step_s": 1.0}

    rows = round_robin(modes, 3, measure, keep=lambda mode: mode.name != "b")
    assert calls == ["a", "b", "c", "a", "c", "a", "c"]
    by = {r["mode"]: r for r in rows}
    assert len(by["a"]["step_s_rounds"]) == 3 and "step_s_rounds" not in by["b"] and by["b"]["step_s"] == 1.0


def test_a_minimum_duration_adds_timed_steps_up_to_its_cap():
    from memfit_benchmarks.runner import MAX_STEPS_FACTOR, more_timed_steps

    assert more_timed_steps([0.5], steps=2, min_seconds=0)  # --steps first, however long
    assert not more_timed_steps([0.5, 0.5], steps=2, min_seconds=0)
    assert more_timed_steps([0.03] * 6, steps=6, min_seconds=1.0)  # 0.18 s of 1 s
    assert not more_timed_steps([0.03] * 34, steps=6, min_seconds=1.0)  # 1.02 s
    assert not more_timed_steps([0.001] * (MAX_STEPS_FACTOR * 2), steps=2, min_seconds=1.0)  # the cap


def test_a_measurement_times_until_its_minimum_duration_and_counts_per_timed_step():
    import torch

    from memfit_benchmarks import runner
    from memfit_benchmarks.modes import Peer
    from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
    from memfit_benchmarks.training import TrainingConfig, prepare

    model = build(dim=32, depth=3, dtype=torch.float32, device="cpu")
    batch = inputs(model, tokens=16, generator=torch.Generator().manual_seed(0))
    prepare(model, batch, TrainingConfig.LORA_ALL, SYNTHETIC, dtype=torch.float32)
    peer = Mode("ckpt-block", None, Peer.CHECKPOINT_BLOCK)
    memfit_torch = Mode("torch", {"gradient_checkpointing": True})
    rows = {
        mode.name: runner.measure_mode(
            model, batch, SYNTHETIC.loss, mode, adapter=SYNTHETIC, warmup=0, steps=2, min_seconds=0.5
        )
        for mode in (peer, memfit_torch)
    }
    for row in rows.values():
        times = row["step_times_s"]
        assert row["timed_steps"] == len(times) and len(times) > 2  # a tiny step takes milliseconds
        assert sum(times) >= 0.5 or len(times) == runner.MAX_STEPS_FACTOR * 2
        assert sum(times[:-1]) < 0.5  # and it stopped as soon as it had them
    assert rows["ckpt-block"]["checkpointed_calls_per_step"] == 3  # per timed step, whatever their count
    assert rows["torch"]["frames_per_step"] == 3
    plain = runner.measure_mode(model, batch, SYNTHETIC.loss, peer, adapter=SYNTHETIC, warmup=0, steps=2)
    assert plain["timed_steps"] == 2


def test_merged_rounds_keep_each_rounds_count_of_timed_steps():
    merged = merge_rounds(
        [{"mode": "torch", "step_s": s, "timed_steps": n} for s, n in ((1.0, 12), (1.2, 9))]
    )
    assert merged["timed_steps_rounds"] == [12, 9] and merged["step_s_rounds"] == [1.0, 1.2]
