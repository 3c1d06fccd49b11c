"""The instruction-count benchmark: its parsing, its rows, and the step it counts, without valgrind (CI has none;
the counts themselves are made on a machine that has it)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("peft")


def test_instructions_are_read_from_a_callgrind_dump():
    from memfit_benchmarks.host_instructions import instructions

    dump = "version: 1\ncreator: callgrind-3.19.0\ncmd: python\npart: 1\nevents: Ir\nsummary: 499707402\ntotals: 499707402\n"
    assert instructions(dump) == 499707402
    with pytest.raises(ValueError, match="not a callgrind dump"):
        instructions("events: Ir\n")


def test_a_row_runs_its_warm_up_and_measured_steps_unmarked(monkeypatch):
    from memfit_benchmarks import host_instructions, host_overhead

    steps = []
    step = host_overhead.Installed.step
    monkeypatch.setattr(host_overhead.Installed, "step", lambda run: (steps.append(run.handle), step(run))[1])
    host_instructions.child("offload_attention", steps=2, depth=2, library=None)
    assert len(steps) == host_instructions.WARMUP_STEPS + 2
    assert steps[0] is not None and all(h is steps[0] for h in steps)  # memfit applied, once, for every step


def test_rows_come_with_their_baselines_and_peers_and_are_compared(monkeypatch, tmp_path):
    from memfit_benchmarks import host_instructions

    counts = {"none": 100, "save_on_cpu": 130, "offload_attention": 120}
    monkeypatch.setattr(host_instructions.shutil, "which", lambda tool: f"/usr/bin/{tool}")
    monkeypatch.setattr(host_instructions, "marks_library", lambda directory: directory / "libmarks.so")
    monkeypatch.setattr(host_instructions, "count", lambda name, **kw: counts[name])
    path = host_instructions.main(["--out", str(tmp_path), "--modes", "offload_attention"])
    rows = {r["mode"]: r for r in json.loads(path.read_text())["rows"]}
    assert list(rows) == ["none", "save_on_cpu", "offload_attention"]
    assert rows["offload_attention"]["over_baseline"] == 20 and rows["offload_attention"]["over_peer"] == -10
    assert (
        "| offload_attention | 0.00 | none | +0.00 | save_on_cpu | -0.00 |"
        in path.with_suffix(".md").read_text()
    )


def test_missing_tools_are_named(monkeypatch, tmp_path):
    from memfit_benchmarks import host_instructions

    monkeypatch.setattr(host_instructions.shutil, "which", lambda tool: None)
    with pytest.raises(host_instructions.ToolMissing, match="valgrind is not installed"):
        host_instructions.run(names=["none"], steps=1, depth=1, jobs=1)
    with pytest.raises(host_instructions.ToolMissing, match="no C compiler"):
        host_instructions.marks_library(tmp_path)


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_the_marks_helper_builds_where_valgrind_headers_are_installed(tmp_path):
    from memfit_benchmarks import host_instructions

    try:
        library = host_instructions.marks_library(tmp_path)
    except host_instructions.ToolMissing as e:
        assert "valgrind" in str(e)  # a compiler without valgrind's headers: named
    else:
        assert library.exists()
