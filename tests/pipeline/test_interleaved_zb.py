"""Interleaved zero bubble (``interleaved_zb``, torch's ``ScheduleInterleavedZeroBubble``, ZB1P):
torch's own orders, the verifier on every size torch accepts, the zero-bubble gain over
interleaved 1F1B in the simulator, the errors, and one pipeline against jax.jit."""

import re
from pathlib import Path

import numpy as np
import pytest

from repo_paths import TESTS_DIR

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline.scheduling.pipeline_schedule import (
    SCHEDULES, StagePlacement, check_stage_placement, make_schedule,
)
from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate
from pipeline_models import assert_trees_close, make_state, mse, run_both

F, I, W = TaskKind.FORWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT
ARTIFACTS = Path(TESTS_DIR) / "artifacts"
# torch 2.14.1's ScheduleInterleavedZeroBubble orders (tests/artifacts/README.md): (P, v, M).
TORCH_CASES = [(2, 2, 8), (4, 2, 8), (3, 2, 6), (2, 3, 6), (4, 2, 10), (4, 2, 3), (2, 1, 4)]
_TORCH_ACTION = re.compile(r"(\d+)([FIW])(\d+)")


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _torch_order(P, v, M):
    """Per rank, the compute tasks of torch's CSV for ``(P, v, M)``, idle steps (empty cells)
    dropped: torch pads them for its lock-step simulation, meshpar's order has none."""
    lines = (ARTIFACTS / f"interleaved_zb_{P}rank_{v}stagep_{M}mb.csv").read_text().splitlines()
    order = []
    for line in lines:
        tasks = []
        for cell in filter(None, line.split(",")):
            stage, kind, micro_batch = _TORCH_ACTION.fullmatch(cell).groups()
            tasks.append(Task({"F": F, "I": I, "W": W}[kind], int(stage), int(micro_batch)))
        order.append(tasks)
    return order


@pytest.mark.parametrize("P,v,M", TORCH_CASES)
def test_each_mesh_runs_torchs_order(P, v, M):
    """Equal to the order torch 2.14.1's ScheduleInterleavedZeroBubble writes, rank by rank; the
    2-rank, 2-stage, 8-micro-batch case is torch's golden zb1p_2rank_2stagep_compute.csv."""
    torch_order = _torch_order(P, v, M)
    assert len(torch_order) == P
    schedule = make_schedule("interleaved_zb", P * v, M, _chain(P * v), num_meshes=P)
    assert [list(seq) for seq in schedule.sequences] == torch_order
    assert schedule.stage_mesh == tuple(s % P for s in range(P * v))
    assert schedule.split_backward and schedule.weight_delays is None


def test_registered_on_the_looped_placement_placing_its_own_weight_passes():
    kind = SCHEDULES["interleaved_zb"]
    assert (kind.placement, kind.virtual_stages, kind.places_weight_passes, kind.stages_per_mesh) == (
        StagePlacement.LOOP, True, True, None)


def _torch_accepts(P, M):
    """torch's rule: M a multiple of its max(1, M // P) rounds."""
    return M % max(1, M // P) == 0


def test_every_size_torch_accepts_runs_and_the_others_are_refused():
    """P = 1..4 meshes, v = 2..3 stages each, M = 1..12: built, acyclic and verified by
    make_schedule where torch accepts M, refused naming num_micro_batches where it does not;
    every task once, each (kind, stage) in micro-batch order, each weight pass after its input
    pass on the stage's own mesh."""
    for P in range(1, 5):
        for v in (2, 3):
            for M in range(1, 13):
                S = P * v
                if not _torch_accepts(P, M):
                    with pytest.raises(ValueError, match=r"^num_micro_batches: interleaved_zb with virtual stages "
                                                         r"needs a multiple of \d+ micro-batches.*pass e\.g\. "):
                        check_stage_placement("interleaved_zb", S, P, M)
                    continue
                schedule = make_schedule("interleaved_zb", S, M, _chain(S), num_meshes=P)
                for r, seq in enumerate(schedule.sequences):
                    assert len(seq) == len(set(seq)) == 3 * v * M
                    assert {t.where for t in seq} == set(range(r, S, P))
                    for kind in (F, I, W):
                        for stage in range(r, S, P):
                            assert [t.micro_batch for t in seq if (t.kind, t.where) == (kind, stage)] == list(range(M))
                    position = {t: k for k, t in enumerate(seq)}
                    assert all(position[Task(W, t.where, t.micro_batch)] > k for k, t in enumerate(seq) if t.kind is I)


@pytest.mark.parametrize("P,M", [(2, 3), (3, 5), (4, 8)])
def test_one_stage_per_mesh_is_zb_h1(P, M):
    """With v = 1 every op is on chunk 0 and mesh r holds back r weight passes: ZB-H1, any M."""
    assert (make_schedule("interleaved_zb", P, M, _chain(P)).sequences
            == make_schedule("zb_h1", P, M, _chain(P)).sequences)


@pytest.mark.parametrize("P,v,M", [(2, 2, 4), (2, 2, 8), (4, 2, 8), (4, 2, 16), (3, 3, 6)])
def test_weight_passes_shorten_interleaved_1f1bs_step_at_the_same_activation_peak(P, v, M):
    """T_F = T_I = T_W, free transfers: the same work as interleaved 1F1B with whole backwards
    of 2 units, in a shorter step, no mesh holding more forward residuals."""
    S = P * v
    unit = StageSeconds(1.0, 2.0, 1.0, 1.0)
    durations = TaskDurations((unit,) * S, (0.0,) * (S - 1), (0.0,) * (S - 1))
    zb = simulate(make_schedule("interleaved_zb", S, M, _chain(S), num_meshes=P), durations)
    one_f_one_b = simulate(make_schedule("interleaved_1f1b", S, M, _chain(S), num_meshes=P), durations)
    assert zb.step_seconds < one_f_one_b.step_seconds
    assert zb.bubble_fraction < one_f_one_b.bubble_fraction
    assert max(zb.peak_live_activations) <= max(one_f_one_b.peak_live_activations)


def test_a_micro_batch_count_torch_refuses_gets_the_nearest_that_fit():
    with pytest.raises(ValueError, match=r"needs a multiple of 2 micro-batches \(4 meshes\), got 9; pass e\.g\. "
                                         r"8 or 10$"):
        make_schedule("interleaved_zb", 8, 9, _chain(8), num_meshes=4)
    with pytest.raises(ValueError, match="^weight_delay: interleaved_zb places its weight passes itself"):
        make_schedule("interleaved_zb", 4, 4, _chain(4), weight_delays=(1, 1), num_meshes=2)


def test_mlp_pipeline_matches_jit():
    """Four stages on two meshes (v = 2), four micro-batches: two training steps equal jax.jit's."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 6)).astype(np.float32),
             "y": rng.standard_normal((32, 4)).astype(np.float32)}
    state = make_state(MLP(features=(16,) * 7 + (4,), num_stages=4), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=4, stages_per_mesh=2,
                                       stage_mesh_shape=(4, 1), schedule="interleaved_zb")
    ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=2)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    schedule = parallel.get_compiled(par_state, batch).schedule
    assert schedule.name == "interleaved_zb" and schedule.stage_mesh == (0, 1, 0, 1)
    assert [list(seq) for seq in schedule.sequences] == [
        list(seq) for seq in make_schedule("interleaved_zb", 4, 4, _chain(4), num_meshes=2).sequences]
