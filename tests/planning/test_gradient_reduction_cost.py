"""Pricing the data-axis gradient reduction (issue 22): the ring all-reduce's seconds against a
simulated ring, ``StageGradients`` and ``estimate_durations(gradients=)``, and the schedule
simulator's per-step reduction against hand-timed steps and a fixed-point solution of the
timing equations with the reduction as one more holder of its mesh."""

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from meshpar.passes.pipeline.pipeline_options import GradientReduction
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, make_schedule
from meshpar.passes.program.tasks import TaskKind, task_dependencies
from meshpar.passes.pipeline.cutting.stage_graph import Ref, Stage
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.pipeline.cutting.stage_parts import stage_parts
from meshpar.passes.simulation.collectives import ring_all_reduce_s
from meshpar.passes.simulation.cost_model import StageGradients, estimate_durations
from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate

B, W, A = TaskKind.BACKWARD, TaskKind.BACKWARD_WEIGHT, TaskKind.SEND_ACT


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


# -- the ring all-reduce ------------------------------------------------------------------------


def _ring_all_reduce(values, bandwidth):
    """A ring all-reduce run step by step: ``D - 1`` reduce-scatter steps, then ``D - 1``
    all-gather steps, each device sending one of ``D`` chunks to its right neighbour per step,
    all in parallel. Returns every device's result and the seconds (per step the largest chunk
    any device sends, over ``bandwidth``)."""
    D = len(values)
    chunks = [np.array_split(np.asarray(v, dtype=np.float64), D) for v in values]
    seconds = 0.0
    for phase in ("reduce", "gather"):
        for step in range(D - 1):
            sent = []
            for i in range(D):
                c = (i - step) % D if phase == "reduce" else (i + 1 - step) % D
                sent.append((i, c, chunks[i][c].copy()))
            for i, c, chunk in sent:
                right = (i + 1) % D
                chunks[right][c] = chunks[right][c] + chunk if phase == "reduce" else chunk
            seconds += max(chunk.nbytes for _, _, chunk in sent) / bandwidth
    return [np.concatenate(c) for c in chunks], seconds


@pytest.mark.parametrize("D", [2, 3, 4, 8])
def test_allreduce_seconds_is_a_ring_all_reduces(D):
    rng = np.random.default_rng(D)
    values = [rng.standard_normal(24) for _ in range(D)]  # 24 float64s: whole chunks for every D here
    results, seconds = _ring_all_reduce(values, bandwidth=1e3)
    for r in results:
        np.testing.assert_allclose(r, np.sum(values, axis=0), rtol=1e-12)
    assert ring_all_reduce_s(24 * 8, D, 1e3) == pytest.approx(seconds, rel=1e-12)


def test_allreduce_seconds_by_hand_and_for_one_device():
    assert ring_all_reduce_s(1000, 2, 100.0) == 10.0  # 2 (2 - 1) / 2 = 1 of the bytes
    assert ring_all_reduce_s(1000, 4, 100.0) == 15.0  # 2 (4 - 1) / 4 = 1.5
    assert ring_all_reduce_s(1000, 8, 1e3) == 1.75
    assert ring_all_reduce_s(10**9, 1, 1.0) == 0.0  # nothing to reduce


@pytest.mark.parametrize("group_size", [0, -1])
def test_allreduce_seconds_rejects_an_empty_group(group_size):
    with pytest.raises(ValueError, match=rf"^group_size: expected at least 1 device, got {group_size}$"):
        ring_all_reduce_s(8, group_size, 1.0)


# -- StageGradients and estimate_durations ------------------------------------------------------


def _gradients(**changes):
    return dataclasses.replace(StageGradients(1000, 2, 100.0, 0, GradientReduction.PER_STEP), **changes)


@pytest.mark.parametrize("changes, match", [
    ({"param_bytes": -1}, r"^StageGradients.param_bytes: expected non-negative bytes, got -1$"),
    ({"data_size": 0}, r"^StageGradients.data_size: expected at least 1 device, got 0$"),
    ({"bandwidth": 0.0}, r"^StageGradients.bandwidth: expected finite positive bytes/s, got 0.0$"),
    ({"bandwidth": float("inf")}, r"^StageGradients.bandwidth: expected finite positive bytes/s, got inf$"),
    ({"bandwidth": float("nan")}, r"^StageGradients.bandwidth: expected finite positive bytes/s, got nan$"),
    ({"mesh": -1}, r"^StageGradients.mesh: expected a mesh index, got -1$"),
])
def test_stage_gradients_are_validated(changes, match):
    with pytest.raises(ValueError, match=match):
        _gradients(**changes)


@pytest.mark.parametrize("name", ["per_batch", "per_step"])
def test_stage_gradients_take_a_resolved_reduction_not_a_name(name):
    with pytest.raises(TypeError, match=f"^StageGradients.reduction: expected a GradientReduction, got '{name}'$"):
        _gradients(reduction=name)


def test_stage_gradients_seconds_are_one_ring_all_reduce():
    assert _gradients().seconds == 10.0
    assert _gradients(data_size=4).seconds == 15.0
    assert _gradients(data_size=1).seconds == 0.0


@pytest.fixture(scope="module")
def three_stages():
    """Three stages of one matmul each, on meshes of two devices along the data axis, with no
    transfer time: the durations ``estimate_durations`` gives without gradients, and its inputs."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    stage = Stage(1, jax.make_jaxpr(lambda x, w: (jnp.tanh(x @ w),))(x, w),
                  (Ref(RefKind.ACT, 0, 0), Ref(RefKind.PARAM, 0)), (Ref(RefKind.ACT, 1, 0),))
    parts = [dataclasses.replace(stage_parts(stage), stage=s) for s in range(3)]
    devices = np.array(jax.devices()[:6]).reshape(3, 2, 1)
    meshes = [Mesh(devices[s], ("data", "model")) for s in range(3)]
    args = (parts, meshes, [], 2, 1e3, 1e5)
    return args, estimate_durations(*args)


def test_estimate_durations_without_gradients_prices_no_reduction(three_stages):
    args, plain = three_stages
    assert plain.reduction == ()
    assert estimate_durations(*args, gradients=None) == plain


def test_a_stage_traced_per_replica_is_priced_as_its_copies_side_by_side(three_stages):
    """Parts traced per replica (2 of the micro-batch's 4 rows), 2 copies each: the forward and
    the input pass, whose every operation follows the rows, cost what the parts traced at the
    micro-batch's size cost; the weight pass more, as each replica repeats its work shaped like
    the parameter."""
    args, plain = three_stages
    x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
    stage = Stage(1, jax.make_jaxpr(lambda x, w: (jnp.tanh(x @ w),))(x, w),
                  (Ref(RefKind.ACT, 0, 0), Ref(RefKind.PARAM, 0)), (Ref(RefKind.ACT, 1, 0),))
    halves = [dataclasses.replace(stage_parts(stage), stage=s) for s in range(3)]
    copied = estimate_durations(halves, *args[1:], copies=[2, 2, 2])
    for got, whole in zip(copied.stages, plain.stages):
        assert (got.forward, got.backward_input) == (whole.forward, whole.backward_input)
        assert whole.backward_weight < got.backward_weight < 2 * whole.backward_weight
    assert estimate_durations(halves, *args[1:]).stages[0].forward == pytest.approx(plain.stages[0].forward / 2)
    with pytest.raises(ValueError, match=r"^copies: expected one per stage \(3\), got 2$"):
        estimate_durations(halves, *args[1:], copies=[2, 2])


def test_per_micro_batch_lengthens_the_backward_and_the_weight_pass_by_the_ring(three_stages):
    """Each backward all-reduces its parameter cotangents: the whole backward and the weight
    pass that makes them take one ring longer; the forward and the input pass do not."""
    args, plain = three_stages
    gradients = [StageGradients(256 * (s + 1), 2, 1e3, s, GradientReduction.PER_MICRO_BATCH) for s in range(3)]
    priced = estimate_durations(*args, gradients=gradients)
    assert priced.reduction == ()
    assert (priced.activation, priced.gradient) == (plain.activation, plain.gradient)
    for s, (got, base) in enumerate(zip(priced.stages, plain.stages)):
        ring = 256 * (s + 1) / 1e3  # 2 (2 - 1) / 2 of the bytes
        assert got == StageSeconds(base.forward, base.backward + ring, base.backward_input,
                                   base.backward_weight + ring)


def test_per_step_adds_up_each_meshs_stages_and_leaves_the_backwards(three_stages):
    """Stages 0 and 2 labelled mesh 0 reduce together (one ring of their summed bytes), stage 1
    alone on mesh 1; a per-micro-batch stage leaves its mesh's entry at 0."""
    args, plain = three_stages
    gradients = [StageGradients(1000, 2, 100.0, 0, GradientReduction.PER_STEP),
                 StageGradients(1500, 2, 100.0, 1, GradientReduction.PER_STEP),
                 StageGradients(500, 2, 100.0, 0, GradientReduction.PER_STEP)]
    priced = estimate_durations(*args, gradients=gradients)
    assert priced.stages == plain.stages
    assert priced.reduction == (15.0, 15.0)  # 10 + 5 on mesh 0, 15 on mesh 1
    mixed = [gradients[0], dataclasses.replace(gradients[1], reduction=GradientReduction.PER_MICRO_BATCH), gradients[2]]
    priced = estimate_durations(*args, gradients=mixed)
    assert priced.reduction == (15.0, 0.0)
    assert priced.stages[1].backward == plain.stages[1].backward + 15.0
    assert (priced.stages[0], priced.stages[2]) == (plain.stages[0], plain.stages[2])


@pytest.mark.parametrize("count", [0, 2, 4])
def test_estimate_durations_wants_one_gradients_per_stage(three_stages, count):
    args, _ = three_stages
    with pytest.raises(ValueError, match=rf"^gradients: expected one per stage \(3\), got {count}$"):
        estimate_durations(*args, gradients=[_gradients()] * count)


# -- the simulated per-step reduction, by hand --------------------------------------------------


def _durations(S, f, b, reduction=(), act=0.0, grad=0.0):
    """Uniform stages of forward ``f`` and whole backward ``b`` (halves when split) on a chain."""
    return TaskDurations((StageSeconds(f, b, b / 2, b / 2),) * S, (act,) * (S - 1), (grad,) * (S - 1),
                         tuple(reduction))


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_each_mesh_reduces_as_its_last_backward_ends(name):
    """S = M = 2, f = 1, b = 2, free transfers, by hand. 1F1B: mesh 0 runs F0 0-1, F1 1-2,
    B0 4-6, B1 7-9; mesh 1 F0 1-2, B0 2-4, F1 4-5, B1 5-7. GPipe: mesh 0 F0 0-1, F1 1-2, B0
    5-7, B1 7-9; mesh 1 F0 1-2, F1 2-3, B0 3-5, B1 5-7. Either way mesh 1's last backward ends
    at 7 and mesh 0's at 9: with reductions of 1 (mesh 0) and 5 (mesh 1), mesh 1 reduces 7-12
    while mesh 0 still computes, and the step is 12, not 9 + 5. Busy: 2 x 2 x 3 of compute and
    1 + 5 of reduction in 2 x 12 mesh-seconds."""
    schedule = make_schedule(name, 2, 2, [(0, 1)])
    step = simulate(schedule, _durations(2, 1.0, 2.0, (1.0, 5.0)))
    assert step.reductions == ((9.0, 10.0), (7.0, 12.0))
    assert step.step_seconds == 12.0
    assert step.bubble_fraction == 1 - 18 / 24
    assert [(e.task, e.start, e.end) for e in step.timeline.events] == [
        (e.task, e.start, e.end) for e in simulate(schedule, _durations(2, 1.0, 2.0)).timeline.events]
    # Mesh 0's reduction ends the step when it is the longer one.
    assert simulate(schedule, _durations(2, 1.0, 2.0, (4.0, 5.0))).step_seconds == 13.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_one_reduction_per_step_beats_one_per_micro_batch(name):
    """The same step with each mesh's gradients reduced in r seconds. Per micro-batch every
    backward takes b + r, and with uniform stages and free transfers the step is
    (M + S - 1)(f + b + r) = 3 (3 + r); per step it is the unreduced 9, then mesh 0's reduction:
    9 + r. With r = 4: 21 against 13."""
    schedule = make_schedule(name, 2, 2, [(0, 1)])
    r = 4.0
    per_micro_batch = simulate(schedule, _durations(2, 1.0, 2.0 + r))
    per_step = simulate(schedule, _durations(2, 1.0, 2.0, (r, r)))
    assert per_micro_batch.step_seconds == pytest.approx(3 * (3 + r), abs=1e-12)
    assert per_step.step_seconds == pytest.approx(9 + r, abs=1e-12)
    assert per_micro_batch.reductions == ()
    # Both count the reduction as busy: inside each backward, or as each mesh's own span.
    assert per_micro_batch.bubble_fraction == pytest.approx(1 - 2 * 2 * (3 + r) / (2 * 21), abs=1e-12)
    assert per_step.bubble_fraction == pytest.approx(1 - (2 * 2 * 3 + 2 * r) / (2 * 13), abs=1e-12)


def test_from_cost_model_durations_per_step_beats_per_micro_batch_by_the_hand_timed_amount(three_stages):
    """The cost model's durations of two of the stages (one per mesh, a ring of r each) in 1F1B,
    S = M = 2, no transfer time: by the timing above, per micro-batch 3 (f + b + r), per step
    3 (f + b) + r."""
    (parts, meshes, _, _, inter, intra), _ = three_stages
    args = (parts[:2], meshes[:2], [], 1, inter, intra)
    plain = estimate_durations(*args)
    f, b = plain.stages[0].forward, plain.stages[0].backward
    r = 4096 / 1e6
    schedule = make_schedule("1f1b", 2, 2, [(0, 1)])
    per_micro_batch = simulate(schedule, estimate_durations(
        *args, gradients=[StageGradients(4096, 2, 1e6, s, GradientReduction.PER_MICRO_BATCH) for s in range(2)]))
    per_step = simulate(schedule, estimate_durations(
        *args, gradients=[StageGradients(4096, 2, 1e6, s, GradientReduction.PER_STEP) for s in range(2)]))
    assert per_micro_batch.step_seconds == pytest.approx(3 * (f + b + r), rel=1e-12)
    assert per_step.step_seconds == pytest.approx(3 * (f + b) + r, rel=1e-12)
    assert per_step.step_seconds < per_micro_batch.step_seconds


def test_a_blocking_transfer_after_the_last_backward_waits_for_the_reduction():
    """Without overlap a transfer is a collective over both meshes, queued on the sender's
    devices behind its reduction: 1F1B as above, mesh 1 reduces 7-12, the cotangent of its
    last backward then crosses at 12, so mesh 0's last backward runs 12-14 and reduces 14-15."""
    step = simulate(make_schedule("1f1b", 2, 2, [(0, 1)]), _durations(2, 1.0, 2.0, (1.0, 5.0)), overlap=False)
    assert step.reductions == ((14.0, 15.0), (7.0, 12.0))
    assert step.step_seconds == 15.0


def test_no_reduction_and_zero_reductions_leave_the_step_alone():
    schedule = make_schedule("1f1b", 3, 4, _chain(3))
    plain = simulate(schedule, _durations(3, 1.0, 2.0, (), 0.5, 0.25))
    zero = simulate(schedule, _durations(3, 1.0, 2.0, (0.0,) * 3, 0.5, 0.25))
    assert plain.reductions == ()
    assert (zero.step_seconds, zero.bubble_fraction, zero.timeline) == (
        plain.step_seconds, plain.bubble_fraction, plain.timeline)
    assert [start == end for start, end in zero.reductions] == [True] * 3


def test_reductions_are_checked():
    with pytest.raises(ValueError, match=r"^TaskDurations.reduction: expected finite non-negative seconds, got -1.0"):
        _durations(2, 1.0, 2.0, (1.0, -1.0))
    with pytest.raises(ValueError, match=r"^durations.reduction: expected one per mesh \(2\) or none, got 3$"):
        simulate(make_schedule("1f1b", 2, 2, [(0, 1)]), _durations(2, 1.0, 2.0, (1.0, 1.0, 1.0)))
    # Four stages on two meshes: one reduction per mesh, not per stage.
    with pytest.raises(ValueError, match=r"^durations.reduction: expected one per mesh \(2\) or none, got 4$"):
        simulate(make_schedule("interleaved_1f1b", 4, 2, _chain(4), num_meshes=2),
                 _durations(4, 1.0, 2.0, (1.0,) * 4))


# -- against an independent solution ------------------------------------------------------------


def _fixed_point(schedule, durations, overlap):
    """The timing equations solved by iteration from all zeros: a task starts at the latest end
    among its data dependencies and its predecessors on each resource it holds, in launch
    order. Mesh ``m``'s reduction ``("R", m)`` reads every gradient (B, W) task of the mesh and
    holds the mesh in launch order right after the last of them. Returns every start (tasks
    and reductions)."""
    mesh = schedule.stage_mesh
    last = {mesh[t.where]: t for t in schedule.order if t.kind in (B, W)}
    holders, reads = {}, {}
    for t in schedule.order:
        if t.kind.is_compute:
            resources = [("mesh", mesh[t.where])]
        else:
            p, c = (mesh[s] for s in schedule.edges[t.where])
            src, dst = (p, c) if t.kind is A else (c, p)
            # Between stages on one mesh a value never leaves it: no collective to block on.
            resources = [("link", src, dst)] if overlap or src == dst else [("mesh", src), ("mesh", dst)]
        for r in resources:
            holders.setdefault(r, []).append(t)
        reads[t] = task_dependencies(t, schedule.edges, schedule.split_backward)
        if durations.reduction and t.kind in (B, W) and last[mesh[t.where]] == t:
            reduction = ("R", mesh[t.where])
            holders[("mesh", mesh[t.where])].append(reduction)
            reads[reduction] = [g for g in schedule.order if g.kind in (B, W) and mesh[g.where] == mesh[t.where]]
    before = {t: list(ds) for t, ds in reads.items()}
    for tasks in holders.values():
        for a, b in zip(tasks, tasks[1:]):
            before[b].append(a)

    def seconds(t):
        return durations.reduction[t[1]] if isinstance(t, tuple) else durations.seconds(t)

    start = {t: 0.0 for t in before}
    for _ in range(len(start) + 1):
        new = {t: max([start[d] + seconds(d) for d in before[t]], default=0.0) for t in start}
        if new == start:
            return start, seconds
        start = new
    raise AssertionError("the timing equations did not settle: a cycle")


def _random_case(rng):
    """A random schedule (virtual stages, split backwards and delays included) on a chain, with
    random durations and per-mesh reductions (some zero)."""
    name = rng.choice(sorted(SCHEDULES))
    kind = SCHEDULES[name]
    if kind.stages_per_mesh:
        P = rng.randint(1, 3)
        S, M = kind.stages_per_mesh * P, P * rng.randint(2, 3)
    elif kind.virtual_stages:
        P = rng.randint(1, 3)
        S, M = P * rng.randint(2, 3), P * rng.randint(1, 3)
    else:
        S = P = rng.randint(1, 4)
        M = rng.randint(1, 5)
    delays = None if kind.places_weight_passes or rng.random() < 0.5 else [rng.randint(0, 3) for _ in range(P)]
    stages = []
    for _ in range(S):
        i, w = rng.uniform(0.1, 3), rng.uniform(0.1, 3)
        stages.append(StageSeconds(rng.uniform(0.1, 3), i + w, i, w))
    transfers = [tuple(rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(S - 1)) for _ in range(2)]
    reduction = tuple(rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(P))
    schedule = make_schedule(name, S, M, _chain(S), delays, P)
    return schedule, TaskDurations(tuple(stages), *transfers, reduction)


def test_simulated_reductions_agree_with_a_fixed_point_iteration():
    rng = random.Random(22)
    for _ in range(150):
        schedule, durations = _random_case(rng)
        overlap = rng.random() < 0.5
        step = simulate(schedule, durations, overlap)
        starts, seconds = _fixed_point(schedule, durations, overlap)
        assert {e.task: e.start for e in step.timeline.events} == pytest.approx(
            {t: s for t, s in starts.items() if not isinstance(t, tuple)})
        P = schedule.num_meshes
        assert len(step.reductions) == P
        for m, (start, end) in enumerate(step.reductions):
            assert start == pytest.approx(starts[("R", m)]) and end - start == pytest.approx(durations.reduction[m])
            # It starts exactly as the mesh's last gradient task ends (same walk, same sum).
            gradient_ends = [e.end for e in step.timeline.events
                             if e.task.kind in (B, W) and schedule.stage_mesh[e.task.where] == m]
            assert start == max(gradient_ends)
        ends = [s + seconds(t) for t, s in starts.items()]
        assert step.step_seconds == pytest.approx(max(ends))
        busy = sum(seconds(t) for t in starts if isinstance(t, tuple) or t.kind.is_compute)
        assert step.bubble_fraction == pytest.approx(1 - busy / (P * max(ends)))
