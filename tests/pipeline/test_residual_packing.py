"""A one-device stage's residuals travel as one flat array per dtype (runtime.stage_executables):
packing and unpacking give back every value bit for bit, keys untouched, and such a stage's
step equals jax.jit's while its forward outputs a handful of arrays instead of one per residual."""

import jax
import jax.numpy as jnp
import numpy as np

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from meshpar.runtime.stage_executables import _Packing
from pipeline_models import assert_trees_close, make_state


def test_packing_round_trips_mixed_dtypes_scalars_empty_arrays_and_keys():
    rng = np.random.default_rng(0)
    values = [jnp.asarray(rng.standard_normal((3, 4)), jnp.float32), jnp.asarray(7, jnp.int32),
              jnp.asarray(rng.standard_normal((2,)), jnp.bfloat16), jax.random.key(3),
              jnp.zeros((0, 5), jnp.float32), jnp.asarray(rng.standard_normal(()), jnp.float32),
              jnp.asarray([1, 2], jnp.int32)]
    packing = _Packing([jax.typeof(v) for v in values])
    packed = jax.jit(packing.pack)(values)
    assert len(packed) == 4  # float32, int32 and bfloat16 flat arrays, then the key
    back = jax.jit(packing.unpack)(packed)
    for v, b in zip(values, back):
        assert b.dtype == v.dtype and b.shape == v.shape
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.extended):
            np.testing.assert_array_equal(jax.random.key_data(b), jax.random.key_data(v))
        else:
            np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(v, np.float32))


def test_a_one_device_stage_passes_packed_residuals_and_equals_jit(monkeypatch):
    from meshpar.runtime.program_interpreter import ProgramInterpreter

    residual_arrays = []
    forward = ProgramInterpreter._forward_kernel

    def counting(self, ins, executables, buffers, inputs, grads):
        launched = forward(self, ins, executables, buffers, inputs, grads)
        residuals = jax.tree.leaves(buffers[ins.residuals])
        if all(isinstance(r, jax.Array) for r in residuals):  # a launch, not compiling ahead (shapes)
            residual_arrays.append(len(residuals))
        return launched

    monkeypatch.setattr(ProgramInterpreter, "_forward_kernel", counting)
    model = GPT(num_stages=2)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    state = make_state(model, batch["x"][:1])
    step = supervised_step(gpt_loss)
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:2], schedule="zb_h1")
    parallel = meshpar.parallelize(step, method=method)
    par_state, par_loss = parallel(state, batch)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par_state, ref_state)
    # Each stage of this GPT keeps over a hundred residuals (a block's attention alone keeps its
    # q, k, v and weights), of three dtypes (float32, int32, the causal mask's bool): three
    # flat arrays a forward.
    assert residual_arrays == [3, 3, 3, 3]
    # The input pass hands the weight pass one packed state, not residuals it forwards.
    assert parallel.get_executable(state, batch).executables[0].state_from_residual is None
