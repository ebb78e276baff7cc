"""``meshpar.reshard``: move a sharded array onto another mesh, by plan.

The API boundary of a single move: the user's names (``strategy``, ``balancer``, ``executor``,
``order``) are resolved here, once, to the objects the compiler and runtime take.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from meshpar.cluster import Cluster
from meshpar.passes.pipeline.placing.edge_transfer import Executor
from meshpar.passes.pipeline.placing.plan_moves import (
    MoveKey, MoveOptions, default_cluster, plan_and_lower, resharding_task,
)
from meshpar.passes.program.moves import TransferKind, TransferOrder
from meshpar.passes.resharding.balancers import get_balancer
from meshpar.passes.resharding.plan_resharding import plan_resharding
from meshpar.passes.resharding.strategies import get_strategy
from meshpar.runtime.coordination import agree
from meshpar.runtime.p2p_executor import P2PReshardExecutable
from meshpar.runtime.remote import absent
from meshpar.runtime.resharding_executor import ReshardingExecutable

__all__ = ["EXECUTORS", "reshard", "plan_for", "plan_between", "prepare_reshard"]

# What ``reshard`` runs a move with: ``"auto"`` is p2p (signal moves exist only in a pipeline).
_KINDS = {Executor.AUTO: TransferKind.P2P, Executor.P2P: TransferKind.P2P, Executor.COLLECTIVE: TransferKind.COLLECTIVE}
EXECUTORS = tuple(e.value for e in _KINDS)


def _named(sharding: Any, ndim: int, arg: str) -> NamedSharding:
    if isinstance(sharding, NamedSharding):
        return sharding
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        mesh = jax.sharding.Mesh(np.array([device]), ("single",))
        return NamedSharding(mesh, jax.sharding.PartitionSpec())
    raise TypeError(f"{arg}: expected a NamedSharding (or a single-device array), got {type(sharding).__name__}")


@functools.lru_cache(maxsize=256)
def _executable(shape, dtype, src, dst, cluster, strategy, balancer, chunks, kind, order):
    key = MoveKey.of(kind, shape, dtype, src, dst)
    options = MoveOptions(strategy, balancer, cluster, chunks, order)
    move, plan = plan_and_lower(key, options)
    if kind is TransferKind.COLLECTIVE:
        return ReshardingExecutable(move.program, shape, dtype, src, dst), plan
    return P2PReshardExecutable(move.program, dtype, src, dst, order=order, gates=move.gates), plan


def plan_for(x: jax.Array, dst: NamedSharding, **kwargs: Any):
    """The ``ReshardingPlan`` that ``reshard(x, dst, **kwargs)`` executes."""
    if getattr(x, "ndim", None) == 0:
        raise ValueError("x: a 0-d array is replicated to every destination device, without a plan")
    return _prepare(x, dst, **kwargs)[1]


def plan_between(shape, dtype, src: NamedSharding, dst: NamedSharding, *, strategy="broadcast",
                 balancer="ensemble", chunks=None, cluster=None):
    """The plan ``reshard`` would use for a ``shape``/``dtype`` array from ``src`` to ``dst``."""
    cluster = cluster if cluster is not None else default_cluster(src, dst)
    task = resharding_task(tuple(shape), np.dtype(dtype), src, dst, cluster)
    return plan_resharding(task, cluster, strategy=strategy, balancer=balancer, chunks=chunks)


def prepare_reshard(shape, dtype, src: NamedSharding, dst: NamedSharding, *, strategy="broadcast",
                    balancer="ensemble", chunks=None, cluster=None, executor="auto", order="gated"):
    """Plans, lowers and compiles the move of a ``shape``/``dtype`` array from ``src`` to
    ``dst``, once: returns ``(executable, plan)``; ``executable(x)`` runs it (``plan`` is
    ``None`` for a 0-d value, which is replicated without one)."""
    if not isinstance(src, NamedSharding):
        raise TypeError(f"src: expected a jax.sharding.NamedSharding, got {type(src).__name__}")
    if not isinstance(dst, NamedSharding):
        raise TypeError(f"dst: expected a jax.sharding.NamedSharding, got {type(dst).__name__}")
    chosen = Executor.of(executor, "executor", among=_KINDS)
    order = TransferOrder.of(order, "order")
    strategy = get_strategy(strategy)
    balancer = get_balancer(balancer)
    if cluster is None:
        cluster = default_cluster(src, dst)
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a meshpar.Cluster, got {type(cluster).__name__}")
    return _executable(tuple(shape), np.dtype(dtype), src, dst, cluster, strategy, balancer, chunks, _KINDS[chosen],
                       order)


def _prepare(x, dst, **kwargs):
    if not isinstance(x, jax.Array):
        raise TypeError(f"x: expected a jax.Array, got {type(x).__name__}")
    return prepare_reshard(x.shape, x.dtype, _named(x.sharding, x.ndim, "x"), dst, **kwargs)


_agreed: set[int] = set()


def reshard(
    x: jax.Array,
    dst: NamedSharding,
    *,
    strategy: str = "broadcast",
    balancer: str = "ensemble",
    chunks: int | None = None,
    cluster: Cluster | None = None,
    executor: str = "auto",
    order: str = "gated",
    timeout_s: float = 120.0,
) -> jax.Array:
    """``x`` moved onto ``dst``, a sharding on another mesh (disjoint from ``x``'s, or, with
    p2p, sharing devices with it: a piece already on its destination device stays there).

    Plans the move (``meshpar.plan_resharding``) and lowers it to
    device-to-device moves; works within a process and across processes
    (``jax.distributed``), where ``jax.device_put`` cannot change layouts.

    Args:
      x: a ``jax.Array`` sharded by a ``NamedSharding`` (or on one device).
      dst: the destination ``NamedSharding``; its tiling divides ``x.shape``;
        its mesh shares no device with ``x``'s for the collective executor.
      strategy: ``broadcast`` (default), ``send_recv``, ``local_allgather``
        (Alpa's) or ``global_allgather``.
      balancer: ``ensemble`` (default), ``dfs``, ``greedy_random``,
        ``load_balance`` or ``naive``.
      chunks: chunks per broadcast; ``None`` lets the cost model choose.
      cluster: hosts and bandwidths for the planner; defaults to one host per
        process with default link speeds.
      executor: ``"p2p"`` (``"auto"``, the default): asynchronous
        point-to-point ``jax.device_put`` moves that overlap with compute
        (``meshpar.runtime.p2p_executor``); ``"collective"``: one compiled
        ``ppermute`` program over both meshes, a rendezvous of all their
        devices (``meshpar.runtime.resharding_executor``).
      order: p2p only: ``"gated"`` (the default: every hop dispatched at
        once, never blocking the caller, each plan round's cross-host hops
        made to wait on the devices for the previous round's arrivals),
        ``"eager"`` (no gates) or ``"rounds"`` (waits on the host for each
        round's arrivals; blocks the caller).
      timeout_s: how long processes wait for each other to agree on the
        plan, and ``"rounds"`` for a round's arrivals.

    Returns:
      An array equal to ``x`` bit for bit with sharding ``dst``; with p2p it
      is returned at once and becomes ready when its data has arrived. On a
      process that owns no device of ``dst`` it has no addressable shards.
      A 0-d ``x`` (p2p only) is replicated onto every device of ``dst``.

    Which processes call: with p2p every process of the job (JAX numbers
    cross-process transfers by a counter every process advances); with
    collective every process owning a device of either mesh. They call with
    the same arguments in the same order; the first call of each plan checks
    that they agree, and raises (never hangs) when they do not.
    """
    executable, plan = _prepare(x, dst, strategy=strategy, balancer=balancer, chunks=chunks, cluster=cluster,
                                executor=executor, order=order)
    p2p = isinstance(executable, P2PReshardExecutable)
    if not p2p and not executable.participates:
        return absent(x.shape, x.dtype, dst)
    if jax.process_count() > 1 and id(executable) not in _agreed:
        participants = (list(range(jax.process_count())) if p2p
                        else sorted({d.process_index for d in executable.union}))
        what = plan.task if plan is not None else (x.shape, str(x.sharding), str(dst))
        topic = "reshard/" + hashlib.sha256(repr((x.shape, what)).encode()).hexdigest()[:16]
        agree(
            topic,
            {"fingerprint": executable.program.fingerprint, "strategy": get_strategy(strategy).name,
             "balancer": get_balancer(balancer).name, "executor": "p2p" if p2p else "collective",
             "order": TransferOrder.of(order, "order").value},
            participants,
            timeout_s=timeout_s,
            what=f"meshpar.reshard of {x.shape} {x.dtype}",
        )
        _agreed.add(id(executable))
    return executable(x, timeout_s=timeout_s) if p2p else executable(x)
