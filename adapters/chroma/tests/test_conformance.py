"""Chroma passes the memfit conformance kit.

Two runs of the kit:

* ``TestChromaConformance`` — the preset's inputs as Chroma is trained: with the boolean text+image
  attention mask. This is the run that needs ``block_entry="hooks"``: diffusers' checkpointing branch
  of ``ChromaTransformer2DModel.forward`` calls the single-stream blocks without ``attention_mask``,
  so entering blocks through it would change the model's math.
* ``TestChromaConformanceUnmasked`` — the same kit without the mask, plus ControlNet residuals,
  which Chroma adds between blocks (in place, for the single-stream list).
"""

from typing import Any

import memfit_chroma
import pytest
import torch
from torch import nn

import memfit
from memfit import Backend
from memfit_conformance import AdapterConformance
from memfit_conformance.harness import Combination, assert_same_step


class TestChromaConformance(AdapterConformance):
    adapter = memfit_chroma.ADAPTER


class TestChromaConformanceUnmasked(AdapterConformance):
    adapter = memfit_chroma.ADAPTER

    @classmethod
    def make_inputs(cls, model: nn.Module, seed: int = 0) -> dict[str, Any]:
        inputs = super().make_inputs(model, seed)
        del inputs["attention_mask"]
        return inputs

    @pytest.mark.parametrize(
        "case",
        [
            Combination(Backend.TORCH, 1),
            Combination(Backend.TORCH, 2),
            Combination(Backend.TORCH, 2, 4),
            Combination(Backend.TORCH_FFN, 1),
        ],
        ids=str,
    )
    def test_controlnet_residuals_equal(
        self, model: nn.Module, inputs: dict[str, Any], case: Combination
    ) -> None:
        g = torch.Generator().manual_seed(1)
        image_tokens, width = inputs["hidden_states"].shape[1], model.inner_dim
        inputs = dict(
            inputs,
            # two residuals per list: each is added to several consecutive blocks' outputs
            controlnet_block_samples=[torch.randn(1, image_tokens, width, generator=g) for _ in range(2)],
            controlnet_single_block_samples=[
                torch.randn(1, image_tokens, width, generator=g) for _ in range(2)
            ],
        )
        expected = self._step(model, inputs, "full")
        with memfit.apply(model, case.config(), adapter=self.adapter) as handle:
            actual = self._step(model, inputs, "full")
            stats = handle.stats()
        assert stats["recomputes"] == stats["frames"] > 0
        assert_same_step(expected, actual, what=f"chroma {case} with controlnet residuals")
