"""Pass: choose how each value crossing two stages moves.

Decided once, when the pipeline compiles, from the two stages' meshes and
which processes own their devices:

- ``LOCAL``: both stages run on one mesh (virtual stages): not a move; the
  value stays on its devices, relaid out there if the shardings differ;
- ``DEVICE_PUT``: one process addresses every device of both meshes, so
  ``jax.device_put`` moves (and relays out) the value inside that process;
- ``P2P``: otherwise, the resharding plan run as asynchronous point-to-point
  moves (``meshpar.runtime.p2p_executor``), which overlap with compute;
- ``COLLECTIVE``: on request, the plan run as one ``ppermute`` program over
  both meshes (the baseline; it cannot overlap with compute). A 0-d value
  has no plan and always goes ``P2P`` unless one process owns everything.
- ``SIGNAL``: with ``executor="signal"`` (``PipeshardParallel`` also takes it
  as ``resharding="signal"``), one byte crosses instead of the value, with the
  same dependencies (the receiver's value exists only after the sender's did),
  and the receiver gets zeros of the value's shape: the communication upper
  bound of a schedule, for benchmarks only.

The user's ``executor`` is an ``Executor``, resolved once at the API
(``Executor.of``); ``Executor.kind`` makes the choice.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding

from ...compiler_pass import compiler_pass
from ...policies import Policy
from .mesh_assignment import batch_sharding
from ..cutting.stage_graph import is_differentiable

__all__ = ["EXECUTORS", "Direction", "EdgeTransfer", "Executor", "MoveKey", "TransferKind", "choose_transfer",
           "plan_edge_transfers", "verify_edge_transfers"]


class TransferKind(enum.Enum):
    LOCAL = "local"
    DEVICE_PUT = "device_put"
    P2P = "p2p"
    COLLECTIVE = "collective"
    SIGNAL = "signal"


class Executor(Policy):
    """How the user asked values to cross meshes (``PipeshardParallel(executor=...)``)."""

    AUTO = "auto"  # jax.device_put inside one process, p2p across
    P2P = "p2p"  # forced, for comparisons and tests
    COLLECTIVE = "collective"  # forced: one ppermute program over both meshes (a 0-d value goes p2p)
    SIGNAL = "signal"  # one byte instead of the value: a schedule's communication upper bound

    def kind(self, one_process: bool, ndim: int) -> TransferKind:
        """How a value of rank ``ndim`` moves between two meshes, whose devices all live in one
        process when ``one_process``."""
        return _KINDS[self](one_process, ndim)


_KINDS: dict[Executor, Callable[[bool, int], TransferKind]] = {
    Executor.AUTO: lambda one_process, ndim: TransferKind.DEVICE_PUT if one_process else TransferKind.P2P,
    Executor.P2P: lambda one_process, ndim: TransferKind.P2P,
    Executor.COLLECTIVE: lambda one_process, ndim: TransferKind.COLLECTIVE if ndim > 0 else TransferKind.P2P,
    Executor.SIGNAL: lambda one_process, ndim: TransferKind.SIGNAL,
}

# What the user may pass as ``executor``.
EXECUTORS = Executor.names()


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


def choose_transfer(executor: Executor, processes: Iterable[int], ndim: int, same_mesh: bool = False) -> TransferKind:
    """How a value of rank ``ndim`` moves between meshes whose devices live in ``processes``.

    Args:
      executor: the user's choice (``Executor.kind``).
      processes: process index of every device of both meshes.
      ndim: the value's rank.
      same_mesh: both ends are one mesh: ``LOCAL``, whatever the rest says.

    Raises:
      TypeError: ``executor`` is not an ``Executor`` (a name is resolved at the API, ``Executor.of``).
    """
    if not isinstance(executor, Executor):
        raise TypeError(f"executor: expected an Executor (resolve a name with Executor.of), got {executor!r}")
    if same_mesh:
        return TransferKind.LOCAL
    return executor.kind(len(set(processes)) == 1, ndim)


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


@compiler_pass
def plan_edge_transfers(
    edges: Sequence[tuple[int, int, int]],
    avals: Sequence[Any],
    meshes: Sequence[Mesh],
    micro_batch_size: int,
    executor: Executor,
    data_axis: str,
    forward_only: bool = False,
) -> tuple[EdgeTransfer, ...]:
    """Both moves of every edge ``(producer, consumer, producer slot)`` whose value travels as
    ``avals[e]`` (``wire_format``); only the activation's for values without a cotangent, and
    for every value of a ``forward_only`` step (no backward runs).

    A boundary value is sharded over its mesh's ``data_axis`` along the batch
    dimension (``mesh_assignment.batch_sharding``), the same way in both
    directions, so the cotangent moves exactly as its activation did, reversed.
    """
    out = []
    for e, ((p, c, slot), aval) in enumerate(zip(edges, avals)):
        shape = tuple(aval.shape)
        for direction, (a, b) in ((Direction.ACTIVATION, (p, c)), (Direction.COTANGENT, (c, p))):
            if direction is Direction.COTANGENT and (forward_only or not is_differentiable(aval)):
                # An integer, bool or key value's cotangent is float0; a forward-only step has none.
                continue
            src = batch_sharding(meshes[a], shape, micro_batch_size, data_axis)
            dst = batch_sharding(meshes[b], shape, micro_batch_size, data_axis)
            processes = [d.process_index for s in (src, dst) for d in s.mesh.devices.flat]
            kind = choose_transfer(executor, processes, len(shape), same_mesh=meshes[a] == meshes[b])
            out.append(EdgeTransfer(e, direction, a, b, slot, shape, np.dtype(aval.dtype), src, dst, kind))
    return tuple(out)


def verify_edge_transfers(transfers: Sequence[EdgeTransfer], edges: Sequence[tuple[int, int, int]],
                          meshes: Sequence[Mesh]) -> None:
    """Each edge's activation moves producer -> consumer once, its cotangent (if any) back once,
    each from its stage's mesh to the other's; ``LOCAL`` exactly between stages on one mesh.
    ``meshes`` per stage.

    Raises:
      PlanVerificationError: naming the transfer.
    """
    from ...verification import PlanVerificationError

    seen: set[tuple[int, Direction]] = set()
    for t in transfers:
        p, c, slot = edges[t.edge]
        want = (p, c) if t.direction is Direction.ACTIVATION else (c, p)
        if (t.src_stage, t.dst_stage) != want or t.slot != slot or (t.edge, t.direction) in seen:
            raise PlanVerificationError(f"{t} does not carry edge {t.edge} ({p} -> {c}, slot {slot}) once")
        seen.add((t.edge, t.direction))
        if t.src.mesh != meshes[t.src_stage] or t.dst.mesh != meshes[t.dst_stage]:
            raise PlanVerificationError(f"{t} is laid out on other meshes than its stages'")
        if (t.kind is TransferKind.LOCAL) != (meshes[t.src_stage] == meshes[t.dst_stage]):
            raise PlanVerificationError(f"{t}: local exactly when both stages share a mesh")
    if {e for e, d in seen if d is Direction.ACTIVATION} != set(range(len(edges))):
        raise PlanVerificationError("an edge's activation has no transfer")
