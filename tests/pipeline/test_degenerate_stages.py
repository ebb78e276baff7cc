"""passes.pipeline.cutting.degenerate_stages: a cut whose stage holds no parameters and almost no
compute is named with a warning (the usual cause: a stack of layers in one scan)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline.cutting.degenerate_stages import DEGENERATE_FLOPS_SHARE, degenerate_stages
from pipeline_models import assert_trees_close, make_state, mse, run_both


class _LoopedStack(nn.Module):
    """Four tanh layers over one stacked kernel in a fori_loop that indexes the stack itself: a
    loop meshpar cannot cut inside (the kernel is a constant of the loop, not scanned over).
    With ``marker`` a stage boundary after it leaves the next stage a slice and a mean."""

    marker: bool = False

    @nn.compact
    def __call__(self, x):
        kernels = self.param("kernels", nn.initializers.lecun_normal(), (4, 16, 16))
        x = jax.lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h @ kernels[i]), x)
        if self.marker:
            meshpar.mark_stage_boundary()
        return x[:, :4]


def _batch():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((16, 16)).astype(np.float32),
            "y": rng.standard_normal((16, 4)).astype(np.float32)}


def _method(**kw):
    return meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4], **kw)


def test_a_loop_that_cannot_be_cut_gives_a_stage_with_nothing_to_do_and_a_warning_naming_it():
    batch = _batch()
    state = make_state(_LoopedStack(), batch["x"][:1])
    with pytest.warns(UserWarning, match=r"meshpar: stage 1 holds no parameters and \d+\.\d% of the forward FLOPs"
                                         r".*fori_loop"):
        ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, _method(auto_layers=2), steps=1)
    assert_trees_close(par_state, ref_state)
    graph = parallel.get_compiled(par_state, batch).graph
    (stage,) = degenerate_stages(graph)
    assert stage.stage == 1 and stage.flops_share < DEGENERATE_FLOPS_SHARE
    assert not graph.stages[1].param_inputs


def test_an_explicit_stage_count_that_leaves_a_stage_nothing_to_do_is_an_error():
    batch = _batch()
    state = make_state(_LoopedStack(marker=True), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=_method(num_stages=2))
    with pytest.raises(ValueError, match=r"num_stages: 2 stages asked for, but stage 1 holds no parameters"):
        parallel(state, batch)


def test_a_scanned_stack_is_cut_inside_and_no_stage_is_degenerate():
    """The stack of nn.scan blocks the warning was first written for now splits at its iterations."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return jnp.tanh(nn.Dense(16)(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)()(x, None)
            return x[:, :4]

    batch = _batch()
    state = make_state(Stack(), batch["x"][:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, _method(auto_layers=2), steps=1)
    assert_trees_close(par_state, ref_state)
    graph = parallel.get_compiled(par_state, batch).graph
    assert degenerate_stages(graph) == () and all(s.param_inputs for s in graph.stages)


def test_stages_that_each_hold_layers_are_not_named():
    batch = _batch()
    state = make_state(MLP(features=(16, 16, 4), num_stages=2), batch["x"][:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        parallel = meshpar.parallelize(supervised_step(mse), method=_method())
        parallel(state, batch)
    assert degenerate_stages(parallel.get_compiled(state, batch).graph) == ()
