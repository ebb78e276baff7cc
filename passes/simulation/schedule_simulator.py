"""Simulate one pipeline step of a schedule from task durations: its length, bubbles and memory.

Model. Every process launches the tasks of ``schedule.order`` in that order
and each lane (``passes.timeline``) runs what was launched on it first in,
first out, so one walk of the order times every task: it starts at the
latest of the ends of its data dependencies (``task_dependencies``) and the
time its lanes become free, and ends its duration later.

- Compute tasks (F, B, I, W) of stage ``s`` hold ``Lane(COMPUTE, mesh)``, the mesh
  ``schedule.stage_mesh`` places it on (stages sharing a mesh share its lane);
  meshes whose devices share cores (``simulate``'s ``cores``: one process's
  CPU devices) share one lane.
- A transfer on edge ``e = (producer, consumer)`` goes producer -> consumer
  (``SEND_ACT``) or consumer -> producer (``SEND_GRAD``). With ``overlap``
  (point-to-point moves and ``jax.device_put``, which run beside compute) it
  holds ``Lane(LINK, src, dst)``: every edge between the same two stages in
  the same direction shares that link, so their transfers serialize.
  Without ``overlap`` (a collective program over both meshes, the
  no-overlap baseline) it waits until both stages' compute lanes are free
  and holds both until it ends; its event is still recorded on the link.

Memory. The forward residuals of ``(s, m)`` live from the start of
``F(s, m)`` to the end of the task that frees them (``B(s, m)``, or
``I(s, m)`` when backwards are split, where ``lower_to_program`` frees
them); its weight state lives from the start of ``I(s, m)`` to the end of
``W(s, m)``. Peaks count these intervals over time, frees first at equal
times. The runtime counts by launch order instead; with positive compute
durations a stage's intervals open and close in its sequence's order, so
both counts agree and each checks the other.

Gradient reduction. A reduction of parameter gradients over a mesh's data
axis in every micro-batch is part of its backward's (or weight pass's)
duration. One per step (``TaskDurations.reduction``) is launched on each
mesh right after that mesh's last gradient task (``B`` or ``W`` of any
stage it hosts) and holds its compute lane; the step ends when every mesh's
reduction has. It is no ``Task`` (nothing in the pipeline reads it), so
``SimulatedStep.reductions`` records it beside the timeline.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Sequence

from ..pipeline.scheduling.pipeline_schedule import PipelineSchedule
from ..program.tasks import Task, TaskKind, task_dependencies
from ..program.timeline import Lane, LaneKind, Timeline, TimelineEvent, timeline_of

__all__ = ["StageSeconds", "TaskDurations", "SimulatedStep", "simulate", "stage_seconds_from",
           "transfer_seconds_from"]

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT


def _check_seconds(name: str, values: Iterable[float]) -> None:
    for v in values:
        if not (math.isfinite(v) and v >= 0):
            raise ValueError(f"{name}: expected finite non-negative seconds, got {v!r}")


@dataclasses.dataclass(frozen=True)
class StageSeconds:
    """One micro-batch on one stage, in seconds: its forward, whole backward, and the
    activation-gradient (I) and weight-gradient (W) passes of its split backward."""

    forward: float
    backward: float
    backward_input: float
    backward_weight: float

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_seconds(f"StageSeconds.{field.name}", [getattr(self, field.name)])

    def of(self, kind: TaskKind) -> float:
        """The duration of this stage's compute task of ``kind``."""
        if kind is F:
            return self.forward
        if kind is B:
            return self.backward
        return self.backward_input if kind is I else self.backward_weight


@dataclasses.dataclass(frozen=True)
class TaskDurations:
    """How long each task of a schedule takes.

    Attributes:
      stages: per stage, its compute tasks' seconds.
      activation, gradient: per schedule edge (``schedule.edges`` index), one
        micro-batch's activation resp. cotangent transfer, in seconds.
      reduction: per mesh (``schedule.stage_mesh`` index), the seconds of its one
        reduction of all its stages' parameter gradients per step (module doc);
        empty: no per-step reduction (none priced, or each runs inside a backward).
    """

    stages: tuple[StageSeconds, ...]
    activation: tuple[float, ...]
    gradient: tuple[float, ...]
    reduction: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check_seconds("TaskDurations.activation", self.activation)
        _check_seconds("TaskDurations.gradient", self.gradient)
        _check_seconds("TaskDurations.reduction", self.reduction)
        if len(self.activation) != len(self.gradient):
            raise ValueError(f"TaskDurations.gradient: expected one per edge ({len(self.activation)}), "
                             f"got {len(self.gradient)}")

    def seconds(self, task: Task) -> float:
        """``task``'s duration: compute by its stage, transfers by their edge."""
        if task.kind is TaskKind.SEND_ACT:
            return self.activation[task.where]
        if task.kind is TaskKind.SEND_GRAD:
            return self.gradient[task.where]
        return self.stages[task.where].of(task.kind)


@dataclasses.dataclass(frozen=True)
class SimulatedStep:
    """A simulated step.

    Attributes:
      step_seconds: from the first task's start to the last one's (or per-step
        reduction's) end.
      bubble_fraction: ``1 - busy / (P * step_seconds)``, ``busy`` the seconds of compute
        tasks and per-step reductions summed over meshes, ``P`` the meshes (the groups of
        cores they compute on, when they share some): the share of compute time spent idle
        or held by a transfer (0 for a step of no time). A reduction
        counts as busy either way it runs: inside a backward or once per step.
      peak_live_activations: per stage, most micro-batches whose forward
        residuals are held at once.
      peak_weight_states: per stage, most weight passes waiting at once.
      timeline: every task's event, ``source="simulated"``.
      reductions: per mesh, ``(start, end)`` of its per-step gradient reduction on
        ``Lane(COMPUTE, mesh)``, on the timeline's clock; empty when
        ``TaskDurations.reduction`` is.
    """

    step_seconds: float
    bubble_fraction: float
    peak_live_activations: tuple[int, ...]
    peak_weight_states: tuple[int, ...]
    timeline: Timeline
    reductions: tuple[tuple[float, float], ...]


def _link(task: Task, schedule: PipelineSchedule) -> Lane:
    producer, consumer = (schedule.stage_mesh[s] for s in schedule.edges[task.where])
    src, dst = (producer, consumer) if task.kind is TaskKind.SEND_ACT else (consumer, producer)
    return Lane(LaneKind.LINK, src, dst)


def _event_lane(task: Task, schedule: PipelineSchedule) -> Lane:
    return Lane(LaneKind.COMPUTE, schedule.stage_mesh[task.where]) if task.kind.is_compute else _link(task, schedule)


def _held_lanes(task: Task, schedule: PipelineSchedule, overlap: bool, cores: Sequence[int]) -> tuple[Lane, ...]:
    """The lanes ``task`` needs free to start and keeps busy until it ends: a mesh's compute holds
    the compute lane of its group of cores (``cores[mesh]``)."""
    lane = _event_lane(task, schedule)
    if task.kind.is_compute:
        return (Lane(LaneKind.COMPUTE, cores[lane.src]),)
    if overlap or lane.src == lane.dst:
        return (lane,)
    return (Lane(LaneKind.COMPUTE, cores[lane.src]), Lane(LaneKind.COMPUTE, cores[lane.dst]))


def _check_sizes(schedule: PipelineSchedule, durations: TaskDurations) -> None:
    if len(durations.stages) != schedule.num_stages:
        raise ValueError(f"durations: {len(durations.stages)} stages' seconds for a "
                         f"{schedule.num_stages}-stage schedule")
    if len(durations.activation) != len(schedule.edges):
        raise ValueError(f"durations: {len(durations.activation)} edges' transfer seconds for a schedule "
                         f"of {len(schedule.edges)} edges")
    if durations.reduction and len(durations.reduction) != schedule.num_meshes:
        raise ValueError(f"durations.reduction: expected one per mesh ({schedule.num_meshes}) or none, "
                         f"got {len(durations.reduction)}")


def _last_gradient_tasks(schedule: PipelineSchedule) -> dict[int, int]:
    """Per mesh, the position in ``schedule.order`` of its last ``B`` or ``W``: where its per-step
    reduction is launched."""
    last = {}
    for position, task in enumerate(schedule.order):
        if task.kind in (B, W):
            last[schedule.stage_mesh[task.where]] = position
    return last


def _events(schedule: PipelineSchedule, durations: TaskDurations, overlap: bool,
            cores: Sequence[int]) -> tuple[list[TimelineEvent], dict[int, tuple[float, float]]]:
    """Every task of the launch order, timed in one walk, and per mesh its per-step reduction's
    ``(start, end)`` (module doc; none when ``durations.reduction`` is empty)."""
    end: dict[Task, float] = {}
    free: dict[Lane, float] = {}
    events = []
    reduce_after = {p: mesh for mesh, p in _last_gradient_tasks(schedule).items()} if durations.reduction else {}
    reductions = {}
    for position, task in enumerate(schedule.order):
        held = _held_lanes(task, schedule, overlap, cores)
        ready = [end[d] for d in task_dependencies(task, schedule.edges, schedule.split_backward)]
        start = max(ready + [free.get(lane, 0.0) for lane in held])
        end[task] = start + durations.seconds(task)
        for lane in held:
            free[lane] = end[task]
        events.append(TimelineEvent(task, _event_lane(task, schedule), start, end[task]))
        if position in reduce_after:
            # Launched right behind the gradient task on its lane, so it starts as that task
            # ends, and whatever the mesh runs next (a blocking transfer) waits for it.
            mesh = reduce_after[position]
            lane = Lane(LaneKind.COMPUTE, cores[mesh])
            reductions[mesh] = (free[lane], free[lane] + durations.reduction[mesh])
            free[lane] = reductions[mesh][1]
    return events, reductions


def _peaks(events: Iterable[TimelineEvent], num_stages: int, opens: TaskKind, closes: TaskKind) -> tuple[int, ...]:
    """Per stage, most intervals open at once, each from an ``opens`` task's start to the end of the
    micro-batch's ``closes`` task; at equal times the closes count first."""
    changes: list[list[tuple[float, int]]] = [[] for _ in range(num_stages)]
    for e in events:
        if e.task.kind is opens:
            changes[e.task.where].append((e.start, 1))
        elif e.task.kind is closes:
            changes[e.task.where].append((e.end, -1))
    peaks = []
    for stage in changes:
        open_now = peak = 0
        for _, delta in sorted(stage):
            open_now += delta
            peak = max(peak, open_now)
        peaks.append(peak)
    return tuple(peaks)


def simulate(schedule: PipelineSchedule, durations: TaskDurations, overlap: bool = True,
             cores: Sequence[int] | None = None) -> SimulatedStep:
    """``schedule``'s step with task ``durations`` (module doc); ``overlap=False`` runs every
    transfer as a collective that blocks both its stages.

    ``cores``: per mesh, the group of cores its compute runs on; meshes of one group compute one
    at a time, as one process's meshes on a CPU do (its devices share the machine's cores: two
    meshes computing at once each run at about half speed, which costs the step what running
    them in turn does). ``None``: each mesh computes on its own (hosts, GPUs).

    Raises:
      ValueError: ``durations`` not sized to ``schedule``'s stages, edges and (its
        ``reduction``, unless empty) meshes, or ``cores`` not one per mesh.
    """
    _check_sizes(schedule, durations)
    if cores is None:
        cores = range(schedule.num_meshes)
    elif len(cores) != schedule.num_meshes:
        raise ValueError(f"cores: expected one group per mesh ({schedule.num_meshes}), got {len(cores)}")
    events, reduction_spans = _events(schedule, durations, overlap, cores)
    timeline = timeline_of(events, "simulated")
    # Every mesh runs a backward of each of its stages, so each has a reduction once any is priced.
    reductions = tuple((start - timeline.origin, end - timeline.origin)
                       for start, end in (reduction_spans[m] for m in range(len(durations.reduction))))
    step = max([timeline.makespan] + [end for _, end in reductions])
    busy = (sum(e.end - e.start for e in timeline.events if e.task.kind.is_compute)
            + sum(end - start for start, end in reductions))
    S = schedule.num_stages
    return SimulatedStep(
        step_seconds=step,
        bubble_fraction=1 - busy / (len(set(cores)) * step) if step > 0 else 0.0,
        peak_live_activations=_peaks(timeline.events, S, F, I if schedule.split_backward else B),
        peak_weight_states=_peaks(timeline.events, S, I, W),
        timeline=timeline,
        reductions=reductions,
    )


def _stage_seconds(stage: int, measured: dict[tuple[int, TaskKind], list[float]]) -> StageSeconds:
    def median(kind: TaskKind) -> float:
        if (stage, kind) not in measured:
            raise ValueError(f"timeline: stage {stage} has no {kind.name.lower()} events")
        return statistics.median(measured[(stage, kind)])

    forward = median(F)
    if (stage, B) in measured:
        # The timeline cannot tell the two passes of a whole backward apart: an estimate.
        backward = median(B)
        return StageSeconds(forward, backward, backward / 2, backward / 2)
    backward_input, backward_weight = median(I), median(W)
    return StageSeconds(forward, backward_input + backward_weight, backward_input, backward_weight)


def _timelines(timelines: Timeline | Sequence[Timeline]) -> Sequence[Timeline]:
    return (timelines,) if isinstance(timelines, Timeline) else timelines


def stage_seconds_from(timelines: Timeline | Sequence[Timeline], num_stages: int) -> tuple[StageSeconds, ...]:
    """Per stage, the median duration of each kind of compute task in (measured) ``timelines``:
    one step's, or several steps' pooled (on one core, one step's isolated times vary by tens of
    percent from one step to the next; the median over several is what a step costs).

    A whole backward's input and weight passes are each estimated as half of
    it; a split one's whole backward is the sum of its two passes.

    Raises:
      ValueError: naming a stage without forward (or backward) events.
    """
    measured: dict[tuple[int, TaskKind], list[float]] = {}
    for timeline in _timelines(timelines):
        for e in timeline.events:
            if e.task.kind.is_compute:
                measured.setdefault((e.task.where, e.task.kind), []).append(e.end - e.start)
    return tuple(_stage_seconds(s, measured) for s in range(num_stages))


def transfer_seconds_from(timelines: Timeline | Sequence[Timeline],
                          num_edges: int) -> tuple[tuple[float | None, ...], tuple[float | None, ...]]:
    """Per edge, the median duration of its activation and of its cotangent transfers in
    (measured, serialized) ``timelines``: what a move takes alone, its latency included.
    ``None`` for an edge with no such event (a value with no cotangent; a move no process
    here received)."""
    measured: dict[tuple[int, TaskKind], list[float]] = {}
    for timeline in _timelines(timelines):
        for e in timeline.events:
            if not e.task.kind.is_compute:
                measured.setdefault((e.task.where, e.task.kind), []).append(e.end - e.start)

    def median(edge: int, kind: TaskKind) -> float | None:
        return statistics.median(measured[(edge, kind)]) if (edge, kind) in measured else None

    return (tuple(median(e, TaskKind.SEND_ACT) for e in range(num_edges)),
            tuple(median(e, TaskKind.SEND_GRAD) for e in range(num_edges)))
