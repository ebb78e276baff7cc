"""Sharding specs in the paper's notation: one token per tensor dimension.

``R`` replicates a dimension; ``S`` followed by mesh-axis digits shards it,
major to minor: ``S0`` over mesh axis 0, ``S01`` over axes 0 and 1 (axis 0
major), ``S10`` over axis 1 then 0. ``"S0RR"``, ``"RS01R"`` and ``"RRS0"`` are
specs of rank-3 tensors. This is the same layout as a
``jax.sharding.PartitionSpec`` whose entries name mesh axes, which is how the
two convert.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["ShardingSpec"]

_TOKEN = re.compile(r"R|S\d+")


@dataclasses.dataclass(frozen=True)
class ShardingSpec:
    """Per tensor dimension, the mesh axes (major first) it is sharded over.

    ``dims[i] == ()`` means dimension ``i`` is replicated. Invariant: no mesh
    axis appears twice across all dimensions.
    """

    dims: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        dims = tuple(tuple(int(a) for a in d) for d in self.dims)
        object.__setattr__(self, "dims", dims)
        used = [a for d in dims for a in d]
        if any(a < 0 for a in used):
            raise ValueError(f"spec: mesh axes must be >= 0, got {dims}")
        dup = sorted({a for a in used if used.count(a) > 1})
        if dup:
            raise ValueError(
                f"spec: mesh axis {dup[0]} is used by more than one dimension in {_format(dims)!r}; "
                f"each mesh axis may shard at most one tensor dimension"
            )

    # -- text form ----------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> ShardingSpec:
        """Parses ``"S0RR"``-style text (case-insensitive, ``^`` and spaces allowed)."""
        if not isinstance(text, str):
            raise TypeError(f"spec: expected a string like 'S0RR', got {type(text).__name__}")
        compact = text.replace(" ", "").replace("^", "").upper()
        tokens = _TOKEN.findall(compact)
        if "".join(tokens) != compact or not tokens:
            raise ValueError(
                f"spec: cannot parse {text!r}; expected one token per tensor dimension, each 'R' "
                f"or 'S' followed by mesh-axis digits (e.g. 'S0RR', 'RS01R')"
            )
        return cls(tuple(() if t == "R" else tuple(int(c) for c in t[1:]) for t in tokens))

    def __str__(self) -> str:
        return _format(self.dims)

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def mesh_axes(self) -> tuple[int, ...]:
        """Mesh axes that shard some dimension, in dimension order."""
        return tuple(a for d in self.dims for a in d)

    # -- checks -------------------------------------------------------------

    def validate(self, rank: int, mesh_ndim: int, *, arg: str = "spec") -> None:
        """Raises ``ValueError`` unless this spec fits a rank-``rank`` tensor on
        a ``mesh_ndim``-d mesh."""
        if self.rank != rank:
            raise ValueError(
                f"{arg}: {str(self)!r} has {self.rank} dimensions but the tensor has rank {rank}"
            )
        bad = [a for a in self.mesh_axes if a >= mesh_ndim]
        if bad:
            raise ValueError(
                f"{arg}: {str(self)!r} shards over mesh axis {bad[0]}, but the mesh has only "
                f"{mesh_ndim} axes (0..{mesh_ndim - 1})"
            )

    def num_shards(self, mesh_shape: Sequence[int]) -> tuple[int, ...]:
        """How many pieces each tensor dimension is cut into on a mesh of this shape."""
        out = []
        for d in self.dims:
            n = 1
            for a in d:
                n *= int(mesh_shape[a])
            out.append(n)
        return tuple(out)

    # -- PartitionSpec ------------------------------------------------------

    def to_partition_spec(self, axis_names: Sequence[str]) -> Any:
        """The equivalent ``jax.sharding.PartitionSpec`` for a mesh with these axis names."""
        from jax.sharding import PartitionSpec

        self.validate(self.rank, len(axis_names))
        entries: list[Any] = []
        for d in self.dims:
            if not d:
                entries.append(None)
            elif len(d) == 1:
                entries.append(axis_names[d[0]])
            else:
                entries.append(tuple(axis_names[a] for a in d))
        return PartitionSpec(*entries)

    @classmethod
    def from_partition_spec(
        cls, partition_spec: Any, axis_names: Sequence[str], rank: int
    ) -> ShardingSpec:
        """From a ``PartitionSpec`` (possibly shorter than ``rank``) over named axes."""
        entries = tuple(partition_spec)
        if len(entries) > rank:
            raise ValueError(
                f"partition_spec: {partition_spec} has {len(entries)} entries for a rank-{rank} tensor"
            )
        index = {name: i for i, name in enumerate(axis_names)}
        dims = []
        for e in entries + (None,) * (rank - len(entries)):
            names = () if e is None else (e,) if isinstance(e, str) else tuple(e)
            unknown = [n for n in names if n not in index]
            if unknown:
                raise ValueError(
                    f"partition_spec: axis {unknown[0]!r} is not a mesh axis; mesh axes are {tuple(axis_names)}"
                )
            dims.append(tuple(index[n] for n in names))
        return cls(tuple(dims))


def _format(dims: tuple[tuple[int, ...], ...]) -> str:
    return "".join("R" if not d else "S" + "".join(str(a) for a in d) for d in dims)
