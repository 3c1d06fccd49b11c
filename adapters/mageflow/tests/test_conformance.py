"""Mage-Flow passes the memfit conformance kit, on both classes the adapter serves, each called as the real one is."""

from typing import Any

import memfit_mageflow
from memfit_mageflow.presets import build_upstream_tiny
from torch import nn

from memfit_conformance import AdapterConformance


class TestMageFlowWrapperConformance(AdapterConformance):
    """The trainer's wrapper (``MageFlowTransformer2DModel``, the ``tiny`` preset): memfit enters through its
    ``enable_gradient_checkpointing``, and its forward calls memfit's function with closures and
    ``use_reentrant=False``."""

    adapter = memfit_mageflow.ADAPTER
    # both streams are inputs of every block: check the text stream's gradients too
    grad_inputs = ("hidden_states", "encoder_hidden_states")


class TestMageFlowUpstreamConformance(TestMageFlowWrapperConformance):
    """Upstream's base class (``MageFlow``): no diffusers hook, its own ``checkpoint`` switch calls
    ``torch.utils.checkpoint`` itself; memfit enters through forward hooks."""

    @classmethod
    def build_model(cls, **kwargs: Any) -> nn.Module:
        return build_upstream_tiny(**kwargs)
