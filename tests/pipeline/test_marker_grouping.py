"""More stage markers than stages (passes.pipeline.cutting.marker_grouping): the balanced
grouping against brute force, the grouped pipeline equal to jax.jit on one device with
describe() naming the chosen cuts, and too few markers still an error."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import meshpar
from examples.train_step import supervised_step
from meshpar.autodiff import tracing_pipeline
from meshpar.passes.pipeline.cutting.marker_grouping import (balanced_partition, group_markers, segment_flops,
                                                             verify_marker_grouping)
from meshpar.passes.pipeline.cutting.stage_graph import MarkerGrouping, StageMarkerError
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.verification import PlanVerificationError
from pipeline_models import assert_trees_close, make_state, mse, run_both


def _brute_force(costs, num_parts):
    """The least (largest part, sum of squared parts) over every choice of cut points."""
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(n - 1), num_parts - 1):
        bounds = (0, *(c + 1 for c in cuts), n)
        sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        key = (max(sums), sum(s * s for s in sums))
        best = key if best is None or key < best else best
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balanced_partition_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    num_parts = int(rng.integers(1, n + 1))
    # Small integers (zeros included) make ties, where the squared sums decide.
    costs = rng.choice([0.0, 1.0, 2.0, 3.0, 7.0], size=n).tolist() if seed % 2 else rng.uniform(0, 100, n).tolist()
    cuts = balanced_partition(costs, num_parts)
    assert len(cuts) == num_parts - 1 and list(cuts) == sorted(set(cuts)) and all(0 <= c < n - 1 for c in cuts)
    bounds = (0, *(c + 1 for c in cuts), n)
    sums = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    largest, squares = _brute_force(costs, num_parts)
    assert max(sums) == pytest.approx(largest)
    assert sum(s * s for s in sums) == pytest.approx(squares)


def test_balanced_partition_rejects_more_parts_than_items():
    with pytest.raises(ValueError, match=r"num_parts: expected 1 to 3 \(the items\), got 4"):
        balanced_partition([1.0, 2.0, 3.0], 4)
    with pytest.raises(ValueError, match="costs: expected non-negative"):
        balanced_partition([1.0, -2.0], 2)


def _three_marked_matmuls(x, w1, w2, w3):
    x = x @ w1
    meshpar.mark_stage_boundary()
    meshpar.mark_stage_boundary()
    x = x @ w2
    meshpar.mark_stage_boundary()
    return jnp.sum(x @ w3)


def _marked_loss():
    args = (jnp.ones((4, 8)), jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 2)))
    with tracing_pipeline():
        return jax.make_jaxpr(_three_marked_matmuls)(*args)


def test_segment_flops_count_matmuls_between_markers():
    # 2mnk per matmul; the sum's one output element after the last marker.
    np.testing.assert_allclose(segment_flops(_marked_loss()),
                               [2 * 4 * 8 * 16, 0.0, 2 * 4 * 16 * 32, 2 * 4 * 32 * 2 + 1])


def test_group_markers_only_with_more_markers_than_cuts_and_verified():
    loss = _marked_loss()
    assert group_markers(loss, None) is None and group_markers(loss, 4) is None
    grouping = group_markers(loss, 2)
    # Segments cost 3 x [1024, 0, 4096, 513]: the one cut worth making ends a stage after the
    # first matmul (either empty-segment side), leaving 4096 + 513 against 1024.
    assert grouping.cut_points in ((0,), (1,)) and grouping.stage_costs[1] == 3 * (4096 + 513)
    assert all("test_marker_grouping.py" in at for at in grouping.locations)
    verify_marker_grouping(grouping, loss, 2)
    verify_marker_grouping(None, loss, 4)
    with pytest.raises(PlanVerificationError, match="none chosen"):
        verify_marker_grouping(None, loss, 2)
    for cuts in ((1, 0), (3,), (0,)):
        bad = MarkerGrouping(cuts, grouping.locations, grouping.segment_costs)
        with pytest.raises(PlanVerificationError, match="cut points"):
            verify_marker_grouping(bad, loss, 3 if cuts == (0,) else len(cuts) + 1)


class _UnequalBlocks(nn.Module):
    """Four Dense + tanh blocks of widths 8, 8, 128, 4, a marker after each of the first three:
    the third block holds most of the work, so the balanced cut is the last marker (stages of
    about 2600 and 1000 FLOPs per example), not the middle one."""

    @nn.compact
    def __call__(self, x):
        for k, width in enumerate((8, 8, 128, 4)):
            x = jnp.tanh(nn.Dense(width)(x))
            if k < 3:
                meshpar.mark_stage_boundary()
        return x


def _batch(n=16, d=8, k=4):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


def test_more_markers_than_stages_are_grouped_by_flops_and_equal_jit():
    batch = _batch()
    state = make_state(_UnequalBlocks(), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(1, 1),
                                       schedule="1f1b", devices=jax.devices()[:2])
    ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=3)
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-4, atol=1e-4)

    graph = parallel.get_compiled(state, batch).graph
    assert graph.num_stages == 2 and graph.marker_grouping.cut_points == (2,)
    # The first three blocks' kernels and biases in stage 0, the last block's in stage 1.
    assert [len(s.param_inputs) for s in graph.stages] == [6, 2]
    assert all(r.kind is not RefKind.PARAM or r.index < 6 for r in graph.stages[0].inputs)
    description = parallel.get_executable(state, batch).describe()
    line = next(ln for ln in description.splitlines() if "stage markers:" in ln)
    assert line.strip().startswith("stage markers: 3 in the model; cuts at markers 2 (")
    assert "test_marker_grouping.py:" in line and "balanced by estimated flops" in line
    costs = [float(c) for c in line.split("stage costs [")[1].rstrip("]").split(", ")]
    assert len(costs) == 2 and costs[0] > costs[1] > 0


def test_grouped_markers_fill_virtual_stages():
    """num_stages is the final stage count with stages_per_mesh too: five markers grouped into
    four stages, two per mesh under interleaved 1F1B."""
    class Blocks(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (8, 32, 8, 32, 8, 4):
                x = jnp.tanh(nn.Dense(width)(x))
                if width != 4:
                    meshpar.mark_stage_boundary()
            return x

    batch = _batch()
    state = make_state(Blocks(), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=4, stages_per_mesh=2, stage_mesh_shape=(1, 1),
                                       schedule="interleaved_1f1b", devices=jax.devices()[:2])
    ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=2)
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-4, atol=1e-4)
    compiled = parallel.get_compiled(state, batch)
    assert compiled.graph.num_stages == 4 and len(compiled.graph.marker_grouping.cut_points) == 3
    assert compiled.schedule.num_meshes == 2


class _OneMarker(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(8)(x))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(x)


def test_fewer_markers_than_stages_is_still_an_error():
    batch = _batch()
    state = make_state(_OneMarker(), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=3, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:3])
    with pytest.raises(StageMarkerError, match=r"num_stages: 3 stages asked for, but the model's 1 stage markers "
                                               r"make 2 stages; pass num_stages=2 \(or None\) or fewer"):
        meshpar.parallelize(supervised_step(mse), method=method)(state, batch)
