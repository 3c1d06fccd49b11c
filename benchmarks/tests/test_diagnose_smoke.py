"""The diagnose script on CPU: tiny Flux or the synthetic stack + LoRA, two modes, host vs step time and a profile table per mode."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")
pytest.importorskip("memfit_flux")


@pytest.mark.parametrize("target", ["flux", "synthetic-1024"])
def test_diagnose_tiny_cpu(tmp_path, target):
    from memfit_benchmarks import diagnose

    diagnose.main(
        [
            "--family",
            target,
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--modes",
            "none,torch,unsloth",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    md = (tmp_path / f"diagnose-{target}.md").read_text()
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| mode")]
    assert [r.split("|")[1].strip() for r in rows] == ["none", "torch"]  # offload modes need CUDA: skipped
    for r in rows:
        step, forward, host_fwd, host_bwd = (float(c) for c in r.split("|")[2:6])
        assert step > 0 and host_fwd > 0 and host_bwd > 0
        assert 0 < forward < step  # the forward's part of the step
    assert (
        "## torch" in md and '"recomputes":' in md and "Host (cProfile, one step)" in md
    )  # the handle's stats and the profiler's table per mode
    traces = sorted(tmp_path.glob("trace-*.json.gz"))
    assert [t.name for t in traces] == [f"trace-{target}-none.json.gz", f"trace-{target}-torch.json.gz"]
    from memfit_benchmarks import trace_gaps

    none, torch_mode = (trace_gaps.summarize(t.name, trace_gaps.load_events(t)) for t in traces)
    # memfit's frames, read from the trace (without checkpointing only the adapter's loss runs memfit code)
    assert none.memfit_python_us < torch_mode.memfit_python_us
    # by function: the recompute runs inside the region engine's unpack; its detaches are C calls memfit makes
    assert "memfit/engine/frame.py: recompute" in torch_mode.memfit_inclusive_us
    assert any("detach" in call for call in torch_mode.calls_from_memfit)


def test_every_mode_is_timed_before_any_is_profiled(tmp_path, monkeypatch):
    """A profiler session slows the CUDA calls of steps timed after it: the timed steps of every mode come first."""
    from memfit_benchmarks import diagnose

    calls = []
    for name in ("measure", "profile"):
        real = getattr(diagnose, name)

        def recorded(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, kwargs.get("trace") is not None if _name == "profile" else None))
            return _real(*args, **kwargs)

        monkeypatch.setattr(diagnose, name, recorded)
    args = ["--family", "flux", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "1"]
    diagnose.main([*args, "--modes", "none,torch,torch-ffn", "--out", str(tmp_path)])
    assert calls == [("measure", None)] * 3 + [("profile", True)] * 3
    md = (tmp_path / "diagnose-flux.md").read_text()
    assert "every mode timed before any is profiled" in md
    rows = [
        line.split("|")[1].strip() for line in md.splitlines() if line.startswith("| ") and "mode" not in line
    ]
    assert rows == ["none", "torch", "torch-ffn"]  # one row per mode, with its profile's columns


def test_diagnose_refuses_tokens_for_a_synthetic_target(tmp_path):
    from memfit_benchmarks import diagnose

    with pytest.raises(SystemExit):
        diagnose.main(["--family", "synthetic-1024", "--tokens", "2048", "--out", str(tmp_path)])


def test_diagnose_runs_auto_at_a_budget(tmp_path):
    """``auto@<budget>`` is the auto backend at that budget, its plan's counts in the report (on CPU the budget
    counts held activation bytes: 96 KiB is well below the tiny model's, so blocks are recomputed)."""
    from memfit_benchmarks import diagnose

    diagnose.main(
        [
            "--family",
            "flux",
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--modes",
            "torch,auto@96KiB",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    md = (tmp_path / "diagnose-flux.md").read_text()
    assert "| auto@96KiB |" in md and "## auto@96KiB" in md
    counts = json.loads(md.split("## auto@96KiB")[1].split("plan: `")[1].split("`")[0])
    assert sum(counts.values()) == 7 and set(counts) - {"keep"}, counts  # every block planned, not all kept


@pytest.mark.parametrize(
    "mode, says",
    [("auto@lots", "not a size"), ("unslot", "unknown mode 'unslot'"), ("torch", "['torch'] listed twice")],
)
def test_diagnose_refuses_a_bad_mode_before_building_anything(tmp_path, capsys, mode, says):
    from memfit_benchmarks import diagnose

    with pytest.raises(SystemExit):
        diagnose.main(
            [
                "--family",
                "flux",
                "--preset",
                "tiny",
                "--device",
                "cpu",
                "--modes",
                f"torch,{mode}",
                "--out",
                str(tmp_path),
            ]
        )
    assert says in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # stopped before any output


def test_diagnose_runs_a_fixed_mode_with_streamed_weights(tmp_path):
    """``<mode>+stream<N>``: the fixed mode with N blocks' frozen weights streamed (on CPU through synchronous
    copies), its uploads in the handle's stats; no trace with ``--no-traces``."""
    from memfit_benchmarks import diagnose

    args = ["--family", "flux", "--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "1"]
    diagnose.main([*args, "--modes", "torch,torch+stream2", "--no-traces", "--out", str(tmp_path)])
    md = (tmp_path / "diagnose-flux.md").read_text()
    stats = json.loads(md.split("## torch+stream2")[1].split("stats: `")[1].split("`")[0])
    assert stats["streamed_blocks"] == 2 and stats["weight_uploads"] > 0
    assert not list(tmp_path.glob("trace-*"))
    with pytest.raises(SystemExit):
        diagnose.main([*args, "--modes", "torch+streamx", "--out", str(tmp_path)])
