"""The planner's input IR: one tensor moving from one mesh and spec to another."""

from __future__ import annotations

import dataclasses

import numpy as np

from ..model.mesh import DeviceMesh
from ..model.sharding_spec import ShardingSpec
from ..model.tiles import Tile, tiles

__all__ = ["ReshardingTask"]


@dataclasses.dataclass(frozen=True)
class ReshardingTask:
    """A cross-mesh resharding task (paper §2.2).

    Attributes:
      shape: the global tensor shape.
      itemsize: bytes per element.
      src_mesh, src_spec: where and how the tensor lives now.
      dst_mesh, dst_spec: where and how it must live afterwards.
      pad: allow dimensions a mesh does not divide (tiles at the end are cut
        short, as XLA pads them).
      shared_devices: allow the meshes to share devices (a point-to-point move's
        piece already on its destination device stays there; a global batch
        laid out over every device feeds a stage on some of them).

    Invariants (checked on construction): both specs fit the tensor and their
    meshes; both layouts tile the tensor (divisibly unless ``pad``); the two
    meshes share no device unless ``shared_devices``.
    """

    shape: tuple[int, ...]
    itemsize: int
    src_mesh: DeviceMesh
    src_spec: ShardingSpec
    dst_mesh: DeviceMesh
    dst_spec: ShardingSpec
    pad: bool = False
    shared_devices: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        for name in ("src_spec", "dst_spec"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, ShardingSpec.parse(value))
            elif not isinstance(value, ShardingSpec):
                raise TypeError(f"{name}: expected a ShardingSpec or spec text, got {type(value).__name__}")
        for name in ("src_mesh", "dst_mesh"):
            if not isinstance(getattr(self, name), DeviceMesh):
                raise TypeError(f"{name}: expected a DeviceMesh, got {type(getattr(self, name)).__name__}")
        if int(self.itemsize) < 1:
            raise ValueError(f"itemsize: expected a positive number of bytes per element, got {self.itemsize}")
        shared = self.src_mesh.shares_devices_with(self.dst_mesh)
        if shared and not self.shared_devices:
            raise ValueError(
                f"dst_mesh: shares devices {list(shared)} with src_mesh; cross-mesh resharding needs "
                f"disjoint meshes (for resharding within one mesh use jax.device_put)"
            )
        object.__setattr__(
            self, "_host_of", {**self.src_mesh._host_of, **self.dst_mesh._host_of}  # type: ignore[attr-defined]
        )
        # Computing the tiles validates both specs against shape and mesh.
        object.__setattr__(self, "_src_tiles", tiles(self.shape, self.src_mesh, self.src_spec, pad=self.pad, arg="src_spec"))
        object.__setattr__(self, "_dst_tiles", tiles(self.shape, self.dst_mesh, self.dst_spec, pad=self.pad, arg="dst_spec"))

    @property
    def src_tiles(self) -> tuple[Tile, ...]:
        return self._src_tiles  # type: ignore[attr-defined]

    @property
    def dst_tiles(self) -> tuple[Tile, ...]:
        return self._dst_tiles  # type: ignore[attr-defined]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(self.itemsize)

    def host_of(self, device_id: int) -> int:
        """Host of a device of either mesh."""
        try:
            return self._host_of[device_id]  # type: ignore[attr-defined]
        except KeyError:
            raise ValueError(f"device_id: {device_id} is in neither mesh") from None
