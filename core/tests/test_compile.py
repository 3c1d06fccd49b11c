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
    "unsloth-ffn+attn": {
        **ON,
        "gradient_checkpointing_backend": "unsloth-ffn",
        "gradient_checkpointing_offload_attention": True,
    },
}


def grads(model) -> dict[str, torch.Tensor]:
    inputs = TINY.inputs(model, tokens=64, generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    out = model(**inputs)[0]
    out.float().pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


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


class _Block(torch.nn.Module):
    def __init__(self, *, call_forward: bool = False) -> None:
        super().__init__()
        self.ff = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.call_forward = call_forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (self.ff.forward(x) if self.call_forward else self.ff(x))


class _Stack(torch.nn.Module):
    def __init__(self, *, call_forward: bool = False) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(call_forward=call_forward) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


STACK = memfit.FamilyAdapter(
    name="hooked-stack",
    model_classes=("_Stack",),
    block_lists=("blocks",),
    blocks={"_Block": memfit.BlockSpec(ffn=(("ff",),))},
)
TORCH_FFN = {**ON, "gradient_checkpointing_backend": "torch-ffn"}


def test_ffn_regions_whose_hooks_never_run_are_an_error():
    """A block that calls its FFN as ``self.ff.forward(x)`` skips the FFN's hooks: without the check, torch-ffn
    would checkpoint nothing and say nothing."""
    model, x = _Stack(call_forward=True), torch.randn(2, 8, 16)
    with memfit.apply(model, TORCH_FFN, adapter=STACK) as handle:
        with pytest.raises(memfit.MemfitError, match=r"hooks on 3 sub-block region modules did not run"):
            model(x).sum().backward()
        assert handle.stats()["recomputes"] == 0
    model = _Stack()
    with memfit.apply(model, TORCH_FFN, adapter=STACK) as handle:
        model(x).sum().backward()
        assert handle.stats()["recomputes"] == 3


def test_ffn_hooks_added_after_a_compiled_forward_run():
    """Each block compiled and run before memfit: here the FFN regions do run (attention hooks, below, do not),
    so the check of the test above does not fire where the hooks work."""
    from torch._dynamo.utils import counters

    model, x = _Stack(), torch.randn(2, 8, 16)
    torch._dynamo.reset()
    counters.clear()
    for block in model.blocks:
        block.compile(backend="aot_eager")
    model(x).sum().backward()
    assert counters["stats"]["unique_graphs"] > 0
    with memfit.apply(model, TORCH_FFN, adapter=STACK) as handle:
        model(x).sum().backward()
        assert handle.stats()["recomputes"] == 3


def test_attention_hooks_added_after_a_compiled_forward_are_an_error_until_dynamo_is_reset():
    """The same for attention offload on Flux's repeated blocks (``compile_repeated_blocks``)."""
    model = TINY.build()
    torch._dynamo.reset()
    model.compile_repeated_blocks(backend="aot_eager")
    grads(model)  # compiled and run without memfit
    config = {"gradient_checkpointing_offload_attention": True}
    with memfit.apply(model, config, copy_engine=cpu_copy_engine(), min_offload_bytes=0) as handle:
        with pytest.raises(memfit.MemfitError, match=r"hooks on \d+ attention modules did not run.*reset"):
            grads(model)
        torch._dynamo.reset()
        grads(model)
        assert handle.stats()["attention_tensors_parked"] > 0


def test_a_forward_without_grad_is_not_checked():
    """Under ``no_grad`` no region opens, so hooks that do not run there are no sign of a stale compiled block."""
    model, x = _Stack(call_forward=True), torch.randn(2, 8, 16)
    with memfit.apply(model, TORCH_FFN, adapter=STACK) as handle:
        with torch.no_grad():
            model(x)
        assert handle.stats()["recomputes"] == 0


def compiled_auto_steps(model, reference: dict[str, torch.Tensor]) -> dict:
    """``auto`` (a forced plan) on ``model`` with its repeated blocks compiled (aot_eager): three steps, each with
    ``reference``'s gradients (the tolerance: see the first test) and no graph compiled after the first; the
    handle's stats."""
    from torch._dynamo.utils import counters

    config = {**ON, "gradient_checkpointing_backend": "auto", "gradient_checkpointing_memory_budget": "1GiB"}
    torch._dynamo.reset()
    counters.clear()
    with memfit.apply(model, config, copy_engine=cpu_copy_engine(), min_offload_bytes=0) as handle:
        model.compile_repeated_blocks(backend="aot_eager")
        compiled: list[int] = []
        for _ in range(3):
            got = grads(model)
            compiled.append(counters["stats"]["unique_graphs"])
            assert got.keys() == reference.keys()
            for n, ref in reference.items():
                torch.testing.assert_close(got[n], ref, rtol=1e-6, atol=1e-7, msg=n)
        stats = handle.stats()
    assert compiled[0] > 0 and compiled[1] == compiled[2] == compiled[0], compiled
    assert not counters["recompiles"], dict(counters["recompiles"])
    return stats


def test_compiled_blocks_parked_whole_same_gradients_no_recompiles(monkeypatch, eager_reference):
    """``BlockPolicy.PARK`` wraps the compiled block call as whole-block regions do: the compiled block packs
    every tensor it saves through the parking hooks."""
    from memfit.auto import BlockPolicy

    from helpers import force_auto_plan

    force_auto_plan(monkeypatch, lambda names: [BlockPolicy.PARK] * len(names))
    stats = compiled_auto_steps(TINY.build(), eager_reference)
    assert stats["recomputes"] == 0 and stats["bytes_offloaded"] > 0


def test_compiled_streamed_blocks_taking_every_policy_same_gradients_no_recompiles(monkeypatch):
    """Streamed blocks not recomputed whole save references to their weights through saved-tensor hooks around
    the compiled block call, as parked blocks do; the layers a recompute calls are pointed at the upload by hooks
    outside the compiled graph. Frozen base, the attention's q/k norms train (a LoRA stand-in)."""
    from helpers import every_streamed_policy, force_auto_plan

    def frozen_model():
        model = TINY.build().requires_grad_(False)
        for name, p in model.named_parameters():
            p.requires_grad_(".norm_q." in name or ".norm_k." in name)
        return model

    reference = grads(frozen_model())
    force_auto_plan(monkeypatch, every_streamed_policy, lambda names: names)
    stats = compiled_auto_steps(frozen_model(), reference)
    assert stats["streamed_blocks"] == 7 and stats["weight_held_after_forward"] == 0
