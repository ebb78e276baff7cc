"""Pass: give every pipeline stage a device mesh (several stages may share one), and every
value a sharding.

Stage meshes are cut from the device list host-major (all of one host's
devices before the next host's), so a stage spans as few hosts as possible
and its collectives stay on fast intra-host links; each is shaped
``(data, model)`` (the axis names ``meshpar.PipeshardParallel`` was given).
Batch-shaped values shard their first dimension over the data axis;
parameters follow their flax partitioning names on their stage's mesh, the
names ``data`` and ``model`` standing for its data and model axes, and are
replicated where a name is not a mesh axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...compiler_pass import compiler_pass
from ...verification import PlanVerificationError
from ..scheduling.pipeline_schedule import ScheduleKind, check_stage_placement

__all__ = ["StageMeshMap", "assign_stage_meshes", "batch_sharding", "check_stage_split", "count_meshes", "mesh_shapes",
           "param_sharding", "place_stages", "verify_stage_mesh_map"]


def mesh_shapes(n: int) -> str:
    """Every ``(data, model)`` shape of ``n`` devices, for error messages: ``(4, 1), (2, 2) or (1, 4)``."""
    shapes = [f"({a}, {n // a})" for a in range(n, 0, -1) if n % a == 0]
    return shapes[0] if len(shapes) == 1 else f"{', '.join(shapes[:-1])} or {shapes[-1]}"


def check_stage_split(
    num_devices: int, num_stages: int, stage_mesh_shape: tuple[int, int] | None, counted: str
) -> None:
    """Checks that ``num_devices`` cut evenly into ``num_stages`` meshes of ``stage_mesh_shape``.

    ``counted`` says where the stage count comes from (``num_stages=3``, or the model's stage
    markers), for the message.

    Raises:
      ValueError: naming ``stage_meshes`` (for an uneven split) or ``stage_mesh_shape``, with a fix.
    """
    if num_devices % num_stages:
        raise ValueError(
            f"{num_stages} stages ({counted}) do not divide {num_devices} devices evenly; pass "
            f"stage_meshes=[...] (one jax.sharding.Mesh per stage) for an uneven split, or devices= "
            f"a multiple of {num_stages} devices"
        )
    per_stage = num_devices // num_stages
    if stage_mesh_shape is not None and stage_mesh_shape[0] * stage_mesh_shape[1] != per_stage:
        wanted = stage_mesh_shape[0] * stage_mesh_shape[1]
        fewer = (f", or devices=jax.devices()[:{wanted * num_stages}] to run on {wanted * num_stages} of the "
                 f"{num_devices} devices" if wanted < per_stage else "")
        raise ValueError(
            f"stage_mesh_shape: {tuple(stage_mesh_shape)} does not hold the {per_stage} devices of each stage "
            f"({num_devices} devices / {num_stages} stages, {counted}); pass stage_mesh_shape="
            f"{mesh_shapes(per_stage)}{fewer}"
        )


@dataclasses.dataclass(frozen=True)
class StageMeshMap:
    """Which device mesh runs each stage.

    Attributes:
      meshes: the pipeline's meshes, disjoint.
      stage_mesh: per stage, the index in ``meshes`` of the mesh running it (the schedule's
        placement); several stages share a mesh when stages outnumber meshes.
    """

    meshes: tuple[Mesh, ...]
    stage_mesh: tuple[int, ...]

    def __post_init__(self) -> None:
        used = set(self.stage_mesh)
        if used != set(range(len(self.meshes))):
            raise ValueError(f"StageMeshMap: stage_mesh {self.stage_mesh} must use each of the "
                             f"{len(self.meshes)} meshes")

    @property
    def stage_meshes(self) -> tuple[Mesh, ...]:
        """Per stage, its mesh (one object per mesh, repeated for stages sharing it)."""
        return tuple(self.meshes[m] for m in self.stage_mesh)


def verify_stage_mesh_map(placed: StageMeshMap, num_stages: int) -> None:
    """Every stage placed on one of the meshes, and no device in two meshes.

    Raises:
      PlanVerificationError: naming the stage count or the shared devices.
    """
    if len(placed.stage_mesh) != num_stages:
        raise PlanVerificationError(f"{len(placed.stage_mesh)} stages placed, for a graph of {num_stages}")
    devices = [d for mesh in placed.meshes for d in mesh.devices.flat]
    if len(set(devices)) != len(devices):
        shared = sorted({d.id for d in devices if devices.count(d) > 1})
        raise PlanVerificationError(f"the stage meshes share devices {shared}")


def count_meshes(num_stages: int, num_stage_meshes: int | None, stages_per_mesh: int | None,
                 counted: str) -> int:
    """The meshes ``num_stages`` stages run on: the user's ``num_stage_meshes``, else the cut
    meshes ``stages_per_mesh`` (default 1) leaves. ``counted`` says where the stage count comes
    from (``num_stages=4``, or the model's stage markers), for the message.

    Raises:
      ValueError: naming ``stage_meshes`` (not dividing the stages) or ``stages_per_mesh`` (not
        dividing them, or disagreeing with the meshes), with a fix.
    """
    if num_stage_meshes is not None:
        n = num_stage_meshes
        if num_stages % n:
            raise ValueError(
                f"stage_meshes: {n} meshes for a model with {num_stages} stages ({counted}); pass one "
                f"mesh per stage, or a number of meshes dividing the stages (virtual stages)")
        if stages_per_mesh is not None and stages_per_mesh * n != num_stages:
            raise ValueError(f"stages_per_mesh: {stages_per_mesh}, but {num_stages} stages ({counted}) on {n} "
                             f"stage_meshes are {num_stages // n} per mesh; pass stages_per_mesh={num_stages // n} "
                             f"or None")
        return n
    per_mesh = stages_per_mesh or 1
    if num_stages % per_mesh:
        raise ValueError(f"stages_per_mesh: {per_mesh} does not divide the {num_stages} stages ({counted}); "
                         f"pass a divisor of {num_stages}")
    return num_stages // per_mesh


@compiler_pass
def place_stages(
    devices: Sequence[Any],
    num_stages: int,
    schedule: ScheduleKind,
    num_micro_batches: int,
    stage_meshes: Sequence[Mesh] | None,
    stage_mesh_shape: tuple[int, int] | None,
    stages_per_mesh: int | None,
    axis_names: tuple[str, str],
) -> StageMeshMap:
    """The pipeline's meshes, and each stage placed on one as ``schedule`` places them.

    The meshes number ``len(stage_meshes)`` when given, else ``num_stages / stages_per_mesh``
    (default one stage per mesh), cut from ``devices`` (``assign_stage_meshes``).

    Raises:
      ValueError: naming the argument: stages that do not divide over the meshes, a schedule
        of one stage per mesh given several, micro-batches the schedule cannot split
        (``check_stage_placement``), devices that do not split evenly.
    """
    counted = "stage markers + 1"
    num_meshes = count_meshes(num_stages, None if stage_meshes is None else len(stage_meshes), stages_per_mesh,
                              counted)
    check_stage_placement(schedule, num_stages, num_meshes, num_micro_batches)
    placement = schedule.placement
    if num_meshes != num_stages:
        counted = f"meshes for {num_stages} stages, {num_stages // num_meshes} per mesh"
    meshes = assign_stage_meshes(devices, num_meshes, stage_meshes, stage_mesh_shape, axis_names, counted)
    return StageMeshMap(meshes, tuple(placement.mesh_of(s, num_meshes) for s in range(num_stages)))


def assign_stage_meshes(
    devices: Sequence[Any],
    num_meshes: int,
    stage_meshes: Sequence[Mesh] | None,
    stage_mesh_shape: tuple[int, int] | None,
    axis_names: tuple[str, str],
    counted: str = "stage markers + 1",
) -> tuple[Mesh, ...]:
    """The pipeline's ``num_meshes`` meshes: the user's, or cut from ``devices``.

    ``meshpar.PipeshardParallel`` has checked everything the stage count does not decide
    (meshes disjoint and within ``devices``, their axes, the shape's form) before tracing.

    Args:
      devices: all devices the pipeline may use.
      num_meshes: how many meshes the stages run on.
      stage_meshes: the user's meshes; else cut from ``devices``.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh; defaults to
        all of a mesh's devices on ``data``.
      axis_names: the ``(data, model)`` axis names of cut meshes.
      counted: where the mesh count comes from, for messages.

    Raises:
      ValueError: naming the argument: devices that do not split evenly, or a shape that does
        not fit.
    """
    if stage_meshes is not None:
        return tuple(stage_meshes)
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    check_stage_split(len(ordered), num_meshes, stage_mesh_shape, counted)
    per_mesh = len(ordered) // num_meshes
    shape = stage_mesh_shape or (per_mesh, 1)
    return tuple(
        Mesh(np.array(ordered[m * per_mesh : (m + 1) * per_mesh]).reshape(shape), axis_names)
        for m in range(num_meshes)
    )


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], micro_batch_size: int, data_axis: str) -> NamedSharding:
    """Shard the batch dimension over ``data_axis`` when a value has one and that axis divides it."""
    if data_axis in mesh.axis_names and shape and shape[0] == micro_batch_size:
        if micro_batch_size % mesh.shape[data_axis] == 0:
            return NamedSharding(mesh, P(data_axis))
    return NamedSharding(mesh, P())


def param_sharding(mesh: Mesh, spec: P | None, shape: tuple[int, ...], axis_names: tuple[str, str]) -> NamedSharding:
    """A parameter's flax partitioning on ``mesh``: the names ``data`` and ``model`` mean the
    mesh's ``axis_names`` (its data and model axes, whatever they are called); names that are not
    mesh axes, or that do not divide their dimension, are replicated."""
    if spec is None:
        return NamedSharding(mesh, P())
    rename = dict(zip(("data", "model"), axis_names))
    entries = []
    for dim, entry in enumerate(tuple(spec)[: len(shape)]):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(n for n in (rename.get(n, n) for n in names) if n in mesh.axis_names)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        entries.append(names if names and shape[dim] % size == 0 else None)
    return NamedSharding(mesh, P(*[e[0] if e and len(e) == 1 else e for e in entries]))
