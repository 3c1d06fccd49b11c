"""memfit's conformance kit: base test classes an adapter's tests subclass."""

from memfit_conformance.base import AdapterConformance
from memfit_conformance.harness import Combination, StepResult, claimed_combinations, run_step

__all__ = ["AdapterConformance", "Combination", "StepResult", "claimed_combinations", "run_step"]
