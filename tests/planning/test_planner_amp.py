"""The AMP planner (passes.planner_amp): its cost on hand-computed cases, its partition DP
against brute force, the seed's Megatron partitions, and the search's constraints, memory
budget and determinism. Pure numpy: no devices."""

import itertools
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest

from meshpar.cluster import Cluster
from meshpar.passes.planning.layer_profile import LayerProfile, ModelProfile
from meshpar.passes.planning.planner_amp import (MEGATRON_PLACEMENT, PLACEMENTS, estimate, megatron_uniform_partition,
                                        partition_layers, pipeline_cost, search)

# 2 hosts of 2 devices: every number below is easy to follow by hand
SMALL = Cluster.uniform(2, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=1e10)
TWO_LAYERS = ModelProfile((
    LayerProfile(flops=1e9, param_bytes=1e6, optimizer_bytes=2e6, activation_bytes=1e3, boundary_bytes=1e4,
                 tp_bytes=1e5),
    LayerProfile(flops=2e9, param_bytes=3e6, optimizer_bytes=6e6, activation_bytes=2e3, boundary_bytes=0.0,
                 tp_bytes=2e5),
), batch_size=8)


def _gpt(num_blocks, h=1024, seq=1024, batch=32):
    """AMP's GPT-2 layout (§6.5.1): 2 layers before the blocks, 4 after."""
    block = LayerProfile(flops=24 * seq * h * h, param_bytes=12 * h * h * 2, optimizer_bytes=12 * h * h * 12,
                         activation_bytes=34 * seq * h, boundary_bytes=seq * h * 2, tp_bytes=2 * seq * h * 2)
    embed = LayerProfile(flops=2 * seq * h * 50257, param_bytes=50257 * h * 2, optimizer_bytes=50257 * h * 12,
                         activation_bytes=seq * h * 2, boundary_bytes=seq * h * 2)
    noop = LayerProfile(0.0, 0.0, 0.0, 0.0, boundary_bytes=seq * h * 2)
    layers = (embed, noop) + (block,) * num_blocks + (noop, noop, embed, noop)
    return ModelProfile(layers, batch, "gpt")


def _random_profile(rng, L, batch):
    return ModelProfile(tuple(
        LayerProfile(flops=float(rng.uniform(1e9, 1e11)), param_bytes=float(rng.uniform(1e6, 1e8)),
                     optimizer_bytes=float(rng.uniform(2e6, 2e8)), activation_bytes=float(rng.uniform(1e4, 1e6)),
                     boundary_bytes=float(rng.uniform(1e3, 1e6)), tp_bytes=float(rng.uniform(0, 1e6)))
        for _ in range(L)), batch)


# -- the cost ------------------------------------------------------------------------------


def test_pipeline_cost_by_hand():
    # stages [1] and [2, 3]: g = (4 - 1) · 5 + 0.5 + (1 + 5)
    assert pipeline_cost([1.0, 2.0, 3.0], [0.5, 0.25], (0, 1, 3), 4) == pytest.approx(21.5)
    # per-boundary edges: the cut after layer 1 as boundary 1 costs 0.7
    edges = [[0.5, 0.1], [0.2, 0.7]]
    assert pipeline_cost([1.0, 2.0, 3.0], edges, (0, 1, 2, 3), 2) == pytest.approx(1 * 3 + 0.5 + 0.7 + 6)
    assert pipeline_cost([1.0, 2.0, 3.0], [0.5, 0.25], (0, 3), 1) == pytest.approx(6.0)


def test_estimate_tensor_parallel_by_hand():
    # tp=2 inside each host, stage 0 on host 0, stage 1 on host 1; b=2, gas=8/2=4
    plan = estimate(TWO_LAYERS, SMALL, 1e12, dp=1, tp=2, micro_batch_size=2)
    t0 = 3 * 2 * 1e9 / (2 * 1e12) + 2 * (2 - 1) / 2 * (2 * 2 * 1e5) / 1e10  # compute + intra-host all-reduces
    t1 = 3 * 2 * 2e9 / (2 * 1e12) + 2 * (2 - 1) / 2 * (2 * 2 * 2e5) / 1e10
    e0 = 2 * 1e4 / (1e9 / 2)  # both tensor ranks send across host 0's NIC at once
    assert (plan.pp, plan.num_micro_batches, plan.partition) == (2, 4, (0, 1, 2))
    assert plan.predicted_step_s == pytest.approx((4 - 1) * max(t0, t1) + e0 + t0 + t1)
    assert plan.predicted_step_s == pytest.approx(27.40e-3)
    # stage 0 keeps min(2, 4) micro-batches alive, stage 1 one
    assert plan.peak_memory_bytes == pytest.approx(max(3e6 / 2 + 2 * 2 * 1e3 / 2, 9e6 / 2 + 1 * 2 * 2e3 / 2))


def test_estimate_data_parallel_by_hand():
    # stages fastest: stage i, replica d on device i + 2d; each stage's replicas on both hosts
    plan = estimate(TWO_LAYERS, SMALL, 1e12, dp=2, tp=1, micro_batch_size=2, placement=("pp", "dp", "tp"))
    assert plan.device_grid(SMALL).tolist() == [[[0], [2]], [[1], [3]]]
    t0, t1 = 3 * 2 * 1e9 / 1e12, 3 * 2 * 2e9 / 1e12
    e0 = 2 * 1e4 / 1e10  # stage edges stay inside a host
    sync = 2 * (2 - 1) / 2 * 3e6 / (1e9 / 2)  # stage 1's gradients; two rings cross each NIC
    assert plan.num_micro_batches == 2
    assert plan.predicted_step_s == pytest.approx((2 - 1) * t1 + e0 + t0 + t1 + sync)
    assert plan.predicted_step_s == pytest.approx(36.002e-3)
    assert plan.peak_memory_bytes == pytest.approx(9e6 + 1 * 2 * 2e3)


def test_estimate_rejects_what_does_not_fit():
    with pytest.raises(ValueError, match="dp, tp"):
        estimate(TWO_LAYERS, SMALL, 1e12, dp=3, tp=1, micro_batch_size=1)
    with pytest.raises(ValueError, match="exceed the 2 layers"):
        estimate(TWO_LAYERS, SMALL, 1e12, dp=1, tp=1, micro_batch_size=1)
    with pytest.raises(ValueError, match="micro_batch_size"):
        estimate(TWO_LAYERS, SMALL, 1e12, dp=2, tp=1, micro_batch_size=3)
    with pytest.raises(ValueError, match="placement"):
        estimate(TWO_LAYERS, SMALL, 1e12, dp=2, tp=1, micro_batch_size=1, placement=("tp", "tp", "pp"))


# -- the partition DP -------------------------------------------------------------------------


def _brute_force(t, e, S, gas, fits=None):
    L, best = len(t), math.inf
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        if fits is None or all(fits[j, a, b] for j, (a, b) in enumerate(zip(bounds, bounds[1:]))):
            best = min(best, pipeline_cost(t, e, bounds, gas))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_partition_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 9))
    t = rng.uniform(0.0, 1.0, L)
    if seed % 3 == 0:
        t = np.round(t * 4) / 4  # ties between stage times
    for S in range(1, min(4, L) + 1):
        for gas in (1, 2, 7):
            e = rng.uniform(0.0, 2.0, (L - 1, S - 1)) if seed % 2 else rng.uniform(0.0, 2.0, L - 1)
            bounds = partition_layers(t, e, S, gas)
            assert len(bounds) == S + 1 and bounds[0] == 0 and bounds[-1] == L
            assert pipeline_cost(t, e, bounds, gas) == pytest.approx(_brute_force(t, e, S, gas), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(15))
def test_partition_dp_with_stage_limits_equals_brute_force(seed):
    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(2, 9))
    t, e = rng.uniform(0.0, 1.0, L), rng.uniform(0.0, 1.0, L - 1)
    for S in range(1, min(4, L) + 1):
        fits = rng.random((S, L + 1, L + 1)) < 0.7
        best = _brute_force(t, e, S, 3, fits)
        if math.isinf(best):
            with pytest.raises(ValueError, match="stage_fits"):
                partition_layers(t, e, S, 3, fits)
            continue
        bounds = partition_layers(t, e, S, 3, fits)
        assert all(fits[j, a, b] for j, (a, b) in enumerate(zip(bounds, bounds[1:])))
        assert pipeline_cost(t, e, bounds, 3) == pytest.approx(best, rel=1e-12)


def test_partition_balances_uniform_layers():
    assert partition_layers([1.0] * 8, [0.0] * 7, 4, 8) == (0, 2, 4, 6, 8)


def test_partition_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_stages"):
        partition_layers([1.0, 1.0], [0.0], 3, 1)
    with pytest.raises(ValueError, match="edge_seconds"):
        partition_layers([1.0, 1.0, 1.0], [0.0], 2, 1)
    with pytest.raises(ValueError, match="layer_seconds"):
        partition_layers([1.0, -1.0], [0.0], 2, 1)
    with pytest.raises(ValueError, match="boundaries"):
        pipeline_cost([1.0, 1.0], [0.0], (0, 1, 1, 2), 1)


# -- Megatron's uniform partition (§6.5 Tables 6, 8, 10) ---------------------------------------


def test_megatron_uniform_partition_of_amp_gpt2():
    gpt2 = [False] * 2 + [True] * 24 + [False] * 4  # blocks are layers 3-26 counted from 1; 30 in all
    assert megatron_uniform_partition(gpt2, 1) == (0, 30)
    assert megatron_uniform_partition(gpt2, 2) == (0, 14, 30)
    assert megatron_uniform_partition(gpt2, 4) == (0, 8, 14, 20, 30)


def test_megatron_uniform_partition_of_amp_transgan():
    # §6.5.3: blocks are layers 4-15 and 42-53 counted from 1, 56 in all
    transgan = [False] * 3 + [True] * 12 + [False] * 26 + [True] * 12 + [False] * 3
    assert megatron_uniform_partition(transgan, 2) == (0, 41, 56)
    assert megatron_uniform_partition(transgan, 4) == (0, 9, 41, 47, 56)


def test_megatron_uniform_partition_gives_extra_blocks_to_first_stages():
    assert megatron_uniform_partition([True] * 7, 3) == (0, 3, 5, 7)
    with pytest.raises(ValueError, match="num_stages"):
        megatron_uniform_partition([False, True, False], 2)


# -- the search --------------------------------------------------------------------------------


def _memory(profile, plan):
    """Per-device memory of ``plan``, from the module docstring's formula."""
    worst = 0.0
    for j, (a, b) in enumerate(zip(plan.partition, plan.partition[1:])):
        layers = profile.layers[a:b]
        static = sum(x.param_bytes + x.optimizer_bytes for x in layers)
        acts = sum(x.activation_bytes for x in layers)
        live = min(plan.pp - j, plan.num_micro_batches)
        worst = max(worst, (static + live * plan.micro_batch_size * acts) / plan.tp)
    return worst


def _check_plan(profile, cluster, plan, budget):
    N, B = cluster.num_devices, profile.batch_size
    assert plan.dp * plan.tp * plan.pp == N
    assert plan.pp <= profile.num_layers
    assert (B // plan.dp) % plan.micro_batch_size == 0 and B % plan.dp == 0
    assert plan.num_micro_batches == B // (plan.dp * plan.micro_batch_size)
    assert len(plan.partition) == plan.pp + 1 and plan.partition[0] == 0 and plan.partition[-1] == profile.num_layers
    assert plan.placement in PLACEMENTS
    assert plan.peak_memory_bytes == pytest.approx(_memory(profile, plan))
    if budget is not None:
        assert plan.peak_memory_bytes <= budget
    assert sorted(plan.device_grid(cluster).ravel().tolist()) == sorted(
        d for host in cluster.host_devices for d in host)


def test_search_respects_constraints_and_memory_budget():
    profile, cluster = _gpt(24), Cluster.aws_p3_8xlarge(4)
    free = search(profile, cluster, 1.25e14, seed=0)
    budget = 6e9
    assert any(p.peak_memory_bytes > budget for p in free)  # the budget binds
    plans = search(profile, cluster, 1.25e14, budget, seed=0)
    assert plans
    for plan in plans:
        _check_plan(profile, cluster, plan, budget)
    steps = [p.predicted_step_s for p in plans]
    assert steps == sorted(steps)
    # the search prices each strategy at its optimal partition
    best = plans[0]
    again = estimate(profile, cluster, 1.25e14, dp=best.dp, tp=best.tp, micro_batch_size=best.micro_batch_size,
                     placement=best.placement, partition=best.partition)
    assert again == best


@pytest.mark.parametrize("seed", range(3))
def test_search_on_random_profiles(seed):
    rng = np.random.default_rng(seed)
    profile, cluster = _random_profile(rng, int(rng.integers(3, 9)), batch=16), Cluster.aws_p3_8xlarge(2)
    budget = float(rng.uniform(1e8, 4e8))
    try:
        plans = search(profile, cluster, 1e13, budget, seed=seed, iterations=50)
    except ValueError as error:
        assert "memory_budget_bytes" in str(error)
        return
    for plan in plans:
        _check_plan(profile, cluster, plan, budget)


def _least_memory_by_brute_force(profile, cluster):
    """The smallest per-device memory of any strategy and partition."""
    N, L, B = cluster.num_devices, profile.num_layers, profile.batch_size
    least = math.inf
    for tp in (t for t in range(1, N + 1) if N % t == 0):
        for dp in (d for d in range(1, N // tp + 1) if (N // tp) % d == 0 and B % d == 0):
            pp = N // (tp * dp)
            if pp > L:
                continue
            for mbs in (m for m in range(1, B // dp + 1) if (B // dp) % m == 0):
                for cuts in itertools.combinations(range(1, L), pp - 1):
                    plan = SimpleNamespace(partition=(0, *cuts, L), pp=pp, tp=tp, micro_batch_size=mbs,
                                           num_micro_batches=B // (dp * mbs))
                    least = min(least, _memory(profile, plan))
    return least


def test_search_names_the_least_memory_when_nothing_fits():
    profile = _random_profile(np.random.default_rng(7), 5, batch=8)
    least = _least_memory_by_brute_force(profile, SMALL)
    with pytest.raises(ValueError, match="memory_budget_bytes") as info:
        search(profile, SMALL, 1e12, least * 0.99)
    named = float(re.search(r"the least any needs is ([0-9.e+]+) bytes", str(info.value)).group(1))
    assert named == pytest.approx(least, rel=1e-3)
    # just above it, the strategy that needs it is found
    plans = search(profile, SMALL, 1e12, least * (1 + 1e-9), iterations=100)
    assert all(p.peak_memory_bytes <= least * (1 + 1e-9) for p in plans)


def test_search_is_deterministic_for_a_seed():
    profile, cluster = _gpt(24), Cluster.aws_p3_8xlarge(4)
    first = search(profile, cluster, 1.25e14, 8e9, seed=3)
    assert first == search(profile, cluster, 1.25e14, 8e9, seed=3)
    assert first[0].placement in PLACEMENTS and MEGATRON_PLACEMENT in PLACEMENTS


def test_search_rejects_bad_arguments():
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        search(TWO_LAYERS, SMALL, 1e12, -1.0)
    with pytest.raises(TypeError, match="cluster"):
        search(TWO_LAYERS, "cluster", 1e12)
