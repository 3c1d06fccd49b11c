"""The families runner and the renderer on CPU: tiny Flux + LoRA, non-offload modes and the peers, one timed step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")


def test_families_tiny_flux_cpu_and_render(tmp_path):
    from memfit_benchmarks import families, render

    written = families.main(
        [
            "--family",
            "flux",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--configs",
            "lora-all,lora-attn",
            "--out",
            str(tmp_path),
            "--no-render",
        ]
    )
    assert [p.name for p in written] == ["family-flux-tiny.json"]
    data = json.loads(written[0].read_text())
    assert data["family"] == "flux" and data["preset"] == "tiny" and data["tokens"] == 64
    assert "error" not in data, data.get("traceback")
    assert data["complete"] and [e["config"] for e in data["results"]] == ["lora-all", "lora-attn"]
    every_linear, attention_only = data["results"]
    assert every_linear["lora_targets_count"] > attention_only["lora_targets_count"] > 0
    assert every_linear["trainable_params"] > attention_only["trainable_params"] > 0
    for entry in data["results"]:
        modes = [r["mode"] for r in entry["rows"]]
        assert modes == [
            "none",
            "torch-ffn",
            "ckpt-ffn",
            "torch",
            "ckpt-block",
            "diffusers-ckpt",
            "torch interval 2",
            "torch interval 2 stride 4",
        ]
        assert set(entry["skipped"]) == {
            "unsloth-ffn",
            "unsloth",
            "offload_attention",
            "torch-ffn + offload_attention",
        }
        by = {r["mode"]: r for r in entry["rows"]}
        for r in entry["rows"]:
            assert (
                not r["oom"]
                and r["step_s"] > 0
                and r["peak_allocated"] is None
                and r["timing"] == "perf_counter"
            )
            assert "x_none" in r and "x_torch" in r and r["grad_bytes"] > 0
        # every memfit row against its peer; Flux has diffusers' checkpointing, which torch is compared with
        assert by["torch"]["vs_peer"] == "diffusers-ckpt" and "ckpt-block" in by["torch"]["x_peers"]
        assert by["torch-ffn"]["vs_peer"] == "ckpt-ffn" and by["torch-ffn"]["x_peer"] > 0
        # the checkpoint peers counted their regions: 3 double + 4 single blocks; 3 × (ff, ff_context) + 4 MLPs
        assert by["ckpt-block"]["checkpointed_calls_per_step"] == 7
        assert by["ckpt-ffn"]["checkpointed_calls_per_step"] == 10
        # and so did diffusers' own checkpointing (every Flux block goes through its function), as many as memfit's
        assert by["diffusers-ckpt"]["checkpointed_calls_per_step"] == 7 == by["torch"]["frames_per_step"]

    files = render.main([str(written[0])])
    md = (tmp_path / f"{written[0].stem}.md").read_text()
    png = tmp_path / f"{written[0].stem}.png"
    assert png in files and png.stat().st_size > 1000
    for mode in modes:
        assert f"| {mode} |" in md
    assert "BUG" not in md


def test_rounds_measure_every_mode_round_robin_and_report_the_median(tmp_path, monkeypatch):
    from memfit_benchmarks import families, runner

    order, times = [], iter([0.5, 0.9, 0.4, 1.3, 0.6, 1.1])  # none, torch, none, torch, none, torch

    def fake_measure(model, batch, loss, mode, **kw):
        order.append(mode.name)
        return {
            "mode": mode.name,
            "config": mode.config,
            "step_s": next(times),
            "oom": False,
            "peak_allocated": 100 + len(order),
            "peak_reserved": None,
        }

    monkeypatch.setattr(runner, "measure_mode", fake_measure)
    written = families.main(
        [
            "--family",
            "flux",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--modes",
            "none,torch",
            "--rounds",
            "3",
            "--out",
            str(tmp_path),
            "--no-render",
        ]
    )
    data = json.loads(written[0].read_text())
    assert order == ["none", "torch"] * 3 and data["rounds"] == 3
    none, torch_row = data["results"][0]["rows"]
    assert none["step_s_rounds"] == [0.5, 0.4, 0.6] and none["step_s"] == 0.5
    assert torch_row["step_s"] == 1.1 and torch_row["peak_allocated"] == 106  # the largest peak of its rounds
    assert torch_row["x_none"] == 1.1 / 0.5
    with pytest.raises(SystemExit):
        families.main(["--family", "flux", "--rounds", "0", "--out", str(tmp_path)])


def test_bug_lines_flag_peaks_at_or_above_none():
    from memfit_benchmarks.report import bug_lines

    rows = [
        {"mode": "none", "peak_allocated": 100, "step_s": 1.0, "oom": False},
        {"mode": "torch", "peak_allocated": 50, "step_s": 1.3, "oom": False},
        {"mode": "unsloth", "peak_allocated": 100, "step_s": 1.3, "oom": False},
        {"mode": "torch-ffn", "oom": True},
    ]
    lines = bug_lines(rows)
    assert len(lines) == 1 and lines[0].startswith("- BUG unsloth")


def test_render_synthetic_with_oom_row(tmp_path):
    from memfit_benchmarks import render

    payload = {
        "suite": "synthetic",
        "date": "2026-01-01T00:00:00+00:00",
        "device": "test",
        "torch": "x",
        "cuda": None,
        "regime": "full",
        "regime_description": "full",
        "steps": 1,
        "warmup": 0,
        "results": [
            {
                "shape": "s 1",
                "rows": [
                    {
                        "mode": "none",
                        "step_s": 0.1,
                        "peak_allocated": 2**31,
                        "peak_reserved": 2**31,
                        "oom": False,
                    },
                    {
                        "mode": "torch",
                        "step_s": 0.2,
                        "peak_allocated": 2**32,
                        "peak_reserved": 2**32,
                        "oom": False,
                    },
                    {"mode": "unsloth", "oom": True},
                ],
            }
        ],
    }
    path = tmp_path / "synthetic-full-x.json"
    path.write_text(json.dumps(payload))
    render.main([str(path)])
    md = (tmp_path / "synthetic-full-x.md").read_text()
    # full regime without a forward+backward peak: the equal-or-higher peak may be AdamW's, so a NOTE
    assert "| unsloth | OOM |" in md and "- NOTE torch" in md
    assert (tmp_path / "synthetic-full-x.png").exists()
    # with it, the verdict is on the activation peak
    rows = payload["results"][0]["rows"]
    rows[0]["peak_allocated_before_optimizer"], rows[1]["peak_allocated_before_optimizer"] = 2**30, 2**30
    path.write_text(json.dumps(payload))
    render.main([str(path)])
    assert "- BUG torch" in (tmp_path / "synthetic-full-x.md").read_text()


def test_synthetic_every_config_cpu(tmp_path):
    from memfit_benchmarks.__main__ import main

    written = main(
        [
            "--configs",
            "all",
            "--modes",
            "none,torch-ffn,torch",
            "--device",
            "cpu",
            "--shapes",
            "tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads(written[0].read_text())
    assert [e["config"] for e in data["results"]] == ["lora-all", "lora-attn", "frozen", "full"]
    for entry in data["results"]:
        assert [r["mode"] for r in entry["rows"]] == ["none", "torch-ffn", "torch"]
        assert not any(r["oom"] for r in entry["rows"])
    assert (tmp_path / f"{written[0].stem}.md").exists()


def test_host_ram_exhaustion_is_an_oom_row_not_a_crash(monkeypatch):
    """A mode whose pinned pool runs out of host RAM (attention offload of a video model) is recorded like a
    GPU OOM, so the other modes of the run still get measured."""
    import torch

    import memfit
    from memfit_benchmarks import runner
    from memfit_benchmarks.modes import Mode
    from memfit_benchmarks.report import row_table

    def apply(*args, **kwargs):
        raise memfit.HostMemoryError("not enough host RAM to pin 256 MiB")

    monkeypatch.setattr(runner.memfit, "apply", apply)
    model = torch.nn.Linear(4, 4)
    mode = Mode("offload_attention", {"gradient_checkpointing_offload_attention": True})
    row = runner.measure_mode(
        model, {"input": torch.randn(2, 4)}, lambda out: out.sum(), mode, adapter=None, warmup=1, steps=1
    )
    assert row["oom"] and row["oom_where"] == "host" and "host RAM" in row["error"]
    assert "| offload_attention | OOM (host RAM) |" in "\n".join(row_table([row]))


# device_sweeps.sh's families parts
FAMILY_MODES = "torch,diffusers-ckpt,torch-ffn,ckpt-ffn,unsloth,unsloth-ffn"


def _family_run(tmp_path, *extra: str) -> dict:
    from memfit_benchmarks import families

    options = "--family flux --preset tiny --device cpu --configs lora-all,lora-attn --rounds 2 --warmup 0"
    (path,) = families.main(
        [*options.split(), "--steps", "1", "--modes", FAMILY_MODES, "--require-peer", "--no-render"]
        + ["--out", str(tmp_path), *extra]
    )
    return json.loads(path.read_text())


def test_the_family_parts_modes_fill_every_headline_column_but_offload_off_cuda(tmp_path, is_ratio_cell):
    from memfit_benchmarks import headline

    data = _family_run(tmp_path, "--min-seconds", "0.2")
    for entry in data["results"]:
        assert entry["min_seconds"] == 0.2
        by = {r["mode"]: r for r in entry["rows"]}
        assert by["torch"]["vs_peer"] == "diffusers-ckpt" and by["torch-ffn"]["vs_peer"] == "ckpt-ffn"
        for row in by.values():  # timed until 0.2 s (a tiny step takes a few ms), each round's count kept
            assert len(row["timed_steps_rounds"]) == 2 and row["timed_steps_rounds"][0] == row["timed_steps"]
            assert sum(row["step_times_s"]) >= 0.2 and len(row["step_times_s"]) == row["timed_steps"]
        assert entry["skipped"] == {"unsloth": "offload needs CUDA", "unsloth-ffn": "offload needs CUDA"}
    found, present = headline.collect(tmp_path)
    row = next(line for line in headline.family_table(found, present) if line.startswith("| flux | 64 |"))
    torch_cell, ffn_cell, unsloth_cell, unsloth_ffn_cell = [c.strip() for c in row.strip("|").split("|")][3:]
    assert is_ratio_cell(torch_cell) and is_ratio_cell(ffn_cell), (torch_cell, ffn_cell)
    assert unsloth_cell == unsloth_ffn_cell == "not run (offload needs CUDA)"


def test_a_family_without_an_ffn_boundary_skips_the_ffn_modes_and_says_why(tmp_path, monkeypatch):
    import dataclasses

    import memfit
    from memfit_benchmarks import families, headline

    flux = memfit.get_adapter("flux")
    no_ffn = dataclasses.replace(
        flux, blocks={name: dataclasses.replace(spec, ffn=()) for name, spec in flux.blocks.items()}
    )
    assert not no_ffn.has_ffn
    monkeypatch.setattr(families.memfit, "get_adapter", lambda name: no_ffn)
    data = _family_run(tmp_path)
    for entry in data["results"]:
        assert [r["mode"] for r in entry["rows"]] == ["torch", "diffusers-ckpt"]
        for mode in ("torch-ffn", "ckpt-ffn", "unsloth-ffn"):
            assert entry["skipped"][mode] == "no FFN boundary declared"
    found, present = headline.collect(tmp_path)
    row = next(line for line in headline.family_table(found, present) if line.startswith("| flux | 64 |"))
    assert [c.strip() for c in row.strip("|").split("|")][4] == "not run (no FFN boundary declared)"
