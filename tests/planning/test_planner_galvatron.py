"""The Galvatron-BMW planner (passes.planner_galvatron): the decision-tree space's counts (§III-B),
the cost estimator on hand-computed cases, the layer DP (Eq. 4) and the balanced partitions
against brute force, Eq. 5/9 by hand, Alg. 2's adjustment, and the search's constraints.
Pure numpy: no devices."""

import collections
import itertools
import math
import time

import numpy as np
import pytest

from meshpar.cluster import Cluster
from meshpar.passes.planning.layer_profile import LayerProfile, ModelProfile
from meshpar.passes.planning.planner_galvatron import (GalvatronPlan, PartitionLoads, Strategy, bi_objective_partition,
                                              layer_cost, layer_dp, memory_balanced_partition, pipeline_cost, search,
                                              stage_memories, stage_memory, stage_times, strategy_space,
                                              time_balanced_partition, transformation_cost)

# 2 hosts of 2 devices, no latency: every number below is easy to follow by hand
SMALL = Cluster.uniform(2, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=1e10)
LAYER = LayerProfile(flops=1e9, param_bytes=1e6, optimizer_bytes=2e6, activation_bytes=1e3, boundary_bytes=1e2,
                     tp_bytes=1e5)


def _gpt_block(h=12288, seq=2048, heads=96):
    return LayerProfile(flops=24 * seq * h * h + 4 * seq * seq * h, param_bytes=12 * h * h * 2,
                        optimizer_bytes=12 * h * h * 12, activation_bytes=34 * seq * h + 5 * heads * seq * seq,
                        boundary_bytes=seq * h * 2, tp_bytes=2 * seq * h * 2)


# -- the strategy space (§III-B) -----------------------------------------------------------------


def test_strategy_space_has_the_papers_68_and_44_strategies_on_8_gpus():
    full = strategy_space(8, apply_takeaway_3=False)
    pruned = strategy_space(8)
    assert (len(full), len(pruned)) == (68, 44)
    # per PP degree (Fig. 3's four trees): groups of 8/4/2/1 devices, CKPT doubling each
    assert collections.Counter(s.pp for s in full) == {1: 42, 2: 18, 4: 6, 8: 2}
    assert collections.Counter(s.pp for s in pruned) == {1: 22, 2: 14, 4: 6, 8: 2}
    # Fig. 3 (pp = 2): S1, S2 are the DP/SDP trees Takeaway #3 removes; S3-S6 and their CKPT twins stay
    two_level = [s for s in pruned if s.pp == 2 and len(s.order) == 2]
    assert len(two_level) == 8 and all("tp" in s.order for s in two_level)
    assert {s for s in full if s.pp == 2} - {s for s in pruned if s.pp == 2} == {
        Strategy(2, 2, 2, 1, ckpt, order) for ckpt in (False, True) for order in (("dp", "sdp"), ("sdp", "dp"))}


def _reference_count(group_size, takeaway_3):
    """Trees by brute force: every (dp, sdp, tp) of powers of two multiplying to the group, each
    order of its degrees above 1, with and without CKPT."""
    powers = [2**x for x in range(group_size.bit_length())]
    count = 0
    for dp, sdp, tp in itertools.product(powers, repeat=3):
        if dp * sdp * tp == group_size and not (takeaway_3 and dp > 1 and sdp > 1):
            count += math.factorial(sum(d > 1 for d in (dp, sdp, tp)))
    return 2 * count


@pytest.mark.parametrize("num_devices", [1, 2, 4, 16, 64])
@pytest.mark.parametrize("takeaway_3", [False, True])
def test_strategy_space_follows_the_tree_rules(num_devices, takeaway_3):
    space = strategy_space(num_devices, apply_takeaway_3=takeaway_3)
    assert len(set(space)) == len(space)
    pps = sorted({s.pp for s in space})
    assert pps == [2**x for x in range(num_devices.bit_length())]
    for pp in pps:
        group = num_devices // pp
        tree = [s for s in space if s.pp == pp]
        assert len(tree) == _reference_count(group, takeaway_3)
        for s in tree:
            assert s.group_size * s.pp == num_devices
            assert all(d >= 2 and d & (d - 1) == 0 for d in s.degrees)
            assert len(set(s.order)) == len(s.order)
            assert not (takeaway_3 and s.dp > 1 and s.sdp > 1)


def test_strategy_space_rejects_what_trees_cannot_split():
    with pytest.raises(ValueError, match="num_devices"):
        strategy_space(12)
    with pytest.raises(ValueError, match="pipeline_degrees"):
        strategy_space(8, (3,))
    with pytest.raises(ValueError, match="order"):
        Strategy(1, 2, 1, 2, False, ("dp",))
    with pytest.raises(ValueError, match="tp"):
        Strategy(1, 1, 1, 3, False, ("tp",))


# -- the cost estimator (§V) -----------------------------------------------------------------------


def test_layer_cost_dp_over_tp_by_hand():
    # TP pairs {0,1}, {2,3} inside the hosts; DP pairs {0,2}, {1,3} cross, two rings share each NIC
    s = Strategy(1, dp=2, tp=2, order=("dp", "tp"))
    cost = layer_cost(LAYER, s, 4, 1e12, SMALL, (0, 1, 2, 3))
    comp_f = 2 * 1e9 / (2 * 1e12)  # 2 examples per device, half the flops each
    ar_tp = 2 * (2 - 1) * (2 * 1e5 / 2) / 1e10
    sync = 2 * (2 - 1) * (1e6 / 2 / 2) / (1e9 / 2)
    overlapped = max(2 * comp_f, sync) + 0.3 * min(2 * comp_f, sync)
    assert cost.time_s == pytest.approx(comp_f + ar_tp + overlapped + ar_tp)
    assert cost.time_s == pytest.approx(3.34e-3)
    assert cost.time_no_sync_s == pytest.approx(comp_f + ar_tp + 2 * comp_f + ar_tp)
    assert cost.states_bytes == pytest.approx((2 * 1e6 + 2e6) / 2)
    assert (cost.forward_bytes, cost.backward_bytes) == pytest.approx((2 * 1e3 / 2, 0.0))


def test_layer_cost_tp_over_dp_crosses_hosts_with_tp():
    s = Strategy(1, dp=2, tp=2, order=("tp", "dp"))
    cost = layer_cost(LAYER, s, 4, 1e12, SMALL, (0, 1, 2, 3))
    comp_f = 1e-3
    ar_tp = 2 * (2 * 1e5 / 2) / (1e9 / 2)
    sync = 2 * (1e6 / 2 / 2) / 1e10
    assert cost.time_s == pytest.approx(comp_f + ar_tp + (2 * comp_f + 0.3 * sync) + ar_tp)


def test_layer_cost_sharded_data_parallel_by_hand():
    # Takeaway #3's figures: SDP moves 3 (N - 1) / N of the (tensor-split) weights, DP 2 (N - 1) / N
    s = Strategy(1, sdp=2, tp=2, order=("sdp", "tp"))
    cost = layer_cost(LAYER, s, 4, 1e12, SMALL, (0, 1, 2, 3))
    comp_f, ar_tp = 1e-3, 2e-5
    gather = (1e6 / 2 / 2) / (1e9 / 2)  # one all-gather of the TP shard over 2 members, across hosts
    assert cost.time_s == pytest.approx(comp_f + ar_tp + gather + (2 * comp_f + 0.3 * 2 * gather) + ar_tp)
    assert cost.time_no_sync_s == pytest.approx(comp_f + ar_tp + gather + (2 * comp_f + 0.3 * gather) + ar_tp)
    assert cost.states_bytes == pytest.approx((2 * 1e6 + 2e6) / 4)


def test_ckpt_lowers_memory_and_raises_time():
    rng = np.random.default_rng(0)
    for _ in range(20):
        layer = LayerProfile(flops=float(rng.uniform(1e8, 1e10)), param_bytes=float(rng.uniform(1e5, 1e7)),
                             optimizer_bytes=float(rng.uniform(1e5, 1e7)),
                             activation_bytes=float(rng.uniform(2e3, 1e5)), boundary_bytes=float(rng.uniform(1e2, 1e3)),
                             tp_bytes=float(rng.uniform(0, 1e5)))
        for s in strategy_space(4, (1,)):
            if s.ckpt:
                continue
            off = layer_cost(layer, s, 8, 1e12, SMALL, (0, 1, 2, 3))
            on = layer_cost(layer, Strategy(s.pp, s.dp, s.sdp, s.tp, True, s.order), 8, 1e12, SMALL, (0, 1, 2, 3))
            assert on.forward_bytes < off.forward_bytes
            assert on.forward_bytes + on.backward_bytes <= off.forward_bytes * (1 + 1e-12)
            assert on.states_bytes == off.states_bytes
            assert on.time_s > off.time_s and on.time_no_sync_s > off.time_no_sync_s
            # one more forward, at worst hidden under gradient communication, slowing it 1.3x
            comp_f = 8 / s.data_degree * layer.flops / (s.tp * 1e12)
            assert on.time_no_sync_s - off.time_no_sync_s >= 0.3 * comp_f * (1 - 1e-9)
            if s.sdp == 1:
                assert on.time_no_sync_s - off.time_no_sync_s >= comp_f * (1 - 1e-9)


def test_transformation_cost_by_hand():
    group, b, nbytes = (0, 1, 2, 3), 4, 1e3
    dp_tp = Strategy(1, dp=2, tp=2, order=("dp", "tp"))  # shards 0, 0, 1, 1
    tp_dp = Strategy(1, dp=2, tp=2, order=("tp", "dp"))  # shards 0, 1, 0, 1
    tp = Strategy(1, tp=4, order=("tp",))
    dp = Strategy(1, dp=4, order=("dp",))
    # to pure TP each device needs the other half of the micro-batch; DP over TP keeps one half
    # per host, so all four devices receive across the NICs (two each)
    assert transformation_cost(dp_tp, tp, nbytes, b, SMALL, group) == pytest.approx(0.5 * b * nbytes / (1e9 / 2))
    # TP over DP has both halves on every host
    assert transformation_cost(tp_dp, tp, nbytes, b, SMALL, group) == pytest.approx(0.5 * b * nbytes / 1e10)
    # DP 4 -> DP 2 over TP 2: a quarter from the host's other device; back: nothing moves
    assert transformation_cost(dp, dp_tp, nbytes, b, SMALL, group) == pytest.approx(0.25 * b * nbytes / 1e10)
    # equal layouts move nothing: SDP for DP, CKPT on or off
    same = Strategy(1, sdp=2, tp=2, ckpt=True, order=("sdp", "tp"))
    assert transformation_cost(dp_tp, same, nbytes, b, SMALL, group) == 0.0
    slow = Cluster.uniform(2, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=1e10, latency=1e-3)
    assert transformation_cost(dp, dp_tp, nbytes, b, slow, group) == pytest.approx(0.25 * b * nbytes / 1e10 + 1e-3)


def test_cost_functions_reject_bad_arguments():
    s = Strategy(1, dp=2, tp=2, order=("dp", "tp"))
    with pytest.raises(ValueError, match="group"):
        layer_cost(LAYER, s, 4, 1e12, SMALL, (0, 1, 2))
    with pytest.raises(ValueError, match="micro_batch_size"):
        layer_cost(LAYER, s, 3, 1e12, SMALL, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="device_flops"):
        layer_cost(LAYER, s, 4, 0.0, SMALL, (0, 1, 2, 3))
    with pytest.raises(ValueError, match="bytes_per_example"):
        transformation_cost(s, s, -1.0, 4, SMALL, (0, 1, 2, 3))


# -- the layer DP (Eq. 4, Alg. 3) ---------------------------------------------------------------------


def _brute_force_dp(c, mem, R, budget, fits=None):
    L, S = c.shape
    best = None
    for choice in itertools.product(range(S), repeat=L):
        if mem[np.arange(L), choice].sum() > budget or (fits is not None and not fits(choice)):
            continue
        total = c[np.arange(L), choice].sum() + sum(R[l, choice[l - 1], choice[l]] for l in range(1, L))
        best = total if best is None else min(best, total)
    return best


def _random_dp_case(rng):
    L, S = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    c = np.round(rng.uniform(0, 10, (L, S)), 1 if rng.random() < 0.3 else 6)  # some ties
    mem = rng.integers(0, 6, (L, S)).astype(float)
    if rng.random() < 0.5:  # transitions from data layouts: strategies sharing a layout share a DP state
        layout = rng.integers(0, 2, S)
        unit = rng.uniform(0, 2, (2, 2)) * (1 - np.eye(2))
        R = rng.uniform(0.5, 2, (L, 1, 1)) * unit[np.ix_(layout, layout)][None]
    else:
        R = rng.uniform(0, 3, (L, S, S))
    return c, mem, R


@pytest.mark.parametrize("seed", range(60))
def test_layer_dp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    c, mem, R = _random_dp_case(rng)
    L = c.shape[0]
    least, most = mem.min(axis=1).sum(), mem.max(axis=1).sum()
    for budget in (math.inf, most, float(rng.integers(least, most + 1)), least, least - 0.5):
        if budget <= 0:
            continue
        expected = _brute_force_dp(c, mem, R, budget)
        got = layer_dp(c, mem, R, budget)
        if expected is None:
            assert got is None
            continue
        total, choice = got
        assert total == pytest.approx(expected, rel=1e-12, abs=1e-12)
        assert mem[np.arange(L), choice].sum() <= budget
        assert total == pytest.approx(c[np.arange(L), choice].sum()
                                      + sum(R[l, choice[l - 1], choice[l]] for l in range(1, L)))


def test_layer_dp_follows_the_budget():
    # layer strategies: 0 fast and large, 1 slow and small; switching costs 0.5 each way
    c = np.array([[1.0, 3.0]] * 3)
    mem = np.array([[4.0, 1.0]] * 3)
    R = np.array([[0.0, 0.5], [0.5, 0.0]])
    assert layer_dp(c, mem, R, 12.0) == (3.0, (0, 0, 0))
    total, choice = layer_dp(c, mem, R, 9.0)  # one layer must go small
    assert total == pytest.approx(1 + 1 + 3 + 0.5) and sorted(choice) == [0, 0, 1] and choice[1] != 1
    assert layer_dp(c, mem, R, 3.0) == (9.0, (1, 1, 1))
    assert layer_dp(c, mem, R, 2.9) is None


@pytest.mark.parametrize("seed", range(20))
def test_layer_dp_with_coarse_units_stays_within_the_budget(seed):
    rng = np.random.default_rng(1000 + seed)
    c, mem, R = _random_dp_case(rng)
    mem = mem * 1.37
    budget = float(rng.uniform(mem.min(axis=1).sum(), mem.max(axis=1).sum() + 1))
    expected = _brute_force_dp(c, mem, R, budget)
    got = layer_dp(c, mem, R, budget, memory_unit=1.37 * 2)
    if got is not None:
        total, choice = got
        assert mem[np.arange(c.shape[0]), choice].sum() <= budget
        assert total >= expected - 1e-9
    # a unit dividing every memory and the budget is exact
    whole = 1.37 * max(1, math.floor(budget / 1.37))
    exact = layer_dp(c, mem, R, whole, memory_unit=1.37)
    reference = _brute_force_dp(c, mem, R, whole * (1 + 1e-12))
    assert (exact is None) == (reference is None)
    if exact is not None:
        assert exact[0] == pytest.approx(reference, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(20))
def test_layer_dp_checks_its_solutions_like_alg_3(seed):
    rng = np.random.default_rng(2000 + seed)
    c, mem, R = _random_dp_case(rng)
    backward = rng.integers(0, 4, c.shape).astype(float)
    budget = float(mem.max(axis=1).sum()) + 1.0
    L = c.shape[0]

    def fits(choice):  # Eq. 2 with no model states
        s = list(choice)
        return stage_memory(np.zeros(L), mem[np.arange(L), s], backward[np.arange(L), s], 1) <= budget

    got = layer_dp(c, mem, R, budget, fits=fits)
    expected = _brute_force_dp(c, mem, R, budget, fits)
    if got is None:
        # Alg. 3 only tries the DP's solution at each forward budget: none of them fit
        return
    assert fits(got[1])
    assert got[0] >= expected - 1e-9


def test_layer_dp_steps_down_the_forward_budget_when_the_check_fails():
    c = np.array([[1.0, 2.0], [1.0, 2.0]])
    mem = np.array([[2.0, 1.0], [2.0, 1.0]])
    R = np.zeros((2, 2))
    assert layer_dp(c, mem, R, 4.0) == (2.0, (0, 0))
    total, choice = layer_dp(c, mem, R, 4.0, fits=lambda ch: ch != (0, 0))
    assert total == 3.0 and sorted(choice) == [0, 1]
    assert layer_dp(c, mem, R, 4.0, fits=lambda ch: False) is None


def test_layer_dp_rejects_bad_arguments():
    with pytest.raises(ValueError, match="costs"):
        layer_dp(np.zeros((0, 2)), np.zeros((0, 2)), np.zeros((2, 2)), 1.0)
    with pytest.raises(ValueError, match="memories"):
        layer_dp(np.zeros((2, 2)), np.zeros((2, 3)), np.zeros((2, 2)), 1.0)
    with pytest.raises(ValueError, match="transition"):
        layer_dp(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((3, 3)), 1.0)
    with pytest.raises(ValueError, match="budget"):
        layer_dp(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2)), 0.0)
    with pytest.raises(ValueError, match="memory_unit"):
        layer_dp(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2)), 1.0, memory_unit=0.0)
    with pytest.raises(ValueError, match="memory_unit"):
        layer_dp(np.zeros((2, 2)), np.zeros((2, 2)), np.zeros((2, 2)), 80e9)


# -- the pipeline cost and stage loads (Eq. 2, 5, 6, 9) -------------------------------------------


def test_pipeline_cost_by_hand():
    assert pipeline_cost([1.0, 2.0, 3.0], 4) == pytest.approx((4 - 1) * 3 + 6)  # Eq. 5
    assert pipeline_cost([1.0, 2.0, 3.0], 4, [0.5, 1.5, 2.5]) == pytest.approx((4 - 1) * 2.5 + 6)  # Eq. 9
    assert pipeline_cost([2.0], 1) == 2.0
    with pytest.raises(ValueError, match="num_micro_batches"):
        pipeline_cost([1.0], 0)
    with pytest.raises(ValueError, match="stage_times_no_sync_s"):
        pipeline_cost([1.0, 2.0], 2, [1.0])


def test_stage_memory_by_hand():
    # two micro-batches in flight: one holds everything, the other is in layer 1's backward
    assert stage_memory([1.0, 2.0], [3.0, 4.0], [0.0, 10.0], 2) == pytest.approx(3 + 7 + (7 + 10))
    assert stage_memory([1.0, 2.0], [3.0, 4.0], [9.0, 0.0], 1) == pytest.approx(3 + (3 + 9))


def _random_loads(rng, L, m):
    return PartitionLoads(0.0, rng.uniform(0.1, 2.0, L), rng.uniform(0, 1, L), rng.uniform(0, 1, L),
                          rng.uniform(0, 1, L) * (rng.random(L) < 0.5), m)


@pytest.mark.parametrize("seed", range(30))
def test_balanced_partitions_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 8))
    loads = _random_loads(rng, L, int(rng.integers(1, 6)))
    for P in range(1, min(4, L) + 1):
        partitions = [(0, *cuts, L) for cuts in itertools.combinations(range(1, L), P - 1)]
        p_t = time_balanced_partition(loads, P)
        p_m = memory_balanced_partition(loads, P)
        assert stage_times(loads, p_t).max() == pytest.approx(min(stage_times(loads, p).max() for p in partitions))
        assert stage_memories(loads, p_m).max() == pytest.approx(
            min(stage_memories(loads, p).max() for p in partitions))


def test_memory_balance_gives_deeper_stages_more_layers_under_1f1b():
    # Fig. 4: shallower stages hold more micro-batches, so p_m shifts layers to deeper ones
    loads = PartitionLoads(0.0, np.ones(32), np.full(32, 1.0), np.full(32, 1.0), np.zeros(32), 8)
    assert time_balanced_partition(loads, 4) == (0, 8, 16, 24, 32)
    p_m = memory_balanced_partition(loads, 4)
    sizes = np.diff(p_m)
    assert list(sizes) == sorted(sizes) and sizes[0] < sizes[-1]


# -- Alg. 2 ----------------------------------------------------------------------------------------


def _mock_search(loads, budget=math.inf, calls=None):
    """Galvatron_Search with strategies fixed per layer: Eq. 5 of the stage times; ``None``
    when a stage exceeds ``budget``."""

    def run(p):
        if calls is not None:
            calls.append(p)
        if stage_memories(loads, p).max() > budget:
            return None
        return _with_step(loads, pipeline_cost(stage_times(loads, p), loads.num_micro_batches))

    return run


def _with_step(loads, step):
    return PartitionLoads(step, loads.layer_time_s, loads.states_bytes, loads.forward_bytes, loads.backward_bytes,
                          loads.num_micro_batches)


@pytest.mark.parametrize("seed", range(30))
def test_alg2_never_returns_worse_than_its_start(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(2, 10))
    loads = _random_loads(rng, L, int(rng.integers(1, 6)))
    P = int(rng.integers(1, min(4, L) + 1))
    budget = float(rng.uniform(1, 6)) if seed % 2 else math.inf
    calls = []
    run = _mock_search(loads, budget, calls)
    start = memory_balanced_partition(loads, P)
    found = bi_objective_partition(run, start, budget)
    searched = list(calls)
    if run(start) is None:
        assert found is None or stage_memories(loads, found[0]).max() <= budget
        return
    p, best = found
    assert best.step_s <= run(start).step_s
    assert stage_memories(loads, p).max() <= budget
    assert len(searched) == len(set(searched)) <= L  # each partition once, at most L searches


@pytest.mark.parametrize("seed", range(40))
def test_alg2_from_the_memory_balanced_start_equals_brute_force_on_two_stages(seed):
    rng = np.random.default_rng(100 + seed)
    L = int(rng.integers(2, 12))
    loads = _random_loads(rng, L, int(rng.integers(1, 6)))
    run = _mock_search(loads)
    found = bi_objective_partition(run, memory_balanced_partition(loads, 2))
    assert found[1].step_s == pytest.approx(min(run((0, c, L)).step_s for c in range(1, L)))


def test_alg2_balances_a_deliberately_unbalanced_start():
    loads = PartitionLoads(0.0, np.ones(8), np.zeros(8), np.zeros(8), np.zeros(8), 4)
    p, best = bi_objective_partition(_mock_search(loads), (0, 1, 8))
    assert p == (0, 4, 8)
    assert best.step_s == pytest.approx(3 * 4 + 8)
    p, _ = bi_objective_partition(_mock_search(loads), (0, 1, 2, 3, 8))
    assert stage_times(loads, p).max() == 2.0


def test_alg2_keeps_within_the_memory_budget():
    # memory-heavy early layers: time balance, (0, 4, 8), would need 32 bytes on stage 0
    loads = PartitionLoads(0.0, np.ones(8), np.zeros(8), np.array([4.0] * 4 + [1.0] * 4), np.zeros(8), 4)
    budget = 17.0
    run = _mock_search(loads, budget)
    start = memory_balanced_partition(loads, 2)
    p, best = bi_objective_partition(run, start, budget)
    assert stage_memories(loads, p).max() <= budget
    feasible = [(0, c, 8) for c in range(1, 8) if stage_memories(loads, (0, c, 8)).max() <= budget]
    assert feasible == [(0, 1, 8), (0, 2, 8)]
    assert p == (0, 2, 8) and best.step_s == pytest.approx(3 * 6 + 8)
    with pytest.raises(ValueError, match="start"):
        bi_objective_partition(run, (0, 0, 8))


# -- the search ------------------------------------------------------------------------------------


def _check_plan(profile, cluster, plan, budget, device_flops):
    """Re-derive the plan's figures from the public per-layer functions."""
    N, L, B = cluster.num_devices, profile.num_layers, profile.batch_size
    g, m = N // plan.pp, plan.num_micro_batches
    b = B // m
    assert plan.partition[0] == 0 and plan.partition[-1] == L and len(plan.partition) == plan.pp + 1
    assert len(plan.strategies) == L
    flat = [d for host in cluster.host_devices for d in host]
    times, no_sync, peaks = [], [], []
    for j, (a, c) in enumerate(zip(plan.partition, plan.partition[1:])):
        group = flat[j * g:(j + 1) * g]
        stage = [(profile.layers[l], plan.strategies[l]) for l in range(a, c)]
        costs = [layer_cost(layer, s, b, device_flops, cluster, group) for layer, s in stage]
        assert all(s.pp == plan.pp and s.group_size == g and b % s.data_degree == 0 for _, s in stage)
        moved = sum(transformation_cost(plan.strategies[l - 1], plan.strategies[l],
                                        profile.layers[l - 1].boundary_bytes, b, cluster, group)
                    for l in range(a + 1, c))
        times.append(sum(x.time_s for x in costs) + moved)
        no_sync.append(sum(x.time_no_sync_s for x in costs) + moved)
        peaks.append(stage_memory([x.states_bytes for x in costs], [x.forward_bytes for x in costs],
                                  [x.backward_bytes for x in costs], min(plan.pp - j, m)))
    assert plan.predicted_step_s == pytest.approx(pipeline_cost(times, m, no_sync), rel=1e-9)
    assert plan.peak_memory_bytes == pytest.approx(tuple(peaks), rel=1e-9)
    if budget is not None:
        assert max(plan.peak_memory_bytes) <= budget


def _small_profile(L=4, batch=8):
    rng = np.random.default_rng(5)
    return ModelProfile(tuple(
        LayerProfile(flops=float(rng.uniform(1e9, 4e9)), param_bytes=float(rng.uniform(1e6, 4e7)),
                     optimizer_bytes=float(rng.uniform(2e6, 8e7)), activation_bytes=float(rng.uniform(1e5, 4e6)),
                     boundary_bytes=float(rng.uniform(1e4, 1e5)), tp_bytes=float(rng.uniform(1e4, 1e5)))
        for _ in range(L)), batch)


def test_search_plans_are_sorted_consistent_and_within_the_budget():
    profile = _small_profile()
    free = search(profile, SMALL, 1e12)
    budget = 0.8 * max(free[0].peak_memory_bytes)
    plans = search(profile, SMALL, 1e12, budget)
    assert plans and any(max(p.peak_memory_bytes) > budget for p in free)  # the budget binds
    steps = [p.predicted_step_s for p in plans]
    assert steps == sorted(steps)
    assert {(p.pp, p.num_micro_batches) for p in plans} <= {(pp, m) for pp in (1, 2, 4) for m in (1, 2, 4, 8)}
    for plan in plans:
        _check_plan(profile, SMALL, plan, budget, 1e12)
    for plan in free:
        _check_plan(profile, SMALL, plan, None, 1e12)


def test_search_without_pipeline_equals_brute_force_over_layer_strategies():
    # pp = 1 and no budget: the plan is the best assignment of the 14 strategies to 3 layers
    profile, F = _small_profile(L=3, batch=8), 1e12
    plans = {(p.pp, p.num_micro_batches): p for p in search(profile, SMALL, F)}
    group = (0, 1, 2, 3)
    for m in (1, 2):
        b = 8 // m
        space = [s for s in strategy_space(4, (1,)) if b % s.data_degree == 0]
        S = len(space)
        cost = np.array([[(m - 1) * x.time_no_sync_s + x.time_s
                          for x in (layer_cost(layer, s, b, F, SMALL, group) for s in space)]
                         for layer in profile.layers])
        moves = np.array([[[m * transformation_cost(a, c, profile.layers[l - 1].boundary_bytes, b, SMALL, group)
                            for c in space] for a in space] for l in (1, 2)])
        best = min(cost[0, i] + cost[1, j] + cost[2, k] + moves[0, i, j] + moves[1, j, k]
                   for i, j, k in itertools.product(range(S), repeat=3))
        assert plans[(1, m)].predicted_step_s == pytest.approx(best, rel=1e-9)


def test_search_raises_when_the_budget_is_tiny():
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        search(_small_profile(), SMALL, 1e12, 1e3)


def test_search_rejects_bad_arguments():
    profile = _small_profile()
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        search(profile, SMALL, 1e12, -1.0)
    with pytest.raises(ValueError, match="device_flops"):
        search(profile, SMALL, 0.0)
    with pytest.raises(ValueError, match="max_micro_batches"):
        search(profile, SMALL, 1e12, max_micro_batches=0)
    with pytest.raises(TypeError, match="cluster"):
        search(profile, "cluster", 1e12)
    with pytest.raises(ValueError, match="cluster"):
        search(profile, Cluster.aws_p3_8xlarge(3), 1e12)


def test_stage_shapes_take_each_stages_most_common_strategy():
    a = Strategy(2, dp=2, tp=2, order=("dp", "tp"))
    b = Strategy(2, sdp=4, ckpt=True, order=("sdp",))
    c = Strategy(2, tp=4, order=("tp",))
    plan = GalvatronPlan(2, (0, 3, 5), 4, (a, b, b, c, a), 1.0, (1.0, 1.0))
    assert plan.stage_shapes == ((4, 1), (1, 4))  # stage 1: a tie, its first layer's
    plan = GalvatronPlan(2, (0, 2, 5), 4, (c, c, a, b, a), 1.0, (1.0, 1.0))
    assert plan.stage_shapes == ((1, 4), (2, 2))


@pytest.mark.slow
def test_search_gpt_96_layers_on_1024_gpus():
    profile = ModelProfile.uniform(96, _gpt_block(), 1536, "gpt-96")
    cluster, budget = Cluster.dgx_h100(128), 80e9
    start = time.perf_counter()
    plans = search(profile, cluster, 4e14, budget)
    elapsed = time.perf_counter() - start
    assert elapsed < 60
    steps = [p.predicted_step_s for p in plans]
    assert plans and steps == sorted(steps)
    assert all(max(p.peak_memory_bytes) <= budget for p in plans)
    # the best is within the compute bound: 3 passes of the flops (4 with CKPT) over 1024 GPUs
    work = 96 * 1536 * _gpt_block().flops / (1024 * 4e14)
    assert 3 * work <= plans[0].predicted_step_s <= 3 * 4 / 3 * work * 1.5
    assert {p.pp for p in plans} <= {1, 2, 4, 8, 16, 32, 64}
