"""A checkpointing switch of the model's own (Mage-Flow's ``checkpoint``), declared by its adapter: switched off
while memfit's regions are entered through hooks (one warning), restored exactly by ``remove()``."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from diffusers.configuration_utils import FrozenDict

import memfit
from memfit import BlockSpec, CheckpointSwitch, FamilyAdapter, MemfitWarning

from helpers import assert_same, step
from toy import ToyBlock, ToyModel

ON = {"gradient_checkpointing": True}
SWITCH = CheckpointSwitch(attribute="checkpoint", config_key="checkpoint")


class _Config:
    def __init__(self, checkpoint: bool) -> None:
        self.checkpoint = checkpoint


class ScaledOutputBlock(ToyBlock):
    """A block whose last op saves its input (as Mage-Flow's blocks do after their MLPs): torch's own recompute of
    it re-runs the FFN, and with it memfit's FFN hooks, if the model's checkpointing is left on."""

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return super().forward(x, scale) * scale


class OwnSwitchModel(ToyModel):
    """A stack that checkpoints its blocks itself when ``checkpoint`` is on, as upstream Mage-Flow does: straight
    through ``torch.utils.checkpoint`` (no diffusers hook), only in training mode."""

    def __init__(self, *, checkpoint: bool = False, frozen_config: bool = False, **kw) -> None:
        super().__init__(**kw)
        dim = self.proj_in.in_features
        self.blocks = torch.nn.ModuleList(ScaledOutputBlock(dim) for _ in self.blocks)
        self.checkpoint = checkpoint
        self.config = FrozenDict(checkpoint=checkpoint) if frozen_config else _Config(checkpoint)

    def forward(self, hidden_states: torch.Tensor, residuals=None) -> torch.Tensor:
        scale = torch.sigmoid(self.proj_in.bias.sum())
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            if self.training and self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, scale, use_reentrant=False)
            else:
                x = block(x, scale)
        return self.proj_out(x)


ADAPTER = FamilyAdapter(
    name="own-switch-toy",
    model_classes=("OwnSwitchModel",),
    block_lists=("blocks",),
    blocks={"ToyBlock": BlockSpec(ffn=(("ff_in", "act", "ff_out"),), attention=(("attn",),))},
    model_checkpoint_switch=SWITCH,
)


def switched_on(**kw) -> OwnSwitchModel:
    torch.manual_seed(0)
    model = OwnSwitchModel(**kw)
    model.checkpoint = True
    if isinstance(model.config, FrozenDict):
        dict.__setitem__(model.config, "checkpoint", True)
        vars(model.config)["checkpoint"] = True
    else:
        model.config.checkpoint = True
    return model


def config_values(model: OwnSwitchModel) -> tuple:
    config = model.config
    return vars(config).get("checkpoint"), (config.get("checkpoint") if isinstance(config, dict) else None)


@pytest.fixture
def x():
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def own_checkpoint_calls(monkeypatch):
    """Counts the model's own torch.utils.checkpoint calls."""
    calls = []
    real = torch.utils.checkpoint.checkpoint
    monkeypatch.setattr(
        torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    return calls


@pytest.mark.parametrize("frozen_config", [False, True])
@pytest.mark.parametrize(
    ("backend", "interval", "frames"), [("torch", 1, 6), ("torch", 2, 3), ("torch-ffn", 1, 6)]
)
def test_a_switch_that_is_on_is_turned_off_once_and_restored(
    x, own_checkpoint_calls, frozen_config, backend, interval, frames
):
    model = switched_on(frozen_config=frozen_config)
    ref = step(model, x)  # the model's own checkpointing: the same gradients as without it
    assert len(own_checkpoint_calls) == 6
    before_attr, before_config = model.__dict__["checkpoint"], config_values(model)
    cfg = {**ON, "gradient_checkpointing_backend": backend, "gradient_checkpointing_interval": interval}
    with pytest.warns(MemfitWarning) as record:
        handle = memfit.apply(model, cfg, adapter=ADAPTER)
    assert len(record) == 1
    message = str(record[0].message)
    assert (
        "checkpoint=True" in message and "config.checkpoint" in message and "recompute for nothing" in message
    )
    own_checkpoint_calls.clear()
    with handle, warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)  # said once: nothing more while training
        assert model.checkpoint is False and not any(config_values(model))
        got = step(model, x)
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    assert own_checkpoint_calls == []  # no memfit region nested inside the model's own checkpoint calls
    assert stats["frames"] == 2 * frames and stats["recomputes"] == 2 * frames and stats["unused"] == 0
    # restored exactly: the very objects that were there
    assert model.__dict__["checkpoint"] is before_attr and config_values(model) == before_config
    step(model, x)
    assert len(own_checkpoint_calls) == 6  # the model checkpoints itself again


def test_the_switch_alone_in_the_config_is_turned_off_too(x, own_checkpoint_calls):
    model = switched_on()
    model.checkpoint = False  # only the config says on
    with pytest.warns(MemfitWarning, match=r"\(config\.checkpoint\)"):
        handle = memfit.apply(model, ON, adapter=ADAPTER)
    with handle:
        assert model.config.checkpoint is False
    assert model.config.checkpoint is True and model.checkpoint is False


def test_a_switch_that_is_off_is_left_alone(x):
    torch.manual_seed(0)
    model = OwnSwitchModel()
    before = dict(model.__dict__), dict(vars(model.config))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        memfit.apply(model, ON, adapter=ADAPTER).remove()
    assert dict(model.__dict__).keys() == before[0].keys() and dict(vars(model.config)) == before[1]


@pytest.mark.parametrize("config", [{"gradient_checkpointing": False}, {}])
def test_memfit_switched_off_leaves_the_models_own_checkpointing_on(x, config):
    model = switched_on()
    with warnings.catch_warnings():
        warnings.simplefilter("error", MemfitWarning)
        with memfit.apply(model, config, adapter=ADAPTER):
            assert (
                model.checkpoint is True and model.config.checkpoint is True
            )  # nothing installed, untouched


def test_without_the_declaration_the_switch_is_not_known():
    model = switched_on()
    undeclared = dataclasses.replace(ADAPTER, model_checkpoint_switch=None)
    with memfit.apply(model, ON, adapter=undeclared):
        assert model.checkpoint is True


def test_diffusers_flags_and_the_switch_are_one_warning(x):
    model = switched_on()
    model.blocks[0].gradient_checkpointing = True  # a diffusers-style flag somewhere inside, too
    with pytest.warns(MemfitWarning) as record:
        handle = memfit.apply(model, ON, adapter=ADAPTER)
    assert len(record) == 1 and "gradient_checkpointing on 1 module(s), checkpoint=True" in str(
        record[0].message
    )
    with handle:
        assert model.blocks[0].gradient_checkpointing is False and model.checkpoint is False
    assert model.blocks[0].gradient_checkpointing is True and model.checkpoint is True


@pytest.mark.parametrize(
    ("switch", "match"),
    [
        ({}, "needs the model attribute and/or the config key"),
        ({"attribute": "a.b"}, "one attribute name"),
        ({"config_key": "two words"}, "one attribute name"),
    ],
)
def test_a_switch_declaration_is_validated(switch, match):
    with pytest.raises(ValueError, match=match):
        CheckpointSwitch(**switch)


def test_an_adapter_takes_a_switch_declaration_only():
    with pytest.raises(
        ValueError, match=r"CheckpointSwitch \(or None\), got 'checkpoint'; e\.g\. CheckpointSwitch"
    ):
        dataclasses.replace(ADAPTER, model_checkpoint_switch="checkpoint")
