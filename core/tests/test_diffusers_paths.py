"""Real diffusers models: controlnet residuals inside interval chunks, and the generic path (no adapter)."""

from __future__ import annotations

import pytest
import torch

import memfit
from memfit import MemfitWarning, UnsupportedBoundaryError

pytest.importorskip("diffusers")
memfit_flux = pytest.importorskip("memfit_flux")

ON = {"gradient_checkpointing": True}


def _step(model, inputs, **extra):
    model.zero_grad(set_to_none=True)
    hs = inputs["hidden_states"].detach().clone().requires_grad_(True)
    out = model(**{**inputs, "hidden_states": hs}, **extra)[0]
    loss = out.float().pow(2).mean()
    loss.backward()
    return (
        loss.detach(),
        hs.grad.clone(),
        {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
    )


def _same(a, b):
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


def test_flux_controlnet_residuals_with_interval_2():
    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build()
    inputs = preset.inputs(model, tokens=16, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    width = model.config.num_attention_heads * model.config.attention_head_dim
    double = [torch.randn(1, 16, width, generator=g).requires_grad_(True) for _ in range(3)]
    single = [torch.randn(1, 16, width, generator=g).requires_grad_(True) for _ in range(2)]
    extra = {"controlnet_block_samples": double, "controlnet_single_block_samples": single}
    ref = _step(model, inputs, **extra)
    ref_cn = [t.grad.clone() for t in double + single]
    for t in double + single:
        t.grad = None
    with memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2}) as handle:
        got = _step(model, inputs, **extra)
        stats = handle.stats()
    _same(ref, got)
    assert all(torch.equal(a, t.grad) for a, t in zip(ref_cn, double + single, strict=True))
    assert stats["frames"] == stats["recomputes"] == 2 + 2  # 3 double blocks -> 2 chunks, 4 single -> 2


def _tiny_sd3():
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(0)
    model = SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=8,
        out_channels=4,
    )
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=g),
        "encoder_hidden_states": torch.randn(1, 5, 16, generator=g),
        "pooled_projections": torch.randn(1, 8, generator=g),
        "timestep": torch.tensor([10.0]),
        "return_dict": False,
    }
    return model, inputs


def test_sd3_without_adapter_uses_the_generic_diffusers_path():
    model, inputs = _tiny_sd3()
    assert memfit.find_adapter(model) is None
    ref = _step(model, inputs)
    with memfit.apply(model, ON) as handle:
        got = _step(model, inputs)
        stats = handle.stats()
        assert "generic diffusers path" in handle.describe()
    _same(ref, got)
    assert stats["frames"] == stats["recomputes"] == 3
    assert not model.is_gradient_checkpointing  # remove() restored diffusers' own flags


def test_sd3_ffn_scope_is_refused_explicitly():
    model, _ = _tiny_sd3()
    with pytest.raises(UnsupportedBoundaryError, match="SD3Transformer2DModel has no memfit adapter"):
        memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"})


def test_sd3_interval_warns_and_is_ignored():
    model, inputs = _tiny_sd3()
    with pytest.warns(MemfitWarning, match="does not support interval"):
        handle = memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2})
    with handle:
        _step(model, inputs)
        assert handle.stats()["frames"] == 3


def test_sd3_stride_skips_blocks_on_the_generic_path():
    model, inputs = _tiny_sd3()
    ref = _step(model, inputs)
    with memfit.apply(model, {**ON, "gradient_checkpointing_segment_stride": 2}) as handle:
        got = _step(model, inputs)
        assert handle.stats()["frames"] == 2  # blocks 0 and 2
    _same(ref, got)


def test_user_gradient_checkpointing_state_is_restored():
    model, _ = _tiny_sd3()
    model.enable_gradient_checkpointing()
    func = model.transformer_blocks[0].__dict__.get("_gradient_checkpointing_func")
    memfit.apply(model, ON).remove()
    assert model.is_gradient_checkpointing
    assert model.transformer_blocks[0].__dict__.get("_gradient_checkpointing_func") is func


def test_models_own_checkpointing_is_switched_off_while_ffn_regions_are_hooked():
    from memfit import MemfitWarning

    preset = memfit_flux.ADAPTER.presets["tiny"]
    model = preset.build()
    inputs = preset.inputs(model, tokens=16, generator=torch.Generator().manual_seed(0))
    ref = _step(model, inputs)
    model.enable_gradient_checkpointing()  # diffusers' own, torch.utils.checkpoint underneath
    with pytest.warns(MemfitWarning, match="own gradient checkpointing switched on") as record:
        handle = memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"})
    assert len(record) == 1
    with handle:
        assert not model.is_gradient_checkpointing
        _same(ref, _step(model, inputs))
        assert handle.stats()["frames"] > 0
    assert model.is_gradient_checkpointing  # restored by remove()
