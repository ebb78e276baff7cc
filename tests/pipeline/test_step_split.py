"""The step split (passes.step_split) on traced steps, without devices: where each computation
around the pipeline runs, what moves between meshes, the verifier, and the micro-batching rules
(passes.micro_batching)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshpar
from meshpar.autodiff import tracing_pipeline
from meshpar.passes.program.step_values import AuxReduction
from meshpar.passes.pipeline.cutting.micro_batching import default_aux_reduction, key_operands
from meshpar.passes.pipeline.cutting.stage_graph import Ref, split_stages
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.pipeline.cutting.step_split import OuterCompute, OuterMove, split_step, verify_step_split
from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.passes.verification import PlanVerificationError


def _model(params, x):
    h = jnp.tanh(x @ params["w0"])
    meshpar.mark_stage_boundary()
    return h @ params["w1"]


PARAMS = {"w0": jnp.ones((4, 8)), "w1": jnp.ones((8, 2))}
X, Y = jnp.ones((6, 4)), jnp.ones((6, 2))


def _split(step, *args):
    with tracing_pipeline():
        outer = jax.make_jaxpr(step)(*args)
    (grad,) = [e for e in outer.jaxpr.eqns if e.primitive.name == "meshpar_pipeline_grad"]
    graph = split_stages(grad.params["loss_jaxpr"], grad.params["num_diff"])
    readers = [graph.consumers(Ref(RefKind.INPUT, k)) for k in range(graph.num_inputs)]
    split = split_step(outer, graph.param_owner, graph.loss.index, [r.index for r in graph.aux],
                       graph.num_stages, readers, [None] * len(outer.jaxpr.outvars))
    return outer, graph, split


def _clipped_step(params, x, y):
    loss, grads = meshpar.value_and_grad(lambda p: jnp.mean((_model(p, x) - y) ** 2))(params)
    norm = jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads)))
    scale = jnp.minimum(1.0, 0.5 / norm)
    return jax.tree.map(lambda p, g: p - 0.1 * scale * g, params, grads), loss, norm


def test_global_norm_moves_only_scalars_and_runs_level_by_level():
    _, graph, split = _split(_clipped_step, PARAMS, X, Y)
    assert graph.param_owner(0) == 0 and graph.param_owner(1) == 1
    assert not split.before
    moves = [s for s in split.after if isinstance(s, OuterMove)]
    # Mesh 1's partial sum meets mesh 0's there (equal sizes: the lower mesh), and the scale
    # goes back to mesh 1, whose gradient is the larger operand of its update: two scalars.
    assert [(len(m.values), split.avals[m.values[0]].shape, m.src, m.dst) for m in moves] == [(1, (), 1, 0), (1, (), 0, 1)]
    computes = [s for s in split.after if isinstance(s, OuterCompute)]
    # Level by level, each as late as its readers allow: mesh 1's partial sum alone (all it
    # sends); mesh 0's partial sum, the combine and mesh 0's update in one program; mesh 1's update.
    assert [c.mesh for c in computes] == [1, 0, 1]
    assert split.after.index(moves[0]) == 1 and split.after.index(moves[1]) == 3
    assert computes[0].outputs == moves[0].values
    assert [e.primitive.name for e in computes[0].jaxpr.jaxpr.eqns] == ["integer_pow", "reduce_sum"]
    # Each parameter's update happens on its own mesh; the norm is returned from mesh 0.
    homes = [meshes for _, meshes in split.outputs]
    assert homes[:2] == [(0,), (1,)] and homes[3] == (0,)


def test_uncoloured_values_are_computed_where_needed_and_whole_batch_values_before_the_pipeline():
    def step(params, x, y, step_count):
        count = jnp.sum(y > 0.5)  # from the batch: no mesh of its own

        def loss_fn(p):
            return jnp.sum((_model(p, x) - y) ** 2) / count

        loss, grads = meshpar.value_and_grad(loss_fn, reduction="sum")(params)
        lr = 0.1 / (1.0 + step_count)  # a schedule: computed by each mesh that updates
        return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss, step_count + 1

    _, graph, split = _split(step, PARAMS, X, Y, jnp.int32(0))
    before = [s for s in split.before if isinstance(s, OuterCompute)]
    assert [c.mesh for c in before] == [1] and not any(isinstance(s, OuterMove) for s in split.before)
    assert split.input_needs[3] == frozenset({1})  # y, read whole by the count's mesh
    after = [s for s in split.after if isinstance(s, OuterCompute)]
    assert sorted(c.mesh for c in after) == [0, 1] and not split.moved()
    assert split.outputs[-1][1] == (0,)  # no counterpart in the state: mesh 0


def test_verifier_rejects_a_missing_move_and_a_misordered_step():
    _, _, split = _split(_clipped_step, PARAMS, X, Y)
    verify_step_split(split, 2)
    after = list(split.after)
    first_move = next(k for k, s in enumerate(after) if isinstance(s, OuterMove))
    without = dataclasses.replace(split, after=tuple(after[:first_move] + after[first_move + 1:]))
    with pytest.raises(PlanVerificationError, match="reads .* before it is there"):
        verify_step_split(without, 2)
    reordered = dataclasses.replace(split, after=tuple(reversed(after)))
    with pytest.raises(PlanVerificationError):
        verify_step_split(reordered, 2)
    lost = dataclasses.replace(split, outputs=((OuterRef(OuterKind.VALUE, 10_000), (0,)), *split.outputs[1:]))
    with pytest.raises(PlanVerificationError, match="output 0"):
        verify_step_split(lost, 2)


def test_key_operands_finds_typed_and_raw_keys_also_inside_jit():
    def loss(p, x, typed, raw, nested_raw, data):
        a = jax.random.normal(typed, x.shape)
        b = jax.random.normal(raw, x.shape)
        c = jax.jit(lambda k: jax.random.normal(k, x.shape))(nested_raw)
        return jnp.sum(p * x * a * b * c) + jnp.sum(data)

    u32 = jnp.zeros(2, jnp.uint32)
    closed = jax.make_jaxpr(loss)(1.0, X, jax.random.key(0), u32, u32, u32)
    assert key_operands(closed, 1) == frozenset({1, 2, 3})  # not x (0), not the uint32 data (4)


def test_default_aux_reductions():
    f32, i32, b = (jax.core.ShapedArray((), d) for d in (jnp.float32, jnp.int32, jnp.bool_))
    assert default_aux_reduction(f32, f32) is AuxReduction.MEAN
    assert default_aux_reduction(i32, i32) is AuxReduction.SUM
    assert default_aux_reduction(b, b) is AuxReduction.LAST
    per_example = (jax.core.ShapedArray((4, 3), jnp.float32), jax.core.ShapedArray((16, 3), jnp.float32))
    assert default_aux_reduction(*per_example) is AuxReduction.CONCAT
    np.testing.assert_equal(len(AuxReduction), 4)
