"""Placing a step input (``runtime.placement.put``): an array on one CPU device is cut into
shards on the host, compiling nothing, and every placement equals the value it placed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from compile_events import compiled
from meshpar.runtime.placement import put


@pytest.fixture
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()[4:8]).reshape(2, 2), ("data", "model"))


@pytest.mark.parametrize("spec", [P("data", "model"), P(None, "model"), P()])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_an_array_on_one_cpu_device_is_placed_without_compiling(mesh, spec, dtype):
    # Shapes no other test uses: JAX's own slicing program would compile for each.
    value = jax.device_put(np.arange(6 * 10, dtype=dtype).reshape(6, 10) * 3, jax.devices()[1])
    expected = np.asarray(value)
    with compiled() as names:
        placed = put(value, NamedSharding(mesh, spec))
    assert names == []
    assert placed.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    np.testing.assert_array_equal(np.asarray(placed), expected)
    for shard in placed.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])


def test_a_key_array_has_no_host_view_and_is_placed_on_devices(mesh):
    keys = jax.random.split(jax.random.key(3), 4)
    placed = put(keys, NamedSharding(mesh, P("data")))
    np.testing.assert_array_equal(jax.random.key_data(placed), jax.random.key_data(keys))


def test_an_array_over_several_devices_is_moved_between_them(mesh):
    other = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    value = jax.device_put(jnp.arange(8.0 * 6).reshape(8, 6), NamedSharding(other, P("data")))
    placed = put(value, NamedSharding(mesh, P(None, "model")))
    assert set(placed.sharding.device_set) == set(mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(placed), np.asarray(value))
