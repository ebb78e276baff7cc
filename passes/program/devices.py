"""Device identity: a device is its platform and its id.

JAX numbers devices per platform, so a GPU's ``cuda:0`` and the host's ``cpu:0`` both have id
0. Every set or map of devices meshpar builds is keyed by ``device_key``, and the integer ids
the resharding planner reasons about (``DeviceMesh``) come from ``planner_ids``, which keeps
devices of two platforms apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

__all__ = ["DeviceKey", "DeviceLike", "device_key", "device_name", "distinct_devices", "planner_ids"]

DeviceKey = tuple[str, int]


class DeviceLike(Protocol):
    """What meshpar reads of a device: ``jax.Device`` has it."""

    platform: str
    id: int
    process_index: int


def device_key(device: DeviceLike) -> DeviceKey:
    """``(platform, id)``: equal for one device, different for devices of two platforms."""
    return (str(device.platform), int(device.id))


def device_name(device: DeviceLike) -> str:
    """``platform:id``, as messages name a device (``cpu:3``, ``cuda:0``)."""
    return f"{device.platform}:{device.id}"


def distinct_devices(devices: Iterable[Any]) -> list[Any]:
    """``devices`` in order, each once."""
    return list({device_key(d): d for d in devices}.values())


def planner_ids(*device_groups: Iterable[Any]) -> Mapping[DeviceKey, int]:
    """An integer per device of ``device_groups`` (e.g. two meshes' ``devices.flat``), distinct
    for distinct devices: the device's own id, except that when devices of several platforms
    share an id, the devices of every platform but the first seen are numbered after the
    highest id, in order of (platform, id)."""
    devices = distinct_devices(d for group in device_groups for d in group)
    ids: dict[DeviceKey, int] = {}
    first_platform = devices[0].platform if devices else ""
    taken = {int(d.id) for d in devices if d.platform == first_platform}
    clash = any(d.platform != first_platform and int(d.id) in taken for d in devices)
    if not clash:
        return {device_key(d): int(d.id) for d in devices}
    next_id = max(int(d.id) for d in devices) + 1
    for d in devices:
        if d.platform == first_platform:
            ids[device_key(d)] = int(d.id)
    for d in sorted((d for d in devices if d.platform != first_platform), key=device_key):
        ids[device_key(d)] = next_id
        next_id += 1
    return ids
