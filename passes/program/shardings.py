"""Shardings the compiler hands the runtime: a device's sharding, one array over several meshes,
and how a step input leaf is placed (``PlaceLeaf``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["PlaceLeaf", "device_sharding", "joined_sharding"]


def device_sharding(device: Any) -> NamedSharding:
    """The sharding of an array that lives whole on ``device``, in any process (a
    ``NamedSharding``: ``SingleDeviceSharding`` cannot name a remote device for the cross-host
    path)."""
    return NamedSharding(Mesh(np.array([device]), ("device",)), P())


def _spans_platforms(shardings: Sequence[NamedSharding]) -> bool:
    """Whether ``shardings``' meshes are on several platforms (a GPU and the host): no one array
    spans them."""
    return len({d.platform for s in shardings for d in s.mesh.devices.flat}) > 1


def _union_sharding(shardings: Sequence[NamedSharding]) -> NamedSharding:
    """Replicated over every device of ``shardings``' meshes (all on one platform): how one
    array holds a value several meshes read."""
    devices = [d for s in shardings for d in s.mesh.devices.flat]
    return NamedSharding(Mesh(np.array(devices), ("union",)), P())


def joined_sharding(shardings: Sequence[NamedSharding]) -> NamedSharding | None:
    """How one value held on several meshes (one sharding each) is one array: replicated over the
    union of their devices; ``None`` for a single mesh, or for meshes of several platforms, which
    no one array spans."""
    return _union_sharding(shardings) if len(shardings) > 1 and not _spans_platforms(shardings) else None


@dataclasses.dataclass(frozen=True)
class PlaceLeaf:
    """How one step input leaf is placed: on each of ``meshes``, laid out as ``shardings[k]`` on
    mesh ``meshes[k]``. With ``union``, one array replicated over all their devices, put once
    and viewed per mesh; without, one array put per mesh (a single mesh, or meshes of several
    platforms, which no one array spans). No meshes: a leaf never placed whole (a batch leaf
    read only per micro-batch; in a forward-only step, a leaf nothing reads)."""

    meshes: tuple[int, ...]
    shardings: tuple[NamedSharding, ...]
    union: NamedSharding | None = None

    @classmethod
    def of(cls, meshes: Sequence[int], shardings: Sequence[NamedSharding]) -> PlaceLeaf:
        """The leaf on ``meshes`` laid out as ``shardings``: one array over them all where one
        platform holds them."""
        return cls(tuple(meshes), tuple(shardings), joined_sharding(shardings))

    def on(self, mesh: int) -> NamedSharding:
        """Its sharding on ``mesh``, one of ``meshes``."""
        return self.shardings[self.meshes.index(mesh)]

    @property
    def targets(self) -> tuple[NamedSharding, ...]:
        """The arrays it is laid out as: the union, or one per mesh."""
        return (self.union,) if self.union is not None else self.shardings
