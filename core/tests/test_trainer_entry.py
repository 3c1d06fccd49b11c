"""Models as trainers write them: checkpoint calls with closures and torch.utils.checkpoint keywords, enable
methods that set switches of their own, and copies of an applied model (EMA)."""

from __future__ import annotations

import copy
import functools
import io
import pickle

import pytest
import torch
from torch import nn

import memfit
from memfit import BlockSpec, FamilyAdapter, MemfitError, MemfitWarning

from helpers import assert_same, step
from toy import TOY, ToyBlock, ToyModel, build

ON = {"gradient_checkpointing": True}


class _Config:
    """A model config that is a plain object (as some trainer-vendored models keep it)."""

    def __init__(self) -> None:
        self.checkpoint = False


class TrainerStyleModel(ToyModel):
    """A toy stack whose checkpointing branch calls the function with a closure over the block (or a partial)
    and ``use_reentrant=False``, and whose enable method sets a switch and a config key of its own."""

    _supports_gradient_checkpointing = True

    def __init__(self, *, partial: bool = False, extra: bool = False, **kw) -> None:
        super().__init__(**kw)
        # a block outside the declared list, also run through the checkpointing function
        self.extra = ToyBlock(self.proj_in.in_features) if extra else None
        self.gradient_checkpointing = False
        self.partial = partial
        self.checkpoint = False
        self.config = _Config()

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        self.gradient_checkpointing = True
        self.checkpoint = True
        self.config.checkpoint = True
        self._gradient_checkpointing_func = gradient_checkpointing_func or torch.utils.checkpoint.checkpoint

    def forward(self, hidden_states: torch.Tensor, residuals=None) -> torch.Tensor:
        scale = torch.sigmoid(self.proj_in.bias.sum())
        x = self.proj_in(hidden_states)
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                if self.partial:
                    run = functools.partial(block)
                else:

                    def run(*inputs, block=block):
                        return block(*inputs)

                x = self._gradient_checkpointing_func(run, x, scale, use_reentrant=False)
            else:
                x = block(x, scale)
        if self.extra is not None and torch.is_grad_enabled() and self.gradient_checkpointing:
            x = self._gradient_checkpointing_func(lambda *i: self.extra(*i), x, scale, use_reentrant=False)
        elif self.extra is not None:
            x = self.extra(x, scale)
        return self.proj_out(x)


TRAINER = FamilyAdapter(
    name="trainer-toy",
    model_classes=("TrainerStyleModel",),
    block_lists=("blocks",),
    blocks={"ToyBlock": BlockSpec(ffn=(("ff_in", "act", "ff_out"),), attention=(("attn",),))},
)


def trainer_model(**kw) -> TrainerStyleModel:
    torch.manual_seed(0)
    return TrainerStyleModel(**kw)


@pytest.fixture
def x():
    return torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize(
    ("interval", "stride", "frames"), [(1, None, 6), (2, None, 3), (2, 3, 2), (3, 3, 2), (6, None, 1)]
)
def test_closure_entry_keeps_the_interval_plan_and_gradients(x, partial, interval, stride, frames):
    model = trainer_model(partial=partial)
    ref = step(model, x)
    cfg = {**ON, "gradient_checkpointing_interval": interval, "gradient_checkpointing_segment_stride": stride}
    with memfit.apply(model, cfg, adapter=TRAINER) as handle:
        got = step(model, x)
        stats = handle.stats()
    assert_same(ref, got)
    assert stats["frames"] == frames and stats["recomputes"] == frames
    assert stats["undeclared_block_calls"] == 0


def test_remove_restores_what_the_models_enable_method_set(x):
    model = trainer_model()
    before = (dict(model.__dict__), dict(vars(model.config)))
    handle = memfit.apply(model, {**ON, "gradient_checkpointing_interval": 2}, adapter=TRAINER)
    assert model.checkpoint is True and model.config.checkpoint is True  # the model's own enable ran
    step(model, x)
    handle.remove()
    assert model.checkpoint is False and model.config.checkpoint is False
    assert model.gradient_checkpointing is False and "_gradient_checkpointing_func" not in model.__dict__
    assert dict(model.__dict__).keys() == before[0].keys() and dict(vars(model.config)) == before[1]
    calls = []
    real = torch.utils.checkpoint.checkpoint
    try:
        torch.utils.checkpoint.checkpoint = lambda *a, **k: calls.append(1) or real(*a, **k)
        step(model, x)
    finally:
        torch.utils.checkpoint.checkpoint = real
    assert not calls  # no checkpointing left behind


def test_a_closure_that_runs_no_declared_block_is_counted_and_said_once(x):
    model = trainer_model(extra=True)
    ref = step(model, x)
    warns = pytest.warns(MemfitWarning, match="no block memfit knows ran")
    with warns, memfit.apply(model, ON, adapter=TRAINER) as handle:
        got = step(model, x)
        got = step(model, x)  # said once
        stats = handle.stats()
    assert_same(ref, got)
    assert stats["undeclared_block_calls"] == 2 and stats["frames"] == 12
    assert len([w for w in warns if issubclass(w.category, MemfitWarning)]) == 1


def test_a_context_fn_is_refused(x):
    model = trainer_model()
    with memfit.apply(model, ON, adapter=TRAINER):
        real = model.forward

        def forward(hidden_states, residuals=None):
            x = model.proj_in(hidden_states)
            return model._gradient_checkpointing_func(
                model.blocks[0], x, torch.ones(()), use_reentrant=False, context_fn=lambda: (None, None)
            )

        model.forward = forward
        try:
            with pytest.raises(MemfitError, match="context_fn"):
                model(x)
        finally:
            model.forward = real
            del model.__dict__["forward"]


# -- copies ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "torch-ffn"])
@pytest.mark.parametrize("trainer_style", [False, True])
def test_a_deep_copy_of_an_applied_model_is_an_ordinary_model(x, backend, trainer_style):
    model = trainer_model() if trainer_style else build()
    adapter = TRAINER if trainer_style else TOY
    ref = step(model, x)
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": backend}, adapter=adapter) as handle:
        twin = copy.deepcopy(model)
        got = step(twin, x)  # the copy trains on its own parameters
        frames_after_copy_step = handle.stats()["frames"]
        assert frames_after_copy_step == 0  # nothing of the original's installation ran for the copy
        assert_same(ref, got)
        assert_same(ref, step(model, x))  # the original still works, through memfit
        assert handle.stats()["frames"] > 0
    assert list(twin.state_dict()) == list(model.state_dict())


def test_a_deep_copy_of_one_block_is_independent(x):
    model = build()
    with memfit.apply(model, {**ON, "gradient_checkpointing_backend": "torch-ffn"}, adapter=TOY):
        block = copy.deepcopy(model.blocks[0])
        h = torch.randn(2, 8, 16, requires_grad=True)
        block(h, torch.ones(())).sum().backward()
    assert all(p.grad is None for p in model.blocks[0].parameters())  # gradients went to the copy
    assert all(p.grad is not None for p in block.parameters())
    with torch.no_grad():
        block.ff_in.weight.zero_()
    assert not torch.equal(block.ff_in.weight, model.blocks[0].ff_in.weight)


@pytest.mark.parametrize("config", [ON, {**ON, "gradient_checkpointing_backend": "torch-ffn"}])
def test_pickling_an_applied_model_says_to_remove_first(config):
    model = build()
    with memfit.apply(model, config, adapter=TOY):
        with pytest.raises(MemfitError, match="remove"):
            torch.save(model, io.BytesIO())
        with pytest.raises(MemfitError, match="remove"):
            pickle.dumps(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # after remove(): an ordinary model
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert isinstance(loaded, nn.Module)
