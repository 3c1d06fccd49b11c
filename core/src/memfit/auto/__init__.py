"""The ``auto`` backend: one profiled forward, then a per-block plan under a memory budget.

* :mod:`memfit.auto.policy` — the planner's menu of :class:`memfit.plan.BlockPolicy` per block;
* :mod:`memfit.auto.profile` — per-block activation bytes and FLOPs from one forward, plus the
  calibration (copy bandwidth, FLOP rate, static and workspace memory, each kind of block's own peak);
* :mod:`memfit.auto.blockpeak` — a block's own forward+backward peak, measured alone (CUDA);
* :mod:`memfit.auto.cost` — what each policy keeps, copies and costs on one block;
* :mod:`memfit.auto.search` — the dynamic programme over blocks;
* :mod:`memfit.auto.streaming` — which blocks stream their frozen weights, and what that does to peak and cost;
* :mod:`memfit.auto.planner` — the peak model and the cheapest plan whose predicted peak fits;
* :mod:`memfit.auto.budget_planner` — a plan per input signature, for the controller to install.
"""

from memfit.auto.planner import Plan, plan_policies
from memfit.auto.profile import BlockProfile, ModelProfile
from memfit.plan import BlockPolicy

__all__ = ["BlockPolicy", "BlockProfile", "ModelProfile", "Plan", "plan_policies"]
