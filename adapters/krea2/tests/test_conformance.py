"""Krea 2 passes the memfit conformance kit."""

import memfit_krea2

from memfit_conformance import AdapterConformance


class TestKrea2Conformance(AdapterConformance):
    adapter = memfit_krea2.ADAPTER
    # The text-fusion blocks sit between encoder_hidden_states and everything else: compare its gradient too.
    grad_inputs = ("hidden_states", "encoder_hidden_states")
