"""The collectives of a compiled XLA program, read from its HLO text, and what they move.

The planner prices tensor parallelism by the bytes a stage all-reduces per example. Megatron's
rule (``LayerProfile.tp_bytes``: two all-reduces of each sharded layer's output per forward)
is a guess about what XLA's partitioner emits; the compiled program says what it does emit,
all-gathers and reduce-scatters included. Every collective is expressed as the bytes of an
all-reduce with the same ring traffic per device (a ring all-reduce of ``X`` bytes over ``t``
devices sends ``2 (t - 1) / t · X`` per device):

    all-reduce, result R                     R
    all-gather, result R (gathered)          R / 2          (sends (t - 1) / t · R)
    reduce-scatter, result R (a 1/t shard)   t · R / 2      (sends (t - 1) / t · t·R)
    all-to-all, result R                     R / 2          (sends (t - 1) / t · R)
    collective-permute, result R             R              (sends R: a 2-device all-reduce's traffic)

Asynchronous pairs count once, at their ``-done`` (whose result is the collective's);
a collective wrapped in an ``async-start`` computation counts as its inner instruction.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import re

import numpy as np

from .layer_profile import ModelProfile

__all__ = ["CollectiveKind", "Collective", "collectives", "collective_groups", "all_reduce_equivalent_bytes",
           "sized_by_program"]


class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, the bytes of its result on one device, and the
    devices in each of its groups (``None`` when the instruction names none: every device)."""

    kind: CollectiveKind
    result_bytes: int
    group_size: int | None

    def all_reduce_equivalent(self, num_devices: int) -> float:
        """Bytes of the all-reduce that sends as much per device (the module's table)."""
        t = self.group_size or num_devices
        if self.kind is CollectiveKind.ALL_REDUCE or self.kind is CollectiveKind.COLLECTIVE_PERMUTE:
            return float(self.result_bytes)
        if self.kind is CollectiveKind.REDUCE_SCATTER:
            return t * self.result_bytes / 2.0
        return self.result_bytes / 2.0


_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}
_KINDS = "|".join(re.escape(k.value) for k in CollectiveKind)
# "%name = <shape> <op>(" where op is a collective, its -done, or (skipped) its -start
_INSTRUCTION = re.compile(rf"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(?P<shape>\(.*?\)|[^\s(]+)\s+(?P<op>{_KINDS})(?P<phase>-start|-done)?\(")
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]")
_EXPLICIT_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_ALL_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_LIST = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _shape_bytes(shape: str) -> int:
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"hlo_text: unknown element type {dtype!r} in the shape {shape!r}")
        total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return int(math.ceil(total))


def _group_size(line: str) -> int | None:
    if m := _EXPLICIT_GROUPS.search(line):
        return len([x for x in m.group(1).split(",") if x])
    if m := _IOTA_GROUPS.search(line):
        return int(m.group(2))
    if m := _MESH_GROUPS.search(line):
        sizes = {name: int(size) for name, size in _MESH_AXIS.findall(m.group(1))}
        names = re.findall(r"'([^']+)'", m.group(2))
        unknown = [n for n in names if n not in sizes]
        if unknown:
            raise ValueError(f"hlo_text: replica groups name axes {unknown} the mesh {sizes} lacks: {line.strip()!r}")
        return math.prod(sizes[n] for n in names)
    return None


def _groups(line: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """The device ids (the program's logical ids) of each replica group ``line`` names."""
    if m := _ALL_GROUPS.search(line):
        groups = tuple(tuple(int(x) for x in g.split(",") if x) for g in re.findall(r"\{([\d,]*)\}", m.group(1)))
        return groups if groups else (tuple(range(num_devices)),)
    if m := _IOTA_LIST.search(line):
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return tuple(map(tuple, ids.reshape(int(m.group(1)), int(m.group(2))).tolist()))
    if m := _MESH_GROUPS.search(line):
        axes = _MESH_AXIS.findall(m.group(1))
        names = [n for n, _ in axes]
        chosen = [names.index(n) for n in re.findall(r"'([^']+)'", m.group(2))]
        ids = np.arange(math.prod(int(size) for _, size in axes)).reshape([int(size) for _, size in axes])
        # A group varies the chosen axes and fixes the others.
        kept = [a for a in range(len(axes)) if a not in chosen]
        size = math.prod(ids.shape[a] for a in chosen)
        return tuple(map(tuple, ids.transpose(kept + chosen).reshape(-1, size).tolist()))
    return (tuple(range(num_devices)),)


def collective_groups(hlo_text: str, num_devices: int) -> tuple[tuple[Collective, tuple[tuple[int, ...], ...]], ...]:
    """Every collective of ``hlo_text`` (as ``collectives`` reads them) with the logical device ids
    (``0 .. num_devices - 1``, the program's device assignment order) of each of its groups,
    whichever syntax spells them: ``{{0,2},{1,3}}``, iota ``[2,2]<=[2,2]T(1,0)``, or
    ``mesh['axis_0'=2,'axis_1'=2] {'axis_0'}``; one group of every device when none is named.

    Raises:
      ValueError: ``num_devices`` not a positive integer, or as ``collectives``.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices: expected a positive integer, got {num_devices!r}")
    found = collectives(hlo_text)
    lines = [line for line in hlo_text.splitlines()
             if (m := _INSTRUCTION.match(line)) is not None and m.group("phase") != "-start"]
    return tuple((c, _groups(line, num_devices)) for c, line in zip(found, lines))


def collectives(hlo_text: str) -> tuple[Collective, ...]:
    """Every collective of ``hlo_text`` (``jax.stages.Compiled.as_text()``), in program order.

    Raises:
      ValueError: a collective's shape holds an element type this module does not know.
    """
    if not isinstance(hlo_text, str):
        raise TypeError(f"hlo_text: expected the HLO module as text, got {type(hlo_text).__name__}")
    found = []
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None or m.group("phase") == "-start":
            continue
        found.append(Collective(CollectiveKind(m.group("op")), _shape_bytes(m.group("shape")), _group_size(line)))
    return tuple(found)


def all_reduce_equivalent_bytes(hlo_text: str, num_devices: int) -> float:
    """The bytes of all-reduce that send per device what all of ``hlo_text``'s collectives
    send, a program on ``num_devices`` devices (the group of a collective naming none)."""
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices: expected a positive integer, got {num_devices!r}")
    return sum(c.all_reduce_equivalent(num_devices) for c in collectives(hlo_text))


def sized_by_program(profile: ModelProfile, hlo_text: str, num_devices: int) -> tuple[ModelProfile, float]:
    """``profile`` with its tensor-parallel bytes as ``hlo_text`` moves them: the step compiled
    as one program on a ``(1, num_devices)`` mesh, every parameter split over ``model`` as its
    flax partitioning names (every collective of that program is tensor-parallel). Per example,
    forward and backward together move ``2 · Σ tp_bytes`` by Megatron's rule; every layer's
    ``tp_bytes`` is scaled by the program's all-reduce-equivalent bytes per example over that
    (the rule places the bytes among layers, the program sizes them).

    Returns:
      The profile and the scale.

    Raises:
      ValueError: no layer of ``profile`` has ``tp_bytes`` (the rule gives nothing to scale), or
        as ``all_reduce_equivalent_bytes``.
    """
    rule = 2.0 * sum(layer.tp_bytes for layer in profile.layers)
    if rule == 0.0:
        raise ValueError("profile: no layer has tp_bytes (no parameter is split over the model axis): nothing to size")
    scale = all_reduce_equivalent_bytes(hlo_text, num_devices) / profile.batch_size / rule
    layers = tuple(dataclasses.replace(layer, tp_bytes=layer.tp_bytes * scale) for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers), scale
