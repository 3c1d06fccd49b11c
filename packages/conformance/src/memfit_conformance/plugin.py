"""pytest plugin (auto-loaded through the ``pytest11`` entry point): markers and the CUDA requirement switch."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs CUDA; run through `nox -s gpu` on a GPU machine")
    pin_sdpa_backend()


def pin_sdpa_backend() -> None:
    """Keep cuDNN SDPA off on GPU machines.

    torch 2.11 (cu130) on an H200: the cuDNN backend of scaled_dot_product_attention corrupted memory
    in backward on diffusers models in bf16 (illegal memory access); flash/efficient backends are fine.
    GPU tests and benchmarks therefore run with cuDNN SDPA disabled and say so in their results.
    """
    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.enable_cudnn_sdp(False)


@pytest.fixture(autouse=True)
def _memfit_gpu_marked(request: pytest.FixtureRequest):
    """Tests marked ``gpu``: skip without CUDA (fail under ``MEMFIT_REQUIRE_CUDA``), cuDNN SDPA off, and the
    cached GPU memory released after each (the next test measures peaks from a clean allocator)."""
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    require_cuda()
    import gc

    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)
    yield
    gc.collect()
    torch.cuda.empty_cache()


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
