"""Load balancing and ordering of unit tasks, selectable by name (§3.2).

Every balancer maps a ``BalancingProblem`` to a ``TaskOrder`` and is
deterministic for a given seed, so every process computes the same plan. A
``Balancer`` also says how a host's sends spread over its devices; a new one is
one ``Balancer`` entry of ``BALANCERS``.

- ``naive``: each task sent from the host of its lowest-indexed sender
  device, in decomposition order (the paper's baseline).
- ``load_balance``: Eq. 4's greedy: tasks by descending duration (ties keep
  decomposition order), each to the least-loaded candidate host, run in that
  order. With ``local_allgather`` this is what Alpa ships.
- ``dfs``: depth-first search over order and sender, pruned by lower bounds.
- ``greedy_random``: rounds of non-conflicting tasks, the best of R random
  orders each round.
- ``ensemble``: ``dfs`` and ``greedy_random``, the faster plan wins (default).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from .balancing_problem import BalancingProblem, TaskOrder, simulate
from .dfs_search import dfs_search
from .greedy_random import greedy_random_search

__all__ = ["Balancer", "BalancerOptions", "BALANCERS", "TaskOrdering", "get_balancer", "naive", "load_balance", "dfs",
           "greedy_random", "ensemble"]


@dataclasses.dataclass(frozen=True)
class BalancerOptions:
    """Knobs of the search-based balancers.

    Attributes:
      seed: seeds ``greedy_random``'s orders.
      dfs_max_evaluations: ``dfs`` budget in candidate moves looked at; a
        count, not a clock, so plans are the same on every machine.
      dfs_time_budget_s: optional wall-clock cap on ``dfs`` as well; plans may
        then differ between machines (the runtime's fingerprint check catches
        that).
      greedy_orders: random orders tried per round by ``greedy_random`` (R).
    """

    seed: int = 0
    dfs_max_evaluations: int = 200_000
    dfs_time_budget_s: float | None = None
    greedy_orders: int = 16

    def __post_init__(self) -> None:
        if self.dfs_max_evaluations < 1:
            raise ValueError(f"dfs_max_evaluations: expected >= 1, got {self.dfs_max_evaluations}")
        if self.dfs_time_budget_s is not None and not self.dfs_time_budget_s > 0:
            raise ValueError(f"dfs_time_budget_s: expected a positive number of seconds, got {self.dfs_time_budget_s}")
        if self.greedy_orders < 1:
            raise ValueError(f"greedy_orders: expected >= 1, got {self.greedy_orders}")


TaskOrdering = Callable[[BalancingProblem, BalancerOptions], TaskOrder]


@dataclasses.dataclass(frozen=True)
class Balancer:
    """One entry of ``BALANCERS``.

    Attributes:
      name: the user's name for it (``plan_resharding(balancer=...)``).
      order: ``(problem, options) ->`` each task's sender host and the launch order;
        deterministic for a given ``options.seed``.
      spread_senders: whether a host's sends spread over its devices (the least-loaded one
        sends next); ``False``: always its lowest-indexed holder, as the paper's naive
        baseline defines it.
    """

    name: str
    order: TaskOrdering = dataclasses.field(repr=False)
    spread_senders: bool = True

    def __call__(self, problem: BalancingProblem, options: BalancerOptions) -> TaskOrder:
        return self.order(problem, options)


def naive(problem: BalancingProblem, options: BalancerOptions) -> TaskOrder:
    return TaskOrder(tuple(range(problem.num_tasks)), problem.lowest)


def load_balance(problem: BalancingProblem, options: BalancerOptions) -> TaskOrder:
    order = sorted(range(problem.num_tasks), key=lambda i: -problem.min_duration(i))
    load: dict[int, float] = {}
    choice = [0] * problem.num_tasks
    for i in order:
        hosts = problem.hosts[i]
        k = min(range(len(hosts)), key=lambda k: (load.get(hosts[k], 0.0), k))
        choice[i] = k
        load[hosts[k]] = load.get(hosts[k], 0.0) + problem.durations[i][k]
    return TaskOrder(tuple(order), tuple(choice))


def dfs(problem: BalancingProblem, options: BalancerOptions) -> TaskOrder:
    return dfs_search(
        problem,
        incumbent=load_balance(problem, options),
        max_evaluations=options.dfs_max_evaluations,
        time_budget_s=options.dfs_time_budget_s,
    )


def greedy_random(problem: BalancingProblem, options: BalancerOptions) -> TaskOrder:
    return greedy_random_search(problem, seed=options.seed, num_orders=options.greedy_orders)


def ensemble(problem: BalancingProblem, options: BalancerOptions) -> TaskOrder:
    candidates = [dfs(problem, options), greedy_random(problem, options)]
    return min(candidates, key=lambda s: simulate(problem, s)[1])


# Name -> balancer; its name is resolved only by ``get_balancer``, at the API.
BALANCERS: dict[str, Balancer] = {
    b.name: b for b in (
        Balancer("naive", naive, spread_senders=False),
        Balancer("load_balance", load_balance),
        Balancer("dfs", dfs),
        Balancer("greedy_random", greedy_random),
        Balancer("ensemble", ensemble),
    )
}


def get_balancer(name: str | Balancer) -> Balancer:
    """The balancer called ``name`` (a ``Balancer`` is itself); ``ValueError`` listing the
    choices otherwise."""
    if isinstance(name, Balancer):
        return name
    try:
        return BALANCERS[name]
    except (KeyError, TypeError):
        raise ValueError(f"balancer: unknown {name!r}; expected one of {sorted(BALANCERS)}") from None
