"""ParallelizedStep.trace: one step's measured timeline, in one process with 8 devices."""

import collections
import dataclasses
import json
import threading
import time
from typing import Any

import jax
import numpy as np
import pytest

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.program.moves import Direction
from meshpar.passes.program.pipeline_instructions import RunForward
from meshpar.passes.pipeline.scheduling.pipeline_schedule import PipelineSchedule
from meshpar.passes.program.tasks import TaskKind, task_dependencies
from meshpar.passes.program.timeline import Lane, LaneKind, Timeline
from meshpar.passes.simulation.timeline import read_chrome_trace
from meshpar.runtime.pipeline_executor import PipelineExecutable
from meshpar.runtime.step_trace import StepRecorder
from pipeline_models import assert_trees_close, make_state, mse

SCHEDULES = [("1f1b", False), ("eager_1f1b", True), ("zb_h1", False)]


def _batch(n=16, d=6, k=4):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


@dataclasses.dataclass(frozen=True)
class Traced:
    """One schedule's pipeline: a plain step, a traced and a serialized traced step on the same
    inputs, and jax.jit's step."""

    executable: PipelineExecutable
    schedule: PipelineSchedule  # the compiler's, which the program was lowered from
    compiled_before: int
    compiled_after: int
    plain: Any
    jitted: Any
    traced: Any
    timeline: Timeline
    path: str
    serialized: Any
    serialized_timeline: Timeline
    outside_pipeline_s: tuple[float, float]  # the traced step's, the serialized one's


@pytest.fixture(scope="module", params=SCHEDULES, ids=lambda p: f"{p[0]}-weight_delay={p[1]}")
def traced(request, tmp_path_factory) -> Traced:
    schedule, weight_delay = request.param
    batch = _batch()
    state = make_state(MLP(features=(16, 16, 16, 16, 4), num_stages=3), batch["x"][:1])
    step = supervised_step(mse)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=3, stage_mesh_shape=(2, 1), devices=jax.devices()[:6],
        schedule=schedule, weight_delay=weight_delay))
    plain = parallel(state, batch)
    executable = parallel.get_executable(state, batch)
    before = executable.compiled_count()
    path = str(tmp_path_factory.mktemp("trace") / "step.json")
    outputs, trace = parallel.trace(path, state, batch)
    serialized, serialized_trace = parallel.trace(path + ".serialized", state, batch, serialize=True)
    timeline, serialized_timeline = trace.timeline, serialized_trace.timeline
    return Traced(executable, parallel.get_compiled(state, batch).schedule, before, executable.compiled_count(), plain, jax.jit(step)(state, batch),
                  outputs, timeline, path, serialized, serialized_timeline,
                  (trace.outside_pipeline_s, serialized_trace.outside_pipeline_s))


def test_trace_returns_the_steps_outputs(traced):
    for outputs in (traced.traced, traced.serialized):
        assert jax.tree.structure(outputs) == jax.tree.structure(traced.plain)
        for got, want in zip(jax.tree.leaves(outputs), jax.tree.leaves(traced.plain)):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    (state, loss), (ref_state, ref_loss) = traced.traced, traced.jitted
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(state.params, ref_state.params)


def test_serialized_steps_time_the_work_around_the_pipeline(traced):
    """Only a serialized step times the step program's other instructions (placing inputs, the
    update of every stage, ...), each run alone."""
    overlapped, serialized = traced.outside_pipeline_s
    assert overlapped == 0.0
    assert 0.0 < serialized


def test_tracing_compiles_nothing_for_the_step(traced):
    assert traced.compiled_after == traced.compiled_before


def test_written_trace_round_trips_to_the_returned_timeline(traced):
    with open(traced.path) as f:
        assert json.load(f)["otherData"]["source"] == "measured"
    for path, timeline in ((traced.path, traced.timeline), (traced.path + ".serialized", traced.serialized_timeline)):
        back = read_chrome_trace(path)
        assert back.source == timeline.source
        assert [(e.task, e.lane) for e in back.events] == [(e.task, e.lane) for e in timeline.events]
        for a, b in zip(back.events, timeline.events):
            assert a.start == pytest.approx(b.start, abs=1e-9) and a.end == pytest.approx(b.end, abs=1e-9)


def test_one_event_per_task_on_its_lane(traced):
    program = traced.executable.program
    for timeline in (traced.timeline, traced.serialized_timeline):
        assert collections.Counter(e.task for e in timeline.events) == collections.Counter(traced.schedule.order)
        links = {(t.edge, t.direction): Lane(LaneKind.LINK, t.src_stage, t.dst_stage) for t in program.transfers}
        for e in timeline.events:
            if e.task.kind.is_compute:
                assert e.lane == Lane(LaneKind.COMPUTE, e.task.where), e
            else:
                direction = Direction.ACTIVATION if e.task.kind is TaskKind.SEND_ACT else Direction.COTANGENT
                assert e.lane == links[(e.task.where, direction)], e
    assert traced.timeline.source == "measured"
    assert traced.serialized_timeline.source == "measured, serialized"
    assert min(e.start for e in traced.timeline.events) == 0.0


def _assert_no_overlap(events):
    ordered = sorted(events, key=lambda e: (e.start, e.end))
    for before, after in zip(ordered, ordered[1:]):
        assert after.start >= before.end, (before, after)


def test_compute_lanes_never_overlap_and_tasks_start_after_their_dependencies(traced):
    schedule = traced.schedule
    for timeline in (traced.timeline, traced.serialized_timeline):
        for lane in timeline.lanes():
            if lane.kind is LaneKind.COMPUTE:
                _assert_no_overlap([e for e in timeline.events if e.lane == lane])
        end = {e.task: e.end for e in timeline.events}
        for e in timeline.events:
            for d in task_dependencies(e.task, schedule.edges, schedule.split_backward):
                assert e.start >= end[d], (e, d)


def test_serialized_tasks_run_one_at_a_time(traced):
    _assert_no_overlap([e for e in traced.serialized_timeline.events if e.task.kind.is_compute])


def test_a_launch_that_never_finishes_times_out_naming_it(traced):
    """A waiter stuck on a launch (a peer that never sent) ends timeline() with its lane and task."""
    release = threading.Event()

    class Stuck:
        def block_until_ready(self):
            release.wait()
            return self

    forward = next(ins for ins in traced.executable.program.instructions[0] if isinstance(ins, RunForward))
    program = traced.executable.program
    try:
        with StepRecorder(program, [True] * len(program.instructions), serialize=False, timeout_s=0.2) as recorder:
            recorder.launched(0, forward, [Stuck()], time.perf_counter())
            with pytest.raises(TimeoutError, match=rf"mesh 0 did not finish F0\.{forward.micro_batch} within 0\.2 s"):
                recorder.timeline()
    finally:
        release.set()


BAD_PATHS = {
    "empty": lambda d: "",
    "missing directory": lambda d: str(d / "missing" / "step.json"),
    "a directory": lambda d: str(d),
    "not a str": lambda d: d / "step.json",
}


@pytest.mark.parametrize("bad", BAD_PATHS.values(), ids=BAD_PATHS.keys())
def test_bad_path_raises_before_running(bad, tmp_path):
    batch = _batch()
    state = make_state(MLP(features=(16, 4), num_stages=2), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(num_micro_batches=2))
    with pytest.raises(ValueError, match="path"):
        parallel.trace(bad(tmp_path), state, batch)
    assert not parallel._cache, "trace compiled the step before checking its path"


def test_plot_timelines_writes_a_png(traced, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.timeline_plot import plot_timelines

    out = tmp_path / "timeline.png"
    plot_timelines([traced.timeline, traced.serialized_timeline], ["overlapped", "serialized"], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="titles"):
        plot_timelines([traced.timeline], [], str(out))
