"""Mage-Flow passes the memfit conformance kit, on both classes the adapter serves, each called as the real one is."""

from typing import Any

import memfit_mageflow
import pytest
import torch
from memfit_mageflow.presets import build_upstream_tiny
from torch import nn

from memfit_conformance import AdapterConformance, claimed_combinations


class TestMageFlowWrapperConformance(AdapterConformance):
    """The trainer's wrapper (``MageFlowTransformer2DModel``, the ``tiny`` preset): memfit enters through its
    ``enable_gradient_checkpointing``, and its forward calls memfit's function with closures and
    ``use_reentrant=False``."""

    adapter = memfit_mageflow.ADAPTER
    # both streams are inputs of every block: check the text stream's gradients too
    grad_inputs = ("hidden_states", "encoder_hidden_states")

    def test_no_checkpointing_left_after_remove(
        self, model: nn.Module, inputs: dict[str, Any], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """After apply, a training step and remove(), a training step checkpoints nothing (the wrapper's enable
        method turned its own switch on for memfit; remove() turns it off again)."""
        calls = []
        real = torch.utils.checkpoint.checkpoint
        monkeypatch.setattr(
            torch.utils.checkpoint, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k)
        )
        if "_gradient_checkpointing_func" in model.__dict__:  # the wrapper's default, counted
            monkeypatch.setitem(
                model.__dict__, "_gradient_checkpointing_func", torch.utils.checkpoint.checkpoint
            )
        for combo in claimed_combinations(self.adapter, intervals=(2,)):
            with self.apply(model, combo.config()):
                self._step(model, inputs, "full")
            calls.clear()
            self._step(model, inputs, "full")
            assert not calls, f"{combo}: {len(calls)} checkpoint calls after remove()"
            assert model.checkpoint is False


class TestMageFlowUpstreamConformance(TestMageFlowWrapperConformance):
    """Upstream's base class (``MageFlow``): no diffusers hook, its own ``checkpoint`` switch calls
    ``torch.utils.checkpoint`` itself; memfit enters through forward hooks."""

    @classmethod
    def build_model(cls, **kwargs: Any) -> nn.Module:
        return build_upstream_tiny(**kwargs)
