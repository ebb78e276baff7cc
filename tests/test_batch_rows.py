"""Micro-batches of a global batch where their rows already lie (``passes.pipeline.placing.batch_rows``):
each view holds exactly rows ``[m * size, (m + 1) * size)`` of the leaf (numpy's slice), on
devices of the batch's own sharding, and a point-to-point move carries it to a stage whose
mesh shares devices with the batch; micro-batches that cut across shards are refused naming
``num_micro_batches``. (Across processes: ``tests/mp_pipeline_worker.py``.)"""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from meshpar.passes.pipeline.placing.batch_rows import micro_batch_rows
from meshpar.runtime.placement import micro_batch_view

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
