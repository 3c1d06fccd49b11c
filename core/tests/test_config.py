"""Config validation: every bad value names its key; unknown keys are errors with a suggestion."""

import json

import pytest

from memfit import Backend, ConfigError, MemfitConfig
from memfit.config import as_config

BAD_VALUES = [
    ("gradient_checkpointing", "yes"),
    ("gradient_checkpointing", 1),
    ("gradient_checkpointing_backend", "torchffn"),
    ("gradient_checkpointing_backend", None),
    ("gradient_checkpointing_interval", 0),
    ("gradient_checkpointing_interval", -2),
    ("gradient_checkpointing_interval", 1.5),
    ("gradient_checkpointing_interval", True),
    ("gradient_checkpointing_segment_stride", 0),
    ("gradient_checkpointing_segment_stride", "four"),
    ("gradient_checkpointing_offload_attention", "sometimes"),
    ("gradient_checkpointing_offload_pin_memory_max_buckets", -1),
    ("gradient_checkpointing_offload_pin_memory_max_buckets", 2.0),
]


@pytest.mark.parametrize(("key", "value"), BAD_VALUES)
def test_bad_value_names_the_key(key, value):
    with pytest.raises(ConfigError, match=key):
        MemfitConfig.from_dict({"gradient_checkpointing": True, key: value})


def test_config_error_is_a_value_error():
    with pytest.raises(ValueError):
        MemfitConfig.from_dict({"gradient_checkpointing_interval": 0})


def test_unknown_backend_lists_allowed_values():
    with pytest.raises(ConfigError, match="torch, torch-ffn, unsloth, unsloth-ffn"):
        MemfitConfig.from_dict({"gradient_checkpointing_backend": "deepspeed"})


def test_stride_below_interval_is_an_error():
    with pytest.raises(ConfigError, match="gradient_checkpointing_segment_stride=2 is smaller than"):
        MemfitConfig.from_dict(
            {"gradient_checkpointing_interval": 3, "gradient_checkpointing_segment_stride": 2}
        )


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="Did you mean 'gradient_checkpointing_interval'"):
        MemfitConfig.from_dict({"gradient_checkpointing_intervall": 2})


def test_non_strict_ignores_foreign_keys_but_not_typos_of_ours():
    cfg = MemfitConfig.from_dict({"learning_rate": 1e-4, "gradient_checkpointing": True}, strict=False)
    assert cfg.enabled
    with pytest.raises(ConfigError, match="Did you mean"):
        MemfitConfig.from_dict({"gradient_checkpointing_backnd": "torch"}, strict=False)


def test_spec_example_round_trips(tmp_path):
    spec_example = {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": "torch-ffn",
        "gradient_checkpointing_interval": 2,
        "gradient_checkpointing_segment_stride": 4,
        "gradient_checkpointing_offload_attention": False,
        "gradient_checkpointing_offload_pin_memory_max_buckets": 12,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(spec_example))
    cfg = MemfitConfig.from_file(path)
    assert cfg.backend is Backend.TORCH_FFN and cfg.interval == 2 and cfg.stride == 4
    assert cfg.to_dict() == spec_example
    assert as_config(str(path)) == cfg


def test_defaults_and_keyword_overrides():
    cfg = as_config(None, gradient_checkpointing=True)
    assert cfg.enabled and cfg.backend is Backend.TORCH and cfg.interval == 1 and cfg.segment_stride is None
    assert cfg.offload_pin_memory_max_buckets == 12
    assert as_config({"gradient_checkpointing": True}, interval=3).interval == 3


def test_invalid_json_file_is_a_config_error(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MemfitConfig.from_file(path)


def test_config_must_be_a_mapping():
    with pytest.raises(ConfigError, match="must be a dict"):
        as_config(42)
