"""flax NNX under meshpar.parallelize: the nnx.jit-style step (model and optimizer updated in
place) against nnx.jit on one device, NNX partitioning metadata honoured, dropout Rngs folded
per micro-batch, BatchNorm statistics, and the errors for the styles that cannot pipeline."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import meshpar
from examples.nnx_mlp import make_model, nnx_batch, train_step
from pipeline_models import assert_trees_close

M = 4
METHOD = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2), batch_argnums=(2,))


def _micro(batch, m):
    return jax.tree.map(lambda v: v[m * (len(v) // M):(m + 1) * (len(v) // M)], batch)


def _devices(x):
    return {d.id for d in x.sharding.device_set}


def test_nnx_jit_style_step_equals_nnx_jit_and_keeps_each_variable_on_its_stage():
    batch = nnx_batch()
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()
    step = meshpar.parallelize(train_step, method=METHOD)
    for _ in range(3):
        loss = step(model, optimizer, batch)
        ref_loss = nnx.jit(train_step)(ref_model, ref_optimizer, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        assert int(optimizer.step[...]) == int(ref_optimizer.step[...])
        assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
        assert_trees_close(nnx.state(optimizer, nnx.OptState), nnx.state(ref_optimizer, nnx.OptState))
        executable = step.get_executable(model, optimizer, batch)
        first, second = ({d.id for d in mesh.devices.flat} for mesh in executable.meshes)
        # Parameters and their Adam moments stay on the mesh of the stage that reads them.
        for layer, devices in (("hidden", first), ("out", second)):
            for tree in (nnx.state(model, nnx.Param)[layer], *(s[layer] for s in optimizer.opt_state[0][1:])):
                for leaf in jax.tree.leaves(tree):
                    assert _devices(leaf) == devices, layer
    assert model.hidden.kernel[...].sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert "1 sharded over 'model'" in executable.describe()


def test_nnx_value_and_grad_outside_a_pipeline_equals_nnx():
    batch = nnx_batch()
    model, _ = make_model(dropout=0.5)
    ref, _ = make_model(dropout=0.5)

    def loss_fn(m):
        return jnp.mean((m(batch["x"]) - batch["y"]) ** 2)

    loss, grads = nnx.jit(lambda m: meshpar.value_and_grad(loss_fn)(m))(model)
    ref_loss, ref_grads = nnx.jit(lambda m: nnx.value_and_grad(loss_fn)(m))(ref)
    assert isinstance(grads, nnx.State)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-6)
    assert_trees_close(grads, ref_grads)
    assert int(model.dropout.rngs.count[...]) == int(ref.dropout.rngs.count[...]) == 1


def test_nnx_dropout_draws_per_micro_batch_keys_and_advances_the_stream_once():
    batch = nnx_batch()
    model, optimizer = make_model(dropout=0.5)
    # Each micro-batch whole on its mesh (run as data-parallel replicas, each replica would
    # fold its index in too: tests/pipeline/test_gradient_reduction.py).
    method = dataclasses.replace(METHOD, gradient_reduction="per_micro_batch")
    loss = meshpar.parallelize(train_step, method=method)(model, optimizer, batch)

    # Reference: micro-batch m draws from the stream key folded with m, as jax.random.fold_in.
    start, _ = make_model(dropout=0.5)
    key = start.dropout.rngs.key[...]
    losses, grads = [], []
    for m in range(M):
        copy = nnx.clone(start)
        copy.dropout.rngs.key[...] = jax.random.fold_in(key, m)
        mb = _micro(batch, m)
        value, g = nnx.jit(lambda c: nnx.value_and_grad(lambda c: jnp.mean((c(mb["x"]) - mb["y"]) ** 2))(c))(copy)
        losses.append(value)
        grads.append(g)
    np.testing.assert_allclose(float(loss), float(np.mean(losses)), rtol=1e-5)
    ref_optimizer = nnx.Optimizer(start, optax.adam(1e-2), wrt=nnx.Param)
    ref_optimizer.update(start, jax.tree.map(lambda *g: sum(g) / M, *grads))
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(start, nnx.Param))
    # One step advances the dropout stream once, as nnx.jit on the whole batch does.
    assert int(model.dropout.rngs.count[...]) == 1
    # Without folding every micro-batch draws the same mask: a different result.
    assert abs(float(np.mean(losses)) - float(_same_key_loss(batch))) > 1e-4


def _same_key_loss(batch):
    start, _ = make_model(dropout=0.5)
    values = []
    for m in range(M):
        mb = _micro(batch, m)
        copy = nnx.clone(start)
        values.append(nnx.jit(lambda c: jnp.mean((c(mb["x"]) - mb["y"]) ** 2))(copy))
    return np.mean(values)


class _NormedMLP(nnx.Module):
    def __init__(self, rngs):
        self.hidden = nnx.Linear(6, 8, rngs=rngs)
        self.norm = nnx.BatchNorm(8, rngs=rngs)
        self.out = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        h = self.norm(jnp.tanh(self.hidden(x)))
        meshpar.mark_stage_boundary()
        return self.out(h)


def test_nnx_batch_norm_stats_are_the_mean_of_per_micro_batch_updates():
    batch = nnx_batch()

    def fresh():
        model = _NormedMLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

    model, optimizer = fresh()
    with pytest.warns(meshpar.MicroBatchingWarning, match="micro-batching is not exact"):
        meshpar.parallelize(train_step, method=METHOD)(model, optimizer, batch)
    means = []
    for m in range(M):
        copy, _ = fresh()
        nnx.jit(lambda c, x: c(x))(copy, _micro(batch, m)["x"])
        means.append(copy.norm.mean[...])
    np.testing.assert_allclose(np.asarray(model.norm.mean[...]), np.mean(means, axis=0), rtol=1e-5, atol=1e-7)
    assert not np.allclose(np.asarray(model.norm.mean[...]), 0.0), "the statistics were updated"


def test_nnx_value_and_grad_in_the_step_names_it_and_shows_the_form():
    batch = nnx_batch()
    model, optimizer = make_model()

    def step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    with pytest.raises(ValueError, match=r"(?s)found none: it differentiates with nnx.value_and_grad / nnx.grad "
                                         r"at .*test_nnx.py:.*meshpar.value_and_grad\(loss_fn\)\(model\)"):
        meshpar.parallelize(step, method=METHOD)(model, optimizer, batch)


def test_jax_grad_in_a_linen_style_step_is_named():
    def step(params, batch):
        grads = jax.grad(lambda p: jnp.mean((batch["x"] @ p - batch["y"]) ** 2))(params)
        return params - 0.1 * grads

    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=1, stage_mesh_shape=(8, 1))
    with pytest.raises(ValueError, match=r"(?s)found none: it differentiates with jax.grad at .*test_nnx.py.*"
                                         r"meshpar.value_and_grad\(loss_fn\)\(state.params\)"):
        meshpar.parallelize(step, method=method)(jnp.ones((6, 4)), nnx_batch())


def test_shared_variables_and_non_variable_state_are_rejected():
    batch = nnx_batch()
    model, optimizer = make_model()
    with pytest.raises(ValueError, match="same nnx.RngCount is reachable from arguments 0 and 1"):
        meshpar.parallelize(lambda a, b, batch: train_step(a, optimizer, batch),
                            method=METHOD)(model, model, batch)

    class Counter(nnx.Module):
        def __init__(self):
            self.model = make_model()[0]
            self.seen = jnp.zeros(())

    def step(counter, optimizer, batch):
        counter.seen = counter.seen + 1
        return train_step(counter.model, optimizer, batch)

    counter = Counter()
    optimizer = nnx.Optimizer(counter.model, optax.adam(1e-2), wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"new value to args\[0\].*seen.*no nnx.Variable holds"):
        meshpar.parallelize(step, method=METHOD)(counter, optimizer, batch)


def test_functional_nnx_pattern_split_merge_and_returned_state():
    """The functional NNX pattern (split / merge, return the new state) keeps working."""
    batch = nnx_batch()
    model, _ = make_model()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    tx = optax.adam(1e-2)
    opt_state = tx.init(params)

    def step(params, opt_state, batch, rest):
        def loss_fn(params):
            return jnp.mean((nnx.merge(graphdef, params, rest)(batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshpar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2), batch_argnums=(2,))
    got = meshpar.parallelize(step, method=method)(params, opt_state, batch, rest)
    want = jax.jit(step)(params, opt_state, batch, rest)
    assert_trees_close(got, want)
