"""meshpar's compiler: small passes over typed IRs, testable without devices."""

from .balancers import BALANCERS, BalancerOptions
from .plan_resharding import ALPA_BASELINE, plan_resharding
from .resharding_plan import ReshardingPlan, ScheduledTask
from .resharding_task import ReshardingTask
from .strategies import STRATEGIES
from .unit_tasks import PlanVerificationError, UnitTask

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
