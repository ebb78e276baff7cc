"""The ``free_step_values`` pass and ``FreeValues``: each value of the step dropped right after its
last use, and each stage's gradient accumulator consumed by its reduction, so the step holds no
gradient past the update that reads it. Against jax.jit on one device; the verifiers refuse a
value used after its free, freed twice, or held to the end unread."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import meshpar
from examples.mlp import MLP
from meshpar.passes.pipeline.lowering.step_frees import free_step_values, verify_step_frees
from meshpar.passes.pipeline.lowering.step_program import verify_step_program
from meshpar.passes.program.step_instructions import AssembleOutputs, FreeValues, RunCompute
from meshpar.passes.program.step_values import OuterKind
from meshpar.passes.verification import PlanVerificationError
from meshpar.runtime.step_handlers import STEP_HANDLERS
from pipeline_models import assert_trees_close, aux_sum_step, make_state, regression_batch

METHOD = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2)


def _state(batch):
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=2), batch["x"][:1])
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3))
    return state.replace(tx=tx, opt_state=tx.init(state.params))


@pytest.fixture(scope="module")
def compiled():
    batch = regression_batch()
    return meshpar.parallelize(aux_sum_step, method=METHOD).get_compiled(_state(batch), batch)


def test_every_value_the_outputs_do_not_read_is_freed_after_its_last_use(compiled):
    step = compiled.step
    end = next(k for k, ins in enumerate(step) if isinstance(ins, AssembleOutputs))
    frees = [(k, ins) for k, ins in enumerate(step) if isinstance(ins, FreeValues)]
    assert frees and all(k < end for k, _ in frees)
    for k, ins in frees:
        # Right after the last instruction using each value it frees: that one, and none later.
        for located in ins.values:
            uses = [j for j, other in enumerate(step) if located in (*other.reads, *other.writes)]
            assert uses[-1] == k - 1, (str(ins), located)
    # Every gradient is freed on its owner's mesh before the outputs are assembled.
    freed = {v for _, ins in frees for v in ins.values}
    grads = {v for ins in step for v in ins.writes if v[0].kind is OuterKind.GRAD}
    assert grads and grads <= freed
    verify_step_frees(step)


def test_no_gradient_or_accumulator_is_held_when_the_outputs_are_assembled_and_the_step_equals_jit(monkeypatch):
    batch = regression_batch()
    state = _state(batch)
    seen = {}
    assemble = STEP_HANDLERS[AssembleOutputs]

    def looking(ex, ins, ready, st):
        seen["values"] = set(st.values)
        seen["accumulators"] = [g for grads in st.run.grads if grads is not None for g in grads]
        assemble.run(ex, ins, ready, st)

    monkeypatch.setitem(STEP_HANDLERS, AssembleOutputs, dataclasses.replace(assemble, run=looking))
    parallel = meshpar.parallelize(aux_sum_step, method=METHOD)
    ref, par = state, state
    for _ in range(2):
        ref_out, par_out = jax.jit(aux_sum_step)(ref, batch), parallel(par, batch)
        ref, par = ref_out[0], par_out[0]
    assert_trees_close(par.params, ref.params)
    assert_trees_close(par.opt_state, ref.opt_state)
    np.testing.assert_allclose(float(par_out[1]), float(ref_out[1]), rtol=1e-5)
    assert seen["accumulators"] and all(g is None for g in seen["accumulators"])
    assert not {v for v in seen["values"] if v[0].kind is OuterKind.GRAD}


def test_the_verifiers_refuse_a_use_after_free_a_double_free_and_a_value_held_to_the_end(compiled):
    step, split, graph, program = compiled.step, compiled.split, compiled.graph, compiled.program
    instructions = list(step.instructions)
    k, free = next((k, ins) for k, ins in enumerate(instructions) if isinstance(ins, FreeValues)
                   and any(isinstance(j, RunCompute) for j in instructions[:k]))
    located = free.values[0]
    reader = max(j for j, ins in enumerate(instructions) if located in (*ins.reads, *ins.writes))
    early = instructions[:reader] + [FreeValues((located,))] + instructions[reader:]
    with pytest.raises(PlanVerificationError, match=f"uses {located[0]} on mesh {located[1]} after it was freed"):
        verify_step_program(dataclasses.replace(step, instructions=tuple(early)), split, graph, program)
    twice = instructions[:k + 1] + [FreeValues((located,))] + instructions[k + 1:]
    with pytest.raises(PlanVerificationError, match="which is already freed"):
        verify_step_program(dataclasses.replace(step, instructions=tuple(twice)), split, graph, program)
    kept = instructions[:k] + ([FreeValues(free.values[1:])] if free.values[1:] else []) + instructions[k + 1:]
    with pytest.raises(PlanVerificationError, match=f"{located[0]} on mesh {located[1]} is held to the step's end"):
        verify_step_frees(dataclasses.replace(step, instructions=tuple(kept)))
    # The pass on a program without frees puts the same ones back.
    bare = dataclasses.replace(step, instructions=tuple(i for i in instructions if not isinstance(i, FreeValues)))
    assert free_step_values(bare) == step
