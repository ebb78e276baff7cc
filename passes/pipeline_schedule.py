"""Pass: a pipeline schedule as typed tasks, per stage and in one launch order.

Tasks are the compute of (stage, micro-batch): ``FORWARD``, a whole
``BACKWARD``, or a backward split into ``BACKWARD_INPUT`` (the activation
cotangents the previous stage waits for) and ``BACKWARD_WEIGHT`` (the
parameter cotangents nobody waits for); and the transfers of an activation
(``SEND_ACT``) or its cotangent (``SEND_GRAD``) along a stage-graph edge.
Each stage runs its own task sequence (the schedule); the launch order merges
those sequences into one list that every process follows, so transfers start
in the same order everywhere and cannot deadlock.

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: stage ``s`` runs ``min(S - s - 1, M)`` forwards to warm up, then
  alternates one forward and one backward, then drains the backwards
  (Narayanan et al.), so at most ``S - s`` micro-batches are in flight.
- ``eager_1f1b``: the same with ``min(2(S - s) - 1, M)`` forwards before the
  first backward (the paper's 2(#stages - i) + 1 with 1-indexed ``i``; Alpa's
  ``1f1b_overlap_friendly``): the extra forwards give the next stage work
  while a boundary transfer is in flight, for at most ``S - s - 1`` more
  live micro-batches than 1F1B.
- ``zb_h1`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): 1F1B's
  forwards and activation-gradient passes, with stage ``s`` holding back its
  first ``s`` weight-gradient passes, which then run one per step and drain
  at the end, filling the cool-down bubbles; forward residuals are released
  as in 1F1B.

Weight delaying (the paper's backward weight delaying) applies to the first
three: each ``BACKWARD`` becomes ``BACKWARD_INPUT`` followed, ``delay`` of the
stage's compute tasks later, by its ``BACKWARD_WEIGHT``. With ``gpipe`` this
means that in the backward phase each weight pass runs after the next
micro-batch's activation pass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from .dependency_graph import dependency_graph, launch_order, verify_acyclic
from .pipeline_tasks import Task, TaskKind, task_dependencies

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT

__all__ = ["PipelineSchedule", "SCHEDULES", "ScheduleKind", "make_schedule", "schedule_kind", "stage_sequence",
           "verify_schedule"]


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """One entry of ``SCHEDULES``: how a stage orders its tasks.

    Attributes:
      name: the user's name for it (``PipeshardParallel(schedule=...)``).
      forwards_ahead: ``(stage, num_stages) ->`` the forwards stage ``s`` runs before its
        first backward, the steady phase's first included (``None``: every forward first,
        GPipe); also the micro-batches it holds at its peak, at most ``M``.
      places_weight_passes: ``(sequence, stage) ->`` the sequence with each backward split and
        its weight pass placed by the schedule itself (``None``: backwards stay whole unless
        weight delaying splits them).
    """

    name: str
    forwards_ahead: Callable[[int, int], int] | None
    places_weight_passes: Callable[[list[Task], int], list[Task]] | None = None

    def peak_live(self, stage: int, num_stages: int, num_micro_batches: int) -> int:
        """Micro-batches whose forward residuals stage ``stage`` holds at its peak."""
        if self.forwards_ahead is None:
            return num_micro_batches
        return min(self.forwards_ahead(stage, num_stages), num_micro_batches)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A schedule for a stage graph.

    Attributes:
      name: a key of ``SCHEDULES``.
      num_stages, num_micro_batches: its size.
      edges: ``(producer, consumer)`` stage pairs, indexed by transfer tasks.
      split_backward: whether backwards are split into input and weight passes.
      weight_delays: per stage, how many compute tasks each weight pass waits
        after its input pass (``None`` for ``zb_h1`` and unsplit schedules).
      sequences: each stage's compute tasks, in the order it runs them.
      order: every task once, in launch order.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    edges: tuple[tuple[int, int], ...]
    split_backward: bool
    weight_delays: tuple[int, ...] | None
    sequences: tuple[tuple[Task, ...], ...]
    order: tuple[Task, ...]


def _base_sequence(kind: ScheduleKind, s: int, num_stages: int, m: int) -> list[Task]:
    fwd = [Task(F, s, i) for i in range(m)]
    bwd = [Task(B, s, i) for i in range(m)]
    if kind.forwards_ahead is None:
        return fwd + bwd
    warmup = min(kind.forwards_ahead(s, num_stages) - 1, m)
    seq = fwd[:warmup]
    for i in range(m - warmup):
        seq += [fwd[warmup + i], bwd[i]]
    return seq + bwd[m - warmup :]


def _delay_weights(seq: list[Task], delay: int) -> list[Task]:
    """Each backward split, its weight pass after ``delay`` more of the stage's compute tasks."""
    out: list[Task] = []
    waiting: list[tuple[int, Task]] = []  # (compute tasks still to pass, weight task)
    for t in seq:
        out.append(Task(I, t.where, t.micro_batch) if t.kind is B else t)
        waiting = [(left - 1, w) for left, w in waiting]
        if t.kind is B:
            waiting.append((delay, Task(W, t.where, t.micro_batch)))
        while waiting and waiting[0][0] <= 0:
            out.append(waiting.pop(0)[1])
    return out + [w for _, w in waiting]


def _zb_h1(seq: list[Task], s: int) -> list[Task]:
    """ZB-H1: after each input pass, the oldest weight pass runs once ``s`` are held back."""
    out: list[Task] = []
    held: list[Task] = []
    for t in seq:
        if t.kind is B:
            out.append(Task(I, t.where, t.micro_batch))
            held.append(Task(W, t.where, t.micro_batch))
            if len(held) > s:
                out.append(held.pop(0))
        else:
            out.append(t)
    return out + held


def stage_sequence(name: str, s: int, num_stages: int, num_micro_batches: int, delay: int | None = None) -> list[Task]:
    """Stage ``s``'s compute tasks under schedule ``name``; ``delay`` splits backwards (see module doc)."""
    kind = schedule_kind(name)
    seq = _base_sequence(kind, s, num_stages, num_micro_batches)
    if kind.places_weight_passes is not None:
        return kind.places_weight_passes(seq, s)
    return seq if delay is None else _delay_weights(seq, delay)


def schedule_kind(name: str) -> ScheduleKind:
    """The registered schedule ``name``.

    Raises:
      ValueError: naming ``schedule`` and the registered names.
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown {name!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


def make_schedule(
    name: str,
    num_stages: int,
    num_micro_batches: int,
    edges: Sequence[tuple[int, int]],
    weight_delays: Sequence[int] | None = None,
) -> PipelineSchedule:
    """The ``name`` schedule for ``num_stages`` stages joined by ``edges``.

    Args:
      weight_delays: per stage, split each backward and delay its weight pass
        by this many compute tasks; ``None`` keeps backwards whole (``zb_h1``
        always splits and places weight passes itself).

    Raises:
      ValueError: unknown ``name``, sizes below 1, or delays that do not fit.
    """
    kind = schedule_kind(name)
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches: expected >= 1, got {num_micro_batches}")
    if weight_delays is not None:
        if kind.places_weight_passes is not None:
            raise ValueError(f"weight_delay: {name} places its weight passes itself; leave weight_delay=False")
        if len(weight_delays) != num_stages or any(not isinstance(d, int) or d < 0 for d in weight_delays):
            raise ValueError(f"weight_delay: expected {num_stages} non-negative delays, got {weight_delays!r}")
    edges = tuple(edges)
    split = kind.places_weight_passes is not None or weight_delays is not None
    sequences = tuple(
        tuple(stage_sequence(name, s, num_stages, num_micro_batches,
                             None if weight_delays is None else weight_delays[s]))
        for s in range(num_stages)
    )
    graph = dependency_graph(sequences, edges, split, num_micro_batches)
    verify_acyclic(graph, name)
    order = launch_order(graph, sequences)
    schedule = PipelineSchedule(name, num_stages, num_micro_batches, edges, split,
                                None if weight_delays is None else tuple(weight_delays), sequences, order)
    verify_schedule(schedule)
    return schedule


def verify_schedule(schedule: PipelineSchedule) -> None:
    """Each task once, after its dependencies, each stage's tasks in its sequence's order.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    from .unit_tasks import PlanVerificationError

    S, M, edges = schedule.num_stages, schedule.num_micro_batches, schedule.edges
    backward = (I, W) if schedule.split_backward else (B,)
    expected = {Task(k, s, m) for k in (F, *backward) for s in range(S) for m in range(M)}
    expected |= {Task(k, e, m) for k in (TaskKind.SEND_ACT, TaskKind.SEND_GRAD) for e in range(len(edges)) for m in range(M)}
    if len(schedule.order) != len(expected) or set(schedule.order) != expected:
        raise PlanVerificationError("the launch order does not run every task exactly once")
    seen: set[Task] = set()
    for t in schedule.order:
        missing = [d for d in task_dependencies(t, edges, schedule.split_backward) if d not in seen]
        if missing:
            raise PlanVerificationError(f"{t} launches before {missing[0]}, which it reads")
        seen.add(t)
    launched_on: list[list[Task]] = [[] for _ in range(S)]
    for t in schedule.order:
        if t.kind.is_compute:
            launched_on[t.where].append(t)
    for s, (seq, launched) in enumerate(zip(schedule.sequences, launched_on)):
        if launched != list(seq):
            raise PlanVerificationError(f"stage {s}: launch order {launched} breaks its sequence {list(seq)}")


def _one_f_one_b(s: int, num_stages: int) -> int:
    return num_stages - s


def _eager_one_f_one_b(s: int, num_stages: int) -> int:
    return 2 * (num_stages - s) - 1


# Name -> schedule; a new schedule is one ScheduleKind here (its name is resolved only here).
SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind for kind in (
        ScheduleKind("gpipe", None),
        ScheduleKind("1f1b", _one_f_one_b),
        ScheduleKind("eager_1f1b", _eager_one_f_one_b),
        ScheduleKind("zb_h1", _one_f_one_b, _zb_h1),
    )
}
