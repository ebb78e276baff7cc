"""Automatic layers for losses without stage markers (passes.layer_clustering): the cut DP
against brute force, the marked loss equal to the original, and marker-less models pipelined
with auto_layers or planned with num_stages="auto", equal to jax.jit."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshpar.passes import jax_ir
import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.pipeline.cutting.layer_clustering import cut_positions, insert_layer_markers, max_layers
from meshpar.passes.planning.planner_meshpar import Hardware
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.pipeline.cutting.stage_graph import StageMarkerError, count_markers, split_stages
from meshpar.planning import plan_parallelism
from meshpar.passes.planning.profile_layers import AUTO_LAYERS
from pipeline_models import assert_trees_close, make_state, mse


def _brute_force(flops, live, L):
    """The cheapest cuts over every combination, at the first eps (0.1, doubling) any fits."""
    n, total, eps = len(flops), float(np.sum(flops)), 0.1
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    while True:
        best = (math.inf, None)
        for cuts in itertools.combinations(range(1, n), L - 1):
            bounds = (0, *cuts, n)
            spans = [prefix[b] - prefix[a] for a, b in zip(bounds, bounds[1:])]
            if all(0 < s <= (1 + eps) * total / L for s in spans):
                best = min(best, (sum(live[c] for c in cuts), cuts))
        if best[1] is not None:
            return best
        eps *= 2


@pytest.mark.parametrize("seed", range(10))
def test_cut_positions_equal_brute_force(seed):
    rng = np.random.default_rng(seed)
    n, L = int(rng.integers(4, 9)), int(rng.integers(2, 4))
    flops = rng.choice([0.0, 1.0, 2.0, 5.0], size=n, p=[0.2, 0.4, 0.3, 0.1])
    flops[rng.choice(n, L, replace=False)] += 1.0  # at least L equations with FLOPs
    live = rng.uniform(0, 10, size=n + 1)
    cuts = cut_positions(flops, live, L)
    cost, _ = _brute_force(flops, live, L)
    assert len(cuts) == L - 1 and cuts == sorted(set(cuts)) and 0 < cuts[0] and cuts[-1] < n
    assert sum(live[c] for c in cuts) == pytest.approx(cost)


def _chain_loss(ws, x):
    for w in ws:
        x = jnp.tanh(x @ w)
    return jnp.mean(x ** 2)


def test_markers_cut_a_chain_into_balanced_layers_and_compute_the_same():
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((16, 16)) / 4, jnp.float32) for _ in range(6)]
    x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
    loss = jax.make_jaxpr(_chain_loss)(ws, x)
    marked = insert_layer_markers(loss, 3, 0)
    assert count_markers(marked) == 2 and max_layers(loss, 0) == len(loss.jaxpr.eqns)  # each computes
    graph = split_stages(marked, 6)
    # Three layers of two matmuls each: each stage owns two of the weights.
    assert [sorted(r.index for r in s.inputs if r.kind is RefKind.PARAM) for s in graph.stages] == [[0, 1], [2, 3], [4, 5]]
    np.testing.assert_allclose(jax_ir.jaxpr_as_fun(marked)(*ws, x)[0], _chain_loss(ws, x), rtol=1e-6)
    with pytest.raises(ValueError, match="has stage markers"):
        insert_layer_markers(marked, 2, 0)
    with pytest.raises(ValueError, match="num_layers"):
        insert_layer_markers(loss, 40, 0)


def _mlp_case():
    model = MLP(features=(16, 16, 16, 16, 4))  # no markers
    rng = np.random.default_rng(4)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    return make_state(model, batch["x"][:1]), batch, supervised_step(mse)


def test_a_markerless_model_pipelined_with_auto_layers_equals_jit():
    state, batch, step = _mlp_case()
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, auto_layers=2, stage_mesh_shape=(2, 1),
                                       devices=jax.devices()[:4])
    parallel = meshpar.parallelize(step, method=method)
    got_state, got_loss = parallel(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    assert parallel.get_compiled(state, batch).graph.num_stages == 2
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
    with pytest.raises(StageMarkerError, match="auto_layers=2"):
        meshpar.parallelize(step, method=meshpar.PipeshardParallel(num_stages=2, devices=jax.devices()[:4]))(state, batch)
    with pytest.raises(ValueError, match="auto_layers: expected"):
        meshpar.PipeshardParallel(auto_layers=0)


def test_planning_a_markerless_model_cuts_it_automatically_and_runs_as_planned():
    state, batch, step = _mlp_case()
    plan = plan_parallelism(step, state, batch, hardware=Hardware(1e13), num_stages=2)
    assert plan.profile.auto_layers == AUTO_LAYERS == plan.profile.num_layers
    assert plan.best.num_stages == 2 and plan.method.auto_layers == AUTO_LAYERS
    got_state, got_loss = meshpar.parallelize(step, method=plan.method)(state, batch)
    want_state, want_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
