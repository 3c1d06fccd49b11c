"""The accelerate example runs a few steps on CPU (gradient accumulation 2, memfit torch-ffn)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
pytest.importorskip("memfit_flux")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_train.py"


def load_example():
    spec = importlib.util.spec_from_file_location("accelerate_train", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("backend", ["torch-ffn", "torch"])
def test_accelerate_example_trains(backend):
    example = load_example()
    losses = example.main(["--steps", "2", "--backend", backend])
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
