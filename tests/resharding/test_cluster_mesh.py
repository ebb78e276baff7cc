import math

import jax
import numpy as np
import pytest

from meshpar import Cluster, DeviceMesh


def test_presets():
    aws = Cluster.aws_p3_8xlarge(3)
    assert aws.num_hosts == 3 and aws.devices_per_host == 4 and aws.num_devices == 12
    assert aws.inter_host_bandwidth == 1.25e9
    assert aws.host_of(5) == 1
    dgx = Cluster.dgx_h100(2)
    assert dgx.devices_per_host == 8 and dgx.inter_host_bandwidth > aws.inter_host_bandwidth


@pytest.mark.parametrize("field", ["inter_host_bandwidth", "intra_host_bandwidth"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_bad_bandwidth_names_argument(field, value):
    kwargs = dict(inter_host_bandwidth=1e9, intra_host_bandwidth=1e10)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        Cluster.uniform(2, 2, **kwargs)


def test_infinite_intra_bandwidth_allowed_and_bad_latency():
    Cluster.uniform(1, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=math.inf)
    with pytest.raises(ValueError, match="latency"):
        Cluster.uniform(1, 2, inter_host_bandwidth=1e9, intra_host_bandwidth=1e9, latency=-1)


def test_duplicate_device_across_hosts():
    with pytest.raises(ValueError, match="more than one host"):
        Cluster(((0, 1), (1, 2)), 1e9, 1e9)


def test_cluster_mesh_layout_and_errors():
    c = Cluster.aws_p3_8xlarge(4)
    m = c.mesh([2, 3], 3, first_device=1)
    assert m.shape == (2, 3)
    assert m.device_ids.tolist() == [[9, 10, 11], [13, 14, 15]]
    assert m.host_ids.tolist() == [[2, 2, 2], [3, 3, 3]]
    assert m.hosts == (2, 3)
    with pytest.raises(ValueError, match="devices_per_host"):
        c.mesh([0], 5)
    with pytest.raises(ValueError, match="hosts"):
        c.mesh([0, 0], 2)


def test_device_mesh_value_semantics_and_errors():
    a = DeviceMesh([[0, 1], [2, 3]], [[0, 0], [1, 1]])
    b = DeviceMesh(np.array([[0, 1], [2, 3]]), np.array([[0, 0], [1, 1]]))
    assert a == b and hash(a) == hash(b)
    assert a != DeviceMesh([[0, 1], [2, 3]], [[0, 0], [0, 0]])
    with pytest.raises(ValueError, match="host_ids"):
        DeviceMesh([[0, 1]], [0, 1])
    with pytest.raises(ValueError, match="axis_names"):
        DeviceMesh([[0, 1]], [[0, 0]], ("x",))
    with pytest.raises(ValueError, match="appears twice"):
        DeviceMesh([[0, 0]], [[0, 0]])


def test_from_devices_groups_by_process_or_override():
    devices = jax.devices()
    assert len(devices) == 8
    one = Cluster.from_devices(devices)
    assert one.num_hosts == 1 and one.devices_per_host == 8
    emulated = Cluster.from_devices(devices, host_of=lambda d: d.id // 4)
    assert emulated.host_devices == (tuple(d.id for d in devices[:4]), tuple(d.id for d in devices[4:]))
    mapped = Cluster.from_devices(devices, host_of={d.id: d.id % 2 for d in devices})
    assert mapped.num_hosts == 2 and mapped.host_of(devices[3].id) == 1
    with pytest.raises(ValueError, match="host_of"):
        Cluster.from_devices(devices, host_of={})


def test_jax_mesh_round_trip():
    devices = jax.devices()
    jm = jax.sharding.Mesh(np.array(devices).reshape(2, 4), ("data", "model"))
    m = DeviceMesh.from_jax(jm, host_of=lambda d: d.id // 4)
    assert m.axis_names == ("data", "model") and m.shape == (2, 4)
    assert m.host_ids.tolist() == [[0] * 4, [1] * 4]
    back = m.to_jax()
    assert back.axis_names == jm.axis_names
    assert (np.vectorize(lambda d: d.id)(back.devices) == np.vectorize(lambda d: d.id)(jm.devices)).all()
