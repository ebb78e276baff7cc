"""One stage and one micro-batch run as one SPMD program (``runtime.spmd_step``): equal to
jax.jit on one device, to the pipeline runtime running the same step, with keys folded as the
pipeline folds them, and placed so that a step's outputs feed the next without moving."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import meshpar
from meshpar.autodiff import tracing_pipeline
from meshpar.passes import jax_ir
from meshpar.passes.pipeline.cutting.micro_batching import resolve_micro_batching
from meshpar.passes.pipeline.lowering.spmd_program import lower_spmd_step, verify_spmd_step
from meshpar.passes.pipeline.step_primitives import pipeline_grad_p, stage_boundary_p
from meshpar.passes.planning.hlo_collectives import CollectiveKind, collectives
from meshpar.passes.verification import PlanVerificationError
from meshpar.runtime.spmd_step import SpmdStep
from pipeline_models import assert_trees_close


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.Dropout(0.3, deterministic=not train)(jnp.tanh(nn.Dense(16)(x)))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(h)


def _batch(n=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, 6)).astype(np.float32), "y": rng.standard_normal((n, 4)).astype(np.float32)}


def _state(batch):
    model = _Net()
    params = model.init(jax.random.key(0), batch["x"][:1], train=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))


def _step(state, batch, key):
    def loss_fn(params):
        out = state.apply_fn({"params": params}, batch["x"], rngs={"dropout": key})
        loss = jnp.mean((out - batch["y"]) ** 2)
        return loss, {"pred": out, "hits": jnp.sum(jnp.abs(out - batch["y"]) < 0.5)}

    (loss, aux), grads = meshpar.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def _method(**kw):
    return meshpar.PipeshardParallel(num_micro_batches=1, cut_points=(), stage_mesh_shape=(2, 2),
                                     devices=jax.devices()[:4], **kw)


def test_one_stage_one_micro_batch_is_one_program_equal_to_jit_and_to_the_pipeline():
    batch, key = _batch(), jax.random.key(3)
    state = _state(batch)
    single = meshpar.parallelize(_step, method=_method())
    # Its micro-batch whole on the mesh, as the single program computes it (as replicas, each
    # would fold its replica index into the key too).
    piped = meshpar.parallelize(_step, method=_method(single_program=False, gradient_reduction="per_micro_batch"))
    # The pipeline folds micro-batch 0's index into the key: so does the reference.
    reference = jax.jit(lambda s, b, k: _step(s, b, jax.random.fold_in(k, 0)))
    ref, one, two = state, state, state
    for _ in range(3):
        ref, ref_loss, ref_aux = reference(ref, batch, key)
        one, one_loss, one_aux = single(one, batch, key)
        two, two_loss, two_aux = piped(two, batch, key)
    assert isinstance(single.get_executable(one, batch, key), SpmdStep)
    assert not isinstance(piped.get_executable(two, batch, key), SpmdStep)
    for params, loss, aux in ((one.params, one_loss, one_aux), (two.params, two_loss, two_aux)):
        assert_trees_close(params, ref.params)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        np.testing.assert_allclose(np.asarray(aux["pred"]), np.asarray(ref_aux["pred"]), rtol=1e-5, atol=1e-6)
        assert int(aux["hits"]) == int(ref_aux["hits"])
    # Without the fold, jax.jit draws other dropout masks.
    assert abs(float(jax.jit(_step)(state, batch, key)[1]) - float(single(state, batch, key)[1])) > 1e-4


def test_outputs_stay_placed_for_the_next_step_and_nothing_recompiles():
    batch, key = _batch(), jax.random.key(1)
    state = _state(batch)
    single = meshpar.parallelize(_step, method=_method())
    state, _, _ = single(state, batch, key)
    executable = single.get_executable(state, batch, key)
    mesh_devices = set(jax.devices()[:4])
    for leaf in jax.tree.leaves(state.params):
        assert set(leaf.sharding.device_set) == mesh_devices
    state, _, _ = single(state, batch, key)
    assert executable.compiled_count() == 1


def test_trace_and_bad_option_name_single_program():
    batch, key = _batch(), jax.random.key(1)
    single = meshpar.parallelize(_step, method=_method())
    with pytest.raises(ValueError, match="single_program=False"):
        single.trace("/tmp/meshpar_spmd_trace.json", _state(batch), batch, key)
    with pytest.raises(ValueError, match="single_program: expected a bool"):
        meshpar.PipeshardParallel(single_program="yes")


@pytest.mark.parametrize("single_program", [True, False])
def test_one_micro_batch_still_splits_the_batch_over_the_data_axis(single_program):
    """With one micro-batch the batch arguments have the same shape in every trace; they are
    still the batch: each half of the (2, 2) mesh's data axis reads half of them (not all of it,
    which would repeat the step on every data shard) and the gradients are all-reduced."""
    batch, key = _batch(), jax.random.key(3)
    state = _state(batch)
    parallel = meshpar.parallelize(_step, method=_method(single_program=single_program))
    executable = parallel.get_executable(state, batch, key)
    compiled = parallel.get_compiled(state, batch, key)
    reads = [op for op in compiled.layout.stage_operands[0] if op.per_micro_batch and not op.fold_key]
    assert len(reads) == 2 and all(op.sharding.spec == P("data") for op in reads)
    if single_program:
        hlo = executable.lower(jax.tree.leaves((state, batch, key))).compile().as_text()
        assert any(c.kind is CollectiveKind.ALL_REDUCE and c.group_size == 2 for c in collectives(hlo))


def test_steps_after_the_first_skip_meshpar_s_own_placement_and_fall_back_where_jit_cannot_run_as_given(
        monkeypatch):
    """A one-program step, once compiled, hands its leaves to jax.jit as given (placing them is
    jax.jit's C++ work, as for jax.jit of the step): no lookup or per-leaf placement in Python.
    Leaves of a new shape, committed elsewhere, or another argument structure take the placing
    path, and every step still equals jax.jit's."""
    batch, key = _batch(), jax.random.key(5)
    state = _state(batch)
    single = meshpar.parallelize(_step, method=_method())
    reference = jax.jit(lambda s, b, k: _step(s, b, jax.random.fold_in(k, 0)))
    lookups = []
    looked_up = type(single)._lookup
    monkeypatch.setattr(type(single), "_lookup", lambda self, args: lookups.append(1) or looked_up(self, args))

    one, ref = single(state, batch, key)[0], reference(state, batch, key)[0]
    for _ in range(3):
        one, one_loss, _ = single(one, batch, key)
        ref, ref_loss, _ = reference(ref, batch, key)
    assert len(lookups) == 1
    # Nor does jax.jit compile the step again for the leaves it now gets as given.
    assert single.get_executable(one, batch, key).compiled_count() == 1
    lookups.clear()
    assert_trees_close(one.params, ref.params)
    np.testing.assert_allclose(float(one_loss), float(ref_loss), rtol=1e-5)

    # A batch of another size: a new program, traced at its shapes (not the old one's jaxpr).
    small = _batch(8, seed=1)
    one, one_loss, _ = single(one, small, key)
    ref, ref_loss, _ = reference(ref, small, key)
    np.testing.assert_allclose(float(one_loss), float(ref_loss), rtol=1e-5)
    assert len(lookups) == 1
    # State committed on other devices than the step keeps it: placed by meshpar, not refused.
    elsewhere = jax.device_put(one, jax.devices()[5])
    one, one_loss, _ = single(elsewhere, small, key)
    ref, ref_loss, _ = reference(ref, small, key)
    np.testing.assert_allclose(float(one_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(one.params, ref.params)
    # Another argument structure (the batch with one more entry the step does not read).
    extra = {**small, "w": np.ones(8, np.float32)}
    one, one_loss, _ = single(one, extra, key)
    ref, ref_loss, _ = reference(ref, extra, key)
    np.testing.assert_allclose(float(one_loss), float(ref_loss), rtol=1e-5)


def test_lower_spmd_step_leaves_plain_jax_equal_to_jit_with_keys_folded():
    """The pass alone: the traced step, its gradient equation and stage markers lowered away,
    evaluates (no meshpar runtime) to jax.jit of the user's step with the dropout key folded
    with micro-batch 0's index; two micro-batches are refused, and the verifier refuses the
    traced step itself."""
    batch, key = _batch(), jax.random.key(3)
    state = _state(batch)
    leaves, in_tree = jax.tree.flatten((state, batch, key))
    with tracing_pipeline():
        traced = jax.make_jaxpr(lambda *ls: _step(*jax.tree.unflatten(in_tree, ls)))(*leaves)
    (grad,) = [e for e in traced.jaxpr.eqns if e.primitive is pipeline_grad_p]
    operands = [v.aval for v in grad.invars[grad.params["num_diff"]:]]
    aux = [v.aval for v in grad.outvars[1:1 + grad.params["num_aux"]]]
    micro_batching = resolve_micro_batching(grad.params, operands, operands, aux, 1)
    assert micro_batching.fold_keys, "the loss reads the dropout key: the pass must fold it"

    lowered = lower_spmd_step(traced, micro_batching)
    verify_spmd_step(traced, lowered)

    def primitives(jaxpr):
        for e in jaxpr.eqns:
            yield e.primitive
            for sub in jax_ir.nested_jaxprs(e):
                yield from primitives(sub)

    assert not {p.name for p in primitives(lowered.jaxpr)} & {pipeline_grad_p.name, stage_boundary_p.name}
    assert not lowered.jaxpr.effects
    got = jax.tree.unflatten(jax.tree.structure(_step(state, batch, key)), jax_ir.jaxpr_as_fun(lowered)(*leaves))
    ref = jax.jit(lambda s, b, k: _step(s, b, jax.random.fold_in(k, 0)))(state, batch, key)
    assert_trees_close(got, ref)

    with pytest.raises(ValueError, match="micro_batching"):
        lower_spmd_step(traced, dataclasses.replace(micro_batching, num_micro_batches=2))
    with pytest.raises(PlanVerificationError, match="meshpar_pipeline_grad"):
        verify_spmd_step(traced, traced)
