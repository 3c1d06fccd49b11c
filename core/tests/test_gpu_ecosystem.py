"""Where users train, on a GPU: regional torch.compile with Inductor, and PEFT LoRA, under every backend.

Run by ``nox -s gpu`` (skips on CPU machines). The CPU halves (``test_compile.py`` with ``aot_eager``,
``test_peft.py``) check the same contracts bitwise; here the kernels are the real ones, so each
comparison is against the noise that the same kernels already show without memfit.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit_conformance.plugin import require_cuda

from helpers import FLUX_LORA_TARGETS

memfit_flux = pytest.importorskip("memfit_flux")
pytestmark = pytest.mark.gpu
TINY = memfit_flux.ADAPTER.presets["tiny"]
ON = {"gradient_checkpointing": True}


def assert_within_noise(reference: dict, again: dict, got: dict, *, floor: float) -> None:
    """``got`` differs from ``reference`` by at most 4x what a second unmodified run differs (the kernels'
    own noise), or ``floor`` times the tensor's magnitude where that noise is zero. A wrong saved tensor or a
    race gives differences of the order of the values themselves, far outside both."""
    assert reference.keys() == got.keys()
    for name, a in reference.items():
        b = got[name]
        assert torch.isfinite(b).all(), f"{name}: non-finite values under memfit"
        scale = a.float().abs().max().item()
        noise = (a.float() - again[name].float()).abs().max().item()
        diff = (a.float() - b.float()).abs().max().item()
        assert diff <= max(4 * noise, floor * scale) + 1e-7, (
            f"{name}: differs by {diff:.3e} (noise {noise:.3e}, magnitude {scale:.3e})"
        )


def _grads(model, inputs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    memfit_flux.ADAPTER.loss(model(**inputs)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


# -- torch.compile with Inductor ---------------------------------------------------------------------------------

COMPILE_CONFIGS = {
    "torch": {**ON},
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth"},
    "unsloth-ffn+attn": {
        **ON,
        "gradient_checkpointing_backend": "unsloth-ffn",
        "gradient_checkpointing_offload_attention": True,
    },
}


def _compiled_run(config: dict | None, steps: int = 3):
    """Gradients of each step and Dynamo's graph counters, for a fresh fp32 tiny Flux whose repeated blocks
    are compiled by Inductor (memfit applied first, as the docs say)."""
    from torch._dynamo.utils import counters

    model = TINY.build(dtype=torch.float32, device="cuda")
    inputs = TINY.inputs(model, tokens=256, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    counters.clear()
    handle = memfit.apply(model, config, min_offload_bytes=0) if config else None
    try:
        model.compile_repeated_blocks()  # default backend: Inductor
        graphs, grads = [], []
        # math SDPA: deterministic in fp32, so the only noise left is Inductor's own fusion choices
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            for _ in range(steps):
                grads.append(_grads(model, inputs))
                graphs.append(counters["stats"]["unique_graphs"])
        stats = handle.stats() if handle else {}
        recompiles = dict(counters["recompiles"])
    finally:
        if handle is not None:
            handle.remove()
    return grads, graphs, recompiles, stats


@pytest.fixture(scope="module")
def compiled_reference():
    require_cuda()  # module fixtures run before the autouse one
    grads, graphs, recompiles, _ = _compiled_run(None, steps=2)
    assert not recompiles
    return grads


@pytest.mark.parametrize("name", list(COMPILE_CONFIGS))
def test_inductor_compiled_blocks_same_gradients_no_recompiles(name, compiled_reference):
    reference, again = compiled_reference
    grads, graphs, recompiles, stats = _compiled_run(COMPILE_CONFIGS[name])
    assert graphs[0] > 0
    assert graphs[1] == graphs[2] == graphs[0], f"recompiled on later steps: graphs per step {graphs}"
    assert not recompiles, recompiles
    assert stats["recomputes"] == stats["frames"] - stats["unused"] > 0
    if COMPILE_CONFIGS[name].get("gradient_checkpointing_backend", "torch").startswith("unsloth"):
        assert stats["bytes_offloaded"] > 0
    # Sub-block regions break the compiled block into other graphs, whose fusions reassociate fp32 sums:
    # 1e-5 of the magnitude is ~100 fp32 ulps, and still 1e5 times below a wrong tensor's error.
    for got in grads:
        assert_within_noise(reference, again, got, floor=1e-5)


# -- PEFT LoRA on a frozen bf16 transformer ------------------------------------------------------------------------

LORA_TARGETS = FLUX_LORA_TARGETS
PEFT_CONFIGS = {
    "torch": {**ON},
    "torch-i2-s4": {**ON, "gradient_checkpointing_interval": 2, "gradient_checkpointing_segment_stride": 4},
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    "unsloth": {**ON, "gradient_checkpointing_backend": "unsloth"},
    "unsloth-ffn": {**ON, "gradient_checkpointing_backend": "unsloth-ffn"},
    "attn-offload": {"gradient_checkpointing_offload_attention": True},
    "torch-ffn+attn": {
        **ON,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_offload_attention": True,
    },
}


@pytest.fixture(scope="module")
def lora_model():
    require_cuda()
    peft = pytest.importorskip("peft")
    model = TINY.build(dtype=torch.bfloat16, device="cuda").requires_grad_(False)
    model.add_adapter(
        peft.LoraConfig(r=8, lora_alpha=8, target_modules=LORA_TARGETS, init_lora_weights="gaussian")
    )
    inputs = TINY.inputs(model, tokens=1024, generator=torch.Generator().manual_seed(0))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        reference, again = _grads(model, inputs), _grads(model, inputs)
    assert reference and all("lora" in n for n in reference)
    return model, inputs, reference, again


@pytest.mark.parametrize("name", list(PEFT_CONFIGS))
def test_peft_lora_gradients_equal_the_unmodified_run(name, lora_model):
    model, inputs, reference, again = lora_model
    with memfit.apply(model, PEFT_CONFIGS[name], min_offload_bytes=0) as handle:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            got = _grads(model, inputs)
        stats = handle.stats()
    cfg = memfit.MemfitConfig.from_dict(PEFT_CONFIGS[name])
    if cfg.offload_attention or (cfg.enabled and cfg.backend.offloads_inputs):
        assert stats["bytes_offloaded"] > 0
    if cfg.enabled:
        assert stats["recomputes"] > 0
    # bf16 with flash attention (dQ accumulated with atomics): within 4x the run-to-run noise, or 1% of the
    # magnitude (a few bf16 ulps) where there is none.
    assert_within_noise(reference, again, got, floor=1e-2)
