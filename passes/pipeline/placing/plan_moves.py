"""Pass: every value that crosses two meshes gets its plan, its lowered program and its executor.

A compiled step moves values in four places: the program's boundary transfers
(activations, cotangents, skip connections), the parameters a stage reads from
their owner's mesh, the gradients sent back there, and the moves around the
pipeline (the update's parameter and scalar moves). Each distinct move
``(kind, shape, dtype, src, dst)`` becomes one ``PlannedMove``, made by its
executor's entry of ``MOVE_EXECUTORS`` and verified there; ``MoveTable``
holds them all. The runtime builds one callable per entry
(``meshpar.runtime.move_handlers``), and ``describe()`` reads each move's
one-line summary, written here from its plan: neither plans anything.

Executors (``TransferKind``), one entry each:

- ``LOCAL``: both ends on one mesh (virtual stages): no plan, no program;
- ``DEVICE_PUT``: one process owns both meshes: ``jax.device_put``;
- ``P2P``: the resharding plan lowered to point-to-point hops, each plan
  round's cross-process hops gated on the previous round's arrivals
  (``round_gates``); a 0-d value is replicated without a plan;
- ``COLLECTIVE``: the plan lowered to one ``ppermute`` program over both meshes;
- ``SIGNAL``: one byte with the value's dependencies (benchmarks' upper
  bound), carried by a 0-d ``DEVICE_PUT`` or ``P2P`` move.

A new executor is one ``MoveExecutor`` here and one runtime handler.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Mapping
from typing import Any, Callable

import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ...compiler_pass import compiler_pass
from ...model.cluster import Cluster
from ...model.mesh import DeviceMesh
from ...model.sharding_spec import ShardingSpec
from ...program.devices import DeviceKey, device_key
from ...program.moves import MoveKey, MoveTable, PlannedMove, TransferKind, TransferOrder, move_device_ids
from ...program.resharding_programs import Gate, HopProgram, TransferProgram
from ...program.shardings import device_sharding
from ...resharding.balancers import Balancer, get_balancer
from ...resharding.hop_program import lower_to_hops, replicate_scalar, verify_hop_program
from ...resharding.plan_resharding import plan_resharding
from ...resharding.resharding_plan import ReshardingPlan
from ...resharding.resharding_task import ReshardingTask
from ...resharding.round_gates import round_gates, verify_round_gates
from ...resharding.strategies import Strategy, get_strategy
from ...resharding.transfer_program import lower_plan, verify_program
from ...verification import PlanVerificationError
from .edge_transfer import Executor, choose_transfer

__all__ = ["MOVE_EXECUTORS", "P2P_ORDERS", "MoveExecutor", "MoveOptions", "default_cluster", "move_plan",
           "plan_and_lower", "plan_move", "plan_moves", "resharding_task", "verify_move_table"]


# What the user may pass as ``order``.
P2P_ORDERS = TransferOrder.names()


@dataclasses.dataclass(frozen=True)
class MoveOptions:
    """How moves are planned: the resharding ``strategy`` and ``balancer``, the ``cluster`` whose
    links the plans are priced on (``None``: one host per process), broadcast ``chunks``
    (``None``: the cost model's choice) and the p2p dispatch ``order``. Resolved objects: the
    API resolves the user's names."""

    strategy: Strategy = get_strategy("broadcast")
    balancer: Balancer = get_balancer("ensemble")
    cluster: Cluster | None = None
    chunks: int | None = None
    order: TransferOrder = TransferOrder.GATED


@dataclasses.dataclass(frozen=True)
class MoveExecutor:
    """One entry of ``MOVE_EXECUTORS``.

    Attributes:
      lower: ``(key, options, plan) ->`` the verified ``PlannedMove``; ``plan()`` is
        ``move_plan(key, options)``, planned on the first call only (once for the lowering and
        for ``plan_and_lower``'s caller, and after the lowering's own checks of ``key``).
      bandwidth: ``(inter_host, intra_host) ->`` the bytes/s the cost model prices it at
        (``None``: free, nothing crosses a link).
    """

    lower: Callable[[MoveKey, MoveOptions, Callable[[], ReshardingPlan | None]], PlannedMove]
    bandwidth: Callable[[float, float], float] | None


def default_cluster(src: NamedSharding, dst: NamedSharding) -> Cluster:
    """One host per process, default link speeds, over the devices of both meshes."""
    # A cluster knows devices by id: one id per host (two platforms' devices of one id are on
    # one process, so one host).
    devices = {d.id: d for d in [*src.mesh.devices.flat, *dst.mesh.devices.flat]}
    return Cluster.from_devices(list(devices.values()))


def resharding_task(shape: tuple[int, ...], dtype: Any, src: NamedSharding, dst: NamedSharding,
                    cluster: Cluster, shared_devices: bool = False) -> ReshardingTask:
    """The planner's input for moving a ``shape``/``dtype`` value from ``src`` to ``dst``
    (meshes that may share devices with ``shared_devices``)."""

    ids = move_device_ids(src, dst)

    def mesh(s: NamedSharding) -> DeviceMesh:
        return DeviceMesh.from_jax(s.mesh, host_of=lambda d: cluster.host_of(d.id), ids=ids)

    def spec(s: NamedSharding) -> ShardingSpec:
        return ShardingSpec.from_partition_spec(s.spec, s.mesh.axis_names, len(shape))

    return ReshardingTask(tuple(shape), np.dtype(dtype).itemsize, mesh(src), spec(src), mesh(dst), spec(dst),
                          shared_devices=shared_devices)


def _plan(key: MoveKey, options: MoveOptions) -> ReshardingPlan:
    cluster = options.cluster if options.cluster is not None else default_cluster(key.src, key.dst)
    # Point-to-point moves run piece by piece, so their meshes may share devices (a piece already
    # where it goes stays); a collective program needs two disjoint meshes.
    task = resharding_task(key.shape, key.dtype, key.src, key.dst, cluster,
                           shared_devices=key.kind is TransferKind.P2P)
    return plan_resharding(task, cluster,
                           strategy=options.strategy, balancer=options.balancer, chunks=options.chunks)


def move_plan(key: MoveKey, options: MoveOptions) -> ReshardingPlan | None:
    """The resharding plan that ``plan_move(key, options)`` lowers (for ``DEVICE_PUT``, the plan
    that prices the move on the cluster); ``None`` for ``LOCAL``, ``SIGNAL`` and a 0-d value,
    which have none."""
    if key.kind in (TransferKind.LOCAL, TransferKind.SIGNAL) or key.shape == ():
        return None
    return _plan(key, options)


def _ids(sharding: NamedSharding, ids: Mapping[DeviceKey, int]) -> tuple[int, ...]:
    return tuple(ids[device_key(d)] for d in sharding.mesh.devices.flat)


def _lower_local(key: MoveKey, options: MoveOptions, plan: Callable[[], None]) -> PlannedMove:
    return PlannedMove(key, "local: both stages on one mesh, no move")


def _lower_device_put(key: MoveKey, options: MoveOptions, plan: Callable[[], ReshardingPlan | None]) -> PlannedMove:
    # Nothing to lower inside one process; the plan says what the move costs on the cluster,
    # and how it runs once the meshes are on different processes.
    across = "" if plan() is None else f"; across processes the plan is {plan().summary()}"
    return PlannedMove(key, "jax.device_put, since one process owns both meshes" + across)


def _lower_p2p(key: MoveKey, options: MoveOptions, plan: Callable[[], ReshardingPlan | None]) -> PlannedMove:
    if not isinstance(options.order, TransferOrder):
        raise TypeError(f"order: expected a TransferOrder (resolve a name with TransferOrder.of), "
                        f"got {options.order!r}")
    if key.shape == ():
        ids = move_device_ids(key.src, key.dst)
        hops = replicate_scalar(_ids(key.src, ids), _ids(key.dst, ids))
        verify_hop_program(hops)
        return PlannedMove(key, f"{key.kind.value}: a scalar, replicated to every device", hops, order=options.order)
    hops = lower_to_hops(plan())
    verify_hop_program(hops)
    gates: tuple[Gate, ...] = ()
    if options.order.gated:
        # Gates wait for arrivals on the devices of one process: hosts here are processes.
        ids = move_device_ids(key.src, key.dst)
        host_of = {ids[device_key(d)]: d.process_index for s in (key.src, key.dst) for d in s.mesh.devices.flat}
        gates = round_gates(hops, host_of)
        verify_round_gates(hops, gates, host_of)
    return PlannedMove(key, f"{key.kind.value}: {plan().summary()}", hops, gates, options.order)


def _lower_collective(key: MoveKey, options: MoveOptions, plan: Callable[[], ReshardingPlan | None]) -> PlannedMove:
    if key.shape == ():
        raise ValueError("executor: a 0-d value has nothing to reshard with executor='collective'; use executor='p2p'")
    platforms = sorted({d.platform for s in (key.src, key.dst) for d in s.mesh.devices.flat})
    if len(platforms) > 1:
        raise ValueError(f"executor: 'collective' runs one program over both meshes, which cannot span the "
                         f"platforms {platforms} of these meshes; use executor='p2p'")
    program = lower_plan(plan())
    verify_program(program)
    if program.fingerprint != plan().fingerprint:
        raise PlanVerificationError(f"{key.kind.value} move of {key.shape}: its program is not its plan's")
    return PlannedMove(key, f"{key.kind.value}: {plan().summary()}", program)


def _lower_signal(key: MoveKey, options: MoveOptions, plan: Callable[[], None]) -> PlannedMove:
    # The byte leaves from one source device (no collective over the source mesh) and moves as
    # any 0-d value to every device of the destination mesh.
    one = device_sharding(key.src.mesh.devices.flat[0])
    everywhere = NamedSharding(key.dst.mesh, PartitionSpec())
    processes = [d.process_index for s in (one, everywhere) for d in s.mesh.devices.flat]
    kind = choose_transfer(Executor.AUTO, processes, 0)
    carry = plan_move(MoveKey.of(kind, (), np.uint8, one, everywhere),
                      dataclasses.replace(options, order=TransferOrder.GATED))
    return PlannedMove(key, "signal: one byte with the same dependencies, zeros delivered (upper-bound run)",
                       carry=carry)


# Kind -> executor; a new executor is one entry here and one in the runtime's MOVE_HANDLERS.
MOVE_EXECUTORS: dict[TransferKind, MoveExecutor] = {
    TransferKind.LOCAL: MoveExecutor(_lower_local, None),
    TransferKind.DEVICE_PUT: MoveExecutor(_lower_device_put, lambda inter, intra: intra),
    TransferKind.P2P: MoveExecutor(_lower_p2p, lambda inter, intra: inter),
    TransferKind.COLLECTIVE: MoveExecutor(_lower_collective, lambda inter, intra: inter),
    TransferKind.SIGNAL: MoveExecutor(_lower_signal, lambda inter, intra: inter),
}


@compiler_pass
def plan_and_lower(key: MoveKey, options: MoveOptions) -> tuple[PlannedMove, ReshardingPlan | None]:
    """``key`` planned (``move_plan``), lowered by its executor and verified; and the plan, planned
    once for both (``meshpar.reshard`` returns it)."""
    plan = functools.cache(lambda: move_plan(key, options))
    move = MOVE_EXECUTORS[key.kind].lower(key, options, plan)
    verify_planned_move(move)
    return move, plan()


@compiler_pass
def plan_move(key: MoveKey, options: MoveOptions) -> PlannedMove:
    """``key`` planned and lowered by its executor, and verified."""
    return plan_and_lower(key, options)[0]


@compiler_pass
def plan_moves(keys: Iterable[MoveKey], options: MoveOptions) -> MoveTable:
    """One ``PlannedMove`` per distinct key of ``keys``, in first-seen order."""
    seen: dict[MoveKey, PlannedMove] = {}
    for key in keys:
        if key not in seen:
            seen[key] = plan_move(key, options)
    return MoveTable(tuple(seen.values()))


def verify_planned_move(move: PlannedMove) -> None:
    """A move carries what its executor runs: a hop program for ``P2P``, a transfer program for
    ``COLLECTIVE``, a carry for ``SIGNAL``, nothing for ``LOCAL`` and ``DEVICE_PUT``; ``LOCAL``
    stays on one mesh. (That a collective's program is its plan's is checked where it is
    lowered, which has the plan.)

    Raises:
      PlanVerificationError: naming the move.
    """
    kind, key = move.key.kind, move.key
    want = {TransferKind.P2P: HopProgram, TransferKind.COLLECTIVE: TransferProgram}.get(kind)
    if (want is None) != (move.program is None) or (want is not None and not isinstance(move.program, want)):
        raise PlanVerificationError(f"{kind.value} move of {key.shape}: carries {type(move.program).__name__}")
    if (kind is TransferKind.SIGNAL) != (move.carry is not None):
        raise PlanVerificationError(f"{kind.value} move of {key.shape}: a carry only a signal has")
    if kind is TransferKind.LOCAL and key.src.mesh != key.dst.mesh:
        raise PlanVerificationError(f"local move of {key.shape} between two meshes")


def verify_move_table(table: MoveTable, keys: Iterable[MoveKey]) -> None:
    """Every key of the step has its planned, verified move."""
    for key in keys:
        verify_planned_move(table.of(key))
