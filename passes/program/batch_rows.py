"""Where a global batch's micro-batch rows lie, and the moves that place or feed them."""

from __future__ import annotations

import dataclasses

from jax.sharding import NamedSharding

from .moves import MoveKey
from .shardings import PlaceLeaf

__all__ = ["GlobalBatchFeed", "GlobalBatchPlacement", "MicroBatchRows", "ROWS_AXIS"]


# The axis a view's mesh names its consecutive blocks by.
ROWS_AXIS = "meshpar_rows"


@dataclasses.dataclass(frozen=True)
class MicroBatchRows:
    """Micro-batch rows of a global batch leaf as they lie: ``sharding`` lays out the
    ``(size, ...)`` view over the devices holding them; on each of them the view's piece is
    rows ``[start, start + size)`` of its shard of the whole leaf, or (``whole``) its shard."""

    sharding: NamedSharding
    start: int
    whole: bool


@dataclasses.dataclass(frozen=True)
class GlobalBatchFeed:
    """Operand ``position`` of stage ``stage`` read per micro-batch from input leaf ``leaf``, a
    global array laid out as ``source``: per micro-batch its rows and the move to the stage."""

    stage: int
    position: int
    leaf: int
    source: NamedSharding
    rows: tuple[MicroBatchRows, ...]
    moves: tuple[MoveKey, ...]


@dataclasses.dataclass(frozen=True)
class GlobalBatchPlacement:
    """Input leaf ``leaf``, a global batch array laid out as ``source``, placed as ``placement``
    says by ``moves``: move ``k`` carries the whole leaf point to point from ``source`` to
    ``placement.targets[k]``: the union of its meshes, of which each mesh's part is a view, or
    one target per mesh, in its order."""

    leaf: int
    source: NamedSharding
    placement: PlaceLeaf
    moves: tuple[MoveKey, ...]

    @property
    def union(self) -> bool:
        """Whether the one move lands on the union of the placement's meshes."""
        return self.placement.union is not None
