"""PEFT LoRA on a frozen diffusers transformer (the common case): LoRA gradients equal the unmodified run.

Bitwise on CPU fp32 for every backend. Adapters added or unloaded after ``memfit.apply`` replace the
targeted ``nn.Linear`` modules (PEFT wraps the original as ``base_layer``; ``unload_lora`` puts it back);
the FFN hooks follow the modules, so the saving is the same as applying memfit after the LoRA setup.
"""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit_conformance.base import cpu_copy_engine

from helpers import FLUX_LORA_TARGETS

peft = pytest.importorskip("peft")
memfit_flux = pytest.importorskip("memfit_flux")

TINY = memfit_flux.ADAPTER.presets["tiny"]
TARGETS = FLUX_LORA_TARGETS
ON = {"gradient_checkpointing": True}
CONFIGS = {
    "torch-i1": {**ON},
    "torch-i2": {**ON, "gradient_checkpointing_interval": 2},
    "torch-i2-s4": {**ON, "gradient_checkpointing_interval": 2, "gradient_checkpointing_segment_stride": 4},
    "torch-ffn-i1": {**ON, "gradient_checkpointing_backend": "torch-ffn"},
    "torch-ffn-i2": {
        **ON,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_interval": 2,
    },
    "torch-ffn-i1-s2": {
        **ON,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_segment_stride": 2,
    },
    "unsloth-i1": {**ON, "gradient_checkpointing_backend": "unsloth"},
    "unsloth-i2-s4": {
        **ON,
        "gradient_checkpointing_backend": "unsloth",
        "gradient_checkpointing_interval": 2,
        "gradient_checkpointing_segment_stride": 4,
    },
    "unsloth-ffn": {**ON, "gradient_checkpointing_backend": "unsloth-ffn"},
    "attn-offload-only": {"gradient_checkpointing_offload_attention": True},
    "torch-ffn+attn": {
        **ON,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_offload_attention": True,
    },
}


def lora_config():
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights="gaussian")


def frozen(lora: bool = True, *, inject: bool = False):
    model = TINY.build()
    model.requires_grad_(False)
    if lora:
        if inject:  # peft's own entry point instead of diffusers' add_adapter
            peft.inject_adapter_in_model(lora_config(), model)
        else:
            model.add_adapter(lora_config())
    return model


def apply(model, config):
    cfg = memfit.MemfitConfig.from_dict(config)
    if cfg.offload_attention or (cfg.enabled and cfg.backend.offloads_inputs):
        return memfit.apply(model, config, copy_engine=cpu_copy_engine(), min_offload_bytes=0)
    return memfit.apply(model, config)


def lora_grads(model, *, only_lora: bool = True) -> dict[str, torch.Tensor]:
    inputs = TINY.inputs(model, tokens=64, generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    out = model(**inputs)[0]
    out.float().pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and (not only_lora or all("lora_" in n for n in grads)), "only the LoRA weights train"
    return grads


def assert_bitwise(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert got.keys() == ref.keys()
    bad = [n for n in ref if not torch.equal(got[n], ref[n])]
    assert not bad, f"LoRA gradients differ from the run without memfit: {bad[:5]}"


@pytest.fixture(scope="module")
def reference():
    return lora_grads(frozen())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_lora_gradients_bitwise(name, reference):
    model = frozen()
    with apply(model, CONFIGS[name]) as handle:
        assert_bitwise(lora_grads(model), reference)
        stats = handle.stats()
    if CONFIGS[name].get("gradient_checkpointing"):
        assert stats["recomputes"] > 0 and stats["recomputes"] == stats["frames"] - stats["unused"]
    strided = "gradient_checkpointing_segment_stride" in CONFIGS[name]
    if "offload" in name or "attn" in name or ("unsloth" in name and (stats["frames"] > 2 or strided)):
        # (the step's last two regions keep their entries: two regions or fewer park nothing; the blocks a
        # stride leaves out are regions of the step too)
        assert stats["bytes_offloaded"] > 0
    elif "unsloth" in name:
        assert stats["bytes_offloaded"] == 0


def test_inject_adapter_in_model(reference):
    model = frozen(inject=True)
    with apply(model, CONFIGS["torch-ffn-i1"]):
        assert_bitwise(lora_grads(model), reference)


def _saving(model, config) -> dict:
    with apply(model, config) as handle:
        lora_grads(model, only_lora=False)
        stats = handle.stats()
    return {k: stats[k] for k in ("frames", "calls", "entries", "entry_bytes", "saved_tensors_replaced")}


@pytest.mark.parametrize("name", ["torch-i1", "torch-ffn-i1", "unsloth-ffn", "torch-ffn+attn"])
def test_adapter_added_after_apply(name, reference):
    """add_adapter after apply: the LoRA wrappers of proj_mlp / ff.net.* are hooked, not their base layers."""
    expected = _saving(frozen(), CONFIGS[name])
    model = frozen(lora=False)
    handle = apply(model, CONFIGS[name])
    model.add_adapter(lora_config())
    handle.reset_stats()
    assert_bitwise(lora_grads(model), reference)
    stats = handle.stats()
    handle.remove()
    got = {k: stats[k] for k in expected}
    # Hooks left on the base layers would still give the right gradients but keep the LoRA branch
    # outside the region, so act_mlp's input would become an entry: more entries, fewer tensors replaced.
    assert got == expected


def test_adapter_unloaded_and_deleted_after_apply():
    cfg = CONFIGS["torch-ffn-i1"]
    expected_plain = _saving(frozen(lora=False).requires_grad_(True), cfg)
    model = frozen()
    handle = apply(model, cfg)
    lora_grads(model)
    model.delete_adapters("default")  # the wrappers stay, without adapters
    model.unload_lora()  # the wrappers are replaced by the original linears
    assert type(model.single_transformer_blocks[0].proj_mlp) is torch.nn.Linear
    handle.reset_stats()
    lora_grads(model.requires_grad_(True), only_lora=False)
    stats = handle.stats()
    handle.remove()
    assert {k: stats[k] for k in expected_plain} == expected_plain
    assert (
        handle.stats()["ffn_resyncs"] == 1
    )  # LoRA was added before apply; unload_lora replaced modules once
    # remove() took every hook and eager-forward wrapper off, from current and replaced modules alike
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks
        assert "forward" not in m.__dict__


def test_the_ffn_sites_are_located_again_only_after_a_module_was_registered():
    """Each forward checks whether PEFT replaced modules since the last one; while no module, parameter or buffer
    was registered anywhere, the adapter's FFN chains are not walked again (that walk ran at every forward's
    start, before any kernel was queued). An adapter added later is still found at the next forward."""
    model = frozen(lora=False)
    handle = apply(model, CONFIGS["torch-ffn-i1"])
    engine = handle._controller.installation.engine
    located = []
    locate = engine._locate
    engine._locate = lambda: located.append(1) or locate()
    for _ in range(3):
        lora_grads(model.requires_grad_(True), only_lora=False)
    assert located == []
    model.add_adapter(lora_config())
    lora_grads(model)
    assert located == [1] and handle.stats()["ffn_resyncs"] == 1
    lora_grads(model)
    assert located == [1]
    handle.remove()


@pytest.mark.parametrize("config", ["torch-ffn-i1", "unsloth-ffn"])
def test_a_large_state_makes_every_recompute_stop_after_its_last_needed_tensor(
    config, reference, monkeypatch
):
    """The FFN regions' inputs differ in size (a double block's text FFN takes fewer tokens than its image FFN).
    Once a state of ``CUT_TAIL_STATE`` elements entered a region of the forward (the GPU, not the host, is then the
    step's bottleneck), every recompute stops after its last needed tensor, the small regions' too, as
    ``torch.utils.checkpoint``'s early stop does; with none that large, a small call replays to its end (its LoRA's
    last factor is cheaper than the cut on a host-bound step). Gradients bitwise either way."""
    from memfit.engine import frame

    model = frozen()
    handle = apply(model, CONFIGS[config])
    entering: list[int] = []

    def largest(module, args, kwargs) -> None:
        entering.append(max(t.numel() for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)))

    sites = handle._controller.installation.engine.hook_sites
    hooks = [
        m.register_forward_pre_hook(largest, with_kwargs=True)
        for m, site in sites.items()
        if site.modules[0] is m
    ]
    lora_grads(model)
    for h in hooks:
        h.remove()
    handle.remove()
    assert min(entering) < max(entering)
    for limit, all_cut in ((max(entering), True), (max(entering) + 1, False)):
        monkeypatch.setattr(frame, "CUT_TAIL_STATE", limit)
        handle = apply(model, CONFIGS[config])
        lora_grads(model)
        handle.reset_stats()
        assert_bitwise(lora_grads(model), reference)
        stats = handle.stats()
        handle.remove()
        recomputes, cut = stats["recomputes"], stats["calls_cut_early_stop"]
        assert recomputes > 0 and stats["frames_by_scope"] == {"ffn": stats["frames"]}
        assert cut == recomputes if all_cut else cut < recomputes
