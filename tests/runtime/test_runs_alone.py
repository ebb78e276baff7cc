"""Which meshes' programs must finish before the next launch (``stage_executables.runs_alone``):
CPU meshes spanning processes, whose gloo collectives carry no tags; not GPU meshes (NCCL orders a
communicator's collectives on its stream), not meshes inside one process."""

import types

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from meshpar.runtime.stage_executables import on_mesh, runs_alone


def _mesh(platform: str, processes: list[int]) -> types.SimpleNamespace:
    devices = [types.SimpleNamespace(platform=platform, process_index=p) for p in processes]
    return types.SimpleNamespace(devices=np.array(devices, dtype=object).reshape(2, -1))


@pytest.mark.parametrize("platform, processes, alone", [
    ("cpu", [0, 0, 1, 1], True),
    ("cpu", [0, 1, 0, 1], True),
    ("cpu", [0, 0, 0, 0], False),
    ("gpu", [0, 0, 1, 1], False),
    ("tpu", [0, 1, 2, 3], False),
])
def test_only_cpu_meshes_spanning_processes_run_alone(platform, processes, alone):
    assert runs_alone(_mesh(platform, processes)) is alone


def test_on_mesh_returns_the_programs_result_on_its_mesh():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    run = on_mesh(jax.jit(lambda x: x * 2), mesh, timeout_s=5.0)
    out = run(np.arange(3.0))
    np.testing.assert_array_equal(np.asarray(out), [0.0, 2.0, 4.0])
    assert out.sharding.device_set == set(mesh.devices.flat)
