"""The pinning probe: refused without CUDA with a clear message, and its report renders what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memfit_benchmarks import pinning

RESULT = Path(__file__).parents[1] / "results" / "streaming" / "pinning.json"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_pinning_needs_cuda(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pinning.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "machine with a GPU" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_committed_result_renders_as_committed():
    payload = json.loads(RESULT.read_text())
    assert pinning.render(payload) == RESULT.with_suffix(".md").read_text()
    assert [r["kind"] for r in payload["rows"]] == list(pinning.KINDS)


def test_the_host_workloads_run_and_the_contention_table_renders():
    for work in pinning.workloads(torch.device("cpu")).values():
        work()  # each runs on its own (on the GPU machine the launches go to the device)
    payload = json.loads(RESULT.read_text()) | {
        "contention": [
            {
                "direction": "uploads",
                "workload": "a Python loop",
                "alone_ms": 10.0,
                "with_copies_ms": 15.0,
                "beside_copies": 5,
            },
            {
                "direction": "downloads",
                "workload": "2000 kernel launches",
                "alone_ms": 8.0,
                "with_copies_ms": None,
                "beside_copies": 0,
            },
        ]
    }
    md = pinning.render(payload)
    assert "| uploads | a Python loop | 10.00 | 15.00 | 1.50 | 5 of 5 |" in md
    assert "| downloads | 2000 kernel launches | 8.00 | - | - | 0 of 5 |" in md
