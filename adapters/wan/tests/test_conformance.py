"""Wan passes the memfit conformance kit."""

import memfit_wan

from memfit_conformance import AdapterConformance


class TestWanConformance(AdapterConformance):
    adapter = memfit_wan.ADAPTER
