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

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh

from ...compiler_pass import compiler_pass
from ...policies import Policy
from ...program.moves import Direction, EdgeTransfer, TransferKind
from ..cutting.stage_graph import is_differentiable
from .mesh_assignment import batch_sharding

__all__ = ["EXECUTORS", "Executor", "choose_transfer", "plan_edge_transfers", "verify_edge_transfers"]


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
