"""The example models: marker placement, differentiability, and invariance to num_stages.

XLA's CPU compiler dominates the cost here: seconds per model for the
backward pass, and seconds more for the threefry code of ``init``. So the
tests compile each model's jit(value_and_grad) once (at num_stages=4) and, for
every other num_stages, check that the lowered program is identical, which is
why results cannot depend on num_stages. Parameters come from
``jax.eval_shape(model.init, PRNGKey(0), x)`` filled with numpy values: that
traces the whole ``init`` and keeps its ``nn.Partitioned`` boxes without
compiling it. A small MLP is also initialized for real.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import PartitionSpec as P

from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.mlp import MLP, mlp_batch, mlp_loss, stage_ends
from examples.u_transformer import UTransformer, ut_batch, ut_loss
from meshpar.autodiff import tracing_pipeline

MARKER = "meshpar_stage_boundary"
STAGES = (1, 2, 4, 8)
RUN_STAGES = 4  # the num_stages whose program is compiled and run

# name -> (model factory, batch, loss, number of markable blocks)
MODELS = {
    "mlp": (
        lambda n: MLP(features=(16, 32, 32, 32, 32, 32, 32, 4), num_stages=n),
        mlp_batch(0, 8, 5, 4),
        mlp_loss,
        8,
    ),
    "gpt": (lambda n: GPT(num_stages=n), gpt_batch(0, 8, 8, 64), gpt_loss, 8),
    "ut": (lambda n: UTransformer(num_stages=n), ut_batch(0, 8), ut_loss, 8),
}
CASES = [(name, n) for name in MODELS for n in STAGES if n <= MODELS[name][3]]


def _count_markers(jaxpr) -> int:
    """Markers in a jaxpr, including those in sub-jaxprs (e.g. of a nested jit)."""
    count = 0
    for eqn in jaxpr.eqns:
        count += eqn.primitive.name == MARKER
        for sub in jaxprs_in_params(eqn.params):
            count += _count_markers(sub)
    return count


def _loss_fn(name, n):
    """(params, batch) -> (loss, model output)."""
    make, _, loss, _ = MODELS[name]
    model = make(n)

    def f(params, batch):
        out = model.apply(params, batch["x"])
        return loss(out, batch["y"]), out

    return f


@functools.cache
def _shapes(name, n):
    make, batch, _, _ = MODELS[name]
    return jax.eval_shape(make(n).init, jax.random.PRNGKey(0), batch["x"])


@functools.cache
def _params(name):
    """Boxed parameters with the structure ``init`` produces, filled from numpy."""
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda s: (0.3 * rng.standard_normal(s.shape)).astype(s.dtype), _shapes(name, 1)
    )


@functools.cache
def _traced(name, n):
    """jit(value_and_grad(loss)), model output as aux, traced on the shared params."""
    f = jax.value_and_grad(_loss_fn(name, n), has_aux=True)
    return jax.jit(f).trace(_params(name), MODELS[name][1])


def _traced_by_meshpar(name, n):
    """``_traced`` while meshpar traces: the markers are bound, and survive differentiation."""
    with tracing_pipeline():
        return _traced(name, n)


@functools.cache
def _hlo(name, n):
    return _traced(name, n).lower().as_text(debug_info=False)


@functools.cache
def _compiled(name):
    return _traced(name, RUN_STAGES).lower().compile()


def _run(name, batch=None):
    """(loss, output, grads) of the compiled program."""
    (loss, out), grads = _compiled(name)(_params(name), batch or MODELS[name][1])
    return loss, out, grads


def test_stage_ends_split_evenly():
    assert stage_ends(8, 1) == frozenset()
    assert sorted(stage_ends(8, 2)) == [3]
    assert sorted(stage_ends(8, 4)) == [1, 3, 5]
    assert sorted(stage_ends(8, 8)) == list(range(7))
    assert sorted(stage_ends(5, 2)) == [2]  # earlier stages take the extra block
    assert sorted(stage_ends(7, 3)) == [2, 4]


@pytest.mark.parametrize("name,n", CASES)
def test_markers_and_num_stages_independence(name, n):
    """For each num_stages: init traces to the same parameters, the loss has n-1
    markers while meshpar traces it and none otherwise, value_and_grad traces under jit, and
    the lowered program equals the num_stages=1 one (markers lower to nothing)."""
    shapes = _shapes(name, n)
    assert jax.tree.structure(shapes) == jax.tree.structure(_shapes(name, 1))
    same_shape = jax.tree.map(lambda a, b: a.shape == b.shape, shapes, _shapes(name, 1))
    assert all(jax.tree.leaves(same_shape))

    loss_only = lambda p, b: _loss_fn(name, n)(p, b)[0]  # noqa: E731
    with tracing_pipeline():
        jaxpr = jax.make_jaxpr(loss_only)(_params(name), MODELS[name][1]).jaxpr
    assert _count_markers(jaxpr) == n - 1
    # Outside meshpar's tracing a marker binds nothing, so jax.jit keeps its C++ dispatch.
    assert _count_markers(jax.make_jaxpr(loss_only)(_params(name), MODELS[name][1]).jaxpr) == 0
    assert _count_markers(_traced_by_meshpar(name, n).jaxpr.jaxpr) >= n - 1
    assert _hlo(name, n) == _hlo(name, 1)


@pytest.mark.parametrize("name", MODELS)
def test_value_and_grad_runs(name):
    loss, out, grads = _run(name)
    assert np.isfinite(loss) and loss > 0
    np.testing.assert_allclose(loss, MODELS[name][2](out, MODELS[name][1]["y"]), rtol=1e-5)
    assert jax.tree.structure(grads) == jax.tree.structure(_params(name))
    leaves = jax.tree.leaves(grads)
    assert all(np.isfinite(g).all() for g in leaves)
    assert any(np.abs(g).max() > 0 for g in leaves)


def test_mlp_real_init_with_fixed_key():
    batch, loss = mlp_batch(0, 8, 5, 2), MODELS["mlp"][2]
    model = MLP(features=(4, 2), num_stages=2)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batch["x"])
    again = jax.jit(model.init)(jax.random.PRNGKey(0), batch["x"])
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(again)):
        np.testing.assert_array_equal(a, b)
    out = jax.jit(model.apply)(params, batch["x"])
    assert out.shape == (8, 2)
    assert np.isfinite(loss(out, batch["y"]))


def test_gpt_shapes_and_causality():
    batch = MODELS["gpt"][1]
    _, logits, _ = _run("gpt")
    assert logits.shape == (8, 8, 64) and logits.dtype == jnp.float32
    for t in (0, 3, 6):
        x = batch["x"].copy()
        x[:, t + 1] = (x[:, t + 1] + 1) % 64
        _, changed, _ = _run("gpt", {"x": x, "y": batch["y"]})
        np.testing.assert_allclose(changed[:, : t + 1], logits[:, : t + 1], rtol=1e-5, atol=1e-6)
        assert not np.allclose(changed[:, t + 1], logits[:, t + 1])


def test_u_transformer_output_shape():
    _, out, _ = _run("ut")
    assert out.shape == MODELS["ut"][1]["x"].shape == (8, 8, 8, 3)
    assert out.dtype == jnp.float32


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("bad", [0, -1, 9])
def test_invalid_num_stages(name, bad):
    make, batch, _, _ = MODELS[name]
    with pytest.raises(ValueError, match="num_stages"):
        jax.eval_shape(make(bad).init, jax.random.PRNGKey(0), batch["x"])


def test_gpt_partition_specs():
    # The test parameters keep init's boxes, so every apply above ran on boxed params.
    assert isinstance(_params("gpt")["params"]["block_0"]["attn"]["qkv"]["kernel"], nn.Partitioned)
    specs = nn.get_partition_spec(_shapes("gpt", 2))["params"]
    for i in range(8):
        block = specs[f"block_{i}"]
        assert block["attn"]["qkv"]["kernel"] == P(None, "model")
        assert block["attn"]["out"]["kernel"] == P("model", None)
        assert block["mlp_up"]["kernel"] == P(None, "model")
        assert block["mlp_down"]["kernel"] == P("model", None)
    annotated = [s for s in jax.tree.leaves(specs) if s != P()]
    assert len(annotated) == 4 * 8
    assert specs["head"]["kernel"] == P() and specs["tok_embed"]["embedding"] == P()


def test_u_transformer_partition_specs():
    specs = nn.get_partition_spec(_shapes("ut", 2))["params"]
    for j in range(2):
        attn = specs[f"mid_{j}"]["attn"]
        assert attn["qkv"]["kernel"] == P(None, "model")
        assert attn["out"]["kernel"] == P("model", None)
    assert len([s for s in jax.tree.leaves(specs) if s != P()]) == 4


def test_supervised_step_names_a_loss_that_is_not_a_function():
    from examples.train_step import supervised_step

    with pytest.raises(TypeError, match="loss_of_output: expected a function"):
        supervised_step("mse")
