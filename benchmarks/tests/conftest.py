"""Fixtures shared by the benchmark tests."""

from __future__ import annotations

import importlib.util
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
