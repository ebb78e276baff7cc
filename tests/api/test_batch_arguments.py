"""Which arguments are the batch: checked before tracing, in parallelize and in planning, with
errors that name batch_argnums, what each argument holds and the likely fix; a plan keeps the
batch_argnums it was made with; meshpar.plan_parallelism and meshpar.distributed at the top."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import meshpar
from examples.mlp import MLP
from meshpar.batch_arguments import batch_size, describe_arguments
from meshpar.passes.planning.planner_meshpar import Hardware
from pipeline_models import assert_trees_close, make_state, mse

BATCH = {"x": np.ones((16, 6), np.float32), "y": np.ones((16, 4), np.float32)}


def test_batch_size_accepts_one_shared_leading_dimension_and_names_the_alternatives():
    params = {"w": np.ones((6, 4), np.float32)}
    assert batch_size((params, BATCH), (1,)) == 16
    assert batch_size((params, BATCH, BATCH), (1, 2)) == 16
    with pytest.raises(ValueError, match=r"batch_argnums=\(1,\) takes argument 1 as the batch, but it holds a PRNG "
                                         r"key.*if the batch is argument 2, pass batch_argnums=\(2,\)"):
        batch_size((params, jax.random.key(0), BATCH), (1,))
    with pytest.raises(ValueError, match="holds a PRNG key"):
        batch_size((params, jax.random.PRNGKey(0), BATCH), (1,))
    with pytest.raises(ValueError, match=r"leading dimensions \[4, 6\], not one shared batch dimension.*"
                                         r"batch_argnums=\(2,\)"):
        batch_size((params, {"a": np.ones((6,)), "b": np.ones((4, 2))}, BATCH), (1,))
    with pytest.raises(ValueError, match=r"batch_argnums=\(3,\) for a step called with 2 arguments; if the batch "
                                         r"is argument 1"):
        batch_size((params, BATCH), (3,))
    with pytest.raises(ValueError, match=r"the batch arguments have leading dimensions \[8, 16\]"):
        batch_size((params, BATCH, {"x": np.ones((8, 2))}), (1, 2))
    for bad in ((), (-1,), (True,), "1", 1):
        with pytest.raises(ValueError, match="batch_argnums: expected a non-empty sequence of non-negative integers"):
            batch_size((params, BATCH), bad)
    assert describe_arguments((jax.random.key(0), BATCH)) == ("argument 0: a PRNG key; "
                                                              "argument 1: leading dimensions [16]")


class _Normed(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        h = nn.BatchNorm(use_running_average=not train)(jnp.tanh(nn.Dense(16)(x)))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(h)


def test_a_step_whose_batch_is_not_argument_one_is_named():
    """(params, batch_stats, opt_state, batch): the default batch_argnums=(1,) takes the batch
    statistics; the trace error says so and names the argument that looks like the batch."""
    model = _Normed()
    variables = model.init(jax.random.key(0), BATCH["x"])
    tx = optax.adam(1e-2)

    def step(params, batch_stats, opt_state, batch):
        def loss_fn(params):
            out, updates = model.apply({"params": params, "batch_stats": batch_stats}, batch["x"],
                                       mutable=["batch_stats"])
            return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]

        (loss, stats), grads = meshpar.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), stats, opt_state, loss

    args = (variables["params"], variables["batch_stats"], tx.init(variables["params"]), BATCH)
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2))
    with pytest.raises(TypeError, match=r"(?s)batch_argnums=\(1,\) cut arguments \[1\] into micro-batches; the "
                                        r"step's arguments: argument 0: .*argument 3: leading dimensions \[16\]"):
        meshpar.parallelize(step, method=method)(*args)
    fixed = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2), batch_argnums=(3,))
    got = meshpar.parallelize(step, method=fixed)(*args)
    assert np.isfinite(float(got[3]))


def test_planning_keeps_batch_argnums_and_rejects_a_key_as_the_batch():
    model = MLP(features=(16, 16, 16, 4), num_stages=2)
    state = make_state(model, BATCH["x"][:1])

    def step(state, key, batch):
        def loss_fn(params):
            noise = jax.random.normal(key, batch["y"].shape) * 0.0
            return mse(state.apply_fn(params, batch["x"]) + noise, batch["y"])

        loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    key = jax.random.key(1)
    with pytest.raises(ValueError, match=r"batch_argnums=\(1,\) takes argument 1 as the batch, but it holds a PRNG "
                                         r"key.*batch_argnums=\(2,\)"):
        meshpar.plan_parallelism(step, state, key, BATCH, hardware=Hardware(1e13))
    plan = meshpar.plan_parallelism(step, state, key, BATCH, hardware=Hardware(1e13), num_stages=2,
                                    num_micro_batches=2, batch_argnums=(2,))
    assert plan.method.batch_argnums == (2,)
    assert plan.method_with(executor="p2p").batch_argnums == (2,)
    got_state, got_loss = meshpar.parallelize(step, method=plan.method)(state, key, BATCH)
    want_state, want_loss = jax.jit(step)(state, key, BATCH)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)


def test_top_level_names():
    import subprocess
    import sys

    code = "import meshpar; print(meshpar.plan_parallelism.__module__, meshpar.distributed.initialize.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["meshpar.planning", "initialize"], out.stderr
