import dataclasses

import numpy as np
import pytest

from meshpar.passes import PlanVerificationError, STRATEGIES, plan_resharding
from meshpar.passes.resharding.unit_tasks import decompose, verify_decomposition
from random_tasks import random_task


def _block(x, bounds):
    return x[tuple(slice(a, b) for a, b in bounds)]


def _execute_with_numpy(plan):
    """Moves data as the plan says, device by device, and returns each destination buffer."""
    task = plan.task
    x = np.random.default_rng(0).standard_normal(task.shape)
    src = {d: (t.bounds, _block(x, t.bounds)) for t in task.src_tiles for d in t.devices}
    dst = {d: (t.bounds, np.full(t.shape, np.nan)) for t in task.dst_tiles for d in t.devices}
    for s in plan.tasks:
        src_bounds, shard = src[s.sender]
        piece = _block(shard, [(a - o, b - o) for (a, b), (o, _) in zip(s.unit.bounds, src_bounds)])
        for r in s.route:
            dst_bounds, buf = dst[r]
            target = _block(buf, [(a - o, b - o) for (a, b), (o, _) in zip(s.unit.bounds, dst_bounds)])
            assert np.isnan(target).all(), "a destination element is written twice"
            target[...] = piece
    return x, dst


@pytest.mark.parametrize("seed", range(60))
def test_plans_deliver_exactly_each_destination_tile(seed):
    task, cluster = random_task(seed)
    strategy = list(STRATEGIES)[seed % 4]
    plan = plan_resharding(task, cluster, strategy=strategy)
    x, dst = _execute_with_numpy(plan)
    for device, (bounds, buf) in dst.items():
        np.testing.assert_array_equal(buf, _block(x, bounds), err_msg=f"device {device}")


def test_decomposition_of_paper_figure_2_task_1():
    # S01R on a 2x2 mesh -> S0R on another 2x2 mesh, 4x4 matrix: every
    # destination row-half is made of two source row-quarters.
    from meshpar import Cluster
    from meshpar.passes import ReshardingTask

    c = Cluster.uniform(4, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=1e10)
    task = ReshardingTask((4, 4), 4, c.mesh([0, 1], 2), "S01R", c.mesh([2, 3], 2), "S0R")
    units = decompose(task)
    assert [u.bounds for u in units] == [((0, 1), (0, 4)), ((1, 2), (0, 4)), ((2, 3), (0, 4)), ((3, 4), (0, 4))]
    assert [u.senders for u in units] == [(0,), (1,), (2,), (3,)]
    assert [u.receivers for u in units] == [(4, 5), (4, 5), (6, 7), (6, 7)]
    assert all(u.nbytes == 16 for u in units)


@pytest.mark.parametrize("mutation", ["shrink", "duplicate", "drop", "wrong_sender"])
def test_verifier_rejects_broken_decompositions(mutation):
    from meshpar import Cluster
    from meshpar.passes import ReshardingTask

    c = Cluster.uniform(4, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=1e10)
    task = ReshardingTask((8, 6, 4), 4, c.mesh([0, 1], 2), "S0RR", c.mesh([2, 3], 2), "RS1R")
    units = list(decompose(task))
    verify_decomposition(task, tuple(units))
    big = max(units, key=lambda u: u.nbytes)
    i = units.index(big)
    if mutation == "shrink":
        d = next(d for d, (a, b) in enumerate(big.bounds) if b - a > 1)
        bounds = list(big.bounds)
        bounds[d] = (bounds[d][0], bounds[d][1] - 1)
        units[i] = dataclasses.replace(big, bounds=tuple(bounds))
    elif mutation == "duplicate":
        units.append(dataclasses.replace(big, index=len(units)))
    elif mutation == "drop":
        units.pop(i)
    else:
        stranger = next(d for d in task.src_mesh.devices if d not in big.senders)
        units[i] = dataclasses.replace(big, senders=(stranger,))
    with pytest.raises(PlanVerificationError):
        verify_decomposition(task, tuple(units))
