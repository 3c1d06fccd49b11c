"""memfit's conformance kit: base test classes an adapter's tests subclass."""

from memfit_conformance.base import AdapterConformance
from memfit_conformance.declaration import Problem, check_declaration
from memfit_conformance.harness import Combination, StepResult, claimed_combinations, run_step

__all__ = [
    "AdapterConformance",
    "Combination",
    "Problem",
    "StepResult",
    "check_declaration",
    "claimed_combinations",
    "run_step",
]
