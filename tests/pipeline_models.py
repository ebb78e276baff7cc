"""A model, train states, losses and tree comparisons for the pipeline equality tests, which run
one step (``examples.train_step.supervised_step``) under jax.jit and meshpar.parallelize."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import meshpar
import meshpar.runtime.placement as placement



def make_state(model, example_x, learning_rate=1e-3):
    """Adam with eps 1e-5: Adam steps by about lr * g / (|g| + eps), so a gradient made of
    cancelling terms, whose float rounding (~1e-8) differs between any two correct summation
    orders, moves its parameter by up to lr * 1e-8 / eps = 1e-6 instead of up to lr with the
    default eps; comparing micro-batched and whole-batch runs is then meaningful."""
    params = model.init(jax.random.PRNGKey(0), example_x)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(learning_rate, eps=1e-5))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def regression_batch():
    """16 rows of ``x`` [16, 6] and ``y`` [16, 4], seeded."""
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}


def aux_sum_step(state, batch):
    """A train step whose loss is a sum over the batch (``reduction="sum"``) with aux values
    combined two ways (a mean and a count): ``(state, loss, aux)``."""
    def loss_fn(params):
        err = jnp.sum((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err), {"err": jnp.mean(err), "hits": jnp.sum(err < 4.0)}

    (loss, aux), grads = meshpar.value_and_grad(loss_fn, has_aux=True, reduction="sum")(state.params)
    return state.apply_gradients(grads=grads), loss, aux


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-5):
    """Equal within ``rtol``; ``atol`` covers parameters near zero."""
    for path, (a, e) in zip(
        jax.tree_util.tree_leaves_with_path(expected), zip(jax.tree.leaves(actual), jax.tree.leaves(expected))
    ):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=str(path[0]))


class TwoStages(nn.Module):
    """Dense(8) + tanh, a stage marker, Dense(4): the smallest two-stage model."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(h)


class TensorParallel(nn.Module):
    """Two stages whose kernels flax partitions over the stage mesh's ``model`` axis (the second
    one its input dimension), so both stages hold sharded parameters."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        meshpar.mark_stage_boundary()
        return nn.Dense(4, kernel_init=nn.with_partitioning(init, ("model", None)))(nn.gelu(h))


def run_both(step, state, batch, method, steps):
    """``step`` under jax.jit and under meshpar.parallelize with ``method``, ``steps`` times from
    ``state``, the losses equal at every step; returns both states and the parallelized step."""
    parallel = meshpar.parallelize(step, method=method)
    reference = jax.jit(step)
    ref_state, par_state = state, state
    for _ in range(steps):
        ref_state, ref_loss = reference(ref_state, batch)
        par_state, par_loss = parallel(par_state, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    return ref_state, par_state, parallel


def assert_steps_match(parallel, state, batch, ref_state, ref_losses):
    """Runs ``parallel`` from ``state`` for as many steps as ``ref_losses``: each loss, read on this
    process, equal to the reference's, then every parameter shard this process holds equal to
    ``ref_state``'s. Returns the last state and how many shards it checked (at least one)."""
    for want in ref_losses:
        state, loss = parallel(state, batch)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    checked = assert_local_shards_close(state.params, ref_state.params)
    assert checked > 0, "this process holds no parameters"
    return state, checked


def assert_local_shards_close(actual, expected, rtol=1e-5, atol=1e-5) -> int:
    """Every shard of ``actual``'s leaves this process holds equals that part of ``expected``'s
    (whole arrays); returns how many shards it checked."""
    checked = 0
    for got, want in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        for shard in got.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=rtol, atol=atol)
            checked += 1
    return checked


class NnxScannedStack(nnx.Module):
    """Four tanh(Linear(d, d)) blocks created with nnx.vmap and applied with nnx.scan (as flax's
    docs write a stack), then Linear(d, k)."""

    def __init__(self, d: int, k: int, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def blocks(rngs: nnx.Rngs) -> nnx.Linear:
            return nnx.Linear(d, d, rngs=rngs)

        self.blocks = blocks(rngs)
        self.out = nnx.Linear(d, k, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h, block):
            return jnp.tanh(block(h))

        return self.out(body(x, self.blocks))


def nnx_mse_step(model, optimizer, batch):
    """The nnx.jit-style step: mean squared error, meshpar's gradient, the update in place."""
    loss, grads = meshpar.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)
    return loss


class MoveCounter:
    """Counts the moves of the given leaves while active: ``jax.device_put`` of one of them, or
    ``runtime.placement.put`` returning another array than the one it was given (a copy)."""

    def __init__(self, monkeypatch, leaves):
        self.names = {id(x): str(path) for path, x in leaves}
        self.moved: list[str] = []
        device_put, put = jax.device_put, placement.put

        def counted_device_put(x, *args, **kwargs):
            if id(x) in self.names:
                self.moved.append(f"jax.device_put {self.names[id(x)]}")
            return device_put(x, *args, **kwargs)

        def counted_put(value, *args, **kwargs):
            out = put(value, *args, **kwargs)
            if id(value) in self.names and out is not value:
                self.moved.append(f"placement.put {self.names[id(value)]}")
            return out

        monkeypatch.setattr(jax, "device_put", counted_device_put)
        monkeypatch.setattr(placement, "put", counted_put)
