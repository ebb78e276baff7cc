"""Stage-marker errors a flax user meets: a marker inside nn.remat or nn.scan names the user's
module line (not flax's) and says how to move it; auto_layers with a different num_stages says
the markers came from auto_layers; markers bind only while meshpar traces, whatever JAX cached."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import meshpar
from examples.train_step import supervised_step
from meshpar.autodiff import tracing_pipeline
from meshpar.passes.pipeline.cutting.stage_graph import StageMarkerError
from meshpar.passes.pipeline.step_primitives import stage_boundary_p
from pipeline_models import assert_trees_close, make_state, mse

BATCH = {"x": np.ones((8, 6), np.float32), "y": np.ones((8, 6), np.float32)}


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h, _=None):
        h = jnp.tanh(nn.Dense(6)(h))
        meshpar.mark_stage_boundary()
        return h, None


class _Remat(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6)(nn.remat(_Block)()(x)[0])


class _Scanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        return nn.Dense(6)(stack()(x, None)[0])


def _fails(model):
    state = make_state(model, BATCH["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2))
    with pytest.raises(StageMarkerError) as error:
        meshpar.parallelize(supervised_step(mse), method=method)(state, BATCH)
    return str(error.value)


def test_marker_inside_remat_names_the_module_and_the_fix():
    message = _fails(_Remat())
    assert "inside a `remat2` body at" in message and "test_marker_errors.py" in message
    assert "between rematerialized blocks (nn.remat / jax.checkpoint)" in message


def test_marker_inside_nn_scan_names_the_users_module_not_flax():
    message = _fails(_Scanned())
    location = message.split(" body at ")[1].split(";")[0]
    assert "test_marker_errors.py" in location and "axes_scan" not in location, location
    assert "two nn.scan / lax.scan stacks with a marker between them" in message


class _FourDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        for _ in range(4):
            x = jnp.tanh(nn.Dense(6)(x))
        return x


def test_auto_layers_with_another_num_stages_says_where_the_markers_came_from():
    state = make_state(_FourDense(), BATCH["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, auto_layers=4, stage_mesh_shape=(2, 2))
    with pytest.raises(StageMarkerError, match=r"auto_layers=4 cut the loss into 4 layers with 3 automatic markers, "
                                               r"one stage each; pass auto_layers=2"):
        meshpar.parallelize(supervised_step(mse), method=method)(state, BATCH)


def test_outside_parallelize_a_marker_leaves_nothing_in_the_program():
    """Under plain jax.jit the model's program has no marker and no effect (an effect costs JAX's
    C++ dispatch path); while parallelize traces, the marker is there, with its effect. The same
    function is traced both ways: JAX's tracing caches tell the two apart."""
    def model(h):
        h = jnp.tanh(h)
        meshpar.mark_stage_boundary()
        return h * 2

    plain = jax.make_jaxpr(model)(jnp.ones(3))
    assert not plain.effects and all(e.primitive is not stage_boundary_p for e in plain.eqns)
    with tracing_pipeline():
        traced = jax.make_jaxpr(model)(jnp.ones(3))
    assert traced.effects and [e.primitive for e in traced.eqns].count(stage_boundary_p) == 1
    again = jax.make_jaxpr(model)(jnp.ones(3))
    assert not again.effects and all(e.primitive is not stage_boundary_p for e in again.eqns)


class _JittedBlocks(nn.Module):
    """Two Dense blocks, each a jax.jit-ed function with the marker after it."""

    @nn.compact
    def __call__(self, x):
        for k in range(2):
            kernel = self.param(f"w{k}", nn.initializers.lecun_normal(), (6, 6))
            x = _jitted_block(x, kernel)
        return x


@jax.jit
def _jitted_block(x, kernel):
    x = jnp.tanh(x @ kernel)
    meshpar.mark_stage_boundary()
    return x


def test_a_step_jitted_first_still_has_its_markers_under_parallelize():
    """A user checks their step with jax.jit, then parallelizes it. The jit inside the model was
    traced, and cached, without markers; parallelize still sees them (JAX traces it again) and
    says where they sit, instead of cutting the step without them."""
    state = make_state(_JittedBlocks(), BATCH["x"][:1])
    step = supervised_step(mse)
    jax.jit(step)(state, BATCH)
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=3, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:3])
    with pytest.raises(StageMarkerError, match=r"inside a `jit` body at .*test_marker_errors.py"):
        meshpar.parallelize(step, method=method)(state, BATCH)
