"""pytest plugin (auto-loaded through the ``pytest11`` entry point): markers and the CUDA requirement switch."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; run through `nox -s gpu` on a GPU machine")


def cuda_required() -> bool:
    """True when a missing GPU must fail the GPU tests instead of skipping them (the nox ``gpu`` session)."""
    return os.environ.get("MEMFIT_REQUIRE_CUDA", "") not in ("", "0")


def require_cuda() -> None:
    """Skip (CPU machines) or fail (``MEMFIT_REQUIRE_CUDA=1``) when CUDA is absent."""
    import torch

    if torch.cuda.is_available():
        return
    if cuda_required():
        pytest.fail("MEMFIT_REQUIRE_CUDA is set but torch.cuda.is_available() is False")
    pytest.skip("needs CUDA (runs in `nox -s gpu` on a GPU machine)")
