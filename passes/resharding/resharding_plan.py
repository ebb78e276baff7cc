"""The planner's output IR: who sends which slice to whom, how, and when."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from .balancers import Balancer
from .resharding_task import ReshardingTask
from .scheduled_task import ScheduledTask
from .unit_tasks import UnitTask
from .strategies import Strategy
from ..verification import PlanVerificationError

__all__ = ["ScheduledTask", "ReshardingPlan", "verify_plan"]


@dataclasses.dataclass(frozen=True)
class ReshardingPlan:
    """How to carry out one ``ReshardingTask``.

    Attributes:
      task: what is resharded.
      strategy, balancer: what made this plan (``strategy.chains`` lowers its tasks).
      tasks: scheduled unit tasks in launch order.
      num_rounds: rounds in ``tasks``; round ``r`` starts after round ``r-1``.
      estimated_time: makespan under the cost model (Eq. 1).
      lower_bound: seconds no plan can beat (``estimated_time >= lower_bound``).
    """

    task: ReshardingTask
    strategy: Strategy
    balancer: Balancer
    tasks: tuple[ScheduledTask, ...]
    num_rounds: int
    estimated_time: float
    lower_bound: float

    @property
    def rounds(self) -> tuple[tuple[ScheduledTask, ...], ...]:
        out: list[list[ScheduledTask]] = [[] for _ in range(self.num_rounds)]
        for t in self.tasks:
            out[t.round].append(t)
        return tuple(tuple(r) for r in out)

    @property
    def fingerprint(self) -> str:
        """Stable hash of everything that determines the data movement."""
        t = self.task
        doc = {
            "shape": t.shape,
            "itemsize": t.itemsize,
            "src": [t.src_mesh.device_ids.tolist(), t.src_mesh.host_ids.tolist(), str(t.src_spec)],
            "dst": [t.dst_mesh.device_ids.tolist(), t.dst_mesh.host_ids.tolist(), str(t.dst_spec)],
            "pad": t.pad,
            "strategy": self.strategy.name,
            "tasks": [[s.unit.bounds, s.sender, s.route, s.chunks, s.round] for s in self.tasks],
        }
        return hashlib.sha256(json.dumps(doc, separators=(",", ":")).encode()).hexdigest()[:16]

    def summary(self) -> str:
        """One line: strategy, balancer, size, rounds and estimated vs lower-bound time."""
        bound = (
            f"lower bound {self.lower_bound * 1e3:.2f} ms ({self.estimated_time / self.lower_bound:.2f}x)"
            if self.lower_bound
            else "no cross-host traffic"
        )
        return (
            f"{self.task.src_spec}{self.task.src_mesh.shape} -> {self.task.dst_spec}{self.task.dst_mesh.shape} "
            f"{self.task.nbytes / 2**20:.1f} MiB: {self.strategy.name}/{self.balancer.name}, "
            f"{len(self.tasks)} unit tasks in {self.num_rounds} rounds, "
            f"est {self.estimated_time * 1e3:.2f} ms vs {bound}"
        )


def verify_plan(plan: ReshardingPlan, units: tuple[UnitTask, ...], resources: dict[int, frozenset[int]]) -> None:
    """Checks the plan against its decomposition.

    Every unit task is scheduled exactly once, from a device that holds its
    slice, to exactly its receivers; rounds are numbered from 0 without gaps
    and the tasks of one round hold disjoint NIC ``resources`` (keyed by unit
    index); the estimate is not below the lower bound.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    seen = sorted(s.unit.index for s in plan.tasks)
    if seen != [u.index for u in units]:
        raise PlanVerificationError("plan does not schedule every unit task exactly once")
    busy: dict[tuple[int, int], int] = {}
    for s in plan.tasks:
        if s.sender not in s.unit.senders:
            raise PlanVerificationError(f"unit task {s.unit.index}: sender {s.sender} does not hold the slice")
        if sorted(s.route) != list(s.unit.receivers):
            raise PlanVerificationError(f"unit task {s.unit.index}: route {s.route} is not its receivers")
        if s.chunks < 1 or not 0 <= s.round < plan.num_rounds:
            raise PlanVerificationError(f"unit task {s.unit.index}: bad chunks {s.chunks} or round {s.round}")
        for r in resources[s.unit.index]:
            other = busy.setdefault((s.round, r), s.unit.index)
            if other != s.unit.index:
                raise PlanVerificationError(
                    f"round {s.round}: unit tasks {other} and {s.unit.index} both hold NIC resource {r}"
                )
    if {s.round for s in plan.tasks} != set(range(plan.num_rounds)):
        raise PlanVerificationError("plan has an empty round")
    if plan.estimated_time < plan.lower_bound * (1 - 1e-9):
        raise PlanVerificationError(
            f"estimated time {plan.estimated_time} is below the lower bound {plan.lower_bound}"
        )
