"""Abstract device meshes: device ids in an N-d array, each with its host.

A ``DeviceMesh`` needs no real devices, so plans for thousands of devices can
be computed anywhere; ``from_jax``/``to_jax`` convert to and from
``jax.sharding.Mesh`` when real devices exist.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ..program.devices import DeviceKey, device_key

__all__ = ["DeviceMesh"]


def _nested(a: np.ndarray) -> tuple:
    return tuple(_nested(x) for x in a) if a.ndim > 1 else tuple(int(x) for x in a)


@dataclasses.dataclass(frozen=True, eq=False)
class DeviceMesh:
    """An N-d array of device ids with named axes and each device's host.

    Args:
      device_ids: integer array (any nesting of sequences) of distinct ids.
      host_ids: same shape; ``host_ids[i]`` is the host of ``device_ids[i]``.
      axis_names: one distinct name per mesh dimension.

    Invariants: ``device_ids.shape == host_ids.shape``, ``len(axis_names) ==
    device_ids.ndim >= 1``, ids distinct. Equality and hashing are by value.
    """

    device_ids: Any
    host_ids: Any
    axis_names: tuple[str, ...] = ("x", "y")

    def __post_init__(self) -> None:
        ids = np.asarray(self.device_ids, dtype=np.int64)
        hosts = np.asarray(self.host_ids, dtype=np.int64)
        names = tuple(self.axis_names)
        if ids.ndim == 0 or ids.size == 0:
            raise ValueError(f"device_ids: expected a non-empty array of rank >= 1, got shape {ids.shape}")
        if hosts.shape != ids.shape:
            raise ValueError(
                f"host_ids: expected the shape of device_ids {ids.shape}, got {hosts.shape}"
            )
        if len(names) != ids.ndim or len(set(names)) != len(names):
            raise ValueError(
                f"axis_names: expected {ids.ndim} distinct names for a rank-{ids.ndim} mesh, got {names}"
            )
        if len(np.unique(ids)) != ids.size:
            raise ValueError(f"device_ids: a device id appears twice in {ids.tolist()}")
        ids.flags.writeable = False
        hosts.flags.writeable = False
        object.__setattr__(self, "device_ids", ids)
        object.__setattr__(self, "host_ids", hosts)
        object.__setattr__(self, "axis_names", names)
        object.__setattr__(self, "_key", (ids.shape, _nested(ids), _nested(hosts), names))
        object.__setattr__(
            self, "_host_of", {int(d): int(h) for d, h in zip(ids.flat, hosts.flat)}
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DeviceMesh) and self._key == other._key  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._key)  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return (
            f"DeviceMesh(shape={self.shape}, axis_names={self.axis_names}, "
            f"device_ids={self.device_ids.tolist()}, host_ids={self.host_ids.tolist()})"
        )

    # -- queries -----------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.device_ids.shape)

    @property
    def ndim(self) -> int:
        return self.device_ids.ndim

    @property
    def size(self) -> int:
        return int(self.device_ids.size)

    @property
    def devices(self) -> tuple[int, ...]:
        """Device ids in row-major mesh order."""
        return tuple(int(d) for d in self.device_ids.flat)

    @property
    def hosts(self) -> tuple[int, ...]:
        """The distinct hosts this mesh touches, sorted."""
        return tuple(sorted(set(int(h) for h in self.host_ids.flat)))

    def host_of(self, device_id: int) -> int:
        try:
            return self._host_of[int(device_id)]  # type: ignore[attr-defined]
        except KeyError:
            raise ValueError(f"device_id: {device_id} is not in this mesh") from None

    def shares_devices_with(self, other: DeviceMesh) -> tuple[int, ...]:
        """Device ids that are in both meshes, sorted."""
        return tuple(sorted(set(self.devices) & set(other.devices)))

    # -- conversion to and from jax.sharding.Mesh ---------------------------

    @classmethod
    def from_jax(
        cls,
        mesh: Any,
        *,
        host_of: Mapping[int, int] | Callable[[Any], int] | None = None,
        ids: Mapping[DeviceKey, int] | None = None,
    ) -> DeviceMesh:
        """From a ``jax.sharding.Mesh``; hosts are ``process_index`` unless overridden.

        Args:
          host_of: a mapping from device id to host, or a callable taking the device.
          ids: the planner's integer per device (``planner_ids`` over every mesh of one
            plan, so devices of two platforms stay apart); defaults to the devices' ids.
        """
        devs = np.asarray(mesh.devices)
        if host_of is None:
            host = lambda d: d.process_index  # noqa: E731
        elif callable(host_of):
            host = host_of
        else:
            host = lambda d: host_of[d.id]  # noqa: E731
        number = (lambda d: d.id) if ids is None else (lambda d: ids[device_key(d)])  # noqa: E731
        numbers = np.vectorize(number, otypes=[np.int64])(devs)
        hosts = np.vectorize(lambda d: int(host(d)), otypes=[np.int64])(devs)
        return cls(numbers, hosts, tuple(mesh.axis_names))

    def to_jax(self, devices: Sequence[Any] | None = None) -> Any:
        """A ``jax.sharding.Mesh`` over the real devices with these ids.

        Args:
          devices: where to look the ids up; defaults to ``jax.devices()``.
        """
        import jax

        pool = {d.id: d for d in (jax.devices() if devices is None else devices)}
        missing = [d for d in self.devices if d not in pool]
        if missing:
            raise ValueError(f"devices: no real device with ids {missing}")
        arr = np.empty(self.shape, dtype=object)
        for idx, d in np.ndenumerate(self.device_ids):
            arr[idx] = pool[int(d)]
        return jax.sharding.Mesh(arr, self.axis_names)
