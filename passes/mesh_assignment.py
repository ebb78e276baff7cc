"""Pass: give every pipeline stage its own device mesh, and every value a sharding.

Stage meshes are cut from the device list host-major (all of one host's
devices before the next host's), so a stage spans as few hosts as possible
and its collectives stay on fast intra-host links; each is shaped
``(data, model)``. Batch-shaped values shard their first dimension over
``data``; parameters follow their flax partitioning names on their stage's
mesh and are replicated where a name is not a mesh axis.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

__all__ = ["assign_stage_meshes", "batch_sharding", "param_sharding", "DEFAULT_AXES"]

DEFAULT_AXES = ("data", "model")


def assign_stage_meshes(
    devices: Sequence[Any],
    num_stages: int,
    stage_meshes: Sequence[Mesh] | None = None,
    stage_mesh_shape: tuple[int, int] | None = None,
) -> tuple[Mesh, ...]:
    """One mesh per stage.

    Args:
      devices: all devices the pipeline may use.
      num_stages: how many stages the model has.
      stage_meshes: the user's meshes, one per stage; else cut from ``devices``.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh; defaults to
        all of a stage's devices on ``data``.

    Raises:
      ValueError: naming the argument: wrong count, overlapping meshes,
        meshes using devices not in ``devices``, or a shape that does not fit.
    """
    if stage_meshes is not None:
        if len(stage_meshes) != num_stages:
            raise ValueError(
                f"stage_meshes: {len(stage_meshes)} meshes for a model with {num_stages} stages "
                f"(stage markers + 1)"
            )
        pool = {d.id for d in devices}
        seen: dict[int, int] = {}
        for i, mesh in enumerate(stage_meshes):
            for d in mesh.devices.flat:
                if d.id not in pool:
                    raise ValueError(f"stage_meshes: mesh {i} uses device {d.id}, which is not available")
                if d.id in seen:
                    raise ValueError(f"stage_meshes: meshes {seen[d.id]} and {i} overlap on device {d.id}")
                seen[d.id] = i
        return tuple(stage_meshes)
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    if len(ordered) % num_stages:
        raise ValueError(
            f"num_stages: {len(ordered)} devices do not split evenly into {num_stages} stage meshes"
        )
    per_stage = len(ordered) // num_stages
    shape = stage_mesh_shape or (per_stage, 1)
    if len(shape) != 2 or shape[0] * shape[1] != per_stage:
        raise ValueError(
            f"stage_mesh_shape: {tuple(shape)} does not hold the {per_stage} devices of each stage "
            f"({len(ordered)} devices / {num_stages} stages)"
        )
    return tuple(
        Mesh(np.array(ordered[s * per_stage : (s + 1) * per_stage]).reshape(shape), DEFAULT_AXES)
        for s in range(num_stages)
    )


def batch_sharding(mesh: Mesh, shape: tuple[int, ...], micro_batch_size: int) -> NamedSharding:
    """Shard the batch dimension over ``data`` when a value has one and ``data`` divides it."""
    if "data" in mesh.axis_names and shape and shape[0] == micro_batch_size:
        if micro_batch_size % mesh.shape["data"] == 0:
            return NamedSharding(mesh, P("data"))
    return NamedSharding(mesh, P())


def param_sharding(mesh: Mesh, spec: P | None, shape: tuple[int, ...]) -> NamedSharding:
    """A parameter's flax partitioning on ``mesh``: names that are not mesh axes, or
    that do not divide their dimension, are replicated."""
    if spec is None:
        return NamedSharding(mesh, P())
    entries = []
    for dim, entry in enumerate(tuple(spec)[: len(shape)]):
        names = (entry,) if isinstance(entry, str) else tuple(entry or ())
        names = tuple(n for n in names if n in mesh.axis_names)
        size = int(np.prod([mesh.shape[n] for n in names])) if names else 1
        entries.append(names if names and shape[dim] % size == 0 else None)
    return NamedSharding(mesh, P(*[e[0] if e and len(e) == 1 else e for e in entries]))
