"""Alpa's stage DP (passes.planner_alpa) against brute force over every partition and submesh
assignment, and its search's invariants."""

import itertools
import math

import numpy as np
import pytest

from meshpar.cluster import Cluster
from meshpar.passes.planning.layer_profile import LayerProfile, ModelProfile
from meshpar.passes.planning import planner_alpa
from meshpar.passes.planning.planner_alpa import cluster_layers, stage_dp, submesh_shapes
from meshpar.passes.planning.protocol import Hardware, NoPlanFits, PlanConstraints


def test_submesh_shapes_are_alpas():
    assert submesh_shapes(Cluster.dgx_h100(3)) == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (3, 8)]
    assert submesh_shapes(Cluster.aws_p3_8xlarge(2)) == [(1, 1), (1, 2), (1, 4), (2, 4)]


def test_layer_clustering_balances_flops():
    profile = ModelProfile(tuple(LayerProfile(f, 0, 0, 0, 0) for f in [1, 1, 1, 1, 4, 4, 1, 1, 1, 1]), 8)
    assert cluster_layers(profile, 16) == list(range(11))
    bounds = cluster_layers(profile, 4)
    assert bounds[0] == 0 and bounds[-1] == 10 and len(bounds) <= 5 and bounds == sorted(set(bounds))
    sums = [sum(x.flops for x in profile.layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    assert max(sums) <= 5  # a quarter of 16 FLOPs, give or take one layer
    with pytest.raises(ValueError, match="max_layers"):
        cluster_layers(profile, 0)


def _brute_force(stage_s, sizes, D, B):
    """min over every stage count, contiguous partition and submesh per stage using exactly D
    devices of  sum t + (B - 1) max t."""
    S_max, K = stage_s.shape[0] - 1, stage_s.shape[1] - 1
    best = math.inf
    for S in range(1, S_max + 1):
        for cuts in itertools.combinations(range(1, K), S - 1):
            bounds = (0, *cuts, K)
            for js in itertools.product(range(len(sizes)), repeat=S):
                if sum(sizes[j] for j in js) != D:
                    continue
                ts = [stage_s[S - p, bounds[p], bounds[p + 1], j] for p, j in enumerate(js)]
                if all(np.isfinite(ts)):
                    best = min(best, sum(ts) + (B - 1) * max(ts))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_stage_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    K, sizes, D, B = 4, [1, 2, 4], 4, int(rng.integers(1, 6))
    S_max = 4
    stage_s = np.full((S_max + 1, K + 1, K + 1, len(sizes)), math.inf)
    for s in range(1, S_max + 1):
        for k in range(K):
            for i in range(k + 1, K + 1):
                for j, size in enumerate(sizes):
                    # More layers cost more, more devices less; some entries do not fit.
                    if rng.random() > 0.15:
                        stage_s[s, k, i, j] = (i - k) * rng.uniform(0.5, 1.5) / size ** rng.uniform(0.3, 1.0)
    found = stage_dp(stage_s, sizes, D, B, gap=0.0)
    want = _brute_force(stage_s, sizes, D, B)
    if not math.isfinite(want):
        assert found is None
        return
    assert found is not None and found[0] == pytest.approx(want, rel=1e-9)
    stages = found[1]
    assert stages[0][0] == 0 and stages[-1][1] == K and sum(sizes[j] for _, _, j in stages) == D
    ts = [stage_s[len(stages) - p, k, i, j] for p, (k, i, j) in enumerate(stages)]
    assert sum(ts) + (B - 1) * max(ts) == pytest.approx(found[0])
    two = stage_dp(stage_s, sizes, D, B, gap=0.0, num_stages=2)
    assert two is None or len(two[1]) == 2 and two[0] >= found[0] - 1e-12


def _profile(L=8, batch=16):
    layer = LayerProfile(flops=2e9, param_bytes=4e7, optimizer_bytes=8e7, activation_bytes=2e5, boundary_bytes=1e4,
                         tp_bytes=2e4)
    return ModelProfile.uniform(L, layer, batch)


def test_search_uses_every_device_and_ranks_by_alpas_latency():
    cluster = Cluster.aws_p3_8xlarge(2)
    plans = planner_alpa.plan(_profile(), cluster, Hardware(1e13))
    assert [p.predicted_step_s for p in plans] == sorted(p.predicted_step_s for p in plans)
    for plan in plans:
        assert plan.planner == "alpa_dp" and plan.stages[0].start == 0 and plan.stages[-1].stop == 8
        assert all(a.stop == b.start for a, b in zip(plan.stages, plan.stages[1:]))
        assert sum(s.shape[0] * s.shape[1] for s in plan.stages) == cluster.num_devices
    fixed = planner_alpa.plan(_profile(), cluster, Hardware(1e13), PlanConstraints(num_stages=2, num_micro_batches=4))
    assert all(p.num_stages == 2 and p.num_micro_batches == 4 for p in fixed)


def test_search_respects_the_memory_budget_and_says_when_nothing_fits():
    cluster = Cluster.aws_p3_8xlarge(2)
    unbounded = planner_alpa.plan(_profile(), cluster, Hardware(1e13))
    budget = 0.5 * max(unbounded[0].peak_memory_bytes)
    for plan in planner_alpa.plan(_profile(), cluster, Hardware(1e13), PlanConstraints(memory_budget_bytes=budget)):
        assert max(plan.peak_memory_bytes) <= budget
    with pytest.raises(NoPlanFits, match="memory_budget_bytes"):
        planner_alpa.plan(_profile(), cluster, Hardware(1e13), PlanConstraints(memory_budget_bytes=1e3))
