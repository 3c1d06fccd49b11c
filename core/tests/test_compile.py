"""Regional torch.compile (diffusers' ``compile_repeated_blocks``) with memfit: same gradients, no recompiles.

The ``aot_eager`` backend runs Dynamo and AOTAutograd (where saved-tensor hooks, guards and graph
breaks are decided) without Inductor's C++ code generation, which takes minutes on a 2-core CPU.
Whole-block regions wrap the compiled block call (the block's compiled function packs its saved tensors
through memfit's hooks; the recompute calls the same compiled block). Sub-block regions (FFN chains,
attention offload) run eagerly inside the compiled block: memfit's hooks are graph breaks, never traced.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit_conformance.base import cpu_copy_engine

memfit_flux = pytest.importorskip("memfit_flux")
TINY = memfit_flux.ADAPTER.presets["tiny"]


def _compile_supported() -> bool:
    try:
        torch.compile(lambda x: x + 1, backend="aot_eager")(torch.ones(2))
    except Exception:  # platform without a working torch.compile (e.g. unsupported Python)
        return False
    return True


pytestmark = pytest.mark.skipif(not _compile_supported(), reason="torch.compile is not supported here")

ON = {"gradient_checkpointing": True}
CONFIGS = {
    "torch-i2": {**ON, "gradient_checkpointing_interval": 2},
    "torch-ffn": {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    "unsloth-ffn+attn": {**ON, "gradient_checkpointing_backend": "unsloth-ffn",
                         "gradient_checkpointing_offload_attention": True},
}


def grads(model) -> dict[str, torch.Tensor]:
    inputs = TINY.inputs(model, tokens=64, generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    out = model(**inputs)[0]
    out.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.fixture(scope="module")
def eager_reference():
    return grads(TINY.build())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_compiled_blocks_same_gradients_no_recompiles(name, eager_reference):
    from torch._dynamo.utils import counters

    config = CONFIGS[name]
    model = TINY.build()
    cfg = memfit.MemfitConfig.from_dict(config)
    offload = cfg.offload_attention or cfg.backend.offloads_inputs
    kw = {"copy_engine": cpu_copy_engine(), "min_offload_bytes": 0} if offload else {}
    torch._dynamo.reset()
    counters.clear()
    with memfit.apply(model, config, **kw) as handle:
        model.compile_repeated_blocks(backend="aot_eager")
        compiled: list[int] = []
        for _ in range(3):
            got = grads(model)
            compiled.append(counters["stats"]["unique_graphs"])
            # Compiled graphs decompose ops (reassociated fp32 sums): measured max |diff| ~4e-9 against
            # eager, with or without memfit. 1e-6 relative / 1e-7 absolute leaves 25x room and still
            # catches any wrong saved tensor (those give O(1) errors or shape failures).
            for n, ref in eager_reference.items():
                torch.testing.assert_close(got[n], ref, rtol=1e-6, atol=1e-7, msg=n)
        stats = handle.stats()
    assert compiled[0] > 0
    assert compiled[1] == compiled[2] == compiled[0], f"recompiled on later steps: graphs per step {compiled}"
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert stats["recomputes"] == stats["frames"] - stats["unused"] > 0
    if offload:
        assert stats["bytes_offloaded"] > 0
