"""The resharding planner: one visible pipeline of passes, verified between steps.

    ReshardingTask
      -> decompose             unit tasks (§2.2)         verify_decomposition
      -> build_problem         per-sender costs (§3.1)
      -> balancer              sender choice + order (§3.2)
      -> simulate, rounds      timing (Eq. 1-3)
      -> ReshardingPlan                                  verify_plan
"""

from __future__ import annotations

from ..compiler_pass import compiler_pass
from ..model.cluster import Cluster

from .balancers import Balancer, BalancerOptions, get_balancer
from .balancing_problem import assign_rounds, build_problem, simulate
from .lower_bound import lower_bound
from .resharding_plan import ReshardingPlan, ScheduledTask, verify_plan
from .resharding_task import ReshardingTask
from .strategies import Strategy, get_strategy, ring_route
from .unit_tasks import decompose, verify_decomposition

__all__ = ["plan_resharding", "ALPA_BASELINE"]

# (strategy, balancer) of what Alpa ships: send/recv with a local all-gather,
# least-loaded sender, destination-tile-major order.
ALPA_BASELINE = ("local_allgather", "load_balance")


@compiler_pass
def plan_resharding(
    task: ReshardingTask,
    cluster: Cluster,
    *,
    strategy: str | Strategy = "broadcast",
    balancer: str | Balancer = "ensemble",
    chunks: int | None = None,
    options: BalancerOptions = BalancerOptions(),
) -> ReshardingPlan:
    """Plans ``task`` on ``cluster``.

    Args:
      task: the tensor, its meshes and specs.
      cluster: bandwidths and latency for the cost model.
      strategy: a ``Strategy`` or its name in ``STRATEGIES``: ``broadcast``,
        ``send_recv``, ``local_allgather`` or ``global_allgather``.
      balancer: a ``Balancer`` or its name in ``BALANCERS``: ``ensemble``, ``dfs``,
        ``greedy_random``, ``load_balance`` or ``naive``.
      chunks: chunk count for ``broadcast``; ``None`` lets the cost model pick.
      options: seeds and budgets of the search balancers.

    Returns:
      A verified plan; the same inputs give the same plan (and fingerprint).
    """
    if not isinstance(task, ReshardingTask):
        raise TypeError(f"task: expected a ReshardingTask, got {type(task).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    strat = get_strategy(strategy)
    balance = get_balancer(balancer)
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks: expected a positive integer or None, got {chunks!r}")

    units = decompose(task)
    verify_decomposition(task, units)
    problem = build_problem(units, strat, cluster, task.host_of, chunks=chunks, itemsize=task.itemsize)
    solution = balance(problem, options)
    starts, makespan = simulate(problem, solution)
    rounds = assign_rounds(problem, solution)

    round_of = {i: r for r, members in enumerate(rounds) for i in members}
    position = {i: p for p, i in enumerate(solution.order)}
    sent_bytes: dict[int, int] = {}
    scheduled = []
    for i in sorted(solution.order, key=lambda i: (round_of[i], position[i])):
        u, k = units[i], solution.choice[i]
        host = problem.hosts[i][k]
        on_host = [s for s in u.senders if task.host_of(s) == host]
        # Spread a host's sends over its devices; the naive baseline always
        # uses the lowest-indexed one, as the paper defines it.
        sender = (min(on_host, key=lambda s: (sent_bytes.get(s, 0), s)) if balance.spread_senders
                  else on_host[0])
        sent_bytes[sender] = sent_bytes.get(sender, 0) + u.nbytes
        scheduled.append(
            ScheduledTask(
                unit=u,
                sender=sender,
                route=ring_route(sender, u.receivers, task.host_of),
                chunks=problem.chunks[i][k],
                round=round_of[i],
                start=starts[i],
                duration=problem.durations[i][k],
            )
        )
    plan = ReshardingPlan(
        task=task,
        strategy=strat,
        balancer=balance,
        tasks=tuple(scheduled),
        num_rounds=len(rounds),
        estimated_time=makespan,
        lower_bound=lower_bound(task, units, cluster),
    )
    verify_plan(plan, units, {i: problem.resources[i][solution.choice[i]] for i in range(len(units))})
    return plan
