"""Fusing a mesh's back-to-back compute (passes.pipeline.lowering.fused_runs): every schedule's program
stays a valid program with the same tasks in the same per-mesh order, a fused program starts
only on values live before it, and a step run with fused programs equals jax.jit."""

import dataclasses

import jax
import numpy as np
import pytest

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from meshpar.passes.program.moves import TransferKind
from meshpar.passes.program.pipeline_instructions import RunFused
from meshpar.passes.pipeline.lowering.fused_runs import fuse_compute_runs
from meshpar.passes.pipeline.lowering.pipeline_program import verify_pipeline_program
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES
from pipeline_models import assert_trees_close, make_state
from test_pipeline_program import _build, _chain, _u_shape

CASES = ([(name, 3, 4, None) for name, k in SCHEDULES.items() if k.stages_per_mesh is None]
         + [(name, 4, 4, 2) for name, k in SCHEDULES.items() if k.stages_per_mesh == 2]
         + [("interleaved_1f1b", 4, 4, 1), ("interleaved_1f1b", 6, 6, 2)])


def _local_moves(program):
    """``program`` with its moves between stages of one mesh ``LOCAL``, as the compiler plans them."""
    home = program.stage_mesh
    return dataclasses.replace(program, transfers=tuple(
        dataclasses.replace(t, kind=TransferKind.LOCAL) if home[t.src_stage] == home[t.dst_stage] else t
        for t in program.transfers))


def _compute_tasks(program):
    """Per mesh, the compute tasks in launch order (a fused instruction's in member order)."""
    return [[t for ins in instructions for t in ins.tasks if t.kind.is_compute]
            for instructions in program.instructions]


@pytest.mark.parametrize("max_members", [None, 2, 3])
@pytest.mark.parametrize("edges_of", [_chain, _u_shape])
@pytest.mark.parametrize("name,S,M,num_meshes", CASES)
def test_fused_programs_verify_and_keep_every_task_in_order(name, S, M, num_meshes, edges_of, max_members):
    reduced = frozenset(range(S))
    program, _, _ = _build(name, S, M, edges_of(S), num_meshes=num_meshes, reduced=reduced)
    program = _local_moves(program)
    fused = fuse_compute_runs(program, max_members)
    verify_pipeline_program(fused, reduced)
    assert _compute_tasks(fused) == _compute_tasks(program)
    local = {k for k, t in enumerate(program.transfers) if t.kind is TransferKind.LOCAL}
    live = [set() for _ in fused.instructions]
    for mesh, ins in fused.launch_sequence():
        if isinstance(ins, RunFused):
            assert len(ins.members) >= 2 and (max_members is None or len(ins.members) <= max_members)
            # It starts on values live before it: what its members read from outside it.
            assert set(ins.inputs) <= live[mesh]
            # Only local moves happen inside it.
            assert all(mv.transfer in local for mv in ins.moves)
        live[mesh] -= set(ins.frees)
        live[mesh] |= set(ins.writes)


def test_a_mesh_hosting_every_stage_runs_its_pipeline_as_one_program():
    program, _, _ = _build("interleaved_1f1b", 4, 4, _chain(4), num_meshes=1)
    fused = fuse_compute_runs(_local_moves(program))
    runs = [ins for _, ins in fused.launch_sequence() if isinstance(ins, RunFused)]
    assert len(runs) == 1 and len(runs[0].members) == 4 * 4 * 2
    # Activations and cotangents between its stages are the program's own: no buffer, no move.
    assert not any(ins.sends for _, ins in fused.launch_sequence())


def test_a_stage_whose_output_crosses_meshes_ends_its_run():
    """1F1B on two meshes: the last stage's forward and backward fuse; the first stage's
    forward, whose activation the other mesh waits for, ends each of its runs."""
    program, _, _ = _build("1f1b", 2, 4, _chain(2))
    fused = fuse_compute_runs(program)
    for ins in (x for _, x in fused.launch_sequence() if isinstance(x, RunFused)):
        stages = [t.where for t in ins.tasks]
        kinds = "".join(t.kind.value for t in ins.tasks)
        assert (stages, kinds) in (([1, 1], "FB"), ([0, 0], "BF")), ins


def test_max_members_must_be_positive():
    program, _, _ = _build("1f1b", 2, 2, _chain(2))
    with pytest.raises(ValueError, match="max_members: expected a positive count or None, got 0"):
        fuse_compute_runs(program, 0)


@pytest.mark.parametrize("schedule,meshes,per_mesh,fuse", [
    ("interleaved_1f1b", 1, 2, None), pytest.param("zb_v", 1, 2, 3, marks=pytest.mark.slow),
    pytest.param("1f1b", 2, 1, None, marks=pytest.mark.slow)])
def test_a_step_of_fused_programs_equals_jit(schedule, meshes, per_mesh, fuse, tmp_path):
    model = GPT(num_stages=meshes * per_mesh)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    state = make_state(model, batch["x"][:1])
    step = supervised_step(gpt_loss)
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=meshes * per_mesh, stages_per_mesh=per_mesh,
                                       stage_mesh_shape=(1, 1), schedule=schedule, devices=jax.devices()[:meshes],
                                       fuse_compute=fuse)
    parallel = meshpar.parallelize(step, method=method)
    ref_state, par_state = state, state
    for _ in range(2):
        ref_state, ref_loss = jax.jit(step)(ref_state, batch)
        par_state, par_loss = parallel(par_state, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par_state, ref_state)
    program = parallel.get_executable(state, batch).program
    assert any(isinstance(ins, RunFused) for _, ins in program.launch_sequence())
    # A trace still times every compute task once (a fused program's time split among its tasks).
    _, trace = parallel.trace(str(tmp_path / "step.json"), par_state, batch)
    events = trace.timeline.events
    compute = sorted(str(e.task) for e in events if e.task.kind.is_compute)
    schedule = parallel.get_compiled(state, batch).schedule
    assert compute == sorted(str(t) for seq in schedule.sequences for t in seq)
