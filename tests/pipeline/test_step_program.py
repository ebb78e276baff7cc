"""The whole step as one typed program (passes/pipeline/lowering/step_program): what lower_step decides
(reductions, gradient homes, output shardings) and what its verifier rejects."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.program.step_values import AuxReduction
from meshpar.passes.program.step_instructions import (
    AssembleOutputs, CombineMicroBatches, FeedInstruction, FeedValue, PlaceInputs, ReduceGradient, RunCompute,
    RunPipeline, ShareOutputs, SliceMicroBatches,
)
from meshpar.passes.pipeline.lowering.step_program import verify_step_program
from meshpar.passes.program.step_values import OuterKind, RefKind
from meshpar.passes.verification import PlanVerificationError
from pipeline_models import aux_sum_step, make_state, mse, regression_batch


def _compiled(step, num_stages=2, **options):
    batch = regression_batch()
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=num_stages), batch["x"][:1])
    state = state.replace(tx=optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3)))
    state = state.replace(opt_state=state.tx.init(state.params))
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=num_stages, **options))
    return parallel.get_compiled(state, batch), parallel, state, batch


def test_the_compiler_decides_reductions_gradient_homes_and_order():
    compiled, parallel, state, batch = _compiled(aux_sum_step)
    step = compiled.step
    kinds = [type(i) for i in step]
    # Small outputs of two meshes are shared onto the same devices after assembly, so they combine.
    assert kinds[0] is PlaceInputs and kinds[-2:] == [AssembleOutputs, ShareOutputs] and kinds.count(RunPipeline) == 1
    combines = [i for i in step if isinstance(i, CombineMicroBatches)]
    # reduction="sum": the loss sums; each aux value combines by the rule the compiler resolved
    # for it (micro_batching), never by one the runtime picks.
    assert [c.value.kind for c in combines] == [OuterKind.LOSS, OuterKind.AUX, OuterKind.AUX]
    assert combines[0].how is AuxReduction.SUM and len(combines[0].buffers) == 4
    assert [c.how for c in combines[1:]] == list(compiled.micro_batching.aux)
    graph, home = compiled.graph, compiled.schedule.stage_mesh
    grads = [i for i in step if isinstance(i, ReduceGradient)]
    assert sorted((g.stage, g.param) for g in grads) == sorted((s.index, k) for s in graph.stages for k in s.param_inputs)
    assert all(g.mesh == home[graph.param_owner(g.param)] for g in grads)
    # The clipped update reads every gradient after it was reduced: the verifier accepted it,
    # and the step equals jax.jit's.
    got, want = parallel(state, batch), jax.jit(aux_sum_step)(state, batch)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)
    small = jax.tree.leaves(got[1:])
    assert all(x.sharding.device_set == small[0].sharding.device_set for x in small)
    np.testing.assert_allclose(float(got[1] / small[-1]), float(want[1] / jax.tree.leaves(want[1:])[-1]), rtol=1e-5)


def test_interleaved_gradients_are_reduced_on_the_owners_mesh():
    compiled, *_ = _compiled(supervised_step(mse), num_stages=4, stages_per_mesh=2, schedule="interleaved_1f1b")
    grads = [i for i in compiled.step if isinstance(i, ReduceGradient)]
    assert {g.mesh for g in grads} == {0, 1}
    assert all(g.mesh == g.stage % 2 for g in grads)


def _verify(compiled, instructions):
    verify_step_program(dataclasses.replace(compiled.step, instructions=tuple(instructions)),
                        compiled.split, compiled.graph, compiled.program)


def test_verifier_rejects_a_second_reduction_a_read_too_early_a_second_pipeline_and_a_lost_combine():
    compiled, *_ = _compiled(aux_sum_step)
    ins = list(compiled.step)
    _verify(compiled, ins)
    first_grad = next(k for k, i in enumerate(ins) if isinstance(i, ReduceGradient))
    with pytest.raises(PlanVerificationError, match="reduced exactly once"):
        _verify(compiled, ins[:first_grad] + [ins[first_grad]] + ins[first_grad:])
    reads_grad = next(k for k, i in enumerate(ins) if isinstance(i, RunCompute)
                      and any(r.kind is OuterKind.GRAD for r in i.inputs))
    early = ins[:first_grad] + [ins[reads_grad]] + [i for k, i in enumerate(ins[first_grad:], first_grad) if k != reads_grad]
    with pytest.raises(PlanVerificationError, match="before it is made there"):
        _verify(compiled, early)
    pipeline = next(k for k, i in enumerate(ins) if isinstance(i, RunPipeline))
    with pytest.raises(PlanVerificationError, match="once each"):
        _verify(compiled, ins[:pipeline] + [ins[pipeline]] + ins[pipeline:])
    combine = next(k for k, i in enumerate(ins) if isinstance(i, CombineMicroBatches))
    with pytest.raises(PlanVerificationError, match="combined"):
        _verify(compiled, ins[:combine] + ins[combine + 1:])


def test_every_stage_operand_is_fed_once_before_the_pipeline():
    """One feed per non-activation input of every stage, each chosen by the compiler: a lost feed,
    a second one, one after the pipeline and one reading off its stage's mesh are refused."""
    compiled, *_ = _compiled(aux_sum_step)
    ins = list(compiled.step)
    _verify(compiled, ins)
    feeds = [k for k, i in enumerate(ins) if isinstance(i, FeedInstruction)]
    want = sum(1 for s in compiled.graph.stages for r in s.inputs if r.kind is not RefKind.ACT)
    assert len(feeds) == want and {type(ins[k]) for k in feeds} >= {FeedValue, SliceMicroBatches}
    pipeline = next(k for k, i in enumerate(ins) if isinstance(i, RunPipeline))
    assert max(feeds) < pipeline
    with pytest.raises(PlanVerificationError, match="not fed exactly once"):
        _verify(compiled, [i for k, i in enumerate(ins) if k != feeds[0]])
    with pytest.raises(PlanVerificationError, match="not fed exactly once"):
        _verify(compiled, ins[:feeds[0]] + [ins[feeds[0]]] + ins[feeds[0]:])
    late = [i for k, i in enumerate(ins) if k != feeds[-1]]
    late.insert(pipeline, ins[feeds[-1]])  # just after the pipeline, which moved up by one
    with pytest.raises(PlanVerificationError, match="feeds a stage after the pipeline runs"):
        _verify(compiled, late)
    value = next(k for k in feeds if isinstance(ins[k], FeedValue))
    elsewhere = dataclasses.replace(ins[value], mesh=1 - ins[value].mesh)
    with pytest.raises(PlanVerificationError, match=f"but stage {ins[value].stage} runs on mesh"):
        _verify(compiled, ins[:value] + [elsewhere] + ins[value + 1:])
