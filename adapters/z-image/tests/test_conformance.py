"""Z-Image passes the memfit conformance kit.

The kit gives ``requires_grad`` only to forward kwargs that are plain tensors.  Z-Image's image, caption
and SigLIP inputs are *lists* of per-sample tensors, so the kit compares the gradient of the timestep
``t`` (the one plain-tensor input; it reaches every modulated block) and the tests below compare the
gradients of the list inputs themselves.
"""

from __future__ import annotations

from typing import Any

import memfit_z_image
import pytest
import torch
from diffusers import ZImageTransformer2DModel
from memfit_z_image.presets import TINY, make_inputs

import memfit
from memfit import Backend
from memfit_conformance import AdapterConformance, Combination

LIST_INPUTS = ("x", "cap_feats", "siglip_feats")


def _with_leaves(inputs: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """A copy of ``inputs`` whose list-held floating tensors are fresh leaves that require grad."""
    leaves: list[torch.Tensor] = []

    def convert(value: Any) -> Any:
        if isinstance(value, list):
            return [convert(v) for v in value]
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            leaf = value.detach().clone().requires_grad_(True)
            leaves.append(leaf)
            return leaf
        return value

    return {k: convert(v) if k in LIST_INPUTS else v for k, v in inputs.items()}, leaves


def _list_input_grads(model: torch.nn.Module, inputs: dict[str, Any]) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    inputs, leaves = _with_leaves(inputs)
    memfit_z_image.ADAPTER.loss(model(**inputs)).backward()
    assert all(leaf.grad is not None for leaf in leaves), "a list input got no gradient: nothing to compare"
    return [leaf.grad for leaf in leaves]


class TestZImageConformance(AdapterConformance):
    adapter = memfit_z_image.ADAPTER
    # `x`, `cap_feats`, `siglip_feats` are lists; `t` is the forward's only plain-tensor input.
    grad_inputs = ("t",)

    def test_timestep_gradient_is_compared(self, reference) -> None:
        for regime, step in reference.items():
            assert set(step.input_grads) == {"t"}, f"{regime}: the kit compared no input gradient"

    def test_list_input_gradients_equal(self, model, inputs) -> None:
        expected = _list_input_grads(model, inputs)
        for combo in (
            Combination(Backend.TORCH),
            Combination(Backend.TORCH, 2, 4),
            Combination(Backend.TORCH_FFN),
            Combination(Backend.TORCH_FFN, 2, 4),
        ):
            with memfit.apply(model, combo.config(), adapter=self.adapter):
                actual = _list_input_grads(model, inputs)
            for i, (a, b) in enumerate(zip(expected, actual, strict=True)):
                assert torch.equal(a, b), f"{combo}: gradient of list input #{i} differs"

    @pytest.mark.parametrize("backend", [Backend.TORCH, Backend.TORCH_FFN])
    def test_text_to_image_config_without_siglip(self, backend) -> None:
        """The published checkpoints (Z-Image-Turbo) set no ``siglip_feat_dim``: ``siglip_refiner`` is None."""
        torch.manual_seed(0)
        model = ZImageTransformer2DModel(**dict(TINY, siglip_feat_dim=None))
        inputs = make_inputs(model, tokens=24, batch=2, generator=torch.Generator().manual_seed(0))
        expected = self._step(model, inputs, "full")
        result, stats = self._step_with(model, inputs, Combination(backend).config())
        assert torch.equal(expected.loss, result.loss)
        for name, grad in expected.param_grads.items():
            assert torch.equal(grad, result.param_grads[name]), name
        blocks = 2 * TINY["n_refiner_layers"] + TINY["n_layers"]  # noise + context refiners, main layers
        assert stats["frames"] == stats["recomputes"] == blocks
