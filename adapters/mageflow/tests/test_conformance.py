"""Mage-Flow passes the memfit conformance kit."""

import memfit_mageflow

from memfit_conformance import AdapterConformance


class TestMageFlowConformance(AdapterConformance):
    adapter = memfit_mageflow.ADAPTER
    # both streams are inputs of every block: check the text stream's gradients too
    grad_inputs = ("hidden_states", "encoder_hidden_states")
