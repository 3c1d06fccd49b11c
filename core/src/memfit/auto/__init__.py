"""The ``auto`` backend: one profiled forward, then a per-block plan under a memory budget.

* :mod:`memfit.auto.policy` — what one block may do (keep, FFN recompute, block recompute, offloads);
* :mod:`memfit.auto.profile` — per-block activation bytes and FLOPs from one forward, plus the
  calibration (copy bandwidth, FLOP rate, static and workspace memory, each kind of block's own peak);
* :mod:`memfit.auto.blockpeak` — a block's own forward+backward peak, measured alone (CUDA);
* :mod:`memfit.auto.planner` — the cheapest assignment of policies whose predicted peak fits;
* :mod:`memfit.auto.controller` — installs the plan, and re-plans when the input shape changes.
"""

from memfit.auto.planner import Plan, plan_policies
from memfit.auto.policy import BlockPolicy
from memfit.auto.profile import BlockProfile, ModelProfile

__all__ = ["BlockPolicy", "BlockProfile", "ModelProfile", "Plan", "plan_policies"]
