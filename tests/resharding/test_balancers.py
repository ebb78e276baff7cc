"""Balancers against brute force and each other."""

import itertools
import random

import pytest

from meshpar.passes import BALANCERS, BalancerOptions, plan_resharding
from meshpar.passes.resharding.balancing_problem import BalancingProblem, TaskOrder, simulate
from meshpar.passes.resharding.dfs_search import dfs_search
from meshpar.passes.resharding.strategies import recv_resource, send_resource
from random_tasks import random_task


def _random_problem(seed: int, n: int) -> BalancingProblem:
    rng = random.Random(seed)
    hosts, durations, resources = [], [], []
    for _ in range(n):
        cands = tuple(sorted(rng.sample(range(3), rng.randrange(1, 3))))
        receivers = rng.sample(range(3, 6), rng.randrange(1, 3))
        size = rng.choice([1.0, 2.0, 3.0])
        hosts.append(cands)
        durations.append(tuple(size * rng.choice([1.0, 1.0, 1.5]) for _ in cands))
        resources.append(tuple(frozenset({send_resource(h)} | {recv_resource(r) for r in receivers}) for h in cands))
    return BalancingProblem(
        tuple(hosts), tuple(durations), tuple((1,) * len(h) for h in hosts), tuple(resources),
        tuple(1 for _ in hosts), tuple(2 for _ in hosts), tuple(0 for _ in hosts),
    )


def _brute_force(problem: BalancingProblem) -> float:
    """Independent reference: every order x every sender choice, each task as early as its NICs allow."""
    best = float("inf")
    n = problem.num_tasks
    for choice in itertools.product(*[range(len(h)) for h in problem.hosts]):
        for order in itertools.permutations(range(n)):
            free: dict[int, float] = {}
            end_max = 0.0
            for i in order:
                res = problem.resources[i][choice[i]]
                start = max([free.get(r, 0.0) for r in res] + [0.0])
                end = start + problem.durations[i][choice[i]]
                free.update({r: end for r in res})
                end_max = max(end_max, end)
            best = min(best, end_max)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dfs_is_optimal_on_small_instances(seed):
    n = 4 + seed % 3  # 4, 5 or 6 tasks
    problem = _random_problem(seed, n)
    found = dfs_search(problem, max_evaluations=None)
    assert sorted(found.order) == list(range(n))
    assert simulate(problem, found)[1] == pytest.approx(_brute_force(problem))


def _small_random_tasks(count: int, max_units: int = 6):
    """The first ``count`` random tasks with at most ``max_units`` unit tasks."""
    from meshpar.passes.resharding.unit_tasks import decompose

    seed = 0
    while count:
        task, cluster = random_task(10_000 + seed)
        seed += 1
        if len(decompose(task)) <= max_units:
            count -= 1
            yield task, cluster


@pytest.mark.parametrize("strategy", ["broadcast", "local_allgather"])
def test_exhaustive_dfs_matches_brute_force_on_real_resharding(strategy):
    from meshpar.passes.resharding.balancing_problem import build_problem
    from meshpar.passes.resharding.strategies import get_strategy
    from meshpar.passes.resharding.unit_tasks import decompose

    for task, cluster in _small_random_tasks(6):
        problem = build_problem(decompose(task), get_strategy(strategy), cluster, task.host_of, itemsize=task.itemsize)
        assert simulate(problem, dfs_search(problem, max_evaluations=None))[1] == pytest.approx(_brute_force(problem))


@pytest.mark.parametrize("seed", range(40))
def test_search_balancers_never_worse_than_naive_and_bound_holds(seed):
    task, cluster = random_task(seed)
    plans = {b: plan_resharding(task, cluster, balancer=b) for b in BALANCERS}
    naive = plans["naive"].estimated_time
    for b in ("greedy_random", "ensemble", "dfs"):
        if b != "greedy_random":
            assert plans[b].estimated_time <= naive * (1 + 1e-9), b
    assert plans["ensemble"].estimated_time <= min(plans["dfs"].estimated_time, plans["greedy_random"].estimated_time) * (1 + 1e-9)
    assert plans["dfs"].estimated_time <= plans["load_balance"].estimated_time * (1 + 1e-9)
    lb = plans["naive"].lower_bound
    assert all(p.lower_bound == lb for p in plans.values())
    assert all(p.estimated_time >= lb * (1 - 1e-9) for p in plans.values())


@pytest.mark.parametrize("seed", range(40))
def test_greedy_random_never_worse_than_naive(seed):
    task, cluster = random_task(seed)
    greedy = plan_resharding(task, cluster, balancer="greedy_random").estimated_time
    naive = plan_resharding(task, cluster, balancer="naive").estimated_time
    assert greedy <= naive * (1 + 1e-9)


def test_lower_bound_never_above_the_optimum():
    from meshpar.passes.resharding.balancing_problem import build_problem
    from meshpar.passes.resharding.strategies import STRATEGIES
    from meshpar.passes.resharding.unit_tasks import decompose

    for task, cluster in _small_random_tasks(8):
        for strategy in STRATEGIES.values():
            problem = build_problem(decompose(task), strategy, cluster, task.host_of, itemsize=task.itemsize)
            plan = plan_resharding(task, cluster, strategy=strategy.name, balancer="naive")
            assert plan.lower_bound <= _brute_force(problem) * (1 + 1e-9)


def test_dfs_budget_returns_incumbent_when_exhausted():
    problem = _random_problem(1, 6)
    incumbent = TaskOrder(tuple(range(6)), (0,) * 6)
    found = dfs_search(problem, incumbent=incumbent, max_evaluations=1)
    assert simulate(problem, found)[1] <= simulate(problem, incumbent)[1]


def test_unknown_balancer_and_bad_options():
    from meshpar.passes.resharding.balancers import get_balancer

    with pytest.raises(ValueError, match=r"balancer: unknown 'fastest'"):
        get_balancer("fastest")
    with pytest.raises(ValueError, match="greedy_orders"):
        BalancerOptions(greedy_orders=0)
    with pytest.raises(ValueError, match="dfs_max_evaluations"):
        BalancerOptions(dfs_max_evaluations=0)
