"""A failed step on a GPU leaves nothing allocated (run by ``nox -s gpu`` on a CUDA machine; skips elsewhere).

Seen on an H200: a trainer-like loop that catches ``torch.OutOfMemoryError`` and goes on kept about 5 GiB of
forward activations allocated for good after an ``auto`` step ran out of memory in its forward (a plan with
attention offload, copies in flight on the copy engine's streams), through ``handle.remove()``, ``gc.collect()``
and ``torch.cuda.empty_cache()``. Attention saves its own output, and what memfit kept for it held that output
with its autograd history: the node kept itself, and every activation before it, alive (docs/architecture.md,
"What autograd keeps"; the CPU tests are in test_failed_steps.py).

Here, after each failed step, and after a forward whose result is dropped: ``memory_allocated`` is back where it
was before the step, within a few MiB. Flux's structure (3 double and 4 single blocks), wide enough that one
step's activations are hundreds of MiB; bf16 with flash attention (cuDNN SDPA is off in GPU tests).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import memfit
from memfit_conformance.plugin import require_cuda

from helpers import FAILED_STEP_CONFIGS, auto_mix, force_auto_plan

memfit_flux = pytest.importorskip("memfit_flux")
pytestmark = pytest.mark.gpu
ADAPTER = memfit_flux.ADAPTER
# what a failed step may leave: the copy engine's 512-byte padding, allocator rounding
LEFT_OVER = 8 << 20

CONFIGS = {
    name: FAILED_STEP_CONFIGS[name]
    for name in ("attention-offload", "unsloth-ffn+attention", "unsloth-i2", "auto")
}
# inside an offloaded attention call, inside an FFN region, after the last block (the step's last regions
# still wait to be parked)
FAILURES = ["single_transformer_blocks.1.attn.to_k", "transformer_blocks.1.ff.net.2", "proj_out"]


@pytest.fixture(scope="module")
def model():
    require_cuda()
    from diffusers import FluxTransformer2DModel

    from memfit.adapters.building import build_model

    config = dict(
        patch_size=1,
        in_channels=16,
        num_layers=3,
        num_single_layers=4,
        attention_head_dim=64,
        num_attention_heads=8,
        joint_attention_dim=64,
        pooled_projection_dim=32,
        axes_dims_rope=[16, 24, 24],
        guidance_embeds=True,
    )
    return build_model(FluxTransformer2DModel, config, dtype=torch.bfloat16, device="cuda", seed=0)


@pytest.fixture(scope="module")
def batch(model):
    inputs = ADAPTER.presets["tiny"].inputs(model, tokens=4096, generator=torch.Generator().manual_seed(0))
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.fixture(autouse=True)
def forced_plan(monkeypatch):
    """``auto`` plans the H200 run's policies (:func:`helpers.auto_mix`)."""
    force_auto_plan(monkeypatch, auto_mix)


@contextmanager
def flash() -> Iterator[None]:
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        yield


def step(model, batch) -> None:
    model.zero_grad(set_to_none=True)
    with flash():
        ADAPTER.loss(model(**batch)).backward()


def allocated(model) -> int:
    """Bytes allocated once the trainer dropped its step: gradients dropped, garbage collected, and autograd's
    queue run out (a backward that raised leaves the tasks it had not run there until the next backward)."""
    model.zero_grad(set_to_none=True)
    x = torch.ones(1, device="cuda", requires_grad=True)
    (x * 2).sum().backward()
    del x
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def fail_step(model, batch) -> str:
    """A step expected to run out of memory; returns where (the trainer's loop catches it and goes on)."""
    model.zero_grad(set_to_none=True)
    phase = "forward"
    try:
        with flash():
            loss = ADAPTER.loss(model(**batch))
            phase = "backward"
            loss.backward()
    except torch.OutOfMemoryError:
        return phase
    raise AssertionError("the step did not run out of memory")


def injected(module: torch.nn.Module):
    """A forward hook that raises out of memory at the module's first call."""
    fired = []

    def hook(m, args, output):
        if not fired:
            fired.append(1)
            raise torch.OutOfMemoryError("injected")

    return module.register_forward_hook(hook)


def applied(model, name):
    return memfit.apply(model, CONFIGS[name], adapter=ADAPTER)


@pytest.mark.parametrize("where", FAILURES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_forward_that_runs_out_of_memory_leaves_nothing_allocated(model, batch, name, where):
    handle = applied(model, name)
    try:
        step(model, batch)  # auto plans; every workspace is made
        before = allocated(model)
        hook = injected(model.get_submodule(where))
        try:
            assert fail_step(model, batch) == "forward"
        finally:
            hook.remove()
        assert allocated(model) - before <= LEFT_OVER  # with memfit still applied, as a trainer goes on
        step(model, batch)  # and the next step runs
    finally:
        handle.remove()
    assert allocated(model) - before <= LEFT_OVER


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_forward_never_backwarded_leaves_nothing_allocated(model, batch, name):
    with applied(model, name):
        step(model, batch)
        before = allocated(model)
        with flash():
            ADAPTER.loss(model(**batch))  # validation with gradients on; the result is dropped
        assert allocated(model) - before <= LEFT_OVER


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_real_out_of_memory_error_leaves_nothing_allocated(model, batch, name):
    """The process is limited (``torch.cuda.set_per_process_memory_fraction``) to half of what the step needs
    above what is resident: the step runs out of memory where the allocator says, copies in flight."""
    handle = applied(model, name)
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        step(model, batch)
        before = allocated(model)
        torch.cuda.reset_peak_memory_stats()
        step(model, batch)
        peak = torch.cuda.max_memory_allocated()
        allocated(model)
        torch.cuda.set_per_process_memory_fraction((before + (peak - before) // 2) / total)
        try:
            phase = fail_step(model, batch)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0)
        left = allocated(model) - before
        assert left <= LEFT_OVER, (
            f"{left / 2**20:.0f} MiB left allocated after running out of memory in the {phase}"
        )
    finally:
        handle.remove()
    assert allocated(model) - before <= LEFT_OVER
