"""The allocator-reserve benchmark: its rows, its rounds' order and its refusals (a CPU smoke run)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")


def test_each_mode_is_measured_every_round_in_alternating_order(tmp_path, capsys):
    from memfit_benchmarks import reserve

    path = reserve.main(
        f"--shape tiny --device cpu --modes none,torch,unsloth --rounds 2 --steps 1 --warmup 1 --out {tmp_path}".split()
    )
    payload = json.loads(path.read_text())
    assert [m["mode"] for m in payload["modes"]] == ["none", "torch", "unsloth"]
    assert all(m["rounds"] == 2 and m["step_s"] > 0 for m in payload["modes"])
    printed = [
        line.split("'")[3] for line in capsys.readouterr().out.splitlines() if line.startswith("{'mode'")
    ]
    assert printed == ["none", "torch", "unsloth", "unsloth", "torch", "none"]
    # off CUDA there is no caching allocator: the memory cells say so rather than read 0
    assert "| torch | 0.00 | - | - | - | - | - |" in path.with_suffix(".md").read_text()


def test_an_unknown_mode_or_shape_is_refused(tmp_path, capsys):
    from memfit_benchmarks import reserve

    with pytest.raises(SystemExit):
        reserve.main(f"--device cpu --modes unslooth --out {tmp_path}".split())
    assert "unknown mode(s) ['unslooth']" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        reserve.main(f"--device cpu --shape 9 --out {tmp_path}".split())
    assert "--shape" in capsys.readouterr().err
