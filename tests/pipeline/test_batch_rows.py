"""Micro-batches of a global batch where their rows already lie (``passes.pipeline.placing.batch_rows``):
each view holds exactly rows ``[m * size, (m + 1) * size)`` of the leaf (numpy's slice), on
devices of the batch's own sharding, and a point-to-point move carries it to a stage whose
mesh shares devices with the batch; micro-batches that cut across shards are refused naming
``num_micro_batches``; a global batch the step reads outside the loss is placed whole by planned
moves (``global_batch_placements``). (Across processes: ``tests/multiprocess/mp_pipeline_worker.py``,
``tests/multiprocess/mp_batch_outside_loss_worker.py``.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from examples.mlp import MLP
from meshpar.passes.program.step_instructions import MoveMicroBatches, PlaceInputs
from meshpar.passes.pipeline.placing import batch_rows
from meshpar.passes.pipeline.placing.batch_rows import micro_batch_rows, verify_global_batch_placements
from meshpar.passes.program.moves import TransferKind
from meshpar.passes.verification import PlanVerificationError
from meshpar.runtime.placement import micro_batch_view
from pipeline_models import assert_trees_close, make_state

DEVICES = jax.devices()


def _sharding(shape, names, spec):
    return NamedSharding(Mesh(np.array(DEVICES[: int(np.prod(shape))]).reshape(shape), names), P(*spec))


CASES = [
    # (mesh shape, axis names, spec, M): whole shards per micro-batch, rows within one shard,
    # the batch split over two axes (in the spec's order, not the mesh's), replicated axes.
    ((8,), ("d",), ("d",), 2),
    ((8,), ("d",), ("d",), 8),
    ((2,), ("d",), ("d",), 4),
    ((2, 4), ("a", "b"), (("b", "a"),), 4),
    ((2, 4), ("a", "b"), ("b", None), 8),
    ((2, 4), ("a", "b"), ("a", "b"), 4),
    ((4,), ("d",), (), 4),
]


@pytest.mark.parametrize("mesh_shape, names, spec, M", CASES)
def test_each_view_holds_its_micro_batchs_rows_on_the_batchs_devices(mesh_shape, names, spec, M):
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    sharding = _sharding(mesh_shape, names, spec)
    leaf = jax.device_put(x, sharding)
    size = 16 // M
    rows = micro_batch_rows(x.shape, sharding, M)
    assert len(rows) == M
    for m, r in enumerate(rows):
        view = micro_batch_view(leaf, r, size)
        assert view.sharding == r.sharding
        assert set(r.sharding.device_set) <= set(sharding.device_set)
        np.testing.assert_array_equal(np.asarray(view), x[m * size:(m + 1) * size])
        for shard in view.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), x[m * size:(m + 1) * size][shard.index])


def test_a_view_moves_to_a_stage_mesh_that_shares_its_devices():
    x = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    sharding = _sharding((8,), ("d",), ("d",))
    leaf = jax.device_put(x, sharding)
    stage = NamedSharding(Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("data", "model")), P("data"))
    for m, r in enumerate(micro_batch_rows(x.shape, sharding, 4)):
        moved = meshpar.reshard(micro_batch_view(leaf, r, 4), stage)
        assert moved.sharding == stage
        np.testing.assert_array_equal(np.asarray(moved), x[4 * m:4 * (m + 1)])


def test_micro_batches_cutting_across_shards_are_refused_naming_num_micro_batches():
    # Shards of 6 rows, micro-batches of 4: neither divides the other.
    sharding = _sharding((4,), ("d",), ("d",))
    with pytest.raises(ValueError, match="num_micro_batches: 6 micro-batches of 4 rows cut across the batch's "
                                         "shards of 6 rows"):
        micro_batch_rows((24, 3), sharding, 6)


def _masked_step(state, batch):
    """docs/multiprocess.md's masked mean: a normaliser from the whole batch's mask, computed in the step,
    and a metric of the batch returned beside the loss."""
    count = jnp.maximum(batch["mask"].sum(), 1)

    def loss_fn(params):
        err = jnp.sum((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["mask"]) / count

    loss, grads = meshpar.value_and_grad(loss_fn, reduction="sum")(state.params)
    return state.apply_gradients(grads=grads), loss, jnp.sum(batch["y"] * batch["mask"][:, None]) / count


def test_a_global_batch_read_outside_the_loss_is_moved_whole_by_planned_moves(monkeypatch):
    """With every batch array treated as spanning processes (as each process's own rows built
    into a global array are), the leaves the step reads outside the loss get one planned
    point-to-point move of the whole leaf each, from the batch's sharding to where the work
    around the pipeline reads it (verified; a tampered move is rejected), the leaves the loss
    reads are fed per micro-batch, and two steps equal ``jax.jit``'s."""
    monkeypatch.setattr(batch_rows, "spans_processes", lambda leaf: isinstance(leaf, jax.Array))
    rng = np.random.default_rng(0)
    full = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32),
            "mask": np.array([1] * 7 + [0] + [1, 0, 0, 1, 0, 0, 0, 1], np.float32)}
    rows = _sharding((8,), ("rows",), ("rows",))
    batch = {k: jax.device_put(v, rows) for k, v in full.items()}
    with jax.default_device(DEVICES[0]):
        state = make_state(MLP(features=(16, 16, 4), num_stages=2), full["x"][:1])
    parallel = meshpar.parallelize(_masked_step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, stage_mesh_shape=(4, 1), schedule="1f1b"))
    compiled = parallel.get_compiled(state, batch)
    (placing,) = [ins for ins in compiled.step if isinstance(ins, PlaceInputs)]
    feeding = [ins.batch for ins in compiled.step if isinstance(ins, MoveMicroBatches)]
    leaves = jax.tree.leaves((state, batch))
    first = len(jax.tree.leaves(state))
    mask, x, y = first, first + 1, first + 2  # the batch's leaves, in key order
    batch_leaves = frozenset({mask, x, y})
    assert sorted(p.leaf for p in placing.global_batches) == [mask, y]
    assert sorted({f.leaf for f in feeding}) == [mask, x, y]
    for p in placing.global_batches:
        assert p.placement == compiled.layout.in_placements[p.leaf] and p.source == rows
        assert all(compiled.moves.of(key).key.kind is TransferKind.P2P for key in p.moves)
    verify_global_batch_placements(placing.global_batches, compiled.layout, leaves, batch_leaves)
    wrong = dataclasses.replace(placing.global_batches[0], moves=(dataclasses.replace(
        placing.global_batches[0].moves[0], dst=NamedSharding(compiled.meshes[0], P("data"))),))
    with pytest.raises(PlanVerificationError, match=f"placement of global batch leaf {mask}: moves to"):
        verify_global_batch_placements([wrong, placing.global_batches[1]], compiled.layout, leaves, batch_leaves)
    with pytest.raises(PlanVerificationError, match=f"global batch leaf {y}: placed on meshes .* by no move"):
        verify_global_batch_placements(placing.global_batches[:1], compiled.layout, leaves, batch_leaves)

    ref_state, par_state = state, state
    for _ in range(2):
        ref_state, ref_loss, ref_metric = jax.jit(_masked_step)(ref_state, full)
        par_state, loss, metric = parallel(par_state, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        np.testing.assert_allclose(float(metric), float(ref_metric), rtol=1e-5)
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-4, atol=1e-4)
