"""Config validation: every bad value names its key; unknown keys are errors with a suggestion."""

import json
import re

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
    ("gradient_checkpointing_interval", "--2"),
    ("gradient_checkpointing_interval", "²"),
    ("gradient_checkpointing_interval", "٣"),  # an Arabic-Indic three: ASCII digits only
    ("gradient_checkpointing_interval", "2.0"),
    ("gradient_checkpointing_segment_stride", "- 4"),
    ("gradient_checkpointing_segment_stride", 0),
    ("gradient_checkpointing_segment_stride", "four"),
    ("gradient_checkpointing_offload_attention", "sometimes"),
    ("gradient_checkpointing_offload_pin_memory_max_buckets", -1),
    ("gradient_checkpointing_offload_pin_memory_max_buckets", 2.0),
    ("gradient_checkpointing_optimizer_state", -1),
    ("gradient_checkpointing_optimizer_state", "adam"),
    ("gradient_checkpointing_optimizer_state", True),
    ("gradient_checkpointing_optimizer_state", float("nan")),
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
            {
                "gradient_checkpointing": True,
                "gradient_checkpointing_interval": 3,
                "gradient_checkpointing_segment_stride": 2,
            }
        )


def test_integer_strings_of_ascii_digits_are_accepted():
    cfg = MemfitConfig.from_dict(
        {"gradient_checkpointing": True, "gradient_checkpointing_interval": " 2", "segment_stride": "+4"}
    )
    assert cfg.interval == 2 and cfg.segment_stride == 4
    with pytest.raises(ConfigError, match=r"gradient_checkpointing_interval must be an integer >= 1, got -2"):
        MemfitConfig.from_dict({"gradient_checkpointing_interval": "-2"})


@pytest.mark.parametrize(
    ("key", "default"),
    [
        ("gradient_checkpointing_interval", 1),
        ("gradient_checkpointing_segment_stride", None),
        ("gradient_checkpointing_memory_budget", None),
        ("gradient_checkpointing_offload_pin_memory_max_buckets", 12),
        ("gradient_checkpointing_optimizer_state", None),
    ],
)
@pytest.mark.parametrize("enabled", [True, False])
def test_null_means_unset_for_every_optional_key(key, default, enabled):
    cfg = MemfitConfig.from_dict({"gradient_checkpointing": enabled, key: None})
    assert cfg == MemfitConfig(enabled=enabled)
    assert cfg.to_dict().get(key, None) == default


def test_checkpointing_off_accepts_any_well_typed_checkpointing_keys():
    """A trainer config as written: checkpointing off, its other keys left as the trainer's template has them."""
    as_written = {
        "gradient_checkpointing": False,
        "gradient_checkpointing_interval": None,
        "gradient_checkpointing_segment_stride": None,
    }
    assert MemfitConfig.from_dict(as_written) == MemfitConfig()
    relations_unchecked = {
        "gradient_checkpointing": False,
        "gradient_checkpointing_backend": "auto",
        "gradient_checkpointing_interval": 4,
        "gradient_checkpointing_segment_stride": 2,
        "gradient_checkpointing_memory_budget": "20GiB",
    }
    cfg = MemfitConfig.from_dict(relations_unchecked)
    assert not cfg.installs_anything and cfg.interval == 4 and cfg.memory_budget == 20 << 30
    with pytest.raises(ConfigError, match="gradient_checkpointing_interval must be an integer"):
        MemfitConfig.from_dict({"gradient_checkpointing": False, "gradient_checkpointing_interval": "two"})


@pytest.mark.parametrize("backend", ["torch", "torch-ffn", "unsloth", "unsloth-ffn"])
def test_memory_budget_with_a_fixed_backend_is_refused_for_installing(backend):
    data = {
        "gradient_checkpointing": True,
        "gradient_checkpointing_backend": backend,
        "gradient_checkpointing_memory_budget": "20GiB",
    }
    with pytest.raises(ConfigError, match=f"the fixed backend '{backend}' cannot keep it"):
        as_config(data)
    with pytest.raises(ConfigError, match="'torch' cannot keep it"):  # the default backend is a fixed one
        as_config({"gradient_checkpointing": True}, gradient_checkpointing_memory_budget="20GiB")
    # the config value itself carries it (`memfit fit --config` reads a trainer config's budget as its budget)
    assert MemfitConfig.from_dict(data).memory_budget == 20 << 30
    assert as_config({**data, "gradient_checkpointing_backend": "auto"}).memory_budget == 20 << 30


@pytest.mark.parametrize(
    "data",
    [
        {"--gradient_checkpointing": True, "gradient_checkpointing": False},
        {"gradient_checkpointing_interval": 2, "interval": 3},
        {"--gradient_checkpointing_backend": "torch", "backend": "torch-ffn"},
    ],
)
def test_a_key_spelled_twice_with_different_values_is_an_error(data):
    with pytest.raises(ConfigError, match="twice"):
        MemfitConfig.from_dict(data)
    with pytest.raises(ConfigError, match="twice"):
        MemfitConfig.from_dict(data, strict=False)


def test_a_key_spelled_twice_with_the_same_value_is_fine():
    cfg = MemfitConfig.from_dict({"--gradient_checkpointing": True, "gradient_checkpointing": True})
    assert cfg.enabled


def test_keyword_overrides_win_over_the_config_keys():
    cfg = as_config({"gradient_checkpointing": True, "gradient_checkpointing_interval": 2}, interval=3)
    assert cfg.interval == 3
    cfg = as_config({"gradient_checkpointing": True, "interval": 2}, gradient_checkpointing_interval=3)
    assert cfg.interval == 3


def test_unknown_key_suggests_the_close_one():
    with pytest.raises(ConfigError, match="Did you mean 'gradient_checkpointing_interval'"):
        MemfitConfig.from_dict({"gradient_checkpointing_intervall": 2})


def test_non_strict_ignores_foreign_keys_but_not_typos_of_ours():
    cfg = MemfitConfig.from_dict({"learning_rate": 1e-4, "gradient_checkpointing": True}, strict=False)
    assert cfg.enabled
    with pytest.raises(ConfigError, match="Did you mean"):
        MemfitConfig.from_dict({"gradient_checkpointing_backnd": "torch"}, strict=False)


@pytest.mark.parametrize(
    ("typo", "meant"),
    [
        ("gradient_checkpoint_interval", "gradient_checkpointing_interval"),  # breaks the prefix
        ("Gradient_Checkpointing_Interval", "gradient_checkpointing_interval"),  # case
        ("gradient-checkpointing-backend", "gradient_checkpointing_backend"),  # dashes
        ("--Gradient_Checkpointing", "gradient_checkpointing"),
        ("gradiant_checkpointing", "gradient_checkpointing"),
        ("gradient_checkpointin_segment_strid", "gradient_checkpointing_segment_stride"),
    ],
)
@pytest.mark.parametrize("strict", [True, False])
def test_near_misses_of_our_keys_are_errors_with_a_suggestion(typo, meant, strict):
    with pytest.raises(ConfigError, match=f"unknown memfit config key '{typo}'. Did you mean '{meant}'"):
        MemfitConfig.from_dict({typo: 2, "learning_rate": 1e-4}, strict=strict)


def test_foreign_keys_that_only_resemble_ours_are_ignored_when_not_strict():
    """Keys of the trainer configs memfit is pasted into (SimpleTuner, diffusers scripts, musubi-tuner)."""
    foreign = {
        "checkpointing_steps": 500,
        "checkpoints_total_limit": 5,
        "gradient_accumulation_steps": 4,
        "gradient_precision": "fp32",
        "resume_from_checkpoint": "latest",
        "max_grad_norm": 1.0,
        "offload_during_startup": True,
    }
    assert MemfitConfig.from_dict(foreign, strict=False) == MemfitConfig()


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


def test_unreadable_config_paths_are_config_errors_naming_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=re.escape(f"{missing}' does not exist")):
        MemfitConfig.from_file(missing)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path}' is a directory")):
        as_config(str(tmp_path))
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"gradient_checkpointing": true, "note": "café"}'.encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"{latin1}' is not UTF-8")):
        as_config(latin1)


def test_config_must_be_a_mapping():
    with pytest.raises(ConfigError, match="must be a dict"):
        as_config(42)


@pytest.mark.parametrize(
    ("value", "per_byte"), [(None, 2.0), ("AdamW", 2.0), ("adamw8bit", 0.5), ("none", 0.0), (1, 1.0)]
)
def test_optimizer_state_is_a_name_or_bytes_per_trainable_byte(value, per_byte):
    auto = {"gradient_checkpointing": True, "gradient_checkpointing_backend": "auto"}
    cfg = as_config({**auto, "gradient_checkpointing_optimizer_state": value})
    assert cfg.optimizer_state_per_byte == per_byte
    assert MemfitConfig.from_dict(cfg.to_dict()) == cfg  # round trips (unset stays out of the dict)


def test_optimizer_state_with_a_fixed_backend_is_refused_for_installing():
    with pytest.raises(ConfigError, match="gradient_checkpointing_optimizer_state.*'auto'"):
        as_config({"gradient_checkpointing": True, "gradient_checkpointing_optimizer_state": "adamw8bit"})
