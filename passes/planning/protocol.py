"""What every automatic planner takes and returns: one interface, so planners compare on one profile.

A planner (``Planner``) is two functions. ``plan`` maps a model's layers (``ModelProfile``), the
cluster, what a device computes (``Hardware``) and the user's limits (``PlanConstraints``) to
plans (``PipelinePlan``) ranked fastest first by its own cost model, or raises ``NoPlanFits``.
``predict`` prices one given layout (stages, micro-batches, schedule) by that cost model: it is
how the planner is calibrated. ``Hardware`` is what the cost model reads of the machine; its
scales and overheads are fitted on the machine a step is planned on so that ``predict`` gives
the steps measured there (``calibration`` fits them, device-free; ``meshpar.calibration``
measures the steps and asks the selected planner's ``predict``). A module defining both
functions is a planner: meshpar's own (``planner_meshpar``), AMP's (``planner_amp``),
Galvatron-BMW's (``planner_galvatron``) and Alpa's stage DP (``planner_alpa``), each beside the
paper's search it adapts, and ``planners.PLANNERS`` names them. The baselines' cost models read
of ``Hardware`` a device's calibrated FLOP/s alone, none of the overheads calibration fits:
their ``predict`` is meshpar's, so every planner plans on the machine as meshpar's model
measured it.

A plan places stages on meshes cut host-major from the cluster's first devices
(``stage_meshes``): a plan may use fewer devices than the cluster has, down to one. A mesh may
run several stages (``stages_per_mesh``), placed as the schedule's ``StagePlacement`` says;
the stages of one mesh share its shape.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ..model.cluster import Cluster
from ..model.mesh import DeviceMesh
from ..pipeline.pipeline_options import GradientReduction
from ..pipeline.scheduling.pipeline_schedule import SCHEDULES, ScheduleKind, schedule_kind
from .layer_profile import ModelProfile

__all__ = ["Hardware", "NoPlanFits", "PipelinePlan", "PlanConstraints", "Planner", "StagePlan", "first_devices",
           "stage_meshes"]


class NoPlanFits(ValueError):
    """No plan fits the memory budget (or the other constraints)."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a device computes: ``device_flops`` sustained FLOP/s each; ``total_flops`` caps the
    whole cluster (virtual CPU devices sharing a few cores), ``inf`` when devices are real;
    ``dispatch_s`` host seconds to launch one task (the runtime launches every task of a step
    from one thread, so no step is faster than its launches); ``op_s`` the seconds one
    operation costs besides its FLOPs on a mesh of ``n`` devices, ``op_s[0] + op_s[1] · n``;
    ``compute_scale`` and ``op_scale`` multiply the FLOP and the operation parts of every
    compute estimate: what a model's measured steps make of them on this machine (fusion,
    memory traffic, the operations XLA really runs), 1 when not calibrated (fitted together on
    the step run as one program on one device and on all of them, the same when only one of
    these was measured: ``calibration.fit_compute``); ``task_s`` the seconds each compute
    task of a pipeline (a forward or
    a backward of one stage and micro-batch) costs beyond its compute per device of its
    stage's mesh (launching its program on each device, its operands and results, its share
    of the stage's update: on CPU each device's partition is launched and run on its own), and
    ``move_s`` the seconds each move between two stage meshes costs beyond its bytes (its
    latency); ``pipeline_s`` the seconds a pipelined step costs once, whatever its tasks
    (placing its inputs, each stage's update, assembling its outputs): 0 until fitted on a
    measured pipeline at two micro-batch counts (``calibration.fit_pipeline``:
    the tasks' cost is the slope over them, this the rest). A step of one stage and one
    micro-batch runs as one program and pays none of these."""

    device_flops: float
    total_flops: float = math.inf
    dispatch_s: float = 0.0
    op_s: tuple[float, float] = (0.0, 0.0)
    compute_scale: float = 1.0
    task_s: float = 0.0
    move_s: float = 0.0
    op_scale: float = 1.0
    pipeline_s: float = 0.0

    def __post_init__(self) -> None:
        if (not self.device_flops > 0 or not self.total_flops > 0 or not self.dispatch_s >= 0
                or len(self.op_s) != 2 or not min(self.op_s) >= 0 or not self.compute_scale > 0
                or not self.op_scale > 0 or not self.task_s >= 0 or not self.move_s >= 0
                or not self.pipeline_s >= 0):
            raise ValueError(f"device_flops, total_flops, dispatch_s, op_s, compute_scale, op_scale, task_s, move_s, "
                             f"pipeline_s: expected positive FLOP/s and scales and seconds >= 0, got {self}")

    def op_seconds(self, num_devices: int) -> float:
        """Seconds one operation of a program on ``num_devices`` devices takes besides its
        FLOPs, calibrated: ``(op_s[0] + op_s[1] · num_devices) · op_scale`` (virtual CPU
        devices run every operation on shared cores; on accelerators a kernel launch, whatever
        the mesh)."""
        return (self.op_s[0] + self.op_s[1] * num_devices) * self.op_scale

    @property
    def shared(self) -> bool:
        """Whether the devices share compute (``total_flops`` is finite): stages then do not
        run in parallel, and no step beats the sum of its tasks' work."""
        return math.isfinite(self.total_flops)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Layers ``[start, stop)`` on a ``(data, model)`` mesh."""

    start: int
    stop: int
    shape: tuple[int, int]

    @property
    def num_devices(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A planner's choice and what it predicts.

    Attributes:
      stages: contiguous, covering every layer once, in order.
      num_micro_batches: M.
      schedule: a ``pipeline_schedule.SCHEDULES`` name: a plan is a record the user reads and
        passes back as ``PipeshardParallel(schedule=...)`` (``stage_mesh`` looks it up).
      predicted_step_s: seconds per step.
      peak_memory_bytes: per mesh, the most bytes one of its devices holds (its stages'
        together).
      planner: which planner chose it.
      stages_per_mesh: ``v``; the ``num_stages / v`` meshes each run ``v`` stages, placed as
        ``schedule`` places them; stages sharing a mesh have its shape.

    Raises:
      ValueError: ``stages_per_mesh`` not dividing the stages, or stages of one mesh with
        different shapes.
    """

    stages: tuple[StagePlan, ...]
    num_micro_batches: int
    schedule: str
    predicted_step_s: float
    peak_memory_bytes: tuple[float, ...]
    planner: str = "meshpar"
    stages_per_mesh: int = 1

    def __post_init__(self) -> None:
        if self.stages_per_mesh < 1 or self.num_stages % self.stages_per_mesh:
            raise ValueError(f"stages_per_mesh: expected a divisor of the {self.num_stages} stages, "
                             f"got {self.stages_per_mesh!r}")
        shapes = [self.stages[s].shape for s in self.first_stage_on_each_mesh]
        for s, stage in enumerate(self.stages):
            if stage.shape != shapes[self.stage_mesh[s]]:
                raise ValueError(f"stages: stage {s} on mesh {self.stage_mesh[s]} is shaped {stage.shape}, but that "
                                 f"mesh is {shapes[self.stage_mesh[s]]}; stages sharing a mesh share its shape")

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_meshes(self) -> int:
        return self.num_stages // self.stages_per_mesh

    @property
    def stage_mesh(self) -> tuple[int, ...]:
        """Per stage, the index of the mesh running it (the schedule's placement)."""
        placement = schedule_kind(self.schedule).placement
        return tuple(placement.mesh_of(s, self.num_meshes) for s in range(self.num_stages))

    @property
    def first_stage_on_each_mesh(self) -> tuple[int, ...]:
        """Per mesh, the first stage it runs."""
        stage_mesh = self.stage_mesh
        return tuple(stage_mesh.index(m) for m in range(self.num_meshes))

    @property
    def mesh_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per mesh, its ``(data, model)`` shape; the meshes are cut in this order."""
        return tuple(self.stages[s].shape for s in self.first_stage_on_each_mesh)

    @property
    def num_devices(self) -> int:
        """The devices the plan runs on: the cluster's first ones (``stage_meshes``)."""
        return sum(d * t for d, t in self.mesh_shapes)

    @property
    def one_program(self) -> bool:
        """One stage and one micro-batch: the step runs as one SPMD program, as ``jax.jit``
        would run it on those devices (``PipeshardParallel.single_program``)."""
        return self.num_stages == 1 and self.num_micro_batches == 1

    @property
    def cut_points(self) -> tuple[int, ...]:
        """The markers that cut: after layer ``stop - 1`` of every stage but the last."""
        return tuple(s.stop - 1 for s in self.stages[:-1])

    def summary(self) -> str:
        """One line: the planner, stages with their layers and shapes, meshes and stages per mesh,
        micro-batches, schedule, devices, predicted step and peak memory."""
        def count(n: int, what: str, plural: str = "s") -> str:
            return f"{n} {what}{plural * (n != 1)}"

        shapes = ", ".join(f"L{s.start}-{s.stop - 1} on {s.shape}" for s in self.stages)
        program = " (one program, as jax.jit runs it)" if self.one_program else ""
        meshes = count(self.num_meshes, "mesh", "es")
        return (f"{self.planner}: {count(self.num_stages, 'stage')} [{shapes}] on {meshes}, stages_per_mesh={self.stages_per_mesh}, {count(self.num_micro_batches, 'micro-batch', 'es')}, "
                f"{self.schedule}, {count(self.num_devices, 'device')}{program}: "
                f"{self.predicted_step_s * 1e3:.2f} ms/step predicted, peak "
                f"{max(self.peak_memory_bytes) / 2**20:.1f} MiB/device")


def _positive_count(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")


@dataclasses.dataclass(frozen=True)
class PlanConstraints:
    """What the user fixes or limits; every planner reads the same ones.

    Attributes:
      memory_budget_bytes: per device; ``None``: unbounded.
      num_stages, num_micro_batches: fix one instead of planning it (``None``: planned).
      schedules: the schedules to choose among (``SCHEDULES`` names); ``None``: every
        registered one. The baselines (AMP, Galvatron-BMW, Alpa) plan 1F1B, as their papers do.
      stages_per_mesh: the stages per mesh to try, where a schedule takes that many
        (``check_stage_placement``).
      gradient_reduction: how the step reduces gradients over the data axis
        (``PipeshardParallel.gradient_reduction``; a name resolves to its ``GradientReduction``
        when made); meshpar prices it as it runs, the
        baselines as their papers model it.
      device_subsets: whether a plan may use fewer devices than the cluster has (down to one
        device: the one-program step ``jax.jit`` runs); the baselines use every device.

    Raises:
      ValueError: naming the field and what was expected.
    """

    memory_budget_bytes: float | None = None
    num_stages: int | None = None
    num_micro_batches: int | None = None
    schedules: tuple[str, ...] | None = None
    stages_per_mesh: tuple[int, ...] = (1, 2)
    gradient_reduction: str | GradientReduction = GradientReduction.PER_STEP
    device_subsets: bool = True

    def __post_init__(self) -> None:
        budget = self.memory_budget_bytes
        if budget is not None and not (isinstance(budget, (int, float)) and budget > 0):
            raise ValueError(f"memory_budget_bytes: expected a positive number of bytes or None, got {budget!r}")
        _positive_count("num_stages", self.num_stages)
        _positive_count("num_micro_batches", self.num_micro_batches)
        if self.schedules is not None:
            if isinstance(self.schedules, str) or not self.schedules or any(s not in SCHEDULES
                                                                            for s in self.schedules):
                raise ValueError(f"schedules: expected a non-empty sequence of {sorted(SCHEDULES)} or None (all), "
                                 f"got {self.schedules!r}")
            object.__setattr__(self, "schedules", tuple(self.schedules))
        per_mesh = tuple(self.stages_per_mesh) if isinstance(self.stages_per_mesh, Sequence) else ()
        if not per_mesh or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in per_mesh):
            raise ValueError(f"stages_per_mesh: expected a non-empty sequence of positive integers, "
                             f"got {self.stages_per_mesh!r}")
        object.__setattr__(self, "stages_per_mesh", per_mesh)
        # The planner's options are its API: the name resolves here, once.
        object.__setattr__(self, "gradient_reduction",
                           GradientReduction.of(self.gradient_reduction, "gradient_reduction"))
        if not isinstance(self.device_subsets, bool):
            raise ValueError(f"device_subsets: expected a bool, got {self.device_subsets!r}")

    @property
    def schedule_names(self) -> tuple[str, ...]:
        """The schedules to choose among: ``schedules``, or every registered one in registry order."""
        return tuple(SCHEDULES) if self.schedules is None else self.schedules

    @property
    def schedule_kinds(self) -> tuple[ScheduleKind, ...]:
        """``schedule_names`` resolved (checked when made): what the planners search over."""
        return tuple(SCHEDULES[name] for name in self.schedule_names)

    @property
    def budget(self) -> float:
        """``memory_budget_bytes``, ``inf`` when unbounded."""
        return math.inf if self.memory_budget_bytes is None else float(self.memory_budget_bytes)

    def fixed_counts(self) -> str:
        """The fixed counts, for a message: ``", 2 stages, 4 micro-batches"``, or ``""``."""
        counts = [(self.num_stages, "stages"), (self.num_micro_batches, "micro-batches")]
        return "".join(f", {n} {what}" for n, what in counts if n is not None)

    def admits(self, plan: PipelinePlan) -> bool:
        """Whether ``plan`` has the fixed stage and micro-batch counts (where fixed)."""
        return ((self.num_stages is None or plan.num_stages == self.num_stages)
                and (self.num_micro_batches is None or plan.num_micro_batches == self.num_micro_batches))


class Planner(Protocol):
    """An automatic planner: its search (``plan``) and its price of one layout (``predict``),
    the cost model it is calibrated by (module doc). Structural: a module defining both
    functions is one (the registered planners), and so is an object with both methods."""

    def plan(self, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
             constraints: PlanConstraints) -> list[PipelinePlan]:
        """Plans fastest first by the planner's own cost model, each covering ``profile``'s
        layers on the first of ``cluster``'s devices.

        Raises:
          NoPlanFits: no plan meets ``constraints``, naming what is missing.
        """
        ...

    def predict(self, profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
                num_micro_batches: int, schedule: ScheduleKind) -> PipelinePlan:
        """``stages`` (one per mesh) run on ``cluster``'s first devices with
        ``num_micro_batches`` under ``schedule``, priced by the planner's cost model on
        ``hardware``: its step time and peak memory per mesh. Calibration fits
        ``hardware``'s ``compute_scale``, ``op_scale``, ``task_s`` and ``pipeline_s`` by
        bisection so that this is the step measured: the step must not shrink as any of them
        grows.
        """
        ...


def first_devices(cluster: Cluster, num_devices: int) -> Cluster:
    """``cluster`` cut to its first ``num_devices`` devices, host-major (what a plan of that many
    devices runs on), its links unchanged.

    Raises:
      ValueError: ``num_devices`` not between 1 and the cluster's devices.
    """
    if not 1 <= num_devices <= cluster.num_devices:
        raise ValueError(f"num_devices: expected 1 to {cluster.num_devices} devices, got {num_devices!r}")
    hosts, left = [], num_devices
    for devices in cluster.host_devices:
        if left == 0:
            break
        hosts.append(devices[:left])
        left -= len(hosts[-1])
    return dataclasses.replace(cluster, host_devices=tuple(hosts))


def stage_meshes(cluster: Cluster, shapes: Sequence[tuple[int, int]]) -> list[DeviceMesh]:
    """The meshes of ``shapes``, cut host-major from ``cluster``'s devices in order.

    Raises:
      ValueError: ``shapes`` need more devices than the cluster has.
    """
    flat = [(d, h) for h, devs in enumerate(cluster.host_devices) for d in devs]
    out, at = [], 0
    for d, t in shapes:
        chunk = flat[at:at + d * t]
        if len(chunk) < d * t:
            raise ValueError(f"shapes: {list(shapes)} need more than the cluster's {len(flat)} devices")
        ids = np.array([c[0] for c in chunk]).reshape(d, t)
        hosts = np.array([c[1] for c in chunk]).reshape(d, t)
        out.append(DeviceMesh(ids, hosts, ("data", "model")))
        at += d * t
    return out
