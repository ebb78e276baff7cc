"""A unit task with its sender, route and timing fixed: what a strategy lowers into hop chains."""

from __future__ import annotations

import dataclasses

from .unit_tasks import UnitTask

__all__ = ["ScheduledTask"]


@dataclasses.dataclass(frozen=True)
class ScheduledTask:
    """A unit task with its sender, route and timing fixed.

    Attributes:
      unit: the unit task.
      sender: the source device that sends it (one of ``unit.senders``).
      route: ``unit.receivers`` in the order data flows (ring order for
        ``broadcast``; for other strategies, the order messages leave).
      chunks: pieces the slice is cut into (``broadcast`` pipelines them).
      round: the round it launches in; tasks of one round share no NIC.
      start, duration: simulated seconds.
    """

    unit: UnitTask
    sender: int
    route: tuple[int, ...]
    chunks: int
    round: int
    start: float
    duration: float
