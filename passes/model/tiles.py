"""Tiles: the unique data slices a sharding spec lays out on a mesh.

For a tensor shape, a mesh and a spec, every device holds one tile; devices
whose mesh coordinates differ only along axes the spec does not use hold
replicas of the same tile. ``tiles`` lists each unique tile once, with the
devices that hold it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from .mesh import DeviceMesh
from .sharding_spec import ShardingSpec

__all__ = ["Tile", "split_bounds", "tiles", "device_blocks"]

Bounds = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Tile:
    """One unique slice of a sharded tensor and the devices holding it.

    Attributes:
      block: the tile's block index per tensor dimension.
      bounds: ``(start, stop)`` per dimension in the unpadded tensor; with
        padding a tile may be shorter than its block, or empty.
      devices: ids of the devices holding a replica, in mesh order.
    """

    block: tuple[int, ...]
    bounds: Bounds
    devices: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def split_bounds(length: int, parts: int, *, pad: bool = False) -> tuple[tuple[int, int], ...]:
    """Cuts ``range(length)`` into ``parts`` consecutive pieces.

    Without ``pad`` the pieces are equal and ``parts`` must divide ``length``.
    With ``pad`` each piece is ``ceil(length / parts)`` long except the last
    ones, which are cut at ``length`` (possibly to nothing): the layout JAX
    and XLA use for a padded dimension.
    """
    if parts < 1:
        raise ValueError(f"parts: expected >= 1, got {parts}")
    if length < 0:
        raise ValueError(f"length: expected >= 0, got {length}")
    if not pad and length % parts:
        raise ValueError(f"length: {length} is not divisible into {parts} equal parts")
    step = -(-length // parts)
    return tuple((min(j * step, length), min((j + 1) * step, length)) for j in range(parts))


def device_blocks(mesh: DeviceMesh, spec: ShardingSpec) -> dict[int, tuple[int, ...]]:
    """Block index (per tensor dimension) of the tile each device of ``mesh`` holds."""
    out: dict[int, tuple[int, ...]] = {}
    for coords, device in np.ndenumerate(mesh.device_ids):
        block = []
        for axes in spec.dims:
            index = 0
            for a in axes:
                index = index * mesh.shape[a] + coords[a]
            block.append(index)
        out[int(device)] = tuple(block)
    return out


def tiles(
    shape: Sequence[int],
    mesh: DeviceMesh,
    spec: ShardingSpec | str,
    *,
    pad: bool = False,
    arg: str = "spec",
) -> tuple[Tile, ...]:
    """Every unique tile of a ``shape`` tensor laid out by ``spec`` on ``mesh``.

    Args:
      shape: the tensor's shape.
      mesh: the mesh it lives on.
      spec: a ``ShardingSpec`` or its text form.
      pad: allow dimensions the mesh does not divide, padding the last tiles.
      arg: the argument name used in error messages.

    Returns:
      Tiles in row-major block order; their bounds partition the tensor and
      each device of the mesh appears in exactly one tile.

    Raises:
      ValueError: the spec does not fit the tensor or mesh, or (without
        ``pad``) a dimension is not divisible by its number of shards.
    """
    spec = ShardingSpec.parse(spec) if isinstance(spec, str) else spec
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"shape: expected non-negative sizes, got {shape}")
    spec.validate(len(shape), mesh.ndim, arg=arg)
    parts = spec.num_shards(mesh.shape)
    per_dim = []
    for dim, (length, n) in enumerate(zip(shape, parts)):
        if not pad and length % n:
            raise ValueError(
                f"{arg}: {str(spec)!r} cuts dimension {dim} (size {length}) into {n} shards over "
                f"mesh axes {spec.dims[dim]} of the {mesh.shape} mesh, which does not divide it; "
                f"choose a divisible size or another spec (the planner alone also accepts pad=True)"
            )
        per_dim.append(split_bounds(length, n, pad=pad))
    holders: dict[tuple[int, ...], list[int]] = {}
    for device, block in device_blocks(mesh, spec).items():
        holders.setdefault(block, []).append(device)
    return tuple(
        Tile(block, tuple(per_dim[i][b] for i, b in enumerate(block)), tuple(holders[block]))
        for block in sorted(holders)
    )
