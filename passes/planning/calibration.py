"""Calibration's arithmetic, device-free: ``Hardware`` fitted so that a planner's cost model
gives the steps measured on the machine a step is planned on.

A planner prices one given layout with ``predict`` (``protocol.Planner``); calibration asks the
selected planner's ``predict`` and fits ``Hardware`` to the measured steps of two layouts:

- the step as one program on one device and on all of them (``one_program_step``):
  ``fit_compute`` fits ``compute_scale`` and ``op_scale`` (``fit_scales``);
- the step as a two-stage pipeline (``CalibrationPipeline``) at two micro-batch counts:
  ``fit_pipeline`` fits ``task_s`` and ``pipeline_s``, and its moves, each run alone, give
  ``move_s`` (``move_latency_s``: what a move takes beyond ``estimated_transfer_s``).

Measuring runs programs on the devices, so it stays beside the runtime: ``meshpar.calibration``
times these layouts and hands the seconds here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from ..model.cluster import Cluster
from ..pipeline.placing.plan_moves import resharding_task
from ..pipeline.scheduling.pipeline_schedule import SCHEDULES
from ..program.moves import Direction, EdgeTransfer, TransferKind
from ..program.tasks import TaskKind
from ..program.timeline import Timeline
from ..resharding.balancers import BALANCERS
from ..resharding.plan_resharding import plan_resharding
from ..resharding.strategies import STRATEGIES, Strategy
from .layer_profile import ModelProfile
from .protocol import Hardware, PipelinePlan, Planner, StagePlan, first_devices

__all__ = ["CALIBRATION_MICRO_BATCHES", "CalibrationPipeline", "estimated_transfer_s", "fit_compute", "fit_pipeline",
           "fit_scales", "move_latency_s", "one_program_step"]

# The micro-batch counts the calibration pipeline runs with.
CALIBRATION_MICRO_BATCHES = (2, 4)
# The schedule of both calibration layouts (one program has no schedule to speak of).
_SCHEDULE = SCHEDULES["1f1b"]


def one_program_step(planner: Planner, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
                     num_devices: int) -> PipelinePlan:
    """``planner``'s price of the step as one program on ``cluster``'s first ``num_devices``
    devices (one stage on a ``(num_devices, 1)`` mesh, one micro-batch: plain data parallelism)."""
    stages = [StagePlan(0, profile.num_layers, (num_devices, 1))]
    return planner.predict(profile, first_devices(cluster, num_devices), hardware, stages, 1, _SCHEDULE)


def _solve(f: Callable[[float], float], target: float, increasing: bool, low: float = 1e-6,
           high: float = 1e6, steps: int = 60) -> float:
    """``x`` in ``[low, high]`` with ``f(x) = target`` by bisection on ``log x``, ``f`` monotone
    (``increasing`` or not); the nearer end when ``target`` is beyond ``f``'s range there."""
    lo, hi = math.log(low), math.log(high)
    for _ in range(steps):
        mid = (lo + hi) / 2
        below = f(math.exp(mid)) < target
        lo, hi = (mid, hi) if below == increasing else (lo, mid)
    return math.exp((lo + hi) / 2)


def fit_scales(predicted: Callable[[float, float, int], float], measured: dict[int, float]) -> tuple[float, float]:
    """``(compute_scale, op_scale)`` making ``predicted(compute_scale, op_scale, n)`` equal
    ``measured[n]``, the seconds of the step as one program on ``n`` devices, for one or two
    device counts. ``predicted`` grows with both scales; it weighs operations more, against
    FLOPs, on more devices (each device runs every operation; the FLOPs split). With one count
    the two scales are one; with two, the operations' weight is what makes both steps as
    measured (bisection: a heavier weight, once the larger count matches, predicts the smaller
    count's step faster), clamped to ``[1e-3, 1e3]`` where no weight does.

    Raises:
      ValueError: ``measured`` is not one or two positive step times.
    """
    if not 1 <= len(measured) <= 2 or not all(t > 0 for t in measured.values()):
        raise ValueError(f"measured: expected one or two positive step times by device count, got {measured!r}")
    (few, few_s), (many, many_s) = min(measured.items()), max(measured.items())

    def matching_many(weight: float) -> float:
        return _solve(lambda k: predicted(k, k * weight, many), many_s, increasing=True, steps=40)

    def few_at(weight: float) -> float:
        scale = matching_many(weight)
        return predicted(scale, scale * weight, few)

    if few == many:
        scale = matching_many(1.0)
        return scale, scale
    # Beyond a thousandfold either way the two steps differ by more than the split between
    # FLOPs and operations explains (a noisy measurement): the other plans' prices stay sane.
    weight = _solve(few_at, few_s, increasing=False, low=1e-3, high=1e3, steps=40)
    scale = matching_many(weight)
    return scale, scale * weight


def fit_compute(planner: Planner, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
                measured: Mapping[int, float]) -> Hardware:
    """``hardware`` with ``compute_scale`` and ``op_scale`` set so that ``planner`` prices the
    step as one program on ``n`` devices (``one_program_step``) at ``measured[n]`` seconds, for
    the one or two counts measured (``fit_scales``): what the FLOP and operation counts miss on
    this machine.

    Raises:
      ValueError: ``measured`` is not one or two positive step times.
    """
    def predicted(compute_scale: float, op_scale: float, num_devices: int) -> float:
        scaled = dataclasses.replace(hardware, compute_scale=compute_scale, op_scale=op_scale)
        return one_program_step(planner, profile, cluster, scaled, num_devices).predicted_step_s

    compute_scale, op_scale = fit_scales(predicted, dict(measured))
    return dataclasses.replace(hardware, compute_scale=compute_scale, op_scale=op_scale)


@dataclasses.dataclass(frozen=True)
class CalibrationPipeline:
    """The pipeline calibration measures: the step cut in two stages of half the layers, each on
    half the devices as a ``(data, 1)`` mesh, under 1F1B (the smallest pipeline that has every
    cost a one-program step lacks: per-task launches, moves between meshes, per-stage updates),
    run with each of ``micro_batch_counts``.

    Attributes:
      stages: the two stages.
      micro_batch_counts: ``CALIBRATION_MICRO_BATCHES`` that split the batch over a mesh (2
        and 4; 2 alone where the batch does not split in 4), fewest first.
    """

    stages: tuple[StagePlan, ...]
    micro_batch_counts: tuple[int, ...]

    @classmethod
    def of(cls, profile: ModelProfile, num_devices: int) -> CalibrationPipeline | None:
        """The calibration pipeline of ``profile`` on ``num_devices`` devices; ``None`` when the
        step cannot be cut so (fewer than two layers or devices, an odd number of devices, a
        batch that does not split over them)."""
        n, L = num_devices, profile.num_layers
        if n < 2 or n % 2 or L < 2 or profile.batch_size % n:
            return None
        stages = (StagePlan(0, L // 2, (n // 2, 1)), StagePlan(L // 2, L, (n // 2, 1)))
        counts = tuple(M for M in CALIBRATION_MICRO_BATCHES if profile.batch_size % (M * (n // 2)) == 0)
        return cls(stages, counts)

    def predict(self, planner: Planner, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
                num_micro_batches: int) -> PipelinePlan:
        """``planner``'s price of this pipeline with ``num_micro_batches`` on ``cluster``'s first
        devices."""
        return planner.predict(profile, cluster, hardware, self.stages, num_micro_batches, _SCHEDULE)


def _bisect(f: Callable[[float], float], target: float, high: float) -> float:
    """The ``x`` in ``[0, high]`` where the increasing ``f`` reaches ``target``; 0 when
    ``f(0)`` already does."""
    if f(0.0) >= target:
        return 0.0
    low = 0.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return (low + high) / 2


def fit_pipeline(planner: Planner, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
                 pipeline: CalibrationPipeline, measured: Mapping[int, float], move_s: float) -> Hardware:
    """``hardware`` with ``move_s`` as given and ``task_s`` and ``pipeline_s`` fitted to
    ``measured``, the seconds of ``pipeline``'s step per micro-batch count, as ``planner``
    prices it (``CalibrationPipeline.predict``).

    ``task_s`` (per device of a stage's mesh) makes the predicted step grow from the fewest to
    the most micro-batches measured as the measured step does (twice the tasks, the same step
    around them), by bisection; ``pipeline_s`` then makes it the measured step at the fewest.
    With one count measured, ``task_s`` alone fits it (``pipeline_s`` 0). Each is 0 where the
    prediction without it is already as slow. (Fitting every second of a pipeline's step to its
    tasks priced the 4-stage ZB-V of the U-Transformer at 3.5-4.5x its measured step: the
    second count separates what a step costs once from what each task costs.)
    """
    def predicted(M: int, task_s: float, pipeline_s: float = 0.0) -> float:
        fitted = dataclasses.replace(hardware, move_s=move_s, task_s=task_s, pipeline_s=pipeline_s)
        return pipeline.predict(planner, profile, cluster, fitted, M).predicted_step_s

    low_M, high_M = min(measured), max(measured)
    if high_M > low_M:
        # The tasks' share: the slope from low_M to high_M micro-batches.
        def grows(task_s: float) -> float:
            return predicted(high_M, task_s) - predicted(low_M, task_s)

        task_s = _bisect(grows, measured[high_M] - measured[low_M], high=measured[high_M])
    else:
        task_s = _bisect(lambda t: predicted(low_M, t), measured[low_M], high=measured[low_M])
    pipeline_s = max(0.0, measured[low_M] - predicted(low_M, task_s))
    return dataclasses.replace(hardware, move_s=move_s, task_s=task_s, pipeline_s=pipeline_s)


def estimated_transfer_s(transfer: EdgeTransfer, cluster: Cluster,
                         strategy: str | Strategy = STRATEGIES["broadcast"]) -> float:
    """What the planner's cost model says one micro-batch of ``transfer`` takes on ``cluster``:
    nothing between two stages of one mesh, a byte's worth for a signal, the bytes at the host's
    copy rate for a ``jax.device_put``, the resharding plan's estimate otherwise (``strategy``,
    the ensemble balancer)."""
    num_bytes = transfer.dtype.itemsize * math.prod(transfer.shape)
    if transfer.kind is TransferKind.LOCAL:
        return 0.0
    if transfer.kind is TransferKind.SIGNAL:
        return cluster.latency + 1 / cluster.inter_host_bandwidth
    if transfer.kind is TransferKind.DEVICE_PUT:
        return num_bytes / cluster.intra_host_bandwidth
    task = resharding_task(transfer.shape, transfer.dtype, transfer.src, transfer.dst, cluster)
    return plan_resharding(task, cluster, strategy=strategy, balancer=BALANCERS["ensemble"]).estimated_time


def move_latency_s(timeline: Timeline, transfers: Sequence[EdgeTransfer], cluster: Cluster) -> float:
    """``Hardware.move_s``: over the moves of ``timeline``, a step whose moves each ran alone
    (serialized), the median of a move's seconds beyond ``estimated_transfer_s`` of its
    transfer (one of ``transfers``, the step's); 0 without moves or where the estimates are
    slower."""
    by_edge = {(t.edge, t.direction is Direction.ACTIVATION): t for t in transfers}
    gaps = [e.end - e.start - estimated_transfer_s(by_edge[(e.task.where, e.task.kind is TaskKind.SEND_ACT)], cluster)
            for e in timeline.events if e.task.kind in (TaskKind.SEND_ACT, TaskKind.SEND_GRAD)]
    return max(0.0, float(np.median(gaps))) if gaps else 0.0
