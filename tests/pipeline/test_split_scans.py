"""passes.pipeline.cutting.split_scans and the layer cuts that use it: a scan over layers split at chosen
iterations computes what the scan did (numpy reference, and the verifier, which can fail), and
automatic layers, the even rule and cut points cut inside scans. No devices needed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.passes import jax_ir
from meshpar.passes.pipeline.cutting.layer_clustering import even_layer_markers, insert_layer_markers, max_layers
from meshpar.passes.pipeline.cutting.split_scans import layer_scans, split_layer_scans, verify_split_scans
from meshpar.passes.pipeline.cutting.stage_graph import count_markers, split_stages
from meshpar.passes.verification import PlanVerificationError

RNG = np.random.default_rng(0)
W = (RNG.standard_normal((6, 4, 4)) / 2).astype(np.float32)
X = RNG.standard_normal((3, 4)).astype(np.float32)


def _stack(w, x, reverse=False):
    """tanh layers over a stacked kernel, each layer's output also stacked: (final, per-layer)."""
    return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), jnp.sum(h)), x, w, reverse=reverse)


def _numpy_stack(w, x, reverse=False):
    order = range(len(w) - 1, -1, -1) if reverse else range(len(w))
    sums = np.zeros(len(w), np.float32)
    for i in order:
        sums[i] = x.sum()
        x = np.tanh(x @ w[i])
    return x, sums


def _loss_jaxpr(fun=_stack, **kw):
    return jax.make_jaxpr(lambda w, x: fun(w, x, **kw))(W, X)


def _eval(closed, *args):
    split_free = closed.jaxpr.replace(eqns=[e for e in closed.jaxpr.eqns if e.primitive.name != "meshpar_stage_boundary"])
    return jax_ir.eval_jaxpr(split_free, closed.consts, *args)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cuts", [(1,), (2, 5), (1, 2, 3, 4, 5)])
def test_a_split_scan_computes_what_the_scan_did(cuts, reverse):
    loss = _loss_jaxpr(reverse=reverse)
    (scan,) = layer_scans(loss, 1)
    split, provenance = split_layer_scans(loss, {scan.index: cuts}, marked=True)
    assert count_markers(split) == len(cuts)
    assert sum(e.primitive.name == "scan" for e in split.jaxpr.eqns) == len(cuts) + 1
    final, sums = _eval(split, W, X)
    want_final, want_sums = _numpy_stack(W, X, reverse)
    np.testing.assert_allclose(np.asarray(final), want_final, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(sums), want_sums, rtol=1e-5, atol=1e-5)
    verify_split_scans(loss, split)
    # Each piece reads its own rows of the stack: the iterations its boundary starts.
    bounds = sorted({p.boundary for p in provenance if p.boundary is not None})
    assert bounds == sorted(({0, *cuts} if not reverse else {*cuts, 6}))


def test_the_verifier_fails_on_a_split_that_changes_the_result():
    loss = _loss_jaxpr()
    (scan,) = layer_scans(loss, 1)
    split, _ = split_layer_scans(loss, {scan.index: (3,)}, marked=False)
    scans = [k for k, e in enumerate(split.jaxpr.eqns) if e.primitive.name == "scan"]
    # The second piece starts from the first piece's input instead of its final carry.
    first, second = (split.jaxpr.eqns[k] for k in scans)
    broken = second.replace(invars=[first.invars[0], *second.invars[1:]])
    eqns = list(split.jaxpr.eqns)
    eqns[scans[1]] = broken
    with pytest.raises(PlanVerificationError, match="output 0 of the split loss differs"):
        verify_split_scans(loss, jax_ir.ClosedJaxpr(split.jaxpr.replace(eqns=eqns), split.consts))


def test_layer_scans_are_scans_over_parameters_not_over_the_batch_or_a_loop_indexing_the_stack():
    def over_time(w, x):
        h, _ = jax.lax.scan(lambda h, xt: (jnp.tanh(h + xt @ w[0]), None), jnp.zeros(4), x)
        return h

    def fori(w, x):
        return jax.lax.fori_loop(0, 6, lambda i, h: jnp.tanh(h @ w[i]), x)

    assert len(layer_scans(_loss_jaxpr(), 1)) == 1
    assert layer_scans(_loss_jaxpr(), 0) == ()  # the stack is no parameter
    assert layer_scans(jax.make_jaxpr(over_time)(W, X), 1) == ()
    assert layer_scans(jax.make_jaxpr(fori)(W, X), 1) == ()


def _two_scans(w, x):
    h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w[:3])
    h = h * 2.0
    h, _ = jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), h, w[3:])
    return jnp.sum(h)


def test_automatic_layers_count_each_scanned_iteration_and_cut_inside_the_scan():
    loss = jax.make_jaxpr(lambda w, x: jnp.sum(_stack(w, x)[0]))(W, X)
    assert max_layers(loss, 1) == 7  # six iterations and the sum
    marked = insert_layer_markers(loss, 3, 1)
    graph = split_stages(marked, 1)
    assert [sum(e.params["length"] for e in s.jaxpr.eqns if e.primitive.name == "scan")
            for s in graph.stages] == [2, 2, 2]
    # Cut points choose among the automatic cuts: only those split the scan.
    uneven = split_stages(insert_layer_markers(loss, 6, 1, keep=(2,)), 1)
    assert [[e.params["length"] for e in s.jaxpr.eqns if e.primitive.name == "scan"] for s in uneven.stages] == [[3], [3]]
    np.testing.assert_allclose(float(_eval(insert_layer_markers(loss, 6, 1, keep=(0, 4)), W, X)[0]),
                               _numpy_stack(W, X)[0].sum(), rtol=1e-5)


def test_the_even_rule_counts_the_iterations_of_all_scans_in_program_order():
    loss = jax.make_jaxpr(lambda w, x: _two_scans(w, x))(W, X)
    assert [s.length for s in layer_scans(loss, 1)] == [3, 3]
    halves = split_stages(even_layer_markers(loss, 2, 1), 1)
    # 3 + 3 of 6: the cut falls between the scans, right after the first.
    assert [[e.params["length"] for e in s.jaxpr.eqns if e.primitive.name == "scan"] for s in halves.stages] == [[3], [3]]
    quarters = split_stages(even_layer_markers(loss, 4, 1), 1)
    assert [[e.params["length"] for e in s.jaxpr.eqns if e.primitive.name == "scan"]
            for s in quarters.stages] == [[2], [1, 1], [1], [1]]
    np.testing.assert_allclose(float(_eval(even_layer_markers(loss, 4, 1), W, X)[0]), float(_two_scans(W, X)), rtol=1e-6)
    assert even_layer_markers(jax.make_jaxpr(lambda w, x: jnp.sum(x @ w[0]))(W, X), 2, 1) is None
    with pytest.raises(ValueError, match="num_stages: 7 stages asked for, but the loss's layer scans have 6"):
        even_layer_markers(loss, 7, 1)
