"""Depth-first search over launch order and sender choice, with pruning (§3.2).

Each level of the tree appends one task, with one of its candidate senders,
to the launch order; a leaf is a complete ``TaskOrder``. Children are tried
earliest-finish first, so the first dive is already a good greedy schedule.
A branch is pruned when a lower bound on any completion below it reaches the
best makespan found:

- per NIC resource: its free time plus the durations of the remaining tasks
  that need it whatever sender they get (the paper's Eq. 4-style bound);
- over sender hosts: their total free time plus the remaining tasks'
  shortest durations, spread evenly over all candidate hosts.

Tasks with identical candidates, durations and resources are interchangeable,
so only the first unscheduled one of each such class is branched on.
"""

from __future__ import annotations

import time

from .balancing_problem import BalancingProblem, TaskOrder, simulate
from .strategies import send_resource

__all__ = ["dfs_search"]

# Relative slack so float noise never counts as an improvement.
_SLACK = 1 - 1e-12


def dfs_search(
    problem: BalancingProblem,
    *,
    incumbent: TaskOrder | None = None,
    max_evaluations: int | None = 200_000,
    time_budget_s: float | None = None,
) -> TaskOrder:
    """The best ``TaskOrder`` found within the budget.

    With ``max_evaluations=None`` and no time budget the search is exhaustive
    and the result optimal. Never worse than ``incumbent``.
    """
    n = problem.num_tasks
    if n == 0:
        return TaskOrder((), ())
    best = incumbent
    best_value = simulate(problem, incumbent)[1] if incumbent is not None else float("inf")

    class_of: dict[tuple, int] = {}
    members: list[list[int]] = []
    for i in range(n):
        key = (problem.hosts[i], problem.durations[i], problem.resources[i])
        if key not in class_of:
            class_of[key] = len(members)
            members.append([])
        members[class_of[key]].append(i)
    taken = [0] * len(members)

    num_resources = 1 + max((r for row in problem.resources for res in row for r in res), default=0)
    free = [0.0] * num_resources
    fixed_rest = [0.0] * num_resources  # remaining load each resource must carry
    fixed_sets = []
    for i in range(n):
        common = frozenset.intersection(*problem.resources[i])
        fixed_sets.append(common)
        for r in common:
            fixed_rest[r] += problem.min_duration(i)
    networked = [i for i in range(n) if any(problem.resources[i])]
    sender_resources = sorted({send_resource(h) for i in networked for h in problem.hosts[i]})
    rest_min_total = sum(problem.min_duration(i) for i in networked)
    is_networked = [bool(any(problem.resources[i])) for i in range(n)]

    order: list[int] = []
    choice = [0] * n
    makespan = 0.0
    evaluations = 0
    deadline = None if time_budget_s is None else time.monotonic() + time_budget_s

    def children() -> list[tuple[float, float, int, int]]:
        nonlocal evaluations
        out = []
        for c, group in enumerate(members):
            if taken[c] == len(group):
                continue
            i = group[taken[c]]
            for k, res in enumerate(problem.resources[i]):
                start = max((free[r] for r in res), default=0.0)
                out.append((start + problem.durations[i][k], start, c, k))
                evaluations += 1
        out.sort()
        return out

    def lower_bound() -> float:
        bound = makespan
        for r in range(num_resources):
            if fixed_rest[r]:
                bound = max(bound, free[r] + fixed_rest[r])
        if sender_resources:
            spread = (sum(free[r] for r in sender_resources) + rest_min_total) / len(sender_resources)
            bound = max(bound, spread)
        return bound

    # Iterative DFS: each frame holds its sorted children and the undo record
    # of the move that led to it.
    stack: list[tuple[list, int]] = [(children(), 0)]
    undo: list[tuple[int, int, list[tuple[int, float]], float]] = []
    while stack:
        out_of_budget = (max_evaluations is not None and evaluations >= max_evaluations) or (
            deadline is not None and time.monotonic() > deadline
        )
        kids, pos = stack[-1]
        if out_of_budget or pos == len(kids):
            stack.pop()
            if undo:
                c, i, saved, old_makespan = undo.pop()
                for r, v in saved:
                    free[r] = v
                makespan = old_makespan
                taken[c] -= 1
                order.pop()
                for r in fixed_sets[i]:
                    fixed_rest[r] += problem.min_duration(i)
                if is_networked[i]:
                    rest_min_total += problem.min_duration(i)
            continue
        stack[-1] = (kids, pos + 1)
        end, start, c, k = kids[pos]
        if end >= best_value * _SLACK:
            # Children are sorted by finish time: the rest can only be later.
            stack[-1] = (kids, len(kids))
            continue
        i = members[c][taken[c]]
        res = problem.resources[i][k]
        undo.append((c, i, [(r, free[r]) for r in res], makespan))
        for r in res:
            free[r] = end
        makespan = max(makespan, end)
        taken[c] += 1
        order.append(i)
        choice[i] = k
        for r in fixed_sets[i]:
            fixed_rest[r] -= problem.min_duration(i)
        if is_networked[i]:
            rest_min_total -= problem.min_duration(i)
        if len(order) == n:
            if makespan < best_value * _SLACK:
                best_value = makespan
                best = TaskOrder(tuple(order), tuple(choice))
            stack.append(([], 0))  # leaf: popped (and undone) next iteration
        elif lower_bound() >= best_value * _SLACK:
            stack.append(([], 0))
        else:
            stack.append((children(), 0))
    if best is None:
        raise RuntimeError("dfs_search: the budget ran out before any complete schedule; pass an incumbent")
    return best
