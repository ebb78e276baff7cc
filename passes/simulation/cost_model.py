"""A simple cost model of pipeline tasks: FLOPs of a jaxpr, bytes over a link.

Estimates, not measurements: ``estimate_durations`` gives the schedule
simulator (``passes.schedule_simulator``) task durations to rank choices
(how long to delay a weight pass) before anything runs; measured durations
(``stage_seconds_from``) can replace them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from jax._src import core
from jax._src.lax.control_flow.loops import scan_p
from jax.sharding import Mesh

from ..pipeline.edge_transfer import Direction, EdgeTransfer
from ..pipeline.plan_moves import MOVE_EXECUTORS
from .schedule_simulator import StageSeconds, TaskDurations
from ..pipeline.stage_graph import subjaxprs
from ..pipeline.stage_parts import StageParts

__all__ = ["DEVICE_FLOPS", "jaxpr_flops", "jaxpr_ops", "compute_seconds", "transfer_seconds", "estimate_durations"]

# Sustained FLOP/s of one device, by platform: orders of magnitude, enough to
# compare a stage's compute with its transfers.
DEVICE_FLOPS = {"cpu": 2e10, "gpu": 1e14, "tpu": 1e14}


def _size(aval: core.AbstractValue) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _eqn_flops(eqn: core.JaxprEqn) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * int(np.prod([lhs[d] for d in contract], dtype=np.int64))
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * int(np.prod(rhs[1:], dtype=np.int64))
    inner = list(subjaxprs(eqn))
    if inner:
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        return trips * sum(jaxpr_flops(j) for j in inner)
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> float:
    """Floating-point operations of one run: 2mnk per matmul, one per output element elsewhere,
    nested bodies counted (a scan's times its length)."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
    return float(sum(_eqn_flops(e) for e in jaxpr.eqns))


def jaxpr_ops(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> float:
    """Operations one run executes: every equation once, nested bodies counted (a scan's times
    its length), the call equations themselves not."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
    total = 0.0
    for e in jaxpr.eqns:
        inner = list(subjaxprs(e))
        if inner:
            total += (e.params.get("length", 1) if e.primitive is scan_p else 1) * sum(jaxpr_ops(j) for j in inner)
        else:
            total += 1.0
    return total


def compute_seconds(flops: float, num_devices: int, platform: str) -> float:
    """``flops`` spread over ``num_devices`` devices of ``platform``."""
    return flops / (DEVICE_FLOPS.get(platform, DEVICE_FLOPS["gpu"]) * max(num_devices, 1))


def transfer_seconds(num_bytes: int, bandwidth: float) -> float:
    """``num_bytes`` over a link of ``bandwidth`` bytes/s."""
    return num_bytes / bandwidth


def _stage_seconds(parts: StageParts, mesh: Mesh) -> StageSeconds:
    platform = mesh.devices.flat[0].platform

    def seconds(jaxpr: core.ClosedJaxpr) -> float:
        return compute_seconds(jaxpr_flops(jaxpr), mesh.size, platform)

    return StageSeconds(seconds(parts.forward), seconds(parts.backward), seconds(parts.backward_input),
                        seconds(parts.backward_weight))


def estimate_durations(
    parts: Sequence[StageParts],
    meshes: Sequence[Mesh],
    transfers: Sequence[EdgeTransfer],
    num_edges: int,
    inter_host_bandwidth: float,
    intra_host_bandwidth: float,
) -> TaskDurations:
    """One micro-batch's task durations, estimated.

    Args:
      parts: per stage, its compute jaxprs; each runs at its platform's
        ``DEVICE_FLOPS`` on every device of ``meshes[stage]``.
      transfers: every edge's moves; an edge's activation (cotangent) time is
        the bytes of its activation (cotangent) moves over the bandwidth:
        ``intra_host_bandwidth`` for ``DEVICE_PUT`` (one process, one host),
        ``inter_host_bandwidth`` otherwise (bytes/s); nothing for ``LOCAL`` (both stages on
        one mesh).
      num_edges: the stage graph's edges, indexed by ``EdgeTransfer.edge``.
    """
    seconds = {Direction.ACTIVATION: [0.0] * num_edges, Direction.COTANGENT: [0.0] * num_edges}
    for t in transfers:
        bandwidth_of = MOVE_EXECUTORS[t.kind].bandwidth
        if bandwidth_of is None:
            continue
        bandwidth = bandwidth_of(inter_host_bandwidth, intra_host_bandwidth)
        seconds[t.direction][t.edge] += transfer_seconds(t.dtype.itemsize * math.prod(t.shape), bandwidth)
    return TaskDurations(
        tuple(_stage_seconds(p, meshes[p.stage]) for p in parts),
        tuple(seconds[Direction.ACTIVATION]),
        tuple(seconds[Direction.COTANGENT]),
    )
