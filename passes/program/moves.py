"""Moves of values between meshes, as the runtime runs them: what moves (``MoveKey``, ``EdgeTransfer``,
``ValueMove``), how (``TransferKind``, ``TransferOrder``), and the lowered move (``PlannedMove``,
``MoveTable``)."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from typing import Any, Union

import numpy as np
from jax.sharding import NamedSharding

from ..policies import Policy
from ..verification import PlanVerificationError
from .devices import DeviceKey, planner_ids
from .resharding_programs import Gate, HopProgram, TransferProgram

__all__ = ["Direction", "EdgeTransfer", "move_device_ids", "MoveKey", "MoveTable", "PlannedMove", "TransferKind",
           "TransferOrder", "ValueMove"]


class TransferKind(enum.Enum):
    LOCAL = "local"
    DEVICE_PUT = "device_put"
    P2P = "p2p"
    COLLECTIVE = "collective"
    SIGNAL = "signal"


@dataclasses.dataclass(frozen=True)
class MoveKey:
    """One kind of move: a ``shape``/``dtype`` value from sharding ``src`` to ``dst``, by ``kind``."""

    kind: TransferKind
    shape: tuple[int, ...]
    dtype: np.dtype
    src: NamedSharding
    dst: NamedSharding

    @staticmethod
    def of(kind: TransferKind, shape: Iterable[int], dtype: Any, src: NamedSharding, dst: NamedSharding) -> MoveKey:
        return MoveKey(kind, tuple(int(n) for n in shape), np.dtype(dtype), src, dst)


class Direction(enum.Enum):
    ACTIVATION = "activation"  # producer stage -> consumer stage, in the forward
    COTANGENT = "cotangent"  # consumer stage -> producer stage, in the backward


@dataclasses.dataclass(frozen=True)
class EdgeTransfer:
    """One way a boundary value crosses: the move every micro-batch of it makes.

    Attributes:
      edge: the stage-graph edge.
      direction: activation (forward) or its cotangent (backward).
      src_stage, dst_stage: the stages it leaves and reaches (on the meshes the schedule
        places them on).
      slot: the producer's output slot the edge carries.
      shape, dtype: the value (a micro-batch's).
      src, dst: its sharding on each mesh.
      kind: how it moves.
    """

    edge: int
    direction: Direction
    src_stage: int
    dst_stage: int
    slot: int
    shape: tuple[int, ...]
    dtype: np.dtype
    src: NamedSharding
    dst: NamedSharding
    kind: TransferKind

    @property
    def move_key(self) -> MoveKey:
        """The move this transfer makes for every micro-batch (``plan_moves`` plans it)."""
        return MoveKey.of(self.kind, self.shape, self.dtype, self.src, self.dst)

    def __str__(self) -> str:
        return (f"{self.direction.value} of edge {self.edge} (stage {self.src_stage} -> {self.dst_stage}, "
                f"{self.dtype.name}{list(self.shape)}, {self.kind.value})")


@dataclasses.dataclass(frozen=True)
class ValueMove:
    """One value moving between meshes after the program: ``what`` names it in errors."""

    what: str
    shape: tuple[int, ...]
    dtype: np.dtype
    src: NamedSharding
    dst: NamedSharding
    kind: TransferKind

    @property
    def move_key(self) -> MoveKey:
        """The move this is (``plan_moves`` plans it)."""
        return MoveKey.of(self.kind, self.shape, self.dtype, self.src, self.dst)


class TransferOrder(Policy):
    """How a p2p move dispatches its hops (``meshpar.runtime.p2p_executor``'s module doc)."""

    GATED = "gated"  # every hop at once, each round's cross-host hops gated on the devices
    EAGER = "eager"  # every hop at once, no gates
    ROUNDS = "rounds"  # waits on the host for each round's arrivals

    @property
    def gated(self) -> bool:
        """Whether the move's rounds are kept apart by round gates (``round_gates``)."""
        return self is TransferOrder.GATED

    @property
    def waits_for_rounds(self) -> bool:
        """Whether the host waits for a round's arrivals before the next round leaves."""
        return self is TransferOrder.ROUNDS


@dataclasses.dataclass(frozen=True)
class PlannedMove:
    """A move ready to run.

    Attributes:
      key: what moves, and by which executor.
      description: one line on how it moves, for ``describe()`` (``summary``); the compiler
        writes it when it lowers the move, naming the resharding plan where there is one.
      program: what the runtime runs: a ``HopProgram`` (``P2P``) or a ``TransferProgram``
        (``COLLECTIVE``); ``None`` for moves with nothing to lower.
      gates: ``P2P`` with a ``gated`` order: the round gates of ``program``.
      order: ``P2P``: how its hops are dispatched.
      carry: ``SIGNAL``: the 0-d move that carries its byte.
    """

    key: MoveKey
    description: str
    program: Union[HopProgram, TransferProgram, None] = None
    gates: tuple[Gate, ...] = ()
    order: TransferOrder = TransferOrder.GATED
    carry: PlannedMove | None = None

    @property
    def fingerprint(self) -> str | None:
        """Identifies the data movement on every process (``None``: nothing lowered)."""
        if self.carry is not None:
            return self.carry.fingerprint
        return None if self.program is None else self.program.fingerprint

    def summary(self) -> str:
        """One line for ``describe()``: ``description``."""
        return self.description


def move_device_ids(src: NamedSharding, dst: NamedSharding) -> Mapping[DeviceKey, int]:
    """The planner's integer per device of a move's two meshes (``planner_ids``): what the
    plan and its hop program name devices by, and the runtime maps back."""
    return planner_ids(src.mesh.devices.flat, dst.mesh.devices.flat)


@dataclasses.dataclass(frozen=True)
class MoveTable:
    """Every move of a compiled step, by key (``MoveKey.of``)."""

    moves: tuple[PlannedMove, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_key", {m.key: m for m in self.moves})

    def of(self, key: MoveKey) -> PlannedMove:
        try:
            return self._by_key[key]  # type: ignore[attr-defined]
        except KeyError:
            raise PlanVerificationError(f"no planned move for {key}") from None

    @property
    def fingerprints(self) -> list[str]:
        """What every process must agree on: each lowered program's fingerprint, in table order."""
        return [m.fingerprint for m in self.moves if m.fingerprint is not None]
