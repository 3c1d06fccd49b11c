"""The weight-streaming benchmark on CPU: tiny Flux + LoRA under ``torch``, streaming none, some and every block."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
        # each streamed block's forward and recompute run on an upload every step: a new one, or one kept at a
        # turnaround (the last block's, and the first's where the plan's first block streams)
        kept = r["weight_uploads_kept_per_step"]
        assert r["weight_uploads_per_step"] + kept == 2 * streamed and kept in (1, 2)
        assert r["weight_uploads_on_demand_per_step"] == 0
        assert (
            r["streamed_weight_bytes"] <= r["weight_bytes_uploaded_per_step"] < 2 * r["streamed_weight_bytes"]
        )
        assert r["weight_held_after_forward"] == 0 and r["x_unconstrained"] > 0
    assert rows["torch + stream 200KiB"]["streamed_weight_bytes"] >= 200 * 1024
    markdown = (tmp_path / "streaming.md").read_text()
    assert "| torch + stream 7 | 7 of 7 |" in markdown


def test_bad_blocks_are_a_usage_error(capsys):
    from memfit_benchmarks import streaming

    with pytest.raises(SystemExit):
        streaming.main(["--blocks", "0,lots", "--out", "/tmp/unused"])
    assert "--blocks" in capsys.readouterr().err


def test_auto_is_compared_with_the_fastest_fixed_mode_unconstrained(tmp_path):
    from memfit_benchmarks import streaming

    args = ["--preset", "tiny", "--device", "cpu", "--backend", "torch", "--blocks", "0,2", "--steps", "1"]
    path = streaming.main([*args, "--fixed", "none,torch-ffn", "--budgets", "1GiB", "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["torch", "torch + stream 2", "none", "torch-ffn", "auto 1GiB"]
    assert rows["none"]["streamed_blocks"] == 0 and rows["torch-ffn"]["streamed_blocks"] == 0
    auto = rows["auto 1GiB"]
    unconstrained = [rows[name] for name in ("torch", "none", "torch-ffn")]
    fastest = min(unconstrained, key=lambda r: r["step_s"])
    assert auto["fastest_fixed"] == fastest["mode"]  # never a streamed row, nor auto itself
    assert auto["x_fastest_fixed"] == pytest.approx(auto["step_s"] / fastest["step_s"])
    assert (
        f"the step of `{fastest['mode']}`, the fastest fixed mode" in (tmp_path / "streaming.md").read_text()
    )


def test_an_unknown_fixed_mode_is_a_usage_error(capsys):
    from memfit_benchmarks import streaming

    with pytest.raises(SystemExit):
        streaming.main(["--fixed", "offload-attention", "--out", "/tmp/unused"])
    err = capsys.readouterr().err
    assert "--fixed" in err and "offload_attention" in err


def test_a_fixed_mode_that_is_already_a_row_is_a_usage_error(capsys):
    from memfit_benchmarks import streaming

    with pytest.raises(SystemExit):
        streaming.main(
            ["--backend", "torch-ffn", "--blocks", "0", "--fixed", "torch-ffn", "--out", "/tmp/unused"]
        )
    assert "already a row" in capsys.readouterr().err


def test_a_card_s_size_needs_cuda(capsys):
    from memfit_benchmarks import streaming

    with pytest.raises(SystemExit):
        streaming.main(["--device", "cpu", "--card-budgets", "16GiB", "--out", "/tmp/unused"])
    assert "--card-budgets" in capsys.readouterr().err


def test_a_model_that_does_not_fit_where_it_is_placed_is_an_out_of_memory_row(monkeypatch):
    import memfit
    import memfit_flux
    from memfit.placement import Placement
    from memfit_benchmarks.modes import Mode
    from memfit_benchmarks.runner import measure_mode

    def out_of_memory(model, device, *, profiles=False, streamed=None):
        raise memfit.DeviceMemoryError(f"the rest does not fit on {device}")

    monkeypatch.setattr(Placement, "move", staticmethod(out_of_memory))
    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build(dtype=torch.float32, device="cpu")
    batch = preset.inputs(model, tokens=16)
    mode = Mode("torch on a small card", {"gradient_checkpointing": True}, options={"device": "cpu"})
    row = measure_mode(
        model, batch, memfit_flux.ADAPTER.loss, mode, adapter=memfit_flux.ADAPTER, warmup=0, steps=1
    )
    assert row["oom"] and row["oom_where"] == "placing the model" and "does not fit on cpu" in row["error"]
    assert not any(m._forward_pre_hooks for m in model.modules())


def _run(date: str, rounds: dict[str, list[float]], wait: float, commit: str = "abc") -> dict:
    keys = {k: "same" for k in ("device", "family", "preset", "backend", "optimizer")}
    rows = [
        {
            "mode": mode,
            "config": {"gradient_checkpointing_stream_blocks": 4} if "stream" in mode else {},
            "step_s": sorted(steps)[len(steps) // 2],
            "step_s_rounds": steps,
            "peak_allocated": 10 if "stream" in mode else 20,
            "streamed_blocks": 4 if "stream" in mode else 0,
            "weight_exposed_wait_ms_per_step": wait,
        }
        for mode, steps in rounds.items()
    ]
    return {**keys, "git_commit": commit, "tokens": 64, "steps": 3, "warmup": 1, "date": date, "rows": rows}


def test_a_ratio_of_rows_that_share_one_round_says_it_is_not_paired():
    """A row the deadline cut to one round (the committed Wan run's row without the reload credit): its ratio is of
    the median steps, and the report says so; the rows that share both rounds stay paired."""
    from memfit_benchmarks.streaming import add_comparisons, render

    path = Path(__file__).parents[1] / "results/streaming/streaming-wan-reloads.json"
    payload = json.loads(path.read_text())
    add_comparisons(payload["rows"])
    auto, alone = payload["rows"][1], payload["rows"][2]
    assert len(alone.get("step_s_rounds") or [alone["step_s"]]) == 1 < len(auto["step_s_rounds"])
    assert auto["unpaired"] == ["x_reloads_alone"]
    assert auto["x_reloads_alone"] == pytest.approx(auto["step_s"] / alone["step_s"])
    assert "(not paired: the two rows share fewer than two rounds" in render(payload)
    assert "x_unconstrained" not in auto["unpaired"]


def test_runs_of_one_commit_merge_round_by_round():
    from memfit_benchmarks.streaming import merge_runs

    a = _run("d1", {"torch": [1.0, 2.0], "torch + stream 4": [1.1, 2.2]}, wait=10.0)
    # the second run's deadline cut its last round: the streaming row never ran it
    b = _run("d2", {"torch": [1.0, 1.5, 9.0], "torch + stream 4": [1.2, 1.8]}, wait=30.0)
    merged = merge_runs(a, b)
    rows = {r["mode"]: r for r in merged["rows"]}
    assert rows["torch"]["step_s_rounds"] == [1.0, 2.0, 1.0, 1.5]  # the unpaired 9.0 dropped
    assert rows["torch + stream 4"]["step_s_rounds"] == [1.1, 2.2, 1.2, 1.8]
    # paired by round: 1.1, 1.1, 1.2, 1.2 -> median 1.15 (the medians' ratio would be 1.5 / 1.25)
    assert rows["torch + stream 4"]["x_unconstrained"] == pytest.approx(1.15)
    assert rows["torch + stream 4"]["weight_exposed_wait_ms_per_step"] == pytest.approx(20.0)
    assert merged["rounds"] == 4 and merged["merged_from"] == [
        {"date": "d1", "rounds": 2},
        {"date": "d2", "rounds": 2},
    ]


def test_a_merged_row_whose_plan_differs_between_runs_lists_each_runs_plan():
    from memfit_benchmarks.streaming import fixed_knob_note, merge_runs

    runs = [_run(d, {"torch": [1.0], "auto 1MiB": [1.1]}, wait=0.0) for d in ("d1", "d2")]
    for run, policies in zip(runs, ({"block": 4}, {"block": 3, "ffn": 1}), strict=True):
        run["rows"][1] |= {
            "policies": policies,
            "streamed": ["blocks.1"],
            "streamed_blocks": 1,
            "forward_uploads_ahead": 1,
            "uploads_kept_first": 0,
        }
    merged = merge_runs(*runs)
    auto = merged["rows"][1]
    assert [p["policies"] for p in auto["run_plans"]] == [{"block": 4}, {"block": 3, "ffn": 1}]
    line = fixed_knob_note(auto | {"fixed_knob": "torch", "x_fixed_knob": 1.0})
    assert "plans per run: 1) block 4; uploads led 1 ahead, 0 kept" in line and "2) block 3, ffn 1" in line
    same = merge_runs(*[_run(d, {"torch": [1.0]}, wait=0.0) for d in ("d1", "d2")])
    assert "run_plans" not in same["rows"][0]


def test_runs_of_different_commits_do_not_merge(tmp_path, capsys):
    from memfit_benchmarks import streaming

    files = []
    for i, commit in enumerate(("abc", "def")):
        files.append(tmp_path / f"{i}.json")
        files[-1].write_text(json.dumps(_run(f"d{i}", {"torch": [1.0, 1.0]}, wait=0.0, commit=commit)))
    with pytest.raises(SystemExit) as exit_info:
        streaming.main(["--merge", *map(str, files), "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "runs differ in git_commit" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("option", "key", "note"),
    [
        ("--per-block", "per_block", "copies charged against its own forward"),
        ("--reloads-alone", "reloads_alone", "each reload hidden behind a backward alone"),
        ("--uploads-late", "uploads_late", "each backward upload issued when the block after it recomputes"),
    ],
)
def test_auto_is_paired_with_its_budget_with_one_of_its_terms_or_behaviours_off(
    tmp_path, monkeypatch, option, key, note
):
    """``--per-block`` (the copy queue off: planner, "Queue"), ``--reloads-alone`` (no credit for the recompute
    after a reload: planner, "Reloads") and ``--uploads-late`` (backward's uploads after the reloads: weights,
    "Ahead of need") each add, per budget, ``auto`` with that switch off, only for that row, and the auto row's
    step against it."""
    from memfit_benchmarks import streaming

    variant = streaming.AUTO_VARIANTS[key]
    seen = {}  # per row measured: the switch's value while it ran
    original = streaming.measure_mode

    def measure_mode(model, batch, loss, mode, **kw):
        seen.setdefault(mode.name, getattr(variant.module, variant.constant))
        return original(model, batch, loss, mode, **kw)

    monkeypatch.setattr(streaming, "measure_mode", measure_mode)
    args = ["--preset", "tiny", "--device", "cpu", "--backend", "torch", "--blocks", "0", "--steps", "1"]
    path = streaming.main([*args, "--budgets", "1GiB", option, "--out", str(tmp_path)])
    rows = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
    other = "auto 1GiB" + variant.suffix
    assert list(rows) == ["torch", "auto 1GiB", other]
    auto, other_row = rows["auto 1GiB"], rows[other]
    assert auto[f"x_{key}"] == pytest.approx(auto["step_s"] / other_row["step_s"])
    assert note in (tmp_path / "streaming.md").read_text()
    default = getattr(variant.module, variant.constant)
    assert default != variant.value
    assert seen == {"torch": default, "auto 1GiB": default, other: variant.value}
