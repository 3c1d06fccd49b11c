"""The host-overhead benchmark on a small stack: every mode measured, extras against their baselines, and the
offload modes parking through the copy engine over streams that do nothing."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")


def test_host_overhead_measures_every_mode_against_its_baseline(tmp_path):
    from memfit_benchmarks import host_overhead

    path = host_overhead.main(["--out", str(tmp_path), "--rounds", "2", "--steps", "2", "--depth", "3"])
    payload = json.loads(path.read_text())
    rows = {r["mode"]: r for r in payload["rows"]}
    assert list(rows) == host_overhead.NAMES
    for name, row in rows.items():
        assert len(row["step_ms_rounds"]) == 2 and row["step_ms"] > 0
        assert ("extra_ms" in row) == (name != "none")
    # every memfit row against its peer, measured in the same rounds by the sweeps' own peer installation
    assert {n: r["peer"] for n, r in rows.items() if "peer" in r} == {
        "torch": "ckpt-block",
        "unsloth": "ckpt-block",
        "torch-ffn": "ckpt-ffn",
        "unsloth-ffn": "ckpt-ffn",
        "offload_attention": "save_on_cpu",
        "torch-ffn + offload_attention": "ckpt-ffn",
    }
    for row in rows.values():
        if "peer" in row:
            peer_ms = rows[row["peer"]]["step_ms_rounds"]
            differences = [a - b for a, b in zip(row["step_ms_rounds"], peer_ms, strict=True)]
            assert row["vs_peer_ms_range"] == [min(differences), max(differences)]
    assert rows["none"]["hooked_tensors_per_step"] == 0
    # every saved tensor of the stack goes through the no-op hooks; the attention offload parks a share of them
    assert (
        rows["none + no-op hooks"]["hooked_tensors_per_step"]
        > rows["offload_attention"]["hooked_tensors_per_step"]
        > 0
    )
    assert "| unsloth | " in path.with_suffix(".md").read_text()


def test_host_overhead_measures_a_subset_with_its_baselines_and_peers():
    from memfit_benchmarks import host_overhead

    assert host_overhead.selected("unsloth-ffn") == ["none", "ckpt-ffn", "torch-ffn", "unsloth-ffn"]
    assert host_overhead.selected("offload_attention") == ["none", "save_on_cpu", "offload_attention"]
    with pytest.raises(ValueError, match="unknown host-overhead mode"):
        host_overhead.selected("torch,nope")


def test_null_streams_run_the_copy_engine_on_cpu_tensors():
    from memfit_benchmarks.host_overhead import main, null_copy_engine

    eng = null_copy_engine()
    a, b = torch.randn(4, 8), torch.randn(8, 4).t()
    parked = eng.offload_many([a, b])
    for p in parked:
        p.source = None
    assert [torch.equal(eng.fetch(p), t) for p, t in zip(parked, (a, b), strict=True)] == [True, True]
    with pytest.raises(SystemExit):  # refused before anything runs
        main(["--out", "x", "--rounds", "0"])
