"""A new planner is one module plus one registry entry (issue 43, item 4): this file alone
defines a toy planner (``protocol.Planner``: ``plan`` and ``predict``), registers it in
``PLANNERS``, and ``meshpar.plan_parallelism(planner="toy")`` takes it by name: its plan is the
one returned and run, and calibration fits ``Hardware`` to the toy's own cost model."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
import pytest

import meshpar
from examples.train_step import supervised_step
from meshpar.passes.model.cluster import Cluster
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, ScheduleKind
from meshpar.passes.planning.calibration import CalibrationPipeline, fit_compute, fit_pipeline
from meshpar.passes.planning.layer_profile import LayerProfile, ModelProfile
from meshpar.passes.planning.planners import PLANNERS
from meshpar.passes.planning.protocol import Hardware, PipelinePlan, PlanConstraints, StagePlan
from pipeline_models import TwoStages, assert_trees_close, make_state, mse


class HalvesOnGPipe:
    """A toy planner: the layers in two halves, each on a ``(2, 1)`` mesh, under GPipe, with the
    fixed micro-batch count or 2. Its cost model: per micro-batch and stage, the forward and
    backward FLOPs (three times the forward's) over the mesh's devices and each operation's
    calibrated seconds; GPipe's ``M + S - 1`` slots of the slowest stage; and, pipelined, two
    tasks per stage and micro-batch at ``task_s`` each plus ``pipeline_s`` once.

    Attributes:
      priced: every layout ``predict`` priced, as ``(stages, num_micro_batches)``.
      planned_on: the hardware ``plan`` was last given.
    """

    def __init__(self) -> None:
        self.priced: list[tuple[tuple[StagePlan, ...], int]] = []
        self.planned_on: Hardware | None = None

    def plan(self, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
             constraints: PlanConstraints) -> list[PipelinePlan]:
        self.planned_on = hardware
        L = profile.num_layers
        stages = (StagePlan(0, L // 2, (2, 1)), StagePlan(L // 2, L, (2, 1)))
        return [self.predict(profile, cluster, hardware, stages, constraints.num_micro_batches or 2,
                             SCHEDULES["gpipe"])]

    def predict(self, profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
                num_micro_batches: int, schedule: ScheduleKind) -> PipelinePlan:
        self.priced.append((tuple(stages), num_micro_batches))
        S, M = len(stages), num_micro_batches
        b = profile.batch_size / M

        def stage_s(stage: StagePlan) -> float:
            layers = profile.span(stage.start, stage.stop)
            flops = 3 * b * sum(layer.flops for layer in layers) / (stage.num_devices * hardware.device_flops)
            ops = 3 * sum(layer.num_ops for layer in layers) * hardware.op_seconds(stage.num_devices)
            return flops * hardware.compute_scale + ops

        step = (M + S - 1) * max(map(stage_s, stages))
        if S > 1 or M > 1:
            step += 2 * S * M * hardware.task_s + hardware.pipeline_s
        memory = tuple(sum(layer.param_bytes for layer in profile.span(s.start, s.stop)) for s in stages)
        return PipelinePlan(tuple(stages), M, schedule.name, step, memory, "toy")


@pytest.fixture
def toy(monkeypatch):
    planner = HalvesOnGPipe()
    monkeypatch.setitem(PLANNERS, "toy", planner)
    return planner


def _two_stages():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 6)).astype(np.float32), "y": rng.standard_normal((8, 4)).astype(np.float32)}
    return make_state(TwoStages(), batch["x"][:1]), batch, supervised_step(mse)


def test_an_unregistered_planner_is_not_taken():
    state, batch, step = _two_stages()
    with pytest.raises(ValueError, match=r"^planner: expected one of \[.*'meshpar'.*\], got 'toy'$"):
        meshpar.plan_parallelism(step, state, batch, hardware=Hardware(1e13), planner="toy")


def test_a_registered_planner_is_taken_by_name_and_its_plan_runs(toy):
    state, batch, step = _two_stages()
    assert meshpar.planning.PLANNERS["toy"] is toy  # the public name is the registry
    plan = meshpar.plan_parallelism(step, state, batch, hardware=Hardware(1e13), planner="toy")
    assert toy.planned_on == Hardware(1e13) and plan.alternatives == ()
    assert plan.best.planner == "toy" and plan.best.schedule == "gpipe" and plan.best.num_micro_batches == 2
    assert [(s.start, s.stop, s.shape) for s in plan.best.stages] == [(0, 1, (2, 1)), (1, 2, (2, 1))]
    assert "chosen: toy: 2 stages" in plan.describe()
    parallel = meshpar.parallelize(step, method=plan.method)
    got_state, got_loss = parallel(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
    compiled = parallel.get_compiled(state, batch)
    assert compiled.schedule.name == "gpipe" and compiled.graph.num_stages == 2
    assert len(plan.method.devices) == 4
    fixed = meshpar.plan_parallelism(step, state, batch, hardware=Hardware(1e13), planner="toy", num_micro_batches=4)
    assert fixed.best.num_micro_batches == 4


def test_calibration_fits_the_hardware_to_the_registered_planners_model(toy):
    """Device-free: priced by the toy's own model at known scales and overheads, the steps are
    fitted back to them exactly; meshpar's model would price the same layouts otherwise."""
    layer = LayerProfile(flops=2e6, param_bytes=1e4, optimizer_bytes=2e4, activation_bytes=1e3, boundary_bytes=1e2,
                         num_ops=50)
    profile = ModelProfile.uniform(4, layer, 16)
    cluster = Cluster.aws_p3_8xlarge(2)
    hardware = Hardware(1e9, op_s=(1e-6, 2e-7))
    truth = dataclasses.replace(hardware, compute_scale=2.0, op_scale=3.0, task_s=1e-3, pipeline_s=5e-3)
    one_program = {n: toy.predict(profile, cluster, truth, [StagePlan(0, 4, (n, 1))], 1, SCHEDULES["1f1b"])
                   .predicted_step_s for n in (1, 8)}
    fitted = fit_compute(PLANNERS["toy"], profile, cluster, hardware, one_program)
    assert (fitted.compute_scale, fitted.op_scale) == pytest.approx((2.0, 3.0), rel=1e-6)
    pipeline = CalibrationPipeline.of(profile, 8)
    assert pipeline.micro_batch_counts == (2, 4)
    toy.priced.clear()
    steps = {M: pipeline.predict(toy, profile, cluster, truth, M).predicted_step_s for M in (2, 4)}
    fitted = fit_pipeline(PLANNERS["toy"], profile, cluster, fitted, pipeline, steps, move_s=2e-4)
    assert (fitted.task_s, fitted.pipeline_s) == pytest.approx((1e-3, 5e-3), rel=1e-6)
    assert fitted.move_s == 2e-4
    assert {layout for layout in toy.priced} == {(pipeline.stages, 2), (pipeline.stages, 4)}


def test_plan_parallelism_calibrates_with_the_selected_planner(toy):
    """Without ``hardware``, the steps measured on the devices are fitted through the toy's
    ``predict``: the one-program step on one device and on all eight, and the two-stage
    calibration pipeline; the toy then plans on what was fitted."""
    state, batch, step = _two_stages()
    meshpar.plan_parallelism(step, state, batch, planner="toy")
    layouts = {(tuple((s.start, s.stop, s.shape) for s in stages), M) for stages, M in toy.priced}
    assert {(((0, 2, (1, 1)),), 1), (((0, 2, (8, 1)),), 1), (((0, 1, (4, 1)), (1, 2, (4, 1))), 2)} <= layouts
    assert toy.planned_on is not None and toy.planned_on.compute_scale != 1.0
