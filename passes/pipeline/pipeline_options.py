"""What the user chose (``meshpar.PipeshardParallel``), grouped as the passes read it.

Each group is what one concern of ``compile_pipeline`` needs: the schedule, where stages
run, and how values cross meshes. Every value here has been checked by
``PipeshardParallel`` (which builds these, ``PipeshardParallel.pipeline_options``); the
passes check only what the model decides (its stage count, its shapes). Every policy here is
resolved: a ``ScheduleKind``, a ``Strategy``, a ``Balancer`` or an enum member, never the
user's name for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from ..model.cluster import Cluster
from ..policies import Policy
from ..resharding.balancers import Balancer
from ..resharding.strategies import Strategy
from .placing.edge_transfer import Executor
from .scheduling.pipeline_schedule import ScheduleKind

__all__ = ["GRADIENT_REDUCTIONS", "GradientOptions", "GradientReduction", "PipelineOptions", "PlacementOptions",
           "ScheduleOptions", "TransferOptions"]


class GradientReduction(Policy):
    """How a stage's parameter gradients are reduced over its mesh's data axis."""

    # Once per step (``data_replicas``: each device accumulates its own examples' partial sums).
    PER_STEP = "per_step"
    # Inside every micro-batch's backward (the SPMD default; kept for benchmarks).
    PER_MICRO_BATCH = "per_micro_batch"

    @property
    def in_backward(self) -> bool:
        """Whether each backward reduces its own micro-batch's gradients (so the backward, not
        the step, pays for the all-reduce)."""
        return self is GradientReduction.PER_MICRO_BATCH

    def reductions_per_step(self, num_micro_batches: int) -> int:
        """All-reduces of a stage's gradients in a step of ``num_micro_batches``."""
        return num_micro_batches if self.in_backward else 1


# What the user may pass as ``gradient_reduction``.
GRADIENT_REDUCTIONS = GradientReduction.names()


@dataclasses.dataclass(frozen=True)
class ScheduleOptions:
    """The order tasks run in.

    Attributes:
      kind: the schedule: an entry of ``pipeline_schedule.SCHEDULES``, or one given as data
        (``schedule_csv.load_schedule_csv``).
      num_micro_batches: micro-batches per step, at least 1.
      weight_delay: ``False``, ``True`` or ``"auto"`` (``weight_delay.check_weight_delay``).
      fuse_compute: the most stage passes a mesh runs as one program (``fused_runs``); 1: each
        its own; ``None``: no limit.
    """

    kind: ScheduleKind
    num_micro_batches: int
    weight_delay: bool | str
    fuse_compute: int | None = 1


@dataclasses.dataclass(frozen=True)
class PlacementOptions:
    """Where the stages run, and how the model is cut into them.

    Attributes:
      stage_meshes: the user's meshes, disjoint; ``None``: cut from the devices.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh; ``None`` with
        ``stage_meshes``, or for all of a mesh's devices on ``data``.
      stages_per_mesh: stages each mesh runs (virtual stages when above 1); ``None``: inferred
        from the model's stage count, ``S / len(stage_meshes)`` with ``stage_meshes`` and 1 for
        cut meshes. When given with ``stage_meshes`` and a stage count, they agree.
      data_axis, model_axis: the mesh axes the batch and the parameters shard over; distinct.
      cut_points: which stage markers cut (increasing, 0-based); ``None``: every marker.
      auto_layers: layers to cut a marker-less loss into; ``None``: the model's markers.
      num_stages: the stages asked for; a loss without markers and without ``auto_layers``
        has its scans over layers cut into this many (``even_layer_markers``), one with more
        than ``num_stages - 1`` markers (and no ``cut_points``) has them grouped into this many
        (``marker_grouping``). ``None``: the model's markers decide.
    """

    stage_meshes: Sequence[Mesh] | None
    stage_mesh_shape: tuple[int, int] | None
    stages_per_mesh: int | None
    data_axis: str
    model_axis: str
    cut_points: tuple[int, ...] | None
    auto_layers: int | None
    num_stages: int | None = None


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    """How values cross meshes, and what the cost model prices them at.

    Attributes:
      executor: how a cross-mesh value moves (``Executor.SIGNAL``: one byte instead).
      strategy: the resharding strategy of planned moves.
      balancer: the resharding balancer.
      inter_host_bandwidth, intra_host_bandwidth: bytes/s, positive.
      timeout_s: seconds a process waits for its peers, positive.
      cluster: the hosts and links moves are planned on (``None``: one host per process).
    """

    executor: Executor
    strategy: Strategy
    balancer: Balancer
    inter_host_bandwidth: float
    intra_host_bandwidth: float
    timeout_s: float
    cluster: Cluster | None = None


@dataclasses.dataclass(frozen=True)
class GradientOptions:
    """How parameter gradients accumulate over micro-batches and reduce over the data axis.

    Attributes:
      gradient_reduction: how gradients reduce over the data axis.
      accumulation_dtype: the floating dtype gradients of narrower floating parameters
        (bfloat16, float16) accumulate in; wider ones accumulate in their own.
    """

    gradient_reduction: GradientReduction
    accumulation_dtype: Any


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """Every option ``compile_pipeline`` reads, by concern; ``micro_batch_size`` is the batch
    over ``schedule.num_micro_batches`` (the traced step decides it, not the user)."""

    schedule: ScheduleOptions
    placement: PlacementOptions
    transfers: TransferOptions
    micro_batch_size: int
    gradients: GradientOptions = GradientOptions(GradientReduction.PER_STEP, "float32")
