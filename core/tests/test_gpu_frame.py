"""GPU tests of the region engine's early stop and replayed state (run by `nox -s gpu` on a CUDA machine)."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import memfit
from memfit.engine.frame import CUT_TAIL_OUTPUT

from helpers import assert_same, step
from toy import TOY, build

pytestmark = pytest.mark.gpu
ON = {"gradient_checkpointing": True}


@pytest.mark.parametrize("backend", ["torch", "torch-ffn", "unsloth", "unsloth-ffn"])
def test_early_stop_on_cuda_changes_no_gradient(backend):
    """fp32 on CUDA, real copy engine for the offload backends: the FFN's frozen last projection is never
    recomputed, and every gradient is bitwise the unmodified model's."""
    model = build(dim=1024, blocks=6, device="cuda")
    for block in model.blocks:
        block.ff_out.requires_grad_(False)
    x = torch.randn(1, 4096, 1024, device="cuda")
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY) as handle:
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    ffn = backend.endswith("-ffn")
    # FFN chains (ff_in, act, ff_out): ff_out is never replayed, and act's replay stops once its input is saved (its
    # 4096 x 4096 output is large: CUT_TAIL_OUTPUT); blocks: each is cut before ff_out's matmul
    assert CUT_TAIL_OUTPUT <= 4096 * 4096
    assert stats["frames"] == 6
    assert stats["calls_skipped_early_stop"] == (6 if ffn else 0)
    assert stats["calls_cut_early_stop"] == 6
    if backend.startswith("unsloth"):
        assert stats["bytes_offloaded"] > 0


@pytest.mark.parametrize("around", ["forward", "backward"])
def test_sdpa_kernel_of_the_forward_is_replayed_on_cuda(around):
    """Math attention around only the forward (or only the backward) of a tiny Flux in fp32: without the replayed
    selection the recompute would run the efficient kernel, which saves other tensors."""
    memfit_flux = pytest.importorskip("memfit_flux")
    from test_misuse import flux_step

    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build(dtype=torch.float32, device="cuda")
    inputs = preset.inputs(model, tokens=1024, generator=torch.Generator().manual_seed(0))
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        ref = flux_step(model, inputs, around=around)
        with memfit.apply(model, ON) as handle:
            got = flux_step(model, inputs, around=around)
            assert handle.stats()["recomputes"] > 0
    for name, grad in ref.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-5, msg=name)
