"""<Family> passes the memfit conformance kit."""

import memfit_template

from memfit_conformance import AdapterConformance


class TestTemplateConformance(AdapterConformance):
    adapter = memfit_template.ADAPTER
