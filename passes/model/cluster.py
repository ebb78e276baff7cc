"""The cluster model: which devices sit on which host, and how fast hosts talk.

The cost model follows the paper's §3 assumptions: each host's network
interface is the bottleneck (full duplex: sending and receiving each get the
full rate), hosts are fully connected, and devices inside a host talk over a
fast interconnect (NVLink on GPUs, shared memory on CPUs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .mesh import DeviceMesh

__all__ = ["Cluster"]


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Hosts, their devices and the network between them.

    Attributes:
      host_devices: ``host_devices[h]`` are the integer ids of the devices on
        host ``h``. Every id appears once.
      inter_host_bandwidth: bytes/s one host's NIC sends (and, separately,
        receives); the bottleneck of cross-host traffic.
      intra_host_bandwidth: bytes/s between two devices on one host;
        ``math.inf`` models intra-host copies as free.
      latency: seconds of fixed cost per message (per chunk of a ring).
    """

    host_devices: tuple[tuple[int, ...], ...]
    inter_host_bandwidth: float
    intra_host_bandwidth: float
    latency: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "host_devices", tuple(tuple(int(d) for d in h) for h in self.host_devices)
        )
        if not self.host_devices or any(len(h) == 0 for h in self.host_devices):
            raise ValueError(
                f"host_devices: expected at least one host, each with at least one device; "
                f"got {self.host_devices!r}"
            )
        flat = [d for h in self.host_devices for d in h]
        if len(set(flat)) != len(flat):
            raise ValueError(f"host_devices: a device id appears on more than one host: {self.host_devices!r}")
        for name in ("inter_host_bandwidth", "intra_host_bandwidth"):
            value = getattr(self, name)
            if not (value > 0):  # also rejects NaN
                raise ValueError(f"{name}: expected a positive number of bytes/s, got {value!r}")
        if not (self.latency >= 0) or math.isinf(self.latency):
            raise ValueError(f"latency: expected a finite number of seconds >= 0, got {self.latency!r}")
        object.__setattr__(
            self, "_host_of", {d: h for h, devs in enumerate(self.host_devices) for d in devs}
        )

    # -- constructors ------------------------------------------------------

    @classmethod
    def uniform(
        cls,
        num_hosts: int,
        devices_per_host: int,
        *,
        inter_host_bandwidth: float,
        intra_host_bandwidth: float,
        latency: float = 0.0,
    ) -> Cluster:
        """``num_hosts`` hosts of ``devices_per_host`` devices, ids host-major."""
        if num_hosts < 1:
            raise ValueError(f"num_hosts: expected >= 1, got {num_hosts}")
        if devices_per_host < 1:
            raise ValueError(f"devices_per_host: expected >= 1, got {devices_per_host}")
        hosts = tuple(
            tuple(range(h * devices_per_host, (h + 1) * devices_per_host)) for h in range(num_hosts)
        )
        return cls(hosts, inter_host_bandwidth, intra_host_bandwidth, latency)

    @classmethod
    def aws_p3_8xlarge(cls, num_hosts: int) -> Cluster:
        """The paper's testbed (§5): 4 V100 per host over NVLink, 10 Gbit/s between hosts."""
        return cls.uniform(
            num_hosts,
            4,
            inter_host_bandwidth=1.25e9,
            intra_host_bandwidth=130e9,  # NVLink 2 between V100 pairs, ~130 GB/s usable
            latency=30e-6,
        )

    @classmethod
    def dgx_h100(cls, num_hosts: int) -> Cluster:
        """A modern 8-GPU host: H100 over NVLink 4, 8x400 Gbit/s InfiniBand per host."""
        return cls.uniform(
            num_hosts,
            8,
            inter_host_bandwidth=400e9,
            intra_host_bandwidth=450e9,
            latency=5e-6,
        )

    @classmethod
    def from_devices(
        cls,
        devices: Sequence[Any],
        *,
        host_of: Mapping[int, int] | Callable[[Any], int] | None = None,
        inter_host_bandwidth: float = 1.25e9,
        intra_host_bandwidth: float = 100e9,
        latency: float = 30e-6,
    ) -> Cluster:
        """Groups real JAX devices into hosts.

        Args:
          devices: ``jax.Device`` objects (anything with ``.id`` and
            ``.process_index``).
          host_of: overrides the grouping, e.g. to emulate several hosts inside
            one process: a mapping from device id to host index or a callable
            taking the device. Defaults to ``device.process_index``.
        """
        if not devices:
            raise ValueError("devices: expected at least one device")
        if host_of is None:
            key = lambda d: int(d.process_index)  # noqa: E731
        elif callable(host_of):
            key = lambda d: int(host_of(d))  # noqa: E731
        else:
            missing = [d.id for d in devices if d.id not in host_of]
            if missing:
                raise ValueError(f"host_of: no host given for device ids {missing}")
            key = lambda d: int(host_of[d.id])  # noqa: E731
        groups: dict[int, list[int]] = {}
        for d in devices:
            groups.setdefault(key(d), []).append(int(d.id))
        hosts = tuple(tuple(sorted(groups[h])) for h in sorted(groups))
        return cls(hosts, inter_host_bandwidth, intra_host_bandwidth, latency)

    # -- queries -----------------------------------------------------------

    @property
    def num_hosts(self) -> int:
        return len(self.host_devices)

    @property
    def devices_per_host(self) -> int:
        """Devices on the largest host."""
        return max(len(h) for h in self.host_devices)

    @property
    def num_devices(self) -> int:
        return sum(len(h) for h in self.host_devices)

    def host_of(self, device_id: int) -> int:
        try:
            return self._host_of[int(device_id)]  # type: ignore[attr-defined]
        except KeyError:
            raise ValueError(f"device_id: {device_id} is not a device of this cluster") from None

    def mesh(
        self,
        hosts: Sequence[int],
        devices_per_host: int,
        *,
        axis_names: tuple[str, ...] = ("x", "y"),
        first_device: int = 0,
    ) -> DeviceMesh:
        """A ``(len(hosts), devices_per_host)`` mesh: row ``i`` is host ``hosts[i]``.

        Takes devices ``first_device .. first_device + devices_per_host - 1``
        of each host, so two meshes can share a host without sharing devices.
        """
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts: expected distinct host indices, got {list(hosts)}")
        ids = []
        for h in hosts:
            if not 0 <= h < self.num_hosts:
                raise ValueError(f"hosts: host {h} is not in this {self.num_hosts}-host cluster")
            devs = self.host_devices[h]
            if first_device < 0 or first_device + devices_per_host > len(devs):
                raise ValueError(
                    f"devices_per_host: host {h} has {len(devs)} devices, cannot take "
                    f"{devices_per_host} starting at {first_device}"
                )
            ids.append(devs[first_device : first_device + devices_per_host])
        device_ids = np.asarray(ids, dtype=np.int64)
        host_ids = np.repeat(np.asarray(hosts, dtype=np.int64)[:, None], devices_per_host, axis=1)
        return DeviceMesh(device_ids, host_ids, axis_names)
