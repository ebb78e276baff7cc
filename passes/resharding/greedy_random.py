"""Greedy search with randomization (§3.2).

Builds the schedule round by round: each round is a set of tasks that share
no NIC resource, and of R random tries the one involving the most devices
(ties: most bytes) is kept. Resharding tasks are mostly many identical unit
tasks spread evenly over the hosts, which is why this finds optimal
schedules quickly in practice.

A try visits the sender hosts in random order and gives each the first task,
from a random point of that host's (shuffled) tasks, whose resources are
still free, stopping once every receiving NIC is busy. That
yields the same kind of random maximal set as scanning a random order of all
tasks, but costs about one look per host instead of one per task: with
thousands of unit tasks per round the plain scan spends nearly all its time
rejecting tasks whose hosts are already busy. Identical tasks are grouped so
each group is looked at once.
"""

from __future__ import annotations

import numpy as np

from .balancing_problem import BalancingProblem, TaskOrder
from .strategies import is_recv_resource, send_resource

__all__ = ["greedy_random_search"]


def greedy_random_search(problem: BalancingProblem, *, seed: int = 0, num_orders: int = 16) -> TaskOrder:
    """Rounds of resource-disjoint tasks, concatenated into a launch order."""
    n = problem.num_tasks
    rng = np.random.default_rng(seed)
    choice = [0] * n
    # Purely local tasks hold no NIC: they all go first, in one round.
    order = [i for i in range(n) if not any(problem.resources[i])]

    groups: dict[tuple, list[int]] = {}
    for i in range(n):
        if any(problem.resources[i]):
            groups.setdefault((problem.hosts[i], problem.durations[i], problem.resources[i]), []).append(i)
    members = [list(reversed(m)) for m in groups.values()]  # pop() yields ascending index
    keys = list(groups)
    # options[h]: (group, candidate) pairs that host h can send.
    options: dict[int, list[tuple[int, int]]] = {}
    for g, (hosts, _, _) in enumerate(keys):
        for k, h in enumerate(hosts):
            options.setdefault(h, []).append((g, k))
    sender_hosts = np.array(sorted(options), dtype=np.int64)
    live_groups = {h: len(opts) for h, opts in options.items()}
    # How many live groups can use each receiving NIC; the set of NICs with a
    # positive count is what a round can still fill.
    group_receivers = [{r for res in key[2] for r in res if is_recv_resource(r)} for key in keys]
    demand: dict[int, int] = {}
    for rs in group_receivers:
        for r in rs:
            demand[r] = demand.get(r, 0) + 1

    while any(members):
        for opts in options.values():
            rng.shuffle(opts)
        receiving = {r for r, count in demand.items() if count}
        best: tuple[tuple[int, int], list[tuple[int, int]], dict[int, int]] | None = None
        for _ in range(num_orders):
            used: set[int] = set()
            picked: list[tuple[int, int]] = []
            taken: dict[int, int] = {}
            devices = nbytes = busy_receivers = 0
            hosts = rng.permutation(sender_hosts)
            offsets = rng.integers(0, 1 << 30, size=len(hosts))
            for h, offset in zip(hosts.tolist(), offsets.tolist()):
                if send_resource(h) in used:
                    continue
                opts = options[h]
                for j in range(len(opts)):
                    g, k = opts[(offset + j) % len(opts)]
                    t = taken.get(g, 0)
                    if t == len(members[g]):
                        continue
                    res = keys[g][2][k]
                    if used.isdisjoint(res):
                        used |= res
                        i = members[g][-1 - t]
                        taken[g] = t + 1
                        picked.append((i, k))
                        devices += problem.devices[i]
                        nbytes += problem.nbytes[i]
                        busy_receivers += len(res & receiving)
                        break
                if busy_receivers == len(receiving):
                    break  # every receiving NIC is busy: nothing else fits
            score = (devices, nbytes)
            if best is None or score > best[0]:
                best = (score, picked, taken)
        assert best is not None and best[1], "a non-empty problem always admits one task per round"
        _, picked, taken = best
        for i, k in sorted(picked, key=lambda p: (-problem.durations[p[0]][p[1]], p[0])):
            choice[i] = k
            order.append(i)
        for g, t in taken.items():
            del members[g][-t:]
            if not members[g]:
                for r in group_receivers[g]:
                    demand[r] -= 1
                for h in keys[g][0]:
                    live_groups[h] -= 1
        # Drop hosts with nothing left to send so tries stop visiting them.
        sender_hosts = np.array([h for h in sender_hosts.tolist() if live_groups[h]], dtype=np.int64)
    return TaskOrder(tuple(order), tuple(choice))
