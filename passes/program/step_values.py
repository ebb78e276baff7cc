"""Names of values in a step: ``OuterRef`` (a value of the traced step), ``RefKind`` (what feeds a
stage input) and ``AuxReduction`` (how a value's micro-batches combine)."""

from __future__ import annotations

import enum
from typing import NamedTuple

__all__ = ["AuxReduction", "OuterKind", "OuterRef", "RefKind"]


class OuterKind(enum.Enum):
    """What an ``OuterRef`` names (see there)."""

    IN = "in"
    CONST = "const"
    LITERAL = "literal"
    LOSS = "loss"
    AUX = "aux"
    GRAD = "grad"
    VALUE = "value"
    PACKED = "packed"

    # Members are singletons: hashing by identity is exact and costs the runtime no Python call
    # (a step looks values up by ``OuterRef`` hundreds of times).
    __hash__ = object.__hash__

    def __lt__(self, other: OuterKind) -> bool:
        return self.value < other.value


class OuterRef(NamedTuple):
    """A value of the traced step: ``IN`` (step input leaf), ``CONST``, ``LITERAL`` (an
    output that is a literal), ``LOSS``, ``AUX`` or ``GRAD`` (outputs of the gradient
    equation, ``index``-th leaf), ``VALUE`` (the ``index``-th other computed value), or
    ``PACKED`` (the ``index``-th vector of several values packed to cross meshes as one move,
    made and read inside the programs around it: ``lowering.packed_moves``).

    A named tuple, not a dataclass: immutable and ordered alike, and hashed in C (a step looks
    values up by ``(OuterRef, mesh)`` hundreds of times; a dataclass's hash is a Python call)."""

    kind: OuterKind
    index: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}{self.index}"


class RefKind(enum.Enum):
    """What a ``Ref`` names: a differentiated leaf, another operand, or a stage's output."""

    PARAM = "param"
    INPUT = "input"
    ACT = "act"

    def __lt__(self, other: RefKind) -> bool:
        return self.value < other.value


class AuxReduction(enum.Enum):
    """How an aux leaf's per-micro-batch values combine into the step's value."""

    MEAN = "mean"
    SUM = "sum"
    LAST = "last"  # the last micro-batch's value
    CONCAT = "concat"  # concatenated along dimension 0, in micro-batch order
