"""meshpar's compiler: small passes over typed IRs, testable without devices.

Four compilers, one sub-package each, over shared model types:

- ``model``: device meshes, sharding specs, tiles and clusters (the types every compiler reads);
- ``resharding``: one tensor's cross-mesh move, from unit tasks to a lowered program;
- ``pipeline``: a traced train step, from stage markers to a per-mesh program;
- ``planning``: stage cuts, mesh shapes and micro-batches chosen automatically, by four registered
  planners (``planning.planners.PLANNERS``), each calibrated to the machine through its protocol;
- ``simulation``: a schedule's step time, bubbles and memory from a cost model.
"""

from .resharding.balancers import BALANCERS, BalancerOptions
from .resharding.plan_resharding import ALPA_BASELINE, plan_resharding
from .resharding.resharding_plan import ReshardingPlan, ScheduledTask
from .resharding.resharding_task import ReshardingTask
from .resharding.strategies import STRATEGIES
from .resharding.unit_tasks import UnitTask
from .verification import PlanVerificationError

__all__ = [
    "ALPA_BASELINE",
    "BALANCERS",
    "BalancerOptions",
    "PlanVerificationError",
    "ReshardingPlan",
    "ReshardingTask",
    "STRATEGIES",
    "ScheduledTask",
    "UnitTask",
    "plan_resharding",
]
