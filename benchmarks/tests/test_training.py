"""The training configs: where LoRA goes, what trains, and that undo() leaves the model as it was."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfit
from memfit import BlockSpec
from memfit_benchmarks.synthetic import SYNTHETIC, build, inputs
from memfit_benchmarks.training import TrainingConfig, lora_targets, parse_configs, prepare

pytest.importorskip("peft")


def _model():
    model = build(dim=32, depth=2, dtype=torch.float32, device="cpu")
    return model, inputs(model, tokens=8, generator=torch.Generator().manual_seed(0))


def _state(model):
    return (
        [(n, type(m).__name__) for n, m in model.named_modules()],
        {n: (p.requires_grad, p.grad) for n, p in model.named_parameters()},
        sorted(model.__dict__),
    )


def test_lora_targets_every_block_linear_or_the_attention_regions_only():
    model, _ = _model()
    per_block = ["attn.to_qkv", "attn.to_out", "ff.proj_in", "ff.proj_out", "modulation"]
    assert lora_targets(model, SYNTHETIC) == [f"blocks.{i}.{n}" for i in range(2) for n in per_block]
    assert lora_targets(model, SYNTHETIC, attention_only=True) == [
        f"blocks.{i}.attn.{n}" for i in range(2) for n in ("to_qkv", "to_out")
    ]
    no_attention = dataclasses.replace(SYNTHETIC, blocks={"SynthBlock": BlockSpec(ffn=(("ff",),))})
    with pytest.raises(ValueError, match="no nn.Linear inside the declared attention regions"):
        lora_targets(model, no_attention, attention_only=True)


def test_flux_attention_only_lora_stays_inside_attn():
    pytest.importorskip("memfit_flux")
    adapter = memfit.get_adapter("flux")
    model = adapter.presets["tiny"].build(dtype=torch.float32, device="cpu")
    attention = lora_targets(model, adapter, attention_only=True)
    assert attention and all(".attn." in t for t in attention)
    assert {t.rsplit(".attn.", 1)[1] for t in attention} >= {"to_q", "to_k", "to_v", "to_out.0"}
    assert set(attention) < set(lora_targets(model, adapter))


@pytest.mark.parametrize("config", list(TrainingConfig))
def test_prepare_then_undo_leaves_model_and_batch_as_they_were(config):
    model, batch = _model()
    before = _state(model)
    training = prepare(model, batch, config, SYNTHETIC, dtype=torch.float32)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if config in (TrainingConfig.LORA_ALL, TrainingConfig.LORA_ATTENTION):
        assert trainable and all("lora_" in n for n in trainable)
        assert len(training.lora_targets) == (10 if config is TrainingConfig.LORA_ALL else 4)
    elif config is TrainingConfig.FROZEN:
        assert not trainable and batch["hidden_states"].requires_grad
    else:
        assert (
            trainable == {n for n, _ in model.named_parameters()} and training.optimizer_factory is not None
        )
    assert training.info()["config"] == config.value and training.trainable_params == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    SYNTHETIC.loss(model(**batch)).backward()
    training.undo()
    assert _state(model) == before
    assert not batch["hidden_states"].requires_grad and batch["hidden_states"].grad is None
    prepare(model, batch, config, SYNTHETIC, dtype=torch.float32).undo()  # and again, on the same model
    assert _state(model) == before


def test_frozen_reaches_a_nested_latent_input():
    pytest.importorskip("memfit_z_image")
    adapter = memfit.get_adapter("z-image")
    preset = adapter.presets["tiny"]
    model = preset.build(dtype=torch.float32, device="cpu")
    batch = preset.inputs(
        model, tokens=preset.default_tokens, batch=1, generator=torch.Generator().manual_seed(0)
    )
    training = prepare(model, batch, TrainingConfig.FROZEN, adapter, dtype=torch.float32)
    latents = [t for group in batch["x"] for t in group]
    assert latents and all(t.requires_grad for t in latents)
    training.undo()
    assert not any(t.requires_grad for t in latents)


def test_configs_parse_and_unknown_ones_are_named():
    assert parse_configs("all") == list(TrainingConfig)
    assert parse_configs("lora-attn, full") == [TrainingConfig.LORA_ATTENTION, TrainingConfig.FULL]
    with pytest.raises(ValueError, match=r"unknown training config\(s\) \['lora'\]: choose from"):
        parse_configs("lora")


def test_attention_only_lora_on_flux_is_the_common_recipe():
    """On Flux the attention-only config targets the image stream's to_q, to_k, to_v, to_out.0 (the text
    stream's add_* projections stay frozen), as diffusers' Flux LoRA scripts do."""
    flux = pytest.importorskip("memfit_flux").ADAPTER
    model = flux.presets["tiny"].build()
    targets = lora_targets(model, flux, attention_only=True)
    assert targets and all(t.endswith(("to_q", "to_k", "to_v", "to_out.0")) for t in targets)
    assert {t.rsplit(".", 1)[-1] for t in targets} >= {"to_q", "to_k", "to_v", "0"}
