"""Pass: a pipeline schedule as typed tasks, per mesh and in one launch order.

Tasks are the compute of (stage, micro-batch): ``FORWARD``, a whole
``BACKWARD``, or a backward split into ``BACKWARD_INPUT`` (the activation
cotangents the previous stage waits for) and ``BACKWARD_WEIGHT`` (the
parameter cotangents nobody waits for); and the transfers of an activation
(``SEND_ACT``) or its cotangent (``SEND_GRAD``) along a stage-graph edge.
Each mesh runs its own task sequence (the schedule); a mesh may host several
stages (virtual stages), placed by the schedule's ``StagePlacement``
(``stage_mesh``). The launch order merges the sequences into one list that
every process follows, so transfers start in the same order everywhere and
cannot deadlock.

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
- ``interleaved_1f1b`` (Narayanan et al., SC'21): ``v`` stages per mesh, stage
  ``k`` on mesh ``k mod P``; 1F1B over chunks of ``P`` micro-batches, which
  shrinks the bubble to ``(P - 1) / (v·M)`` of the ideal step. ``M`` must be
  a multiple of ``P``, as in Megatron-LM.
- ``interleaved_zb`` (``interleaved_zero_bubble``; PyTorch's ``ScheduleInterleavedZeroBubble``,
  the zero-bubble paper's ZB1P): ``interleaved_1f1b``'s looped placement with split
  backwards, mesh ``r`` holding back its first ``r`` weight passes to fill the bubbles. With
  virtual stages ``M`` must be a multiple of torch's ``max(1, M // P)`` rounds.
- ``zb_v`` and ``dualpipev`` (``v_schedules``): exactly two stages per mesh on the
  V placement (stages ``r`` and ``2P - 1 - r`` on mesh ``r``), split backwards
  with the weight passes placed by the schedule, at least ``2P`` micro-batches.
- ``forward_only`` and ``forward_only_v`` (``forward_only``): forwards only, for a step without
  a gradient (an evaluation step), on the loop resp. V placement. They are registered apart
  (``FORWARD_ONLY_SCHEDULES``, by placement): a train step cannot run them, and the compiler,
  not the user, picks the one with the train schedule's placement (``forward_only_schedule``).

A new schedule is one function ``(num_meshes, stages_per_mesh, M) -> per-mesh
compute tasks`` and one ``ScheduleKind`` in ``SCHEDULES``. A name resolves to its
``ScheduleKind`` once, at the API (``PipeshardParallel``, ``PlanConstraints``: ``schedule_kind``);
the compiler and planner pass the ``ScheduleKind`` on. This module's entry points
(``make_schedule``, ``mesh_sequences``, ``check_stage_placement``, ``forward_only_schedule``)
also take a registered name, for direct callers (tests, benchmarks, charts). A user's own order, loaded from
torch's CSV action format (``schedule_csv``), is a ``ScheduleKind`` of one fixed ``size``,
accepted wherever a schedule name is.

Weight delaying (the paper's backward weight delaying) applies to the first
schedules with whole backwards: each ``BACKWARD`` becomes ``BACKWARD_INPUT``
followed, ``delay`` of the mesh's compute tasks later, by its ``BACKWARD_WEIGHT``. With ``gpipe`` this
means that in the backward phase each weight pass runs after the next
micro-batch's activation pass.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence

from ...compiler_pass import compiler_pass
from ...program.tasks import Task, TaskKind, task_dependencies
from .dependency_graph import dependency_graph, launch_order, verify_acyclic
from .forward_only import FORWARD_ONLY, FORWARD_ONLY_V, forward_only_actions
from .interleaved_zero_bubble import interleaved_zb_actions, interleaved_zb_rounds
from .v_schedules import V_STAGES_PER_MESH, dualpipev_actions, min_micro_batches_v, zb_v_actions

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT

__all__ = ["FORWARD_ONLY_SCHEDULES", "PipelineSchedule", "SCHEDULES", "ScheduleKind", "StagePlacement",
           "check_stage_placement",
           "forward_only_schedule", "make_schedule", "mesh_sequences", "schedule_kind", "verify_schedule"]


class StagePlacement(enum.Enum):
    """Which mesh hosts each stage, for ``num_stages = num_meshes * stages_per_mesh``."""

    LOOP = "loop"  # stage k on mesh k mod P: a micro-batch loops over the meshes stages_per_mesh times
    # 2P stages: stage k on mesh k for k < P, else on mesh 2P - 1 - k; a micro-batch goes down the
    # meshes and back up, so the first and last stages share mesh 0.
    V = "v"

    def mesh_of(self, stage: int, num_meshes: int) -> int:
        """The mesh of ``stage`` (``0 <= stage < num_stages``) among ``num_meshes`` meshes.

        Raises:
          ValueError: naming ``stage`` outside the V's ``2 * num_meshes`` stages.
        """
        if self is StagePlacement.V:
            if not 0 <= stage < 2 * num_meshes:
                raise ValueError(f"stage: the V places 2 x {num_meshes} stages, got stage {stage}")
            return stage if stage < num_meshes else 2 * num_meshes - 1 - stage
        return stage % num_meshes


# (num_meshes, stages_per_mesh, num_micro_batches) -> per mesh, its compute tasks in order.
MeshActions = Callable[[int, int, int], list[list[Task]]]


@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """One entry of ``SCHEDULES``: the compute tasks each mesh runs, in order.

    Attributes:
      name: the user's name for it (``PipeshardParallel(schedule=...)``).
      actions: ``(num_meshes, stages_per_mesh, num_micro_batches) ->`` per mesh, its
        compute tasks (``Task.where`` is the stage), with every backward whole unless
        ``places_weight_passes``.
      placement: which mesh hosts each stage.
      virtual_stages: whether ``actions`` takes ``stages_per_mesh > 1``.
      places_weight_passes: whether ``actions`` splits backwards and places the weight passes
        itself (then weight delaying does not apply).
      micro_batches_per_round: ``(num_meshes, num_micro_batches) ->`` what ``num_micro_batches``
        must be a multiple of with virtual stages (``None``: any number).
      stages_per_mesh: the only number of stages per mesh ``actions`` takes (``None``: any
        its ``virtual_stages`` allows).
      min_micro_batches: ``num_meshes ->`` the fewest micro-batches ``actions`` takes
        (``None``: one).
      size: ``(num_stages, num_meshes, num_micro_batches)``, the only size ``actions`` takes: a
        schedule given as data (``schedule_csv``); ``None``: any size the fields above allow.
      task_name: how errors name a compute task of an order given as data, as its author wrote
        it (a CSV's action, rank and cell); ``None``: as ``Task`` prints.
      forward_only: ``actions`` runs forwards only (a step without a gradient): no backward
        task and no cotangent transfer exists.
    """

    name: str
    actions: MeshActions
    placement: StagePlacement = StagePlacement.LOOP
    virtual_stages: bool = False
    places_weight_passes: bool = False
    micro_batches_per_round: Callable[[int, int], int] | None = None
    stages_per_mesh: int | None = None
    min_micro_batches: Callable[[int], int] | None = None
    size: tuple[int, int, int] | None = None
    task_name: Callable[[Task], str] | None = None
    forward_only: bool = False

    def peak_live(self, stage: int, num_stages: int, num_micro_batches: int, num_meshes: int | None = None) -> int:
        """Micro-batches whose forward residuals stage ``stage`` holds at its peak (counted
        along its mesh's actions: a forward opens one, a backward or input pass closes one)."""
        P = num_stages if num_meshes is None else num_meshes
        return _peak_live(self, num_stages // P, P, num_micro_batches)[stage]


@functools.lru_cache(maxsize=256)
def _peak_live(kind: ScheduleKind, stages_per_mesh: int, num_meshes: int, num_micro_batches: int) -> tuple[int, ...]:
    live = [0] * (num_meshes * stages_per_mesh)
    peak = list(live)
    for seq in kind.actions(num_meshes, stages_per_mesh, num_micro_batches):
        for t in seq:
            if t.kind is F:
                live[t.where] += 1
                peak[t.where] = max(peak[t.where], live[t.where])
            elif t.kind in (B, I):
                live[t.where] -= 1
    return tuple(peak)


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A schedule for a stage graph whose stages are placed on meshes.

    Attributes:
      name: a key of ``SCHEDULES``, or the name of a ``ScheduleKind`` given as data.
      num_stages, num_micro_batches: its size.
      stage_mesh: per stage, the mesh that runs it (several stages may share one).
      edges: ``(producer, consumer)`` stage pairs, indexed by transfer tasks.
      split_backward: whether backwards are split into input and weight passes.
      weight_delays: per mesh, how many compute tasks each weight pass waits
        after its input pass (``None`` for ``zb_h1`` and unsplit schedules).
      sequences: per mesh, its compute tasks in the order it runs them.
      order: every task once, in launch order.
      forward_only: forwards and activation transfers only (``ScheduleKind.forward_only``).
    """

    name: str
    num_stages: int
    num_micro_batches: int
    edges: tuple[tuple[int, int], ...]
    split_backward: bool
    weight_delays: tuple[int, ...] | None
    sequences: tuple[tuple[Task, ...], ...]
    order: tuple[Task, ...]
    stage_mesh: tuple[int, ...]
    forward_only: bool = False

    @property
    def num_meshes(self) -> int:
        return len(self.sequences)

    def stages_on(self, mesh: int) -> tuple[int, ...]:
        """The stages mesh ``mesh`` runs, in stage order."""
        return tuple(s for s, m in enumerate(self.stage_mesh) if m == mesh)


def _one_stage_per_mesh(forwards_ahead: Callable[[int, int], int] | None,
                        weight_passes: Callable[[list[Task], int], list[Task]] | None = None) -> MeshActions:
    """The actions of a schedule with one stage per mesh: stage ``s`` runs ``forwards_ahead(s, S)``
    forwards before its first backward, then alternates (all forwards first when ``None``);
    ``weight_passes(sequence, s)`` splits its backwards and places the weight passes."""

    def actions(num_meshes: int, stages_per_mesh: int, m: int) -> list[list[Task]]:
        out = []
        for s in range(num_meshes):
            fwd = [Task(F, s, i) for i in range(m)]
            bwd = [Task(B, s, i) for i in range(m)]
            if forwards_ahead is None:
                seq = fwd + bwd
            else:
                warmup = min(forwards_ahead(s, num_meshes) - 1, m)
                seq = fwd[:warmup]
                for i in range(m - warmup):
                    seq += [fwd[warmup + i], bwd[i]]
                seq += bwd[m - warmup:]
            out.append(seq if weight_passes is None else weight_passes(seq, s))
        return out

    return actions


def _interleaved_1f1b(num_meshes: int, stages_per_mesh: int, m: int) -> list[list[Task]]:
    """Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM's order). Mesh ``r`` holds the
    ``v`` stages ``c·P + r`` (chunks ``c``). Its forwards visit chunks in groups of ``P``
    micro-batches: the ``k``-th forward is chunk ``(k mod P·v) // P`` on micro-batch
    ``(k // P·v)·P + k mod P``; backwards go the same way with the chunks reversed. It runs
    ``2(P - r - 1) + (v - 1)·P`` forwards first (every forward when ``M = P``), then alternates
    one forward and one backward, then drains the backwards."""
    P, v = num_meshes, stages_per_mesh
    total = m * v

    def task(kind: TaskKind, k: int, r: int) -> Task:
        chunk = (k % (P * v)) // P
        if kind is not F:
            chunk = v - 1 - chunk
        return Task(kind, chunk * P + r, (k // (P * v)) * P + k % P)

    out = []
    for r in range(P):
        warmup = total if m == P else min(2 * (P - r - 1) + (v - 1) * P, total)
        seq = [task(F, k, r) for k in range(warmup)]
        for k in range(total - warmup):
            seq += [task(F, warmup + k, r), task(B, k, r)]
        seq += [task(B, k, r) for k in range(total - warmup, total)]
        out.append(seq)
    return out


def _delay_weights(seq: list[Task], delay: int) -> list[Task]:
    """Each backward split, its weight pass after ``delay`` more of the mesh's compute tasks."""
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


def mesh_sequences(name: str | ScheduleKind, num_stages: int, num_micro_batches: int, num_meshes: int | None = None,
                   delays: Sequence[int] | None = None) -> list[list[Task]]:
    """Per mesh, its compute tasks under schedule ``name`` (a registered name or a ``ScheduleKind``);
    ``delays`` (per mesh) split backwards (see module doc). ``num_meshes`` defaults to one stage
    per mesh."""
    kind = schedule_kind(name)
    P = num_stages if num_meshes is None else num_meshes
    seqs = kind.actions(P, num_stages // P, num_micro_batches)
    if delays is None or kind.places_weight_passes:
        return seqs
    return [_delay_weights(seq, d) for seq, d in zip(seqs, delays)]


def schedule_kind(name: str | ScheduleKind) -> ScheduleKind:
    """The registered schedule ``name``, or ``name`` itself when it is a ``ScheduleKind`` (a
    schedule given as data, e.g. ``schedule_csv.load_schedule_csv``).

    Raises:
      ValueError: naming ``schedule`` and the registered names.
    """
    if isinstance(name, ScheduleKind):
        return name
    if not isinstance(name, str) or name not in SCHEDULES:
        # A path is the likeliest wrong name: say how to load it.
        hint = "; load a CSV order with meshpar.load_schedule_csv(path)" if str(name).endswith(".csv") else ""
        raise ValueError(f"schedule: unknown {name!r}; expected one of {sorted(SCHEDULES)} or a ScheduleKind "
                         f"(meshpar.load_schedule_csv){hint}")
    return SCHEDULES[name]


def check_stage_placement(schedule: str | ScheduleKind, num_stages: int, num_meshes: int,
                          num_micro_batches: int) -> None:
    """Checks that ``schedule`` (a registered name or a ``ScheduleKind``) can place ``num_stages``
    stages on ``num_meshes`` meshes with ``num_micro_batches`` micro-batches.

    Raises:
      ValueError: naming ``schedule`` (unknown, or one stage per mesh only), ``num_stages``
        (not a multiple of the meshes), ``stages_per_mesh`` and ``num_meshes`` (not the one
        number of stages per mesh the schedule takes, e.g. ``num_stages != 2 * num_meshes``
        for the V schedules), ``num_micro_batches`` (fewer than, or not a multiple of, what
        the schedule needs, with counts that fit), or every size that differs from the one
        size of a schedule given as data.
    """
    kind = schedule_kind(schedule)
    name = kind.name
    if num_meshes < 1 or num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"num_stages, num_micro_batches: expected positive counts, got {num_stages} stages on "
                         f"{num_meshes} meshes, {num_micro_batches} micro-batches")
    if kind.size is not None:
        _check_size(kind, (num_stages, num_meshes, num_micro_batches))
    if kind.stages_per_mesh is not None and num_stages != kind.stages_per_mesh * num_meshes:
        k = kind.stages_per_mesh
        if num_stages % k:
            raise ValueError(f"num_stages: {name} places exactly {k} stages on each mesh, so it needs a "
                             f"multiple of {k} stages, got {num_stages}")
        raise ValueError(f"stages_per_mesh, num_meshes: {name} places exactly {k} stages on each mesh, so "
                         f"{num_stages} stages need num_meshes={num_stages // k}, got {num_meshes} meshes "
                         f"({num_stages / num_meshes:g} per mesh); pass stages_per_mesh={k}")
    if kind.min_micro_batches is not None and num_micro_batches < kind.min_micro_batches(num_meshes):
        raise ValueError(f"num_micro_batches: {name} needs at least {kind.min_micro_batches(num_meshes)} "
                         f"micro-batches on {num_meshes} meshes, got {num_micro_batches}")
    if num_stages % num_meshes:
        raise ValueError(f"num_stages: {num_stages} stages do not divide over {num_meshes} meshes; pass a multiple "
                         f"of {num_meshes} stages (stages_per_mesh = num_stages / meshes)")
    if num_stages == num_meshes:
        return
    if not kind.virtual_stages:
        virtual = sorted(n for n, k in SCHEDULES.items() if k.virtual_stages)
        raise ValueError(f"schedule: {name!r} runs one stage per mesh, but {num_stages} stages share "
                         f"{num_meshes} meshes ({num_stages // num_meshes} per mesh); pass one of {virtual}, or one "
                         f"mesh per stage")
    if kind.micro_batches_per_round is not None:
        step = kind.micro_batches_per_round(num_meshes, num_micro_batches)
        if num_micro_batches % step:
            fits = _fitting_micro_batches(kind, num_meshes, num_micro_batches)
            raise ValueError(f"num_micro_batches: {name} with virtual stages needs a multiple of {step} "
                             f"micro-batches ({num_meshes} meshes), got {num_micro_batches}; "
                             f"pass e.g. {' or '.join(map(str, fits))}")


def _check_size(kind: ScheduleKind, size: tuple[int, int, int]) -> None:
    """Raises ``ValueError`` naming each of ``num_stages``, ``num_meshes``, ``num_micro_batches`` in
    ``size`` that differs from ``kind.size``, the one size a schedule given as data runs at."""
    labels = ("num_stages", "num_meshes", "num_micro_batches")
    wrong = [(label, want, got) for label, want, got in zip(labels, kind.size, size) if want != got]
    if wrong:
        S, P, M = kind.size
        # The meshes follow from the stages per mesh, which is what a user passes.
        fix = f"; pass stages_per_mesh={S // P}" if size[1] != P and size[0] == S else ""
        raise ValueError(f"{', '.join(label for label, _, _ in wrong)}: schedule {kind.name!r} is an order for "
                         f"{S} stages on {P} meshes over {M} micro-batches; got "
                         + ", ".join(f"{label}={got}" for label, _, got in wrong) + fix)


def _fitting_micro_batches(kind: ScheduleKind, num_meshes: int, num_micro_batches: int) -> list[int]:
    """The nearest counts below and above ``num_micro_batches`` that ``kind.micro_batches_per_round``
    divides (the one above only, when none below does)."""
    def fits(m: int) -> bool:
        return m % kind.micro_batches_per_round(num_meshes, m) == 0

    below = [m for m in range(num_micro_batches - 1, 0, -1) if fits(m)][:1]
    above = next(m for m in range(num_micro_batches + 1, 2 * num_micro_batches + num_meshes + 1) if fits(m))
    return below + [above]


@compiler_pass
def make_schedule(
    name: str | ScheduleKind,
    num_stages: int,
    num_micro_batches: int,
    edges: Sequence[tuple[int, int]],
    weight_delays: Sequence[int] | None = None,
    num_meshes: int | None = None,
) -> PipelineSchedule:
    """The ``name`` schedule (a registered name or a ``ScheduleKind``) for ``num_stages`` stages
    joined by ``edges``, placed on ``num_meshes`` meshes (default: one stage per mesh) as the
    schedule places them.

    Args:
      weight_delays: per mesh, split each backward and delay its weight pass
        by this many compute tasks; ``None`` keeps backwards whole (``zb_h1``
        always splits and places weight passes itself).

    Raises:
      ValueError: unknown ``name``, sizes below 1, a placement the schedule cannot make
        (``check_stage_placement``), or delays that do not fit.
      ValueError: naming ``schedule`` and the tasks of a cycle, when an order given as data
        (``ScheduleKind.size``) deadlocks on ``edges`` (``verify_acyclic``).
      PlanVerificationError: a built-in order that deadlocks, or that ``verify_schedule`` rejects.
    """
    kind = schedule_kind(name)
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches: expected >= 1, got {num_micro_batches}")
    P = num_stages if num_meshes is None else num_meshes
    check_stage_placement(kind, num_stages, P, num_micro_batches)
    if weight_delays is not None:
        if kind.places_weight_passes:
            raise ValueError(f"weight_delay: {kind.name} places its weight passes itself; leave weight_delay=False")
        if len(weight_delays) != P or any(not isinstance(d, int) or d < 0 for d in weight_delays):
            raise ValueError(f"weight_delay: expected {P} non-negative delays (one per mesh), got {weight_delays!r}")
    edges = tuple(edges)
    split = kind.places_weight_passes or weight_delays is not None
    sequences = tuple(map(tuple, mesh_sequences(kind, num_stages, num_micro_batches, P, weight_delays)))
    stage_mesh = tuple(kind.placement.mesh_of(s, P) for s in range(num_stages))
    graph = dependency_graph(sequences, edges, split, num_micro_batches, kind.forward_only)
    verify_acyclic(graph, kind.name, given=kind.size is not None, task_name=kind.task_name)
    order = launch_order(graph, sequences)
    schedule = PipelineSchedule(kind.name, num_stages, num_micro_batches, edges, split,
                                None if weight_delays is None else tuple(weight_delays), sequences, order, stage_mesh,
                                kind.forward_only)
    verify_schedule(schedule)
    return schedule


def verify_schedule(schedule: PipelineSchedule) -> None:
    """Each task once, after its dependencies, each mesh's tasks in its sequence's order, each
    stage's compute on the mesh the map gives it.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    from ...verification import PlanVerificationError

    S, M, edges = schedule.num_stages, schedule.num_micro_batches, schedule.edges
    if len(schedule.stage_mesh) != S or not all(0 <= m < schedule.num_meshes for m in schedule.stage_mesh):
        raise PlanVerificationError(f"stage_mesh {schedule.stage_mesh} does not place {S} stages on "
                                    f"{schedule.num_meshes} meshes")
    backward = () if schedule.forward_only else (I, W) if schedule.split_backward else (B,)
    transfers = (TaskKind.SEND_ACT,) if schedule.forward_only else (TaskKind.SEND_ACT, TaskKind.SEND_GRAD)
    expected = {Task(k, s, m) for k in (F, *backward) for s in range(S) for m in range(M)}
    expected |= {Task(k, e, m) for k in transfers for e in range(len(edges)) for m in range(M)}
    if len(schedule.order) != len(expected) or set(schedule.order) != expected:
        raise PlanVerificationError("the launch order does not run every task exactly once")
    for mesh, seq in enumerate(schedule.sequences):
        elsewhere = [t for t in seq if schedule.stage_mesh[t.where] != mesh]
        if elsewhere:
            raise PlanVerificationError(f"mesh {mesh} runs {elsewhere[0]}, whose stage the map puts on mesh "
                                        f"{schedule.stage_mesh[elsewhere[0].where]}")
    seen: set[Task] = set()
    for t in schedule.order:
        missing = [d for d in task_dependencies(t, edges, schedule.split_backward) if d not in seen]
        if missing:
            raise PlanVerificationError(f"{t} launches before {missing[0]}, which it reads")
        seen.add(t)
    launched_on: list[list[Task]] = [[] for _ in schedule.sequences]
    for t in schedule.order:
        if t.kind.is_compute:
            launched_on[schedule.stage_mesh[t.where]].append(t)
    for mesh, (seq, launched) in enumerate(zip(schedule.sequences, launched_on)):
        if launched != list(seq):
            raise PlanVerificationError(f"mesh {mesh}: launch order {launched} breaks its sequence {list(seq)}")


def _one_f_one_b(s: int, num_stages: int) -> int:
    return num_stages - s


def _eager_one_f_one_b(s: int, num_stages: int) -> int:
    return 2 * (num_stages - s) - 1


def _one_round(num_meshes: int, num_micro_batches: int) -> int:
    return num_meshes


def _forward_only(placement: StagePlacement) -> MeshActions:
    """The forward-only actions (``forward_only.forward_only_actions``) on ``placement``."""
    def actions(num_meshes: int, stages_per_mesh: int, m: int) -> list[list[Task]]:
        return forward_only_actions([placement.mesh_of(s, num_meshes) for s in range(num_meshes * stages_per_mesh)],
                                    num_meshes, m)

    return actions


def forward_only_schedule(train: str | ScheduleKind) -> ScheduleKind:
    """The forward-only schedule for a step without a gradient compiled under the ``train``
    schedule (a registered name or a ``ScheduleKind``): the registered one with ``train``'s
    stage placement, so each stage runs on the mesh a train step runs it on.

    Raises:
      ValueError: ``train`` is not a schedule (``schedule_kind``).
    """
    return FORWARD_ONLY_SCHEDULES[schedule_kind(train).placement]


# Name -> schedule; a new schedule is one actions function and one ScheduleKind here (its name
# is resolved only here).
SCHEDULES: dict[str, ScheduleKind] = {
    kind.name: kind for kind in (
        ScheduleKind("gpipe", _one_stage_per_mesh(None)),
        ScheduleKind("1f1b", _one_stage_per_mesh(_one_f_one_b)),
        ScheduleKind("eager_1f1b", _one_stage_per_mesh(_eager_one_f_one_b)),
        ScheduleKind("zb_h1", _one_stage_per_mesh(_one_f_one_b, _zb_h1), places_weight_passes=True),
        # Megatron-LM requires the micro-batches to fill whole rounds of the meshes.
        ScheduleKind("interleaved_1f1b", _interleaved_1f1b, virtual_stages=True, micro_batches_per_round=_one_round),
        # torch's flexible rounds: M a multiple of max(1, M // P), not of P.
        ScheduleKind("interleaved_zb", interleaved_zb_actions, virtual_stages=True, places_weight_passes=True,
                     micro_batches_per_round=interleaved_zb_rounds),
        ScheduleKind("zb_v", zb_v_actions, StagePlacement.V, virtual_stages=True, places_weight_passes=True,
                     stages_per_mesh=V_STAGES_PER_MESH, min_micro_batches=min_micro_batches_v),
        ScheduleKind("dualpipev", dualpipev_actions, StagePlacement.V, virtual_stages=True,
                     places_weight_passes=True, stages_per_mesh=V_STAGES_PER_MESH,
                     min_micro_batches=min_micro_batches_v),
    )
}

# Per stage placement, the schedule of a step without a gradient (an evaluation step): not in
# SCHEDULES, whose schedules train (a user or planner choosing among them); the compiler picks
# one by the train schedule's placement (forward_only_schedule) and passes the kind itself.
FORWARD_ONLY_SCHEDULES: dict[StagePlacement, ScheduleKind] = {
    StagePlacement.LOOP: ScheduleKind(FORWARD_ONLY, _forward_only(StagePlacement.LOOP), virtual_stages=True,
                                      forward_only=True),
    StagePlacement.V: ScheduleKind(FORWARD_ONLY_V, _forward_only(StagePlacement.V), StagePlacement.V,
                                   virtual_stages=True, stages_per_mesh=V_STAGES_PER_MESH, forward_only=True),
}
