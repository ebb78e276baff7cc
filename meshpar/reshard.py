"""``meshpar.reshard``: move a sharded array onto a disjoint mesh, by plan."""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding

from meshpar.cluster import Cluster
from meshpar.mesh import DeviceMesh
from meshpar.passes.balancers import get_balancer
from meshpar.passes.plan_resharding import plan_resharding
from meshpar.passes.resharding_task import ReshardingTask
from meshpar.passes.strategies import get_strategy
from meshpar.passes.transfer_program import lower_plan, verify_program
from meshpar.runtime.coordination import agree
from meshpar.runtime.resharding_executor import ReshardingExecutable
from meshpar.sharding_spec import ShardingSpec

__all__ = ["reshard", "plan_for", "plan_between"]


def _named(sharding: Any, ndim: int, arg: str) -> NamedSharding:
    if isinstance(sharding, NamedSharding):
        return sharding
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        mesh = jax.sharding.Mesh(np.array([device]), ("single",))
        return NamedSharding(mesh, jax.sharding.PartitionSpec())
    raise TypeError(f"{arg}: expected a NamedSharding (or a single-device array), got {type(sharding).__name__}")


def _task(shape: tuple[int, ...], dtype: Any, src: NamedSharding, dst: NamedSharding, cluster: Cluster) -> ReshardingTask:
    def mesh(s: NamedSharding) -> DeviceMesh:
        return DeviceMesh.from_jax(s.mesh, host_of=lambda d: cluster.host_of(d.id))

    def spec(s: NamedSharding) -> ShardingSpec:
        return ShardingSpec.from_partition_spec(s.spec, s.mesh.axis_names, len(shape))

    return ReshardingTask(shape, np.dtype(dtype).itemsize, mesh(src), spec(src), mesh(dst), spec(dst))


@functools.lru_cache(maxsize=256)
def _executable(shape, dtype, src, dst, cluster, strategy, balancer, chunks) -> tuple[ReshardingExecutable, Any]:
    task = _task(shape, dtype, src, dst, cluster)
    plan = plan_resharding(task, cluster, strategy=strategy, balancer=balancer, chunks=chunks)
    program = lower_plan(plan)
    verify_program(program)
    return ReshardingExecutable(program, shape, dtype, src, dst), plan


def plan_for(x: jax.Array, dst: NamedSharding, **kwargs: Any):
    """The ``ReshardingPlan`` that ``reshard(x, dst, **kwargs)`` executes."""
    return _prepare(x, dst, **kwargs)[1]


def plan_between(shape, dtype, src: NamedSharding, dst: NamedSharding, *, strategy="broadcast",
                 balancer="ensemble", chunks=None, cluster=None):
    """The plan ``reshard`` would use for a ``shape``/``dtype`` array from ``src`` to ``dst``."""
    cluster = cluster if cluster is not None else _default_cluster(src, dst)
    task = _task(tuple(shape), np.dtype(dtype), src, dst, cluster)
    return plan_resharding(task, cluster, strategy=strategy, balancer=balancer, chunks=chunks)


def _default_cluster(src: NamedSharding, dst: NamedSharding) -> Cluster:
    devices = {d.id: d for d in [*src.mesh.devices.flat, *dst.mesh.devices.flat]}
    return Cluster.from_devices(list(devices.values()))


def _prepare(x, dst, *, strategy="broadcast", balancer="ensemble", chunks=None, cluster=None):
    if not isinstance(x, jax.Array):
        raise TypeError(f"x: expected a jax.Array, got {type(x).__name__}")
    if not isinstance(dst, NamedSharding):
        raise TypeError(f"dst: expected a jax.sharding.NamedSharding, got {type(dst).__name__}")
    get_strategy(strategy)
    get_balancer(balancer)
    src = _named(x.sharding, x.ndim, "x")
    if x.ndim == 0:
        raise ValueError("x: a 0-d array has nothing to reshard; use jax.device_put")
    if cluster is None:
        cluster = _default_cluster(src, dst)
    elif not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a meshpar.Cluster, got {type(cluster).__name__}")
    return _executable(tuple(x.shape), np.dtype(x.dtype), src, dst, cluster, strategy, balancer, chunks)


_agreed: set[tuple] = set()


def reshard(
    x: jax.Array,
    dst: NamedSharding,
    *,
    strategy: str = "broadcast",
    balancer: str = "ensemble",
    chunks: int | None = None,
    cluster: Cluster | None = None,
    timeout_s: float = 120.0,
) -> jax.Array:
    """``x`` moved onto ``dst``, a sharding on a mesh disjoint from ``x``'s.

    Plans the move (``meshpar.plan_resharding``), lowers it to device-to-device
    transfers and runs them as one compiled SPMD program over both meshes;
    works within a process and across processes (``jax.distributed``), where
    ``jax.device_put`` cannot.

    Args:
      x: a ``jax.Array`` sharded by a ``NamedSharding`` (or on one device).
      dst: the destination ``NamedSharding``; its mesh shares no device with
        ``x``'s and its tiling divides ``x.shape``.
      strategy: ``broadcast`` (default), ``send_recv``, ``local_allgather``
        (Alpa's) or ``global_allgather``.
      balancer: ``ensemble`` (default), ``dfs``, ``greedy_random``,
        ``load_balance`` or ``naive``.
      chunks: chunks per broadcast; ``None`` lets the cost model choose.
      cluster: hosts and bandwidths for the planner; defaults to one host per
        process with default link speeds.
      timeout_s: how long processes wait for each other to agree on the plan.

    Returns:
      An array equal to ``x`` bit for bit with sharding ``dst``. On a process
      that owns no device of either mesh it has no addressable shards.

    Every process owning a device of either mesh must call ``reshard`` with
    the same arguments in the same order; the first call of each plan checks
    that they agree, and raises (never hangs) when they do not.
    """
    executable, plan = _prepare(x, dst, strategy=strategy, balancer=balancer, chunks=chunks, cluster=cluster)
    if not executable.participates:
        return jax.make_array_from_single_device_arrays(x.shape, dst, [], dtype=x.dtype)
    if jax.process_count() > 1:
        key = (id(executable),)
        if key not in _agreed:
            participants = sorted({d.process_index for d in executable.union})
            topic = "reshard/" + hashlib.sha256(repr((x.shape, plan.task)).encode()).hexdigest()[:16]
            agree(
                topic,
                {"fingerprint": plan.fingerprint, "strategy": strategy, "balancer": balancer},
                participants,
                timeout_s=timeout_s,
                what=f"meshpar.reshard of {x.shape} {x.dtype}",
            )
            _agreed.add(key)
    return executable(x)
