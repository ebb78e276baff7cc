"""passes.pipeline.placing.stacked_leaves: a step rewritten over the per-stage pieces of its stacked
parameters computes what the step did (numpy comparison), runs an optimizer's update and a
global norm per piece, splits an optimizer's moments with their parameter (not those of another
parameter of the same shape), and says which leaves the user can get back without a copy."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from meshpar.autodiff import tracing_pipeline
from meshpar.passes import jax_ir
from meshpar.passes.pipeline_driver import state_counterparts
from meshpar.passes.program.stacked_leaves import LeafPieces
from meshpar.passes.pipeline.placing.stacked_leaves import (
    split_stacked_leaves, stacked_arrays, stacked_params, take_pieces, verify_leaf_pieces,
)
from meshpar.passes.pipeline.step_primitives import pipeline_grad_p
from meshpar.passes.verification import PlanVerificationError

RNG = np.random.default_rng(0)
PARAMS = {"stack": (RNG.standard_normal((4, 3, 3)) / 2).astype(np.float32),
          "twin": (RNG.standard_normal((4, 3, 3)) / 2).astype(np.float32)}  # same shape, not stacked
BATCH = RNG.standard_normal((5, 3)).astype(np.float32)
TX = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))


def _loss(params, x):
    parts = [params["stack"][a:b] for a, b in ((0, 1), (1, 4))]
    h = x
    for part in parts:
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, part)
    return jnp.mean(h * jnp.sum(params["twin"]))


def _step(state, x):
    params, opt = state
    loss, grads = meshpar.value_and_grad(_loss)(params, x)
    updates, opt = TX.update(grads, opt, params)
    return (optax.apply_updates(params, updates), opt), (loss, optax.tree.norm(grads))


def _traced():
    state = (PARAMS, TX.init(PARAMS))
    leaves, in_tree = jax.tree.flatten((state, BATCH))
    with tracing_pipeline():
        step = jax.make_jaxpr(lambda *ls: _step(*jax.tree.unflatten(in_tree, ls)))(*leaves)
    out_tree = jax.tree.structure(jax.eval_shape(_step, state, BATCH))
    return step, leaves, state_counterparts(in_tree, out_tree)


def test_stacked_params_are_those_read_only_as_slices_that_partition_the_stack():
    def loss(a, b, c, d):
        return jnp.sum(a[0:1]) + jnp.sum(a[1:4]) + jnp.sum(b[0:2]) + jnp.sum(b) + jnp.sum(c[0:2]) + jnp.sum(c[1:4]) \
            + jnp.sum(d[0:2])

    x = np.ones((4, 2), np.float32)
    closed = jax.make_jaxpr(loss)(x, x, x, x)
    assert stacked_params(closed, 4) == {0: (0, 1, 4)}  # b is read whole, c overlaps, d is not covered
    pieced = take_pieces(closed, 4, {0: (0, 1, 4)})
    assert [v.aval.shape for v in pieced.jaxpr.invars] == [(1, 2), (3, 2), (4, 2), (4, 2), (4, 2)]
    got = jax_ir.eval_jaxpr(pieced.jaxpr, pieced.consts, x[:1], x[1:], x, x, x)
    np.testing.assert_allclose(float(got[0]), float(loss(x, x, x, x)), rtol=1e-6)


def test_the_rewritten_step_equals_the_step_and_updates_each_piece_on_its_own():
    step, leaves, counterparts = _traced()
    (grad,) = [e for e in step.jaxpr.eqns if e.primitive is pipeline_grad_p]
    stack = next(k for k, v in enumerate(grad.invars) if v in step.jaxpr.invars
                 and np.shape(leaves[step.jaxpr.invars.index(v)]) == (4, 3, 3)
                 and np.array_equal(leaves[step.jaxpr.invars.index(v)], PARAMS["stack"]))
    rewritten, pieces, used = split_stacked_leaves(step, {stack: (0, 1, 4)}, counterparts)
    verify_leaf_pieces(pieces, len(leaves), len(counterparts))
    assert used == {stack: (0, 1, 4)}
    split_leaves = [i for i, b in enumerate(pieces.inputs) if b is not None]
    # The stack and its two Adam moments; the twin and its moments stay whole.
    assert len(split_leaves) == 3
    assert all(np.shape(leaves[i]) == (4, 3, 3) for i in split_leaves)
    assert not any(np.array_equal(leaves[i], PARAMS["twin"]) for i in split_leaves)
    assert sum(b is not None for b in pieces.outputs) == 3
    # The update and the global norm run per piece: nothing is put back together.
    assert not any(e.primitive.name == "concatenate" for e in rewritten.jaxpr.eqns)
    args = [leaves[i] if p is None else leaves[i][pieces.inputs[i][p]:pieces.inputs[i][p + 1]]
            for i, p in pieces.piece_inputs()]
    got = iter(jax_ir.eval_jaxpr(rewritten.jaxpr, rewritten.consts, *args))
    want = jax_ir.eval_jaxpr(step.jaxpr, step.consts, *leaves)
    for w, b in zip(want, pieces.outputs):
        g = next(got) if b is None else np.concatenate([next(got) for _ in range(len(b) - 1)])
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def test_verify_leaf_pieces_names_a_bad_split():
    with pytest.raises(PlanVerificationError, match="input leaf 0 split at"):
        verify_leaf_pieces(LeafPieces(((0, 4),), (None,), (None,)), 1, 1)
    with pytest.raises(PlanVerificationError, match="output leaf 0 split at"):
        verify_leaf_pieces(LeafPieces((None,), ((0, 1, 4),), (0,)), 1, 1)


def test_only_even_pieces_on_distinct_meshes_of_one_shape_are_held_as_one_array():
    devices = jax.devices()
    meshes = [Mesh(np.array(devices[2 * m:2 * m + 2]).reshape(1, 2), ("data", "model")) for m in range(3)]
    spec = P(None, "model")
    pieces = LeafPieces(((0, 2, 4), (0, 1, 4), (0, 2, 4)), (None, None, None), (None, None, None))
    held = stacked_arrays(pieces, {0: [NamedSharding(meshes[0], spec), NamedSharding(meshes[1], spec)],
                                   1: [NamedSharding(meshes[0], spec), NamedSharding(meshes[1], spec)],
                                   2: [NamedSharding(meshes[0], spec), NamedSharding(meshes[0], spec)]})
    assert set(held) == {0}
    assert held[0].sharding.spec == P("stacked_pieces", "model") and held[0].sharding.mesh.devices.shape == (2, 1, 2)
