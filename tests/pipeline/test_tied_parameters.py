"""Tied parameters across stages: GPT with its token embedding reused as the output head (the
embedding's first reader is stage 0, the head is on the last stage, on another mesh), against
jax.jit on one device."""

import jax
import pytest

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from meshpar.passes.program.step_instructions import ReduceGradient
from pipeline_models import assert_trees_close, make_state, run_both


@pytest.mark.parametrize("schedule,num_stages,stages_per_mesh", [
    ("1f1b", 2, None), pytest.param("interleaved_1f1b", 4, 2, marks=pytest.mark.slow)])
def test_tied_embeddings_train_as_under_jit(schedule, num_stages, stages_per_mesh):
    model = GPT(num_stages=num_stages, num_layers=4, tie_embeddings=True)
    batch = gpt_batch(0, 16, 8, 64)
    state = make_state(model, batch["x"][:1])
    assert "head" not in state.params["params"]
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=num_stages, stages_per_mesh=stages_per_mesh,
                                       stage_mesh_shape=(2, 2), schedule=schedule)
    ref_state, par_state, parallel = run_both(supervised_step(gpt_loss), state, batch, method, steps=2)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    executable = parallel.get_executable(par_state, batch)
    compiled = parallel.get_compiled(par_state, batch)
    # The embedding lives on stage 0's mesh only; the last stage reads a fetched copy and its
    # gradient goes back there, summed with stage 0's once per step.
    embedding = par_state.params["params"]["tok_embed"]["embedding"]
    assert set(embedding.sharding.device_set) == set(executable.meshes[0].devices.flat)
    last = compiled.graph.num_stages - 1
    fetched = [op for op in compiled.layout.stage_operands[last] if op.fetch is not None]
    assert len(fetched) == 1
    back = [i for i in executable.step_program if isinstance(i, ReduceGradient) and i.stage == last
            and i.move is not None]
    assert len(back) == 1 and back[0].mesh == 0
    # The compiler says which contribution adds to an earlier one (the runtime does not look):
    # stage 0's makes the gradient, the last stage's adds to it, reading it.
    mine = [i for i in executable.step_program if isinstance(i, ReduceGradient) and i.param == back[0].param]
    assert [i.adds for i in mine] == [False, True] and mine[1].reads == mine[0].writes
