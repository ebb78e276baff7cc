"""A device is its platform and its id: a GPU mesh and a CPU mesh whose devices share ids are
different devices everywhere meshpar builds device sets (stand-in GPU devices here: this
machine has one platform)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from meshpar.passes.program.devices import device_key, device_name, distinct_devices, planner_ids
from meshpar.passes.program.moves import MoveKey, TransferKind
from meshpar.passes.pipeline.placing.plan_moves import MoveOptions, plan_move
from meshpar.passes.resharding.hop_program import verify_hop_program


class FakeGpu:
    """What meshpar reads of a device, on a platform this machine does not have."""

    def __init__(self, id: int) -> None:
        self.platform, self.id, self.process_index = "cuda", id, 0

    def __repr__(self) -> str:
        return f"FakeGpu({self.id})"


def _gpu_mesh() -> Mesh:
    return Mesh(np.array([FakeGpu(k) for k in range(4)]).reshape(2, 2), ("data", "model"))


def _cpu_mesh(first: int = 0) -> Mesh:
    return Mesh(np.array(jax.devices()[first:first + 4]).reshape(2, 2), ("data", "model"))


def test_device_key_and_name_tell_platforms_apart():
    gpu, cpu = FakeGpu(0), jax.devices()[0]
    assert gpu.id == cpu.id == 0
    assert device_key(gpu) != device_key(cpu)
    assert (device_name(gpu), device_name(cpu)) == ("cuda:0", "cpu:0")
    assert distinct_devices([gpu, cpu, cpu]) == [gpu, cpu]


def test_planner_ids_are_the_ids_on_one_platform_and_distinct_across_two():
    cpus = jax.devices()[:4]
    assert planner_ids(cpus[:2], cpus[2:]) == {device_key(d): d.id for d in cpus}
    gpus = [FakeGpu(k) for k in range(4)]
    ids = planner_ids(gpus, cpus)
    assert len(set(ids.values())) == 8
    assert [ids[device_key(g)] for g in gpus] == [0, 1, 2, 3]  # the first platform keeps its ids
    assert sorted(ids[device_key(c)] for c in cpus) == [4, 5, 6, 7]


def test_stage_meshes_on_two_platforms_do_not_overlap():
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_meshes=[_gpu_mesh(), _cpu_mesh()])
    assert len(method.stage_meshes) == 2
    with pytest.raises(ValueError, match="stage_meshes: meshes 0 and 1 overlap on device cpu:2"):
        meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_meshes=[_cpu_mesh(0), _cpu_mesh(2)])


def test_repeated_devices_are_named_with_their_platform():
    cpu = jax.devices()[0]
    with pytest.raises(ValueError, match=r"devices: devices \['cpu:0', 'cpu:0'\] repeat"):
        meshpar.PipeshardParallel(num_micro_batches=2, num_stages=1, devices=[cpu, cpu])


def test_a_move_between_a_gpu_and_a_cpu_mesh_is_planned_between_distinct_devices():
    src, dst = NamedSharding(_gpu_mesh(), P("data")), NamedSharding(_cpu_mesh(), P(None, "model"))
    plan = meshpar.plan_between((64, 32), np.float32, src, dst)
    assert not set(plan.task.src_mesh.devices) & set(plan.task.dst_mesh.devices)
    move = plan_move(MoveKey.of(TransferKind.P2P, (64, 32), np.float32, src, dst),
                     MoveOptions())
    verify_hop_program(move.program)
    # Every hop goes from a GPU device to a CPU one, or between CPU devices: none stays on a
    # "device 0" the two platforms would share.
    senders = {h.src_device for step in move.program.steps for h in step}
    receivers = {h.dst_device for step in move.program.steps for h in step}
    assert receivers <= set(plan.task.dst_mesh.devices)
    assert senders <= set(plan.task.src_mesh.devices) | set(plan.task.dst_mesh.devices)


def test_a_collective_move_across_platforms_is_refused_naming_the_executor():
    src, dst = NamedSharding(_gpu_mesh(), P("data")), NamedSharding(_cpu_mesh(), P())
    with pytest.raises(ValueError, match=r"executor: 'collective' .* platforms \['cpu', 'cuda'\].*executor='p2p'"):
        plan_move(MoveKey.of(TransferKind.COLLECTIVE, (64, 32), np.float32, src, dst),
                  MoveOptions())
