"""Exact narrowing (memfit.offload.narrow): proven up-casts are parked in their narrow dtype, bit for bit.

Wan normalises in float32 (``FP32LayerNorm``, an RMS norm across heads): six of its block's saved tensors are
float32 copies of bfloat16 activations. Parked narrow they copy half the bytes, and backward gets the same bits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memfit
from memfit.auto import BlockPolicy
from memfit.auto.profile import profile_model
from memfit.offload.narrow import Narrowed, exact_narrow_dtype, widened
from memfit_conformance.base import cpu_copy_engine
from memfit_conformance.streams import order_checking_copy_engine

import toy
from helpers import assert_same_family_step, auto_config, family_step, force_auto_plan, step

COPY_ENGINES = {"sync": cpu_copy_engine, "cuda-engine": order_checking_copy_engine}
BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64


def _leaf(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(4, 6).to(dtype).requires_grad_(True)


@pytest.mark.parametrize(
    ("source", "saved", "narrow"),
    [(BF16, FP32, BF16), (FP16, FP32, FP16), (BF16, FP64, BF16), (FP32, FP64, FP32)],
)
def test_an_up_cast_is_proven_narrow(source, saved, narrow):
    x = _leaf(source)
    assert exact_narrow_dtype(x.to(saved)) is narrow
    assert exact_narrow_dtype((x * 2).to(saved)) is narrow  # from an op's output, not only from a leaf


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: _leaf(FP32).to(BF16), id="a down-cast"),
        pytest.param(lambda: _leaf(BF16).to(FP16), id="bf16 to fp16 loses range"),
        pytest.param(lambda: _leaf(FP16).to(BF16), id="fp16 to bf16 loses precision"),
        pytest.param(lambda: _leaf(BF16).detach().to(FP32), id="no history"),
        pytest.param(lambda: _leaf(BF16).to(FP32).mul_(3), id="written in place since"),
        pytest.param(lambda: _leaf(BF16).to(FP32).t(), id="a view of it"),
        pytest.param(lambda: _leaf(BF16).to(FP32) * 1, id="another op's output"),
        pytest.param(lambda: _leaf(FP32).to(FP32), id="no cast at all"),
    ],
)
def test_nothing_else_is(make):
    assert exact_narrow_dtype(make()) is None


def test_a_tensor_saved_twice_in_a_call_is_narrowed_once():
    up = _leaf(BF16).to(FP32)
    narrowed = Narrowed()
    first, saved = narrowed.of(up, BF16)
    assert first.dtype is BF16 and saved == up.nbytes // 2 and first.grad_fn is None
    again, saved_again = narrowed.of(up, BF16)
    assert again is first and saved_again == 0
    other = _leaf(BF16).to(FP32)
    assert narrowed.of(other, BF16)[0] is not first
    narrowed.clear()
    assert narrowed.of(up, BF16)[0] is not first


def test_widening_gives_the_saved_bits_back():
    x = torch.randn(1000, dtype=BF16)
    up = x.to(FP32)
    assert torch.equal(widened(up.to(BF16), FP32), up)
    assert widened(up, FP32) is up and widened(up, None) is up


# -- on a model: tiny Wan in bfloat16, whose norms save float32 up-casts ---------------------------------------------


@pytest.fixture(scope="module")
def wan():
    pytest.importorskip("peft")
    memfit_wan = pytest.importorskip("memfit_wan")
    import peft

    preset = memfit_wan.ADAPTER.presets["tiny"]
    torch.manual_seed(0)
    model = preset.build(dtype=BF16, device="cpu").requires_grad_(False)
    model.add_adapter(peft.LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0", "net.2"]))
    batch = preset.inputs(model, tokens=720, generator=torch.Generator().manual_seed(1))
    return model, batch, memfit_wan.ADAPTER


@pytest.mark.parametrize("engine_name", COPY_ENGINES)
def test_offloaded_attention_parks_wans_float32_norms_narrow_with_the_same_gradients(wan, engine_name):
    model, batch, adapter = wan
    reference = family_step(model, batch, adapter)
    profile = profile_model(model, adapter, (), batch, min_offload_bytes=0, copy_bytes_per_second=1e9)
    engine = COPY_ENGINES[engine_name]()
    with memfit.apply(
        model, {"gradient_checkpointing_offload_attention": True}, copy_engine=engine, min_offload_bytes=0
    ) as handle:
        got = family_step(model, batch, adapter)
        stats = handle.stats()
    assert_same_family_step(got, reference)
    # the q and k norms' float32 inputs (torch's RMSNorm casts up off CUDA) went at half their bytes (the last two
    # calls keep theirs: not counted)
    assert stats["bytes_narrowed"] > 0
    assert stats["bytes_offloaded"] + stats["bytes_kept_on_device"] < (
        stats["bytes_offloaded"] + stats["bytes_narrowed"] + stats["bytes_kept_on_device"]
    )
    wide = profile_model(
        model, adapter, (), batch, min_offload_bytes=0, copy_bytes_per_second=1e9, storages_once=False
    )
    assert sum(b.attention_copy_bytes for b in profile.blocks) <= sum(
        b.attention_copy_bytes for b in wide.blocks
    )


@pytest.mark.parametrize("engine_name", COPY_ENGINES)
def test_parked_blocks_copy_what_the_profile_priced_narrowing_included(wan, monkeypatch, engine_name):
    model, batch, adapter = wan
    reference = family_step(model, batch, adapter)
    engine = COPY_ENGINES[engine_name]()
    profile = profile_model(
        model,
        adapter,
        (),
        batch,
        min_offload_bytes=0,
        copy_bytes_per_second=1e9,
        storages_once=engine.parks_storages_once,
    )
    force_auto_plan(monkeypatch, lambda names: [BlockPolicy.PARK] * len(names))
    with memfit.apply(model, auto_config("1GiB"), copy_engine=engine, min_offload_bytes=0) as handle:
        got = family_step(model, batch, adapter)
        stats = handle.stats()
    assert_same_family_step(got, reference)
    assert stats["bytes_narrowed"] > 0
    # every block saves float32 up-casts of its norms' inputs: parking prices them narrow, below their own bytes
    for b in profile.blocks[1:]:
        assert b.park_copy_bytes < b.park_bytes
    # the last two blocks keep theirs on the device, wide; the others copy what the profile priced, and the
    # shared tensors they saw first (copied once for all)
    own = sum(b.park_copy_bytes for b in profile.blocks[:-2])
    shared = profile.outside_bytes + profile.attention_shared_copy_bytes
    assert own <= stats["bytes_offloaded"] <= own + shared


class _SavesAnUpCast(nn.Module):
    """An attention stand-in whose ``pow`` saves a float32 up-cast of its input (kept in ``up`` to edit it)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear
        self.up: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.up = x.float()
        return self.linear(self.up.pow(2).to(x.dtype))


def test_a_narrowed_tensor_edited_in_place_after_the_call_is_an_error():
    """The narrow copy is made as the tensor is saved: an edit of the saved float32 tensor in place afterwards
    would not reach backward. Autograd rejects such an edit; memfit says so at parking, as for any saved tensor."""
    model = toy.build(dtype=BF16)
    for block in model.blocks:
        block.attn = _SavesAnUpCast(block.attn)
    x = torch.randn(2, 8, 16, dtype=BF16)
    edited = model.blocks[1]
    config = {"gradient_checkpointing_offload_attention": True}
    engine = cpu_copy_engine()
    with memfit.apply(model, config, adapter=toy.TOY, copy_engine=engine, min_offload_bytes=0) as handle:
        step(model, x)
        assert handle.stats()["bytes_narrowed"] > 0

        def edit_up_cast(*_) -> None:
            edited.attn.up.mul_(1.0)

        edit = edited.norm2.register_forward_hook(edit_up_cast)
        with pytest.raises(memfit.MemfitError, match="modified in place after the call"):
            step(model, x)
        edit.remove()
