"""LTX-2 passes the memfit conformance kit."""

import memfit_ltxvideo2
import pytest
import torch

from memfit_conformance import AdapterConformance


class TestLTXVideo2Conformance(AdapterConformance):
    adapter = memfit_ltxvideo2.ADAPTER
    grad_inputs = ("hidden_states", "audio_hidden_states")


@pytest.mark.parametrize("return_dict", [False, True])
def test_loss_reaches_both_heads(return_dict: bool) -> None:
    """The family loss backpropagates into the video and the audio output head, for both output forms."""
    preset = memfit_ltxvideo2.ADAPTER.presets["tiny"]
    model = preset.build()
    inputs = preset.inputs(model, tokens=preset.default_tokens, generator=torch.Generator().manual_seed(0))
    memfit_ltxvideo2.ADAPTER.loss(model(**{**inputs, "return_dict": return_dict})).backward()
    assert model.proj_out.weight.grad is not None and model.proj_out.weight.grad.abs().sum() > 0
    assert model.audio_proj_out.weight.grad is not None and model.audio_proj_out.weight.grad.abs().sum() > 0
