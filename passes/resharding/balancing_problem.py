"""The load-balancing and scheduling problem of §3.2 (Eq. 1-3), and its simulator.

Every unit task picks one sender host among its candidates; the choice fixes
its duration and the NIC resources it holds. A launch order then fixes the
timing: each task starts as soon as every resource it needs is free of the
tasks before it in the order (list scheduling). Any schedule that keeps
tasks sharing a resource apart can be reached this way by ordering tasks by
start time, so searching over (order, choice) loses nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from ..model.cluster import Cluster

from .strategies import Multicast, Strategy
from .unit_tasks import UnitTask

__all__ = ["BalancingProblem", "TaskOrder", "build_problem", "simulate", "assign_rounds"]


@dataclasses.dataclass(frozen=True)
class BalancingProblem:
    """Per task ``i`` and candidate ``c``: ``hosts[i][c]`` sends, taking
    ``durations[i][c]`` seconds in ``chunks[i][c]`` chunks and holding the NIC
    resources ``resources[i][c]`` (ids from ``strategies.send_resource`` and
    ``recv_resource``).

    ``nbytes[i]`` and ``devices[i]`` (sender plus receivers) feed heuristics;
    ``lowest[i]`` is the candidate holding the task's lowest-indexed sender
    device. Candidates are sorted by host id.
    """

    hosts: tuple[tuple[int, ...], ...]
    durations: tuple[tuple[float, ...], ...]
    chunks: tuple[tuple[int, ...], ...]
    resources: tuple[tuple[frozenset[int], ...], ...]
    nbytes: tuple[int, ...]
    devices: tuple[int, ...]
    lowest: tuple[int, ...]

    @property
    def num_tasks(self) -> int:
        return len(self.hosts)

    def min_duration(self, i: int) -> float:
        return min(self.durations[i])


@dataclasses.dataclass(frozen=True)
class TaskOrder:
    """A solution: launch order and, per task, the index of its chosen candidate."""

    order: tuple[int, ...]
    choice: tuple[int, ...]


def build_problem(
    units: Sequence[UnitTask],
    strategy: Strategy,
    cluster: Cluster,
    host_of: Callable[[int], int],
    *,
    chunks: int | None = None,
    itemsize: int = 1,
) -> BalancingProblem:
    """Costs every unit task from every candidate sender host.

    Args:
      chunks: fixed chunk count for chunked strategies; ``None`` lets the cost
        model pick one per task.
      itemsize: bytes per element, to cap the chunk count at one element each.
    """
    cost_cache: dict[tuple, tuple[float, int]] = {}
    # Many unit tasks share a receiver set (one destination tile's holders).
    layout_cache: dict[tuple[tuple[int, ...], int], Multicast] = {}
    hosts, durations, chunk_counts, resources = [], [], [], []
    for u in units:
        by_host: dict[int, int] = {}
        for s in u.senders:
            by_host.setdefault(host_of(s), s)  # senders ascend: keep each host's lowest id
        row_h, row_d, row_k, row_r = [], [], [], []
        for h in sorted(by_host):
            layout = layout_cache.get((u.receivers, h))
            if layout is None:
                layout = layout_cache[(u.receivers, h)] = Multicast.of(0, by_host[h], u.receivers, host_of)
            m = dataclasses.replace(layout, nbytes=u.nbytes)
            key = m.cost_key
            if key not in cost_cache:
                k = chunks if chunks is not None and strategy.chunked else strategy.best_chunks(
                    m, cluster, u.nbytes // itemsize
                )
                cost_cache[key] = (strategy.cost(m, cluster, k), k)
            d, k = cost_cache[key]
            row_h.append(h)
            row_d.append(d)
            row_k.append(k)
            row_r.append(strategy.resources(m))
        hosts.append(tuple(row_h))
        durations.append(tuple(row_d))
        chunk_counts.append(tuple(row_k))
        resources.append(tuple(row_r))
    return BalancingProblem(
        tuple(hosts),
        tuple(durations),
        tuple(chunk_counts),
        tuple(resources),
        tuple(u.nbytes for u in units),
        tuple(1 + len(u.receivers) for u in units),
        tuple(hosts[i].index(host_of(u.senders[0])) for i, u in enumerate(units)),
    )


def simulate(problem: BalancingProblem, solution: TaskOrder) -> tuple[tuple[float, ...], float]:
    """Start time of every task and the makespan (Eq. 1) under list scheduling."""
    free: dict[int, float] = {}
    starts = [0.0] * problem.num_tasks
    makespan = 0.0
    for i in solution.order:
        c = solution.choice[i]
        res = problem.resources[i][c]
        start = max((free.get(r, 0.0) for r in res), default=0.0)
        end = start + problem.durations[i][c]
        for r in res:
            free[r] = end
        starts[i] = start
        makespan = max(makespan, end)
    return tuple(starts), makespan


def assign_rounds(problem: BalancingProblem, solution: TaskOrder) -> tuple[tuple[int, ...], ...]:
    """Groups the order into rounds of tasks that share no resource.

    A task goes one round after the last earlier task it shares a resource
    with, so rounds run one after another and tasks within a round together.
    """
    last: dict[int, int] = {}
    rounds: list[list[int]] = []
    for i in solution.order:
        res = problem.resources[i][solution.choice[i]]
        r = 1 + max((last.get(x, -1) for x in res), default=-1)
        for x in res:
            last[x] = r
        while len(rounds) <= r:
            rounds.append([])
        rounds[r].append(i)
    return tuple(tuple(r) for r in rounds)
