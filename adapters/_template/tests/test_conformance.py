"""<Family> passes the memfit conformance kit."""

from memfit_conformance import AdapterConformance

import memfit_template


class TestTemplateConformance(AdapterConformance):
    adapter = memfit_template.ADAPTER
