"""The ``fuse_packing`` pass: a packed move's packing and unpacking run inside the programs making
and reading its values, where it can; elsewhere the move keeps its own packing programs. Both
against jax.jit on one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import meshpar
from meshpar.passes.pipeline.lowering.packed_moves import fuse_packing, verify_fused_packing
from meshpar.passes.program.step_instructions import RunCompute, RunMove
from meshpar.passes.program.step_values import OuterKind
from meshpar.passes.verification import PlanVerificationError
from pipeline_models import TwoStages, assert_trees_close

METHOD = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2))


def _batch(n=16, d=6, k=4):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


def _state(batch, tx):
    model = TwoStages()
    params = model.init(jax.random.key(0), batch["x"][:1])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


def _run(step, state, batch, steps=2):
    parallel = meshpar.parallelize(step, method=METHOD)
    ref, par = state, state
    for _ in range(steps):
        ref_out, par_out = jax.jit(step)(ref, batch), parallel(par, batch)
        ref, par = ref_out[0], par_out[0]
    return ref_out, par_out, parallel.get_compiled(par, batch)


def _norm_step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss, optax.tree.norm(grads)


def _packed_moves(step):
    return [(k, ins) for k, ins in enumerate(step) if isinstance(ins, RunMove)
            and (ins.unpacked or ins.values[0].kind is OuterKind.PACKED)]


def test_a_global_norms_partial_sums_are_packed_in_the_program_making_them_and_unpacked_in_those_reading_them():
    batch = _batch()
    state = _state(batch, optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2, eps=1e-5)))
    (ref, _, ref_norm), (par, _, par_norm), compiled = _run(_norm_step, state, batch)
    np.testing.assert_allclose(float(par_norm), float(ref_norm), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    assert_trees_close(par.opt_state, ref.opt_state)

    (before,) = [st.step for name, st in compiled.passes if name == "lower_step"]
    [(k, packed_before)] = _packed_moves(before)
    assert len(packed_before.unpacked) == len(packed_before.values) == 4
    step = compiled.step
    [(k_after, move)] = _packed_moves(step)
    assert k_after == k and not move.unpacked and move.values == (move.values[0],)
    vector = move.values[0]
    assert step.avals[vector].shape == (4,) and step.avals[vector].dtype == np.float32
    # One program on mesh 1 makes the vector; those values no longer leave it one by one.
    (producer,) = [ins for ins in step if isinstance(ins, RunCompute) and vector in ins.outputs]
    assert producer.mesh == move.src and not set(packed_before.values) & set(producer.outputs)
    # Every program reading them on mesh 0 takes the vector instead.
    readers = [ins for ins in step if (vector, move.dst) in ins.reads]
    assert readers and all(isinstance(r, RunCompute) and r.mesh == move.dst for r in readers)
    assert not any((v, move.dst) in ins.reads for ins in step for v in packed_before.values)
    verify_fused_packing(step)


def test_the_pass_refuses_nothing_it_can_fuse_left_behind():
    batch = _batch()
    state = _state(batch, optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2, eps=1e-5)))
    compiled = meshpar.parallelize(_norm_step, method=METHOD).get_compiled(state, batch)
    (before,) = [st.step for name, st in compiled.passes if name == "lower_step"]
    with pytest.raises(PlanVerificationError, match="still packed by programs of its own"):
        verify_fused_packing(before)
    # Fusing twice changes nothing.
    once = fuse_packing(before)
    assert [str(i) for i in fuse_packing(once)] == [str(i) for i in once]


def test_values_the_pipeline_makes_keep_their_packing_programs_and_equal_jit():
    # The loss and an aux value are combined on mesh 1 (not by a program around the pipeline),
    # and the update of mesh 0's parameters reads both: they cross packed, by their own programs.
    batch = _batch()
    state = _state(batch, optax.sgd(1e-2))

    def step(state, batch):
        def loss_fn(params):
            err = state.apply_fn({"params": params}, batch["x"]) - batch["y"]
            return jnp.mean(err ** 2), jnp.mean(jnp.abs(err))

        (loss, mae), grads = meshpar.value_and_grad(loss_fn, has_aux=True)(state.params)
        grads = jax.tree.map(lambda g: g * loss * mae, grads)
        return state.apply_gradients(grads=grads), loss, mae

    (ref, ref_loss, ref_mae), (par, par_loss, par_mae), compiled = _run(step, state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(float(par_mae), float(ref_mae), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    moves = _packed_moves(compiled.step)
    assert moves and all(move.unpacked for _, move in moves)
    verify_fused_packing(compiled.step)
