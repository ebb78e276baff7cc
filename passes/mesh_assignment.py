"""Pass: give every pipeline stage its own device mesh, and every value a sharding.

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

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["assign_stage_meshes", "batch_sharding", "check_stage_split", "mesh_shapes", "param_sharding"]


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
        raise ValueError(
            f"stage_mesh_shape: {tuple(stage_mesh_shape)} does not hold the {per_stage} devices of each stage "
            f"({num_devices} devices / {num_stages} stages, {counted}); pass stage_mesh_shape="
            f"{mesh_shapes(per_stage)}"
        )


def assign_stage_meshes(
    devices: Sequence[Any],
    num_stages: int,
    stage_meshes: Sequence[Mesh] | None,
    stage_mesh_shape: tuple[int, int] | None,
    axis_names: tuple[str, str],
) -> tuple[Mesh, ...]:
    """One mesh per stage.

    ``meshpar.PipeshardParallel`` has checked everything the stage count does not decide
    (meshes disjoint and within ``devices``, their axes, the shape's form) before tracing.

    Args:
      devices: all devices the pipeline may use.
      num_stages: how many stages the model has.
      stage_meshes: the user's meshes, one per stage; else cut from ``devices``.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh; defaults to
        all of a stage's devices on ``data``.
      axis_names: the ``(data, model)`` axis names of cut meshes.

    Raises:
      ValueError: naming the argument: a mesh count other than ``num_stages``, devices that
        do not split evenly, or a shape that does not fit.
    """
    counted = "stage markers + 1"
    if stage_meshes is not None:
        if len(stage_meshes) != num_stages:
            raise ValueError(
                f"stage_meshes: {len(stage_meshes)} meshes for a model with {num_stages} stages "
                f"({counted}); pass one mesh per stage"
            )
        return tuple(stage_meshes)
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    check_stage_split(len(ordered), num_stages, stage_mesh_shape, counted)
    per_stage = len(ordered) // num_stages
    shape = stage_mesh_shape or (per_stage, 1)
    return tuple(
        Mesh(np.array(ordered[s * per_stage : (s + 1) * per_stage]).reshape(shape), axis_names)
        for s in range(num_stages)
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
