"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="session")
def lease() -> ModuleType:
    """``benchmarks/tools/lease.py`` (a script beside the package, not part of it)."""
    spec = importlib.util.spec_from_file_location("memfit_benchmarks_tools_lease", TOOLS / "lease.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# a headline cell of a measured step ratio without a peak (off CUDA): bold where over its limit in every round, the
# rounds' spread after it where the verdict is a tie (which CPU timings often are), or unpaired
_RATIO_CELL = re.compile(r"(\*\*)?\d+\.\d{3}(\*\*)?( \(tie: rounds \d+\.\d{3}–\d+\.\d{3}\)| \(unpaired\))?")


@pytest.fixture(scope="session")
def is_ratio_cell() -> Callable[[str], bool]:
    """Whether a headline cell is a measured step ratio (no peak beside it), however its verdict reads."""
    return lambda cell: _RATIO_CELL.fullmatch(cell) is not None
