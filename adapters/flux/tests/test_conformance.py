"""Flux passes the memfit conformance kit."""

import memfit_flux
from memfit_conformance import AdapterConformance


class TestFluxConformance(AdapterConformance):
    adapter = memfit_flux.ADAPTER
