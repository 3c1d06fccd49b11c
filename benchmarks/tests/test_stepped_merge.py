"""Folding a later stepped run of other pairs into the committed file of the same model."""

from __future__ import annotations

import json

import pytest

from memfit_benchmarks import headline, stepped_merge


def _run(date: str, commit: str, steps: int, pairs: list[tuple[str, str, float]], **extra) -> dict:
    return {
        "suite": "interleaved-families",
        "family": "flux",
        "preset": "full",
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.11.0+cu130",
        "sdpa_backend": "default dispatch, cuDNN SDPA disabled",
        "shape": "flux full, 4096 tokens",
        "tokens": 4096,
        "config": "lora-all",
        "compile": None,
        "regime": "frozen bfloat16 base + PEFT LoRA r16",
        "date": date,
        "git_commit": commit,
        "steps": steps,
        "warmup": 3,
        "pairs": [
            {
                "a": a,
                "b": b,
                "ratio_median": ratio,
                "ratio_q1": ratio - 0.01,
                "ratio_q3": ratio + 0.01,
                "a_step_s": 0.5,
                "b_step_s": 0.5,
                "target": 1.0,
            }
            for a, b, ratio in pairs
        ],
        **extra,
    }


def test_a_later_run_of_other_pairs_keeps_the_committed_rows_stamped_with_their_run(tmp_path):
    into, new_dir = tmp_path / "results", tmp_path / "new"
    into.mkdir()
    new_dir.mkdir()
    name = "interleaved-flux-4096-lora-all.json"
    committed = _run(
        "2026-12-05T10:00:00",
        "aaa1111",
        24,
        [("torch", "diffusers-ckpt", 0.95), ("torch-ffn", "ckpt-ffn", 1.01)],
    )
    (into / name).write_text(json.dumps(committed))
    (new_dir / name).write_text(
        json.dumps(_run("2026-12-06T08:00:00", "bbb2222", 30, [("torch-ffn", "ckpt-ffn", 0.99)]))
    )

    stepped_merge.main([str(new_dir / name), "--into", str(into)])

    merged = json.loads((into / name).read_text())
    assert (merged["date"], merged["git_commit"], merged["steps"]) == ("2026-12-06T08:00:00", "bbb2222", 30)
    rows = {(r["a"], r["b"]): r for r in merged["pairs"]}
    assert set(rows) == {("torch-ffn", "ckpt-ffn"), ("torch", "diffusers-ckpt")}
    assert rows[("torch-ffn", "ckpt-ffn")]["ratio_median"] == 0.99  # the new measurement replaces the old one
    assert "run" not in rows[("torch-ffn", "ckpt-ffn")]
    assert rows[("torch", "diffusers-ckpt")]["run"] == {
        "date": "2026-12-05T10:00:00",
        "git_commit": "aaa1111",
        "steps": 24,
        "warmup": 3,
    }
    report = (into / name).with_suffix(".md").read_text()
    assert "| torch / diffusers-ckpt † | 0.950 |" in report
    assert "| torch-ffn / ckpt-ffn | 0.990 |" in report
    assert (
        "† From an earlier run of the same model: 2026-12-05T10:00:00, commit aaa1111, 24 steps each"
        in report
    )

    # a third run keeps the first run's stamp on the row it still did not measure
    (new_dir / name).write_text(
        json.dumps(_run("2026-12-07T08:00:00", "ccc3333", 30, [("unsloth-ffn", "ckpt-ffn", 1.0)]))
    )
    stepped_merge.main([str(new_dir / name), "--into", str(into)])
    rows = {(r["a"], r["b"]): r for r in json.loads((into / name).read_text())["pairs"]}
    assert rows[("torch", "diffusers-ckpt")]["run"]["git_commit"] == "aaa1111"
    assert rows[("torch-ffn", "ckpt-ffn")]["run"]["git_commit"] == "bbb2222"
    report = (into / name).with_suffix(".md").read_text()
    assert report.count("From an earlier run") == 2

    # the headline's source line says which rows an earlier run measured
    text = headline.headline(into, into, suite="families")
    source = next(line for line in text.splitlines() if line.startswith(f"- `{name}`"))
    assert (
        "kept from an earlier run: torch-ffn ÷ ckpt-ffn (2026-12-06, 30 steps), torch ÷ diffusers-ckpt (2026-12-05, 24 steps)"
        in source
    )


def test_a_file_without_a_committed_twin_is_copied_as_it_is(tmp_path):
    into = tmp_path / "results"
    into.mkdir()
    new = tmp_path / "interleaved-flux-4096-lora-all.json"
    new.write_text(
        json.dumps(_run("2026-12-06T08:00:00", "bbb2222", 30, [("torch", "diffusers-ckpt", 0.99)]))
    )
    stepped_merge.main([str(new), "--into", str(into)])
    assert json.loads((into / new.name).read_text()) == json.loads(new.read_text())
    assert "†" not in (into / new.name).with_suffix(".md").read_text()


@pytest.mark.parametrize(
    ("key", "value"), [("device", "NVIDIA H200"), ("tokens", 1024), ("sdpa_backend", "flash")]
)
def test_runs_of_another_device_or_shape_are_refused_with_what_differs(tmp_path, capsys, key, value):
    into = tmp_path / "results"
    into.mkdir()
    name = "interleaved-flux-4096-lora-all.json"
    (into / name).write_text(
        json.dumps(_run("2026-12-05T10:00:00", "aaa1111", 24, [("torch", "diffusers-ckpt", 0.95)]))
    )
    new = tmp_path / name
    new.write_text(
        json.dumps(
            _run("2026-12-06T08:00:00", "bbb2222", 30, [("torch-ffn", "ckpt-ffn", 0.99)], **{key: value})
        )
    )
    with pytest.raises(SystemExit):
        stepped_merge.main([str(new), "--into", str(into)])
    err = capsys.readouterr().err
    assert f"differ in {key}" in err and "separate files" in err
    assert json.loads((into / name).read_text())["git_commit"] == "aaa1111"  # left as it was


def test_a_file_from_before_the_lora_config_axis_holds_lora_on_every_linear(tmp_path, capsys):
    """Its rows merge with a later ``lora-all`` run of the same shape; a later ``lora-attn`` run is refused."""
    into = tmp_path / "results"
    into.mkdir()
    name = "interleaved.json"
    legacy = _run("2026-12-05T10:00:00", "aaa1111", 24, [("torch", "ckpt-block", 0.88)])
    del legacy["config"]
    (into / name).write_text(json.dumps(legacy))
    new = tmp_path / name
    new.write_text(json.dumps(_run("2026-12-06T08:00:00", "bbb2222", 30, [("unsloth", "ckpt-block", 0.95)])))
    stepped_merge.main([str(new), "--into", str(into)])
    merged = json.loads((into / name).read_text())
    assert [(p["a"], p["run"]["git_commit"] if "run" in p else None) for p in merged["pairs"]] == [
        ("unsloth", None),
        ("torch", "aaa1111"),
    ]
    (into / name).write_text(json.dumps(legacy))
    new.write_text(
        json.dumps(
            _run("2026-12-06T08:00:00", "bbb2222", 30, [("unsloth", "ckpt-block", 0.95)], config="lora-attn")
        )
    )
    with pytest.raises(SystemExit):
        stepped_merge.main([str(new), "--into", str(into)])
    assert "differ in config: None vs 'lora-attn'" in capsys.readouterr().err
