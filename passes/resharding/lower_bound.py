"""A lower bound on any plan's time for a resharding task, from volumes alone.

Whatever the strategy, balancer or order, every byte that a destination host
needs and does not already hold must enter that host's NIC, every byte only
one source host holds must leave that host's NIC at least once, and all such
bytes together must leave some source host. Each unit task moving data across
hosts holds those NICs for at least one message latency plus its bytes at NIC
speed, and tasks sharing a NIC do not overlap (Eq. 3), so the busiest NIC's
total bounds every plan from below.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..model.cluster import Cluster

from .resharding_task import ReshardingTask
from .unit_tasks import UnitTask

__all__ = ["lower_bound"]


def lower_bound(task: ReshardingTask, units: Sequence[UnitTask], cluster: Cluster) -> float:
    """Seconds no plan for ``task`` can beat on ``cluster``."""
    into: dict[int, float] = {}
    only: dict[int, float] = {}
    total = 0.0
    source_hosts: set[int] = set()
    for u in units:
        holders = {task.host_of(s) for s in u.senders}
        needy = {task.host_of(r) for r in u.receivers} - holders
        if not needy:
            continue
        busy = cluster.latency + u.nbytes / cluster.inter_host_bandwidth
        for h in needy:
            into[h] = into.get(h, 0.0) + busy
        if len(holders) == 1:
            (g,) = holders
            only[g] = only.get(g, 0.0) + busy
        total += busy
        source_hosts |= holders
    if not total:
        return 0.0
    return max(max(into.values()), max(only.values(), default=0.0), total / len(source_hosts))
