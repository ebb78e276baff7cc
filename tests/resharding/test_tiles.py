import itertools
import random

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from meshpar import DeviceMesh, ShardingSpec, tiles
from meshpar.tiles import split_bounds


def _random_spec(rng, rank, mesh_ndim):
    axes = list(range(mesh_ndim))
    rng.shuffle(axes)
    dims = [[] for _ in range(rank)]
    for a in axes:
        r = rng.randrange(rank + 1)
        if r < rank:
            dims[r].append(a)
    return ShardingSpec(tuple(tuple(d) for d in dims))


@pytest.mark.parametrize("seed", range(30))
def test_tiles_match_jax_named_sharding(seed):
    """Each device's tile equals the slice JAX itself assigns it."""
    rng = random.Random(seed)
    devices = jax.devices()
    mesh_shape = rng.choice([(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)])
    names = ("a", "b", "c")[: len(mesh_shape)]
    jmesh = jax.sharding.Mesh(np.array(devices).reshape(mesh_shape), names)
    mesh = DeviceMesh.from_jax(jmesh)
    rank = rng.randrange(1, 4)
    spec = _random_spec(rng, rank, len(mesh_shape))
    parts = spec.num_shards(mesh.shape)
    shape = tuple(p * rng.randrange(1, 4) for p in parts)
    expected = NamedSharding(jmesh, spec.to_partition_spec(names)).devices_indices_map(shape)
    got = {d: t for t in tiles(shape, mesh, spec) for d in t.devices}
    assert sorted(got) == sorted(d.id for d in devices)
    x = np.arange(int(np.prod(shape))).reshape(shape)
    for dev, index in expected.items():
        tile = got[dev.id]
        np.testing.assert_array_equal(x[tuple(slice(a, b) for a, b in tile.bounds)], x[index])


def test_tiles_partition_the_tensor_and_group_replicas():
    mesh = DeviceMesh(np.arange(8).reshape(2, 4), np.repeat([[0], [1]], 4, axis=1))
    ts = tiles((4, 6, 2), mesh, "RS0R")
    assert len(ts) == 2
    assert ts[0].bounds == ((0, 4), (0, 3), (0, 2)) and ts[0].devices == (0, 1, 2, 3)
    assert ts[1].devices == (4, 5, 6, 7)
    assert sum(t.size for t in ts) == 4 * 6 * 2


def test_indivisible_dimension_error_names_dimension_and_axes():
    mesh = DeviceMesh(np.arange(12).reshape(3, 4), np.repeat([[0], [1], [2]], 4, axis=1))
    with pytest.raises(ValueError, match=r"dst_spec: 'S0RR' cuts dimension 0 \(size 1024\) into 3 shards over mesh axes \(0,\)"):
        tiles((1024, 8, 8), mesh, "S0RR", arg="dst_spec")


def test_padding_follows_ceil_layout():
    mesh = DeviceMesh(np.arange(4).reshape(1, 4), np.zeros((1, 4), int))
    ts = tiles((10,), mesh, "S1", pad=True)
    assert [t.bounds[0] for t in ts] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    ts = tiles((2,), mesh, "S1", pad=True)
    assert [t.size for t in ts] == [1, 1, 0, 0]


@pytest.mark.parametrize("length, parts", [(10, 3), (7, 7), (2, 5), (0, 3), (1026, 4)])
def test_split_bounds_covers_range(length, parts):
    b = split_bounds(length, parts, pad=True)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == length
    assert all(x[1] == y[0] for x, y in itertools.pairwise(b))
