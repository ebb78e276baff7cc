"""A stacked leaf (a scan-stacked parameter) cut into the pieces the stages take, and back."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import jax_ir
from .moves import ValueMove

__all__ = ["Bounds", "GatheredArray", "LeafPieces", "STACK_AXIS", "StackedArray"]


Bounds = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class LeafPieces:
    """Which leaves of a step live as per-stage slices: per input leaf of the user's step, and
    per output leaf, the bounds ``(0, k_1, ..., L)`` it is split at along axis 0, or ``None``;
    per output leaf in pieces, the input leaf it replaces. The rewritten step takes and returns
    the leaves in order, each split one as its pieces in its place."""

    inputs: tuple[Bounds | None, ...]
    outputs: tuple[Bounds | None, ...]
    replaces: tuple[int | None, ...]

    @staticmethod
    def _expand(bounds: Sequence[Bounds | None]) -> list[tuple[int, int | None]]:
        return [(i, p) for i, b in enumerate(bounds) for p in ([None] if b is None else range(len(b) - 1))]

    def piece_inputs(self) -> list[tuple[int, int | None]]:
        """Per input of the rewritten step: the user's input leaf and its piece (``None``: whole)."""
        return self._expand(self.inputs)

    def piece_outputs(self) -> list[tuple[int, int | None]]:
        """Per output of the rewritten step: the user's output leaf and its piece (``None``: whole)."""
        return self._expand(self.outputs)

    def piece_leaves(self, leaves: Sequence[Any], avals: Sequence[jax_ir.ShapedArray], specs: Sequence[Any],
                     batch_leaves: frozenset[int], counterparts: Sequence[int | None]
                     ) -> tuple[list[Any], list[Any], frozenset[int], list[int | None]]:
        """The compiler's per-leaf arguments for the rewritten step, from the original step's
        (its input leaves and their ``avals``): its input leaves (a piece as a
        ``ShapeDtypeStruct``), their partition specs (a piece's its stack's), its batch leaves
        and, per output, the input it replaces (a piece the same piece)."""
        ins = self.piece_inputs()
        at = {key: n for n, key in enumerate(ins)}
        piece_leaves = []
        for i, p in ins:
            if p is None:
                piece_leaves.append(leaves[i])
            else:
                a, b = self.inputs[i][p], self.inputs[i][p + 1]
                shape = np.shape(leaves[i])
                piece_leaves.append(jax.ShapeDtypeStruct((b - a, *shape[1:]), avals[i].dtype))
        piece_counterparts: list[int | None] = []
        for j, p in self.piece_outputs():
            i = counterparts[j] if j < len(counterparts) else None
            piece_counterparts.append(None if i is None else at.get((i, p)))
        return (piece_leaves, [specs[i] for i, _ in ins], frozenset(n for n, (i, p) in enumerate(ins) if i in batch_leaves),
                piece_counterparts)


# The leading mesh axis of a stacked array held as its pieces: one index per piece's mesh.
STACK_AXIS = "stacked_pieces"


@dataclasses.dataclass(frozen=True)
class StackedArray:
    """A split leaf held as one array: ``sharding`` over a mesh of its pieces' meshes stacked
    along ``STACK_AXIS`` (which shards axis 0), each piece with ``pieces[p]`` on its own."""

    sharding: NamedSharding
    pieces: tuple[NamedSharding, ...]


@dataclasses.dataclass(frozen=True)
class GatheredArray:
    """A split leaf the user sees as one array on its first piece's mesh (``sharding``): split,
    each piece is cut there (laid out as ``at_home[p]``) and moved by ``into[p]`` to where its
    stage reads it (``pieces[p]``); joined, each moves back by ``out_of[p]`` and the pieces are
    concatenated. A piece on that mesh already moves by ``None``. What no ``StackedArray`` can
    hold (uneven pieces, meshes of several shapes, several pieces on one mesh) costs these
    copies every step."""

    sharding: NamedSharding
    pieces: tuple[NamedSharding, ...]
    at_home: tuple[NamedSharding, ...]
    into: tuple[ValueMove | None, ...]
    out_of: tuple[ValueMove | None, ...]

    def moves(self) -> list[ValueMove]:
        return [mv for mv in (*self.into, *self.out_of) if mv is not None]
