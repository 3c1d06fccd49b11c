"""The per-module cache of what a region call reads (parameters, buffers, tuner layers): no walk per call, dropped
on any registration, never keeps a replaced parameter or a dropped model alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import memfit
from memfit.engine import replay

from helpers import step
from toy import TOY, build

ON = {"gradient_checkpointing": True}


@pytest.fixture
def builds(monkeypatch):
    """Counts ModuleTree builds (module walks)."""
    count = [0]
    original = replay.ModuleTree.__init__

    def counting(self, module, generation):
        count[0] += 1
        original(self, module, generation)

    monkeypatch.setattr(replay.ModuleTree, "__init__", counting)
    return count


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
def test_no_module_walk_per_call_once_cached(model, x, builds, backend):
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=TOY) as handle:
        step(model, x)
        first = builds[0]
        step(model, x)
        step(model, x)
        assert handle.stats()["recomputes"] > 0
    assert first == (6 if backend == "torch" else 18)  # each region module once
    assert builds[0] == first


def test_a_registration_drops_the_cache_and_the_walk_sees_the_change(model, x, builds):
    with memfit.apply(model, ON, adapter=TOY):
        step(model, x)
        before = builds[0]
        model.blocks[0].ff_in.weight = torch.nn.Parameter(model.blocks[0].ff_in.weight.detach().clone())
        step(model, x)
        assert builds[0] == before + 6  # every region module walked again, once
        tree = replay.TREES.of(model.blocks[0])
        assert any(t is model.blocks[0].ff_in.weight for t in tree.tensors)


def test_a_replaced_parameter_or_a_dropped_model_is_not_kept_alive(x):
    model = build()
    with memfit.apply(model, ON, adapter=TOY):
        step(model, x)
    old = weakref.ref(model.blocks[0].ff_in.weight)
    model.blocks[0].ff_in.weight = torch.nn.Parameter(torch.zeros(64, 16))  # e.g. a quantized weight put in
    gc.collect()
    assert old() is None
    alive = weakref.ref(model.blocks[1])
    del model
    gc.collect()
    assert alive() is None
