"""meshpar's planner (passes.planner_meshpar) against brute force, its memory budget, and
``meshpar.plan_parallelism`` end to end: the plan runs under parallelize and equals jax.jit."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline.pipeline_options import GradientReduction
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES
from meshpar.autodiff import tracing_pipeline
from meshpar.cluster import Cluster
from meshpar.passes.planning.layer_profile import CrossingValue, LayerProfile, ModelProfile
from meshpar.passes.planning import planner_meshpar
from meshpar.passes.planning.planner_meshpar import (NUM_RANKED, _axis_bandwidth, _live, _memory, _partition, _Prefix, _shapes,
                                                     _stage_seconds, _step_lower_bound, predict,
                                                     tensor_parallel_bandwidth)
from meshpar.passes.planning.protocol import (Hardware, NoPlanFits, PlanConstraints, StagePlan, first_devices,
                                              stage_meshes)
from meshpar.passes.pipeline.cutting.stage_graph import count_markers, split_stages
from meshpar.planning import plan_parallelism
from pipeline_models import assert_trees_close, make_state, mse

CLUSTER = Cluster.aws_p3_8xlarge(2)
HW = Hardware(1e13)


def _random_profile(rng, L, batch=16):
    layers = tuple(LayerProfile(flops=float(rng.uniform(1e8, 1e9)), param_bytes=float(rng.uniform(1e6, 1e8)),
                                optimizer_bytes=float(rng.uniform(1e6, 2e8)), activation_bytes=float(rng.uniform(1e4, 1e6)),
                                boundary_bytes=float(rng.uniform(1e3, 1e5)), tp_bytes=float(rng.uniform(0, 1e5)))
                   for _ in range(L))
    return ModelProfile(layers, batch)


def _ring_s(num_bytes, d, bandwidth):
    """A ring all-reduce of ``num_bytes`` over ``d`` devices: each sends 2 (d - 1) / d of them."""
    return 2 * (d - 1) / d * num_bytes / bandwidth


def _brute_force(profile, S, M, schedule, budget, gradient_reduction=GradientReduction.PER_STEP):
    """The least bottleneck over every contiguous partition and every per-stage shape; per
    micro-batch, each backward includes the stage's gradient all-reduce over its data axis."""
    L, b, n = profile.num_layers, profile.batch_size // M, CLUSTER.num_devices // S
    pre, best = _Prefix(profile), math.inf
    for cuts in itertools.combinations(range(1, L), S - 1):
        bounds = (0, *cuts, L)
        worst = 0.0
        for s, (i, j) in enumerate(zip(bounds, bounds[1:])):
            options = []
            for shape in (sh for sh in _shapes(n) if b % sh[0] == 0):
                mesh = stage_meshes(CLUSTER, [shape])[0]
                if _memory(pre, i, j, shape, b, _live(SCHEDULES[schedule], s, S, M)) <= budget:
                    f, bw = _stage_seconds(pre, i, j, shape, b, HW, tensor_parallel_bandwidth(CLUSTER, shape))
                    if gradient_reduction is GradientReduction.PER_MICRO_BATCH:
                        d, t = shape
                        params = sum(x.param_bytes for x in profile.layers[i:j])
                        bw += _ring_s(params / t, d, _axis_bandwidth(CLUSTER, mesh, 0))
                    options.append(f + bw)
            worst = max(worst, min(options, default=math.inf))
        best = min(best, worst)
    return best


@pytest.mark.parametrize("gradient_reduction", list(GradientReduction), ids=str)
@pytest.mark.parametrize("seed", range(6))
def test_partition_dp_equals_brute_force(seed, gradient_reduction):
    rng = np.random.default_rng(seed)
    profile = _random_profile(rng, L=int(rng.integers(2, 7)))
    for S in (1, 2, 4):
        if S > profile.num_layers:
            continue
        for M, schedule in ((4, "1f1b"), (8, "eager_1f1b")):
            budget = float(rng.choice([math.inf, 3e8]))
            want = _brute_force(profile, S, M, schedule, budget, gradient_reduction)
            got = _partition(_Prefix(profile), profile.num_layers, S, M, profile.batch_size // M,
                             CLUSTER.num_devices // S, SCHEDULES[schedule], HW, CLUSTER, budget,
                             gradient_reduction=gradient_reduction)
            if math.isinf(want):
                assert got is None
            else:
                assert got is not None and got[1] == pytest.approx(want, rel=1e-12)
                stages = got[0]
                assert stages[0].start == 0 and stages[-1].stop == profile.num_layers
                assert all(a.stop == b.start for a, b in zip(stages, stages[1:]))


def test_every_plan_fits_the_budget_and_the_error_names_the_least_memory():
    profile = _random_profile(np.random.default_rng(7), L=8)
    unbounded = planner_meshpar.plan(profile, CLUSTER, HW)
    budget = sorted(max(p.peak_memory_bytes) for p in unbounded)[len(unbounded) // 2]
    plans = planner_meshpar.plan(profile, CLUSTER, HW, PlanConstraints(budget))
    assert plans and all(max(p.peak_memory_bytes) <= budget for p in plans)
    assert [p.predicted_step_s for p in plans] == sorted(p.predicted_step_s for p in plans)
    with pytest.raises(NoPlanFits, match=r"memory_budget_bytes: .* the least any plan needs is ([0-9.e+]+) bytes") as e:
        planner_meshpar.plan(profile, CLUSTER, HW, PlanConstraints(1e3))
    least = float(str(e.value).split("needs is ")[1].split(" bytes")[0])
    assert planner_meshpar.plan(profile, CLUSTER, HW, PlanConstraints(least * 1.0001))  # that much memory does fit a plan
    with pytest.raises(NoPlanFits):
        planner_meshpar.plan(profile, CLUSTER, HW, PlanConstraints(least * 0.999))
    for bad in ({"max_micro_batches": 0}, {"num_ranked": 0}):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}: expected a positive integer"):
            planner_meshpar.plan(profile, CLUSTER, HW, **bad)


@pytest.mark.parametrize("gradient_reduction", list(GradientReduction), ids=str)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("hardware", [HW, Hardware(1e13, total_flops=2e13, dispatch_s=1e-4)])
def test_the_bound_never_exceeds_the_step_and_the_ranked_plans_are_the_fastest_of_all(seed, hardware,
                                                                                     gradient_reduction):
    """``plan`` simulates candidates in the order of ``_step_lower_bound`` and stops when the
    bound reaches its ``num_ranked``-th fastest: the same plans as simulating every candidate."""
    profile = _random_profile(np.random.default_rng(seed), L=6)
    constraints = PlanConstraints(gradient_reduction=gradient_reduction)
    everything = planner_meshpar.plan(profile, CLUSTER, hardware, constraints, num_ranked=10**6)
    for num_ranked in (NUM_RANKED, 5):
        ranked = planner_meshpar.plan(profile, CLUSTER, hardware, constraints, num_ranked=num_ranked)
        assert len(ranked) < len(everything)  # the bound spared some simulations
        # The same plans up to rounding: a bound summed in another order than the simulation
        # may exceed an equal step by an ulp.
        assert [p.predicted_step_s for p in ranked[:num_ranked]] == pytest.approx(
            [p.predicted_step_s for p in everything[:num_ranked]], rel=1e-12)
    for p in everything:
        devices = first_devices(CLUSTER, p.num_devices)
        bound = _step_lower_bound(profile, devices, hardware, p.stages, p.num_micro_batches, gradient_reduction,
                                  schedule=SCHEDULES[p.schedule], stages_per_mesh=p.stages_per_mesh)
        assert bound <= p.predicted_step_s * (1 + 1e-12)
        assert p.predicted_step_s == predict(profile, devices, hardware, p.stages, p.num_micro_batches, p.schedule,
                                             gradient_reduction=gradient_reduction,
                                             stages_per_mesh=p.stages_per_mesh).predicted_step_s


def test_per_micro_batch_reductions_are_priced_inside_the_backwards():
    """Two one-layer stages on (2, 2) meshes, one per host (NVLink rings over the data axis),
    1F1B, M = 2, no transfer or tensor-parallel time: f = 1e9 x 4 / (4 x 1e13) = 1e-4 s,
    b = 2f, and each stage's gradient ring r carries its 1e8 / 2 parameter bytes per device.
    With uniform stages the step takes (M + S - 1) = 3 slots: per step 3 (f + b), then one r
    (the default, as before); per micro-batch each backward takes b + r, 3 (f + b + r): 2 r more."""
    layer = LayerProfile(flops=1e9, param_bytes=1e8, optimizer_bytes=0.0, activation_bytes=0.0, boundary_bytes=0.0)
    profile = ModelProfile((layer, layer), 8)
    stages = [StagePlan(0, 1, (2, 2)), StagePlan(1, 2, (2, 2))]
    f, b, r = 1e-4, 2e-4, _ring_s(1e8 / 2, 2, CLUSTER.intra_host_bandwidth)
    default = predict(profile, CLUSTER, HW, stages, 2, "1f1b").predicted_step_s
    per_step = predict(profile, CLUSTER, HW, stages, 2, "1f1b", gradient_reduction="per_step").predicted_step_s
    per_micro_batch = predict(profile, CLUSTER, HW, stages, 2, "1f1b",
                              gradient_reduction="per_micro_batch").predicted_step_s
    assert default == per_step == pytest.approx(3 * (f + b) + r, rel=1e-12)
    assert per_micro_batch == pytest.approx(3 * (f + b + r), rel=1e-12)
    assert per_micro_batch - per_step == pytest.approx(2 * r, rel=1e-9)
    # The bound: stage 1's mesh starts after stage 0's first forward, then runs its M forwards
    # and backwards (and its reduction): f + M (f + b) + r, with r inside the backwards per
    # micro-batch.
    assert _step_lower_bound(profile, CLUSTER, HW, stages, 2) == pytest.approx(f + 2 * (f + b) + r, rel=1e-12)
    assert _step_lower_bound(profile, CLUSTER, HW, stages, 2, GradientReduction.PER_MICRO_BATCH) == pytest.approx(
        f + 2 * (f + b + r), rel=1e-12)


def test_gradient_reduction_must_be_known():
    profile = _random_profile(np.random.default_rng(0), L=2)
    match = r"^gradient_reduction: expected one of \('per_step', 'per_micro_batch'\), got 'per_batch'$"
    with pytest.raises(ValueError, match=match):
        predict(profile, CLUSTER, HW, [StagePlan(0, 2, (1, 8))], 1, "1f1b", gradient_reduction="per_batch")
    with pytest.raises(ValueError, match=match):
        planner_meshpar.plan(profile, CLUSTER, HW, PlanConstraints(gradient_reduction="per_batch"))


def test_one_layer_plans_one_stage_and_skip_connections_become_edges():
    one = ModelProfile((LayerProfile(1e9, 1e6, 2e6, 1e4, 0.0),), 8)
    assert {p.num_stages for p in planner_meshpar.plan(one, CLUSTER, HW)} == {1}
    # Transfers dominate (little compute, large boundaries): a large skip from stage 0 to stage 3
    # crosses hosts, and the chain prices only the boundary after each layer.
    layer = LayerProfile(1e6, 1e6, 2e6, 1e4, 4e6)
    skip = ModelProfile((layer,) * 4, 8, values=(CrossingValue(0, (1,), 4e6), CrossingValue(0, (3,), 4e7),
                                                  CrossingValue(1, (2,), 4e6), CrossingValue(2, (3,), 4e6)))
    chain = ModelProfile((layer,) * 4, 8)
    stages = [StagePlan(k, k + 1, (1, 2)) for k in range(4)]
    with_skip = predict(skip, CLUSTER, HW, stages, 4, "1f1b")
    without = predict(chain, CLUSTER, HW, stages, 4, "1f1b")
    assert with_skip.predicted_step_s > without.predicted_step_s  # the skip's extra edge costs time


def test_cut_points_choose_which_markers_cut():
    def loss(p, x):
        for k in range(4):
            x = jnp.tanh(x * p[k])
            if k < 3:
                meshpar.mark_stage_boundary()
        return jnp.sum(x)

    with tracing_pipeline():
        closed = jax.make_jaxpr(loss)(jnp.ones(4), jnp.ones(3))
    assert count_markers(closed) == 3
    assert split_stages(closed, 1).num_stages == 4
    assert split_stages(closed, 1, (1,)).num_stages == 2
    assert split_stages(closed, 1, ()).num_stages == 1
    with pytest.raises(ValueError, match="cut_points"):
        split_stages(closed, 1, (3,))


def test_plan_parallelism_runs_as_planned_and_equals_jit():
    model = MLP(features=(16, 16, 16, 16, 4), num_stages=4)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(model, batch["x"][:1])
    step = supervised_step(mse)
    plan = plan_parallelism(step, state, batch, hardware=HW, num_stages=2, num_micro_batches=4)
    assert plan.best.num_stages == 2 and plan.best.num_micro_batches == 4
    assert plan.profile.num_layers == 4 and len(plan.best.cut_points) == 1
    assert "chosen: meshpar: 2 stages" in plan.describe()
    parallel = meshpar.parallelize(step, method=plan.method)
    got_state, got_loss = parallel(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
    assert parallel.get_compiled(state, batch).graph.num_stages == 2
    with pytest.raises(ValueError, match="planner: expected one of"):
        plan_parallelism(step, state, batch, planner="oracle")
    with pytest.raises(ValueError, match="gradient_reduction: expected one of"):
        plan_parallelism(step, state, batch, gradient_reduction="never")
    # Priced as the runtime runs it: per micro-batch every plan takes at least as long, so the best does.
    slower = plan_parallelism(step, state, batch, hardware=HW, num_stages=2, num_micro_batches=4,
                              gradient_reduction="per_micro_batch")
    assert slower.best.predicted_step_s >= plan.best.predicted_step_s


def test_auto_plans_on_the_first_call_and_equals_jit(capsys):
    model = MLP(features=(16, 16, 16, 16, 4), num_stages=4)
    rng = np.random.default_rng(1)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(model, batch["x"][:1])
    step = supervised_step(mse)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(num_stages="auto", num_micro_batches=4))
    got_state, got_loss = parallel(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
    assert parallel.plan.best.num_micro_batches == 4 and parallel.method.num_micro_batches == 4
    assert parallel.get_compiled(state, batch).graph.num_stages == parallel.plan.best.num_stages
    assert "chosen: meshpar:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="stage_meshes or cut_points"):
        meshpar.PipeshardParallel(num_stages="auto", cut_points=(1,))


def test_pipeline_calibration_fits_the_measured_two_stage_step():
    """The fitted per-task, per-move and per-step costs make the planner predict the pipeline it
    measured at 2 micro-batches and its growth to 4; a one-program plan pays none, and they add
    to every pipelined plan's step."""
    from meshpar.calibration import calibrate_pipeline
    from meshpar.step_profile import profile_step

    model = MLP(features=(64, 64, 64, 64, 4), num_stages=4)
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((32, 16)).astype(np.float32), "y": rng.standard_normal((32, 4)).astype(np.float32)}
    state = make_state(model, batch["x"][:1])
    step = supervised_step(mse)
    devices = jax.devices()[:4]
    cluster = Cluster.from_devices(list(devices))
    profile = profile_step(step, (state, batch), (1,))
    hardware = Hardware(1e11, total_flops=2e11)
    fitted, measured = calibrate_pipeline(hardware, step, (state, batch), (1,), devices, cluster, profile,
                                          planner_meshpar)
    assert fitted.task_s + fitted.pipeline_s > 0 and fitted.move_s >= 0
    assert fitted.compute_scale == hardware.compute_scale
    assert (measured["task_s"], measured["move_s"], measured["pipeline_s"]) == (
        fitted.task_s, fitted.move_s, fitted.pipeline_s)
    two = [StagePlan(0, 2, (2, 1)), StagePlan(2, 4, (2, 1))]
    steps = measured["measured_step_s"]
    assert sorted(steps) == [2, 4]
    at = {M: predict(profile, cluster, fitted, two, M, "1f1b").predicted_step_s for M in (2, 4)}
    if fitted.task_s > 0:
        assert at[4] - at[2] == pytest.approx(steps[4] - steps[2], rel=1e-3)
    if fitted.pipeline_s > 0:
        assert at[2] == pytest.approx(steps[2], rel=1e-3)
    assert predict(profile, cluster, hardware, two, 2, "1f1b").predicted_step_s == pytest.approx(
        measured["predicted_before_s"])
    whole = [StagePlan(0, 4, (4, 1))]
    assert predict(profile, cluster, fitted, whole, 1, "1f1b").predicted_step_s == pytest.approx(
        predict(profile, cluster, hardware, whole, 1, "1f1b").predicted_step_s)
    for M in (2, 4):
        assert predict(profile, cluster, fitted, two, M, "1f1b").predicted_step_s > predict(
            profile, cluster, hardware, two, M, "1f1b").predicted_step_s
    # Shapes alone cannot be measured: unchanged.
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), (state, batch))
    assert calibrate_pipeline(hardware, step, shapes, (1,), devices, cluster, profile, planner_meshpar) == (hardware, {})
    with pytest.raises(ValueError, match="task_s"):
        Hardware(1e9, task_s=-1.0)
    with pytest.raises(ValueError, match="pipeline_s"):
        Hardware(1e9, pipeline_s=-1.0)
    with pytest.raises(ValueError, match="^repeats: expected a positive number"):
        calibrate_pipeline(hardware, step, (state, batch), (1,), devices, cluster, profile, planner_meshpar, repeats=0)


@pytest.mark.parametrize("planner", ["amp", "galvatron", "alpa_dp"])
def test_the_baseline_planners_picks_run_and_equal_jit(planner):
    model = MLP(features=(16, 16, 16, 16, 4), num_stages=4)
    rng = np.random.default_rng(2)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(model, batch["x"][:1])
    step = supervised_step(mse)
    plan = plan_parallelism(step, state, batch, hardware=HW, planner=planner)
    assert plan.best.planner == planner and plan.best.stages[-1].stop == 4
    got_state, got_loss = meshpar.parallelize(step, method=plan.method)(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)


@pytest.mark.parametrize("schedule", ["1f1b", "eager_1f1b"])
def test_the_partition_dps_live_activations_are_what_the_simulated_schedule_keeps(schedule):
    """The DP prices memory with ``_live`` before simulating; ``predict`` reports the simulated
    schedule's peak: the two agree, so a plan the DP fits is reported within the budget."""
    rng = np.random.default_rng(7)
    profile = _random_profile(rng, 8)
    for S in (1, 2, 4):
        for M in (1, 2, 4, 8, 16):
            if M != 1 and M < S:
                continue
            stages = [StagePlan(k * (8 // S), (k + 1) * (8 // S), (1, 8 // S)) for k in range(S)]
            plan = predict(profile, CLUSTER, HW, stages, M, schedule)
            pre, b = _Prefix(profile), 16 // M
            want = [float(_memory(pre, st.start, st.stop, st.shape, b, _live(SCHEDULES[schedule], k, S, M)))
                    for k, st in enumerate(stages)]
            np.testing.assert_allclose(plan.peak_memory_bytes, want, rtol=1e-12)
