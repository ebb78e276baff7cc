"""A simple cost model of pipeline tasks: FLOPs of a jaxpr, bytes over a link.

Estimates, not measurements: ``estimate_durations`` gives the schedule
simulator (``passes.schedule_simulator``) task durations to rank choices
(how long to delay a weight pass) before anything runs; measured durations
(``stage_seconds_from``) can replace them.

Gradient reduction. A stage mesh with ``D`` devices on its data axis
all-reduces its stages' parameter gradients among them, by ring: each device
sends and receives ``2 (D - 1) / D`` of the bytes (``collectives.ring_all_reduce_s``).
``per_micro_batch`` runs it in every backward (the weight pass of a split
one, which makes the parameter cotangents), ``per_step`` once per mesh and
step for all its stages together (``TaskDurations.reduction``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import Mesh, NamedSharding

from .. import jax_ir
from ..compiler_pass import compiler_pass
from ..pipeline.cutting.jaxpr_flops import jaxpr_flops
from ..pipeline.pipeline_options import GradientReduction
from ..pipeline.placing.drop_mesh_axis import spec_without
from ..pipeline.placing.plan_moves import MOVE_EXECUTORS
from ..program.moves import Direction, EdgeTransfer
from ..program.stage_kernel import StageAccumulation, StageParts
from .collectives import ring_all_reduce_s
from .schedule_simulator import StageSeconds, TaskDurations

__all__ = ["DEVICE_FLOPS", "compute_seconds", "transfer_seconds", "StageGradients",
           "stage_gradients", "estimate_durations"]

# Sustained FLOP/s of one device, by platform: orders of magnitude, enough to
# compare a stage's compute with its transfers.
DEVICE_FLOPS = {"cpu": 2e10, "gpu": 1e14, "tpu": 1e14}


def compute_seconds(flops: float, num_devices: int, platform: str) -> float:
    """``flops`` spread over ``num_devices`` devices of ``platform``."""
    return flops / (DEVICE_FLOPS.get(platform, DEVICE_FLOPS["gpu"]) * max(num_devices, 1))


def transfer_seconds(num_bytes: int, bandwidth: float) -> float:
    """``num_bytes`` over a link of ``bandwidth`` bytes/s."""
    return num_bytes / bandwidth


@dataclasses.dataclass(frozen=True)
class StageGradients:
    """What reducing one stage's parameter gradients over its mesh's data axis costs, and when.

    Attributes:
      param_bytes: bytes of the stage's parameter gradients each device of its mesh holds
        and all-reduces with its data-axis peers (all of them unless another mesh axis
        shards the parameters).
      data_size: devices along the mesh's data axis, the all-reduce's group; 1 reduces nothing.
      bandwidth: bytes/s of the links the reduction runs over, positive.
      mesh: the mesh running the stage (``schedule.stage_mesh`` index); the stages of one
        mesh reduce together per step.
      reduction: once per step, or inside every micro-batch's backward.
    """

    param_bytes: int
    data_size: int
    bandwidth: float
    mesh: int
    reduction: GradientReduction

    def __post_init__(self) -> None:
        if not self.param_bytes >= 0:
            raise ValueError(f"StageGradients.param_bytes: expected non-negative bytes, got {self.param_bytes!r}")
        if not self.data_size >= 1:
            raise ValueError(f"StageGradients.data_size: expected at least 1 device, got {self.data_size!r}")
        if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
            raise ValueError(f"StageGradients.bandwidth: expected finite positive bytes/s, got {self.bandwidth!r}")
        if not self.mesh >= 0:
            raise ValueError(f"StageGradients.mesh: expected a mesh index, got {self.mesh!r}")
        if not isinstance(self.reduction, GradientReduction):
            raise TypeError(f"StageGradients.reduction: expected a GradientReduction, got {self.reduction!r}")

    @property
    def seconds(self) -> float:
        """One all-reduce of the stage's gradients."""
        return ring_all_reduce_s(self.param_bytes, self.data_size, self.bandwidth)


def stage_gradients(accumulation: Sequence[StageAccumulation], meshes: Sequence[Mesh], stage_mesh: Sequence[int],
                    axis: str, inter_host_bandwidth: float, intra_host_bandwidth: float) -> tuple[StageGradients, ...]:
    """Per stage, what reducing its gradients costs as ``data_replicas`` planned it: the bytes
    one device reduces (its accumulators' share along the mesh's other axes, in the
    accumulation dtype), once per step for a stage run as replicas, else per micro-batch;
    over the inter-host links when the data axis spans processes (hosts), else within a host.

    ``meshes`` are the pipeline's meshes, ``stage_mesh`` each stage's index into them.
    """
    out = []
    for s, plan in enumerate(accumulation):
        mesh = meshes[stage_mesh[s]]
        num_bytes = 0
        for acc, (sharding, _) in zip(plan.accumulators, plan.reduced):
            shape = acc.shape[1:] if plan.replicas is not None else acc.shape
            # The data axis is what the all-reduce runs over: each device holds the whole of it.
            shard = NamedSharding(mesh, spec_without(sharding.spec, axis)).shard_shape(shape)
            num_bytes += acc.dtype.itemsize * math.prod(shard)
        data = dict(mesh.shape).get(axis, 1)
        groups = np.moveaxis(mesh.devices, list(mesh.axis_names).index(axis), -1).reshape(-1, data) \
            if axis in mesh.axis_names else mesh.devices.reshape(-1, 1)
        spans = any(len({d.process_index for d in group}) > 1 for group in groups)
        out.append(StageGradients(num_bytes, data, inter_host_bandwidth if spans else intra_host_bandwidth,
                                  stage_mesh[s], GradientReduction.PER_STEP if plan.replicas is not None
                                  else GradientReduction.PER_MICRO_BATCH))
    return tuple(out)


def _stage_seconds(parts: StageParts, mesh: Mesh, copies: int) -> StageSeconds:
    platform = mesh.devices.flat[0].platform

    def seconds(jaxpr: jax_ir.ClosedJaxpr) -> float:
        return compute_seconds(copies * jaxpr_flops(jaxpr), mesh.size, platform)

    return StageSeconds(seconds(parts.forward), seconds(parts.backward), seconds(parts.backward_input),
                        seconds(parts.backward_weight))


@compiler_pass
def estimate_durations(
    parts: Sequence[StageParts],
    meshes: Sequence[Mesh],
    transfers: Sequence[EdgeTransfer],
    num_edges: int,
    inter_host_bandwidth: float,
    intra_host_bandwidth: float,
    *,
    gradients: Sequence[StageGradients] | None = None,
    copies: Sequence[int] | None = None,
) -> TaskDurations:
    """One micro-batch's task durations, estimated.

    Args:
      parts: per stage, its compute jaxprs; each runs at its platform's
        ``DEVICE_FLOPS`` on every device of ``meshes[stage]``.
      copies: per stage, how many copies of its parts make one micro-batch's work: a stage run
        as ``D`` data-parallel replicas has its parts traced per replica, ``D`` side by side on
        its mesh. ``None``: one each.
      transfers: every edge's moves; an edge's activation (cotangent) time is
        the bytes of its activation (cotangent) moves over the bandwidth:
        ``intra_host_bandwidth`` for ``DEVICE_PUT`` (one process, one host),
        ``inter_host_bandwidth`` otherwise (bytes/s); nothing for ``LOCAL`` (both stages on
        one mesh).
      num_edges: the stage graph's edges, indexed by ``EdgeTransfer.edge``.
      gradients: per stage, how its parameter gradients reduce over its mesh's data axis
        (module doc): a ``per_micro_batch`` stage's all-reduce lengthens its backward and
        weight pass; ``per_step`` stages' all-reduces add up per mesh into
        ``TaskDurations.reduction`` (one per mesh, ``max(mesh) + 1``; empty when no stage
        is ``per_step``). ``None``: no reduction priced.

    Raises:
      ValueError: ``gradients`` or ``copies`` not one per stage.
    """
    if copies is not None and len(copies) != len(parts):
        raise ValueError(f"copies: expected one per stage ({len(parts)}), got {len(copies)}")
    seconds = {Direction.ACTIVATION: [0.0] * num_edges, Direction.COTANGENT: [0.0] * num_edges}
    for t in transfers:
        bandwidth_of = MOVE_EXECUTORS[t.kind].bandwidth
        if bandwidth_of is None:
            continue
        bandwidth = bandwidth_of(inter_host_bandwidth, intra_host_bandwidth)
        seconds[t.direction][t.edge] += transfer_seconds(t.dtype.itemsize * math.prod(t.shape), bandwidth)
    stages = tuple(_stage_seconds(p, meshes[p.stage], 1 if copies is None else copies[k]) for k, p in enumerate(parts))
    reduction: tuple[float, ...] = ()
    if gradients is not None:
        stages, reduction = _with_reductions(stages, gradients)
    return TaskDurations(stages, tuple(seconds[Direction.ACTIVATION]), tuple(seconds[Direction.COTANGENT]),
                         reduction)


def _with_reductions(stages: tuple[StageSeconds, ...], gradients: Sequence[StageGradients]
                     ) -> tuple[tuple[StageSeconds, ...], tuple[float, ...]]:
    """``stages`` with each ``per_micro_batch`` all-reduce in its backward, and the per-mesh
    per-step reduction seconds (``estimate_durations``)."""
    if len(gradients) != len(stages):
        raise ValueError(f"gradients: expected one per stage ({len(stages)}), got {len(gradients)}")
    priced = []
    for seconds, g in zip(stages, gradients):
        if g.reduction.in_backward:
            # The whole backward and the weight pass both make the parameter cotangents; the
            # input pass makes none, so it is not lengthened.
            seconds = dataclasses.replace(seconds, backward=seconds.backward + g.seconds,
                                          backward_weight=seconds.backward_weight + g.seconds)
        priced.append(seconds)
    per_step = [g for g in gradients if not g.reduction.in_backward]
    if not per_step:
        return tuple(priced), ()
    reduction = [0.0] * (max(g.mesh for g in gradients) + 1)
    for g in per_step:
        # Ring time is linear in the bytes: one combined all-reduce costs the sum of its parts.
        reduction[g.mesh] += g.seconds
    return tuple(priced), tuple(reduction)
