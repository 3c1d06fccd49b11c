"""A SimpleTuner-style trainer config file passed to memfit unchanged (strict=False), and the one-line
integration of a diffusers training script (README: "Use from a training script")."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import memfit
from memfit import ConfigError

memfit_flux = pytest.importorskip("memfit_flux")
TINY = memfit_flux.ADAPTER.presets["tiny"]

MEMFIT_KEYS = {
    "gradient_checkpointing": True,
    "gradient_checkpointing_backend": "torch-ffn",
    "gradient_checkpointing_interval": 2,
    "gradient_checkpointing_segment_stride": 4,
    "gradient_checkpointing_offload_attention": False,
    "gradient_checkpointing_offload_pin_memory_max_buckets": 12,
}
TRAINER_KEYS = {
    "model_type": "lora",
    "model_family": "flux",
    "pretrained_model_name_or_path": "black-forest-labs/FLUX.1-dev",
    "output_dir": "output/models",
    "data_backend_config": "config/multidatabackend.json",
    "resume_from_checkpoint": "latest",
    "checkpointing_steps": 500,
    "checkpoints_total_limit": 5,
    "lora_rank": 16,
    "lora_alpha": 16,
    "lora_type": "standard",
    "flux_lora_target": "all",
    "learning_rate": 1e-4,
    "lr_scheduler": "constant_with_warmup",
    "lr_warmup_steps": 100,
    "optimizer": "adamw_bf16",
    "max_train_steps": 3000,
    "num_train_epochs": 0,
    "train_batch_size": 1,
    "gradient_accumulation_steps": 4,
    "mixed_precision": "bf16",
    "base_model_precision": "int8-quanto",
    "seed": 42,
    "resolution": 1024,
    "resolution_type": "pixel_area",
    "validation_steps": 250,
    "validation_prompt": "a photo of a cat",
    "validation_guidance": 3.5,
    "validation_num_inference_steps": 20,
    "report_to": "wandb",
    "tracker_project_name": "flux-lora",
    "push_to_hub": False,
    "disable_benchmark": False,
    "caption_dropout_probability": 0.05,
    "flow_schedule_shift": 3.0,
    "use_ema": False,
}


@pytest.fixture
def config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**TRAINER_KEYS, **MEMFIT_KEYS}, indent=2))
    return path


def test_file_accepted_unchanged_with_strict_false(config_file):
    cfg = memfit.MemfitConfig.from_file(config_file, strict=False)
    assert cfg.to_dict() == MEMFIT_KEYS


def test_unknown_keys_rejected_by_default(config_file):
    with pytest.raises(ConfigError, match="unknown memfit config key 'model_type'"):
        memfit.apply(TINY.build(), str(config_file))
    with pytest.raises(ConfigError, match="unknown memfit config key"):
        memfit.apply(TINY.build(), {**TRAINER_KEYS, **MEMFIT_KEYS})


def test_typo_in_a_memfit_key_is_still_an_error(config_file):
    data = {**TRAINER_KEYS, **MEMFIT_KEYS, "gradient_checkpointing_intervall": 3}
    with pytest.raises(ConfigError, match="Did you mean 'gradient_checkpointing_interval'"):
        memfit.MemfitConfig.from_dict(data, strict=False)


def test_cli_flag_style_keys(tmp_path):
    """Older SimpleTuner configs spell every key as its command-line flag ("--gradient_checkpointing")."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({f"--{k}": v for k, v in {**TRAINER_KEYS, **MEMFIT_KEYS}.items()}))
    assert memfit.MemfitConfig.from_file(path, strict=False).to_dict() == MEMFIT_KEYS


@pytest.mark.parametrize("form", ["file", "dict"])
def test_training_script_one_liner(form, config_file):
    """The README's integration: after the frozen base + LoRA setup, one line; the step trains as before."""
    peft = pytest.importorskip("peft")
    args = argparse.Namespace(
        memfit_config=str(config_file) if form == "file" else json.loads(config_file.read_text())
    )

    def setup():
        transformer = TINY.build()
        transformer.requires_grad_(False)
        transformer.add_adapter(
            peft.LoraConfig(
                r=4,
                lora_alpha=4,
                init_lora_weights="gaussian",
                target_modules=["to_q", "to_k", "to_v", "proj_mlp", "ff.net.2"],
            )
        )
        return transformer

    def train_step(transformer):
        inputs = TINY.inputs(transformer, tokens=64, generator=torch.Generator().manual_seed(0))
        transformer(**inputs)[0].pow(2).mean().backward()
        return {n: p.grad for n, p in transformer.named_parameters() if p.requires_grad}

    reference = train_step(setup())
    transformer = setup()
    handle = memfit.apply(transformer, args.memfit_config, strict=False)  # the one line
    got = train_step(transformer)
    assert handle.config.to_dict() == MEMFIT_KEYS
    assert handle.stats()["recomputes"] > 0
    assert all(torch.equal(got[n], reference[n]) for n in reference)
