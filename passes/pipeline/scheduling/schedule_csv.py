"""Schedules as data: a per-mesh order in PyTorch's CSV action format, read and written.

The format is ``torch.distributed.pipelining``'s compute-only schedule CSV
(``PipelineScheduleMulti._load_csv`` / ``_dump_csv``, actions as ``_Action.from_str`` /
``__repr__`` spell them): one line per rank (here: per mesh), comma-separated actions
``<stage><type><micro-batch>``, e.g. ``0F0`` (stage 0's forward of micro-batch 0), ``3I1`` (its
input pass), ``3W1`` (its weight pass), ``2B0`` (a whole backward); an empty cell is an idle
step (torch's ``None``) and is skipped; ``(0F7;7B3)OVERLAP_F_B`` is its two sub-actions in
order. torch's lowered actions (``SEND_F``, ``RECV_B``, ``UNSHARD``, ``REDUCE_GRAD``, ...) are
rejected: meshpar places the transfers and gradient reductions itself.

A loaded order is a ``ScheduleKind`` of one ``size``, accepted wherever a schedule name is
(``make_schedule``, ``PipeshardParallel(schedule=...)``). What is inferred and checked:

- the placement: each stage runs on one rank, ``v`` stages per rank, stages ``0 .. S-1``
  placed in a loop (stage ``k`` on rank ``k mod P``) or a V (stages ``r`` and ``2P-1-r`` on
  rank ``r``), the placements meshpar's runtime runs;
- the micro-batches ``M``: every stage runs a forward and a backward of each of ``0 .. M-1``
  exactly once, backwards either whole (``B``) or split (``I`` and ``W``); a backward written
  whole where others are split is its input pass followed by its weight pass (a schedule here
  splits every backward or none);
- that the order does not deadlock on a chain of stages (``make_schedule``'s check, naming a
  cycle in the CSV's own actions, each with its rank, line and column). A stage graph's edges
  run from earlier stages to later ones, so the chain's dependencies already include a model's;
  ``make_schedule`` checks again when it compiles.

Writing gives the same format, so every built-in schedule can be saved, edited and loaded.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import re
from collections.abc import Sequence
from pathlib import Path

from ...program.tasks import Task, TaskKind
from .pipeline_schedule import PipelineSchedule, ScheduleKind, StagePlacement, make_schedule

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT

__all__ = ["format_schedule_csv", "load_schedule_csv", "parse_schedule_csv", "save_schedule_csv"]

_ACTION = re.compile(r"(\d+)([A-Z_]+)(\d*)")
_OVERLAP = re.compile(r"\((.*)\)OVERLAP_F_B")
_COMPUTE = {"F": F, "I": I, "W": W, "B": B}
# torch's lowered actions, which a compute-only order leaves out.
_LOWERED = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD")


@dataclasses.dataclass(frozen=True)
class _Cell:
    """Where an action sits: ``line`` (1-based; rank ``line - 1``) and ``column`` (1-based), and
    the ``token`` written there."""

    line: int
    column: int
    token: str

    def __str__(self) -> str:
        return f"line {self.line}, column {self.column}"


# One line of the CSV: its compute tasks, each with the cell it came from.
_Row = list[tuple[Task, _Cell]]


@dataclasses.dataclass(frozen=True)
class FixedOrder:
    """A ``ScheduleKind.actions`` that returns one order, given as data.

    Attributes:
      sequences: per mesh, its compute tasks in order (``Task.where`` is the stage).
    """

    sequences: tuple[tuple[Task, ...], ...]

    def __call__(self, num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> list[list[Task]]:
        """The order, for the size it was given at (``check_stage_placement`` checks that size
        against ``ScheduleKind.size`` first).

        Raises:
          ValueError: naming ``num_meshes`` when it differs from the order's meshes.
        """
        if num_meshes != len(self.sequences):
            raise ValueError(f"num_meshes: this order runs on {len(self.sequences)} meshes, got {num_meshes}")
        return [list(seq) for seq in self.sequences]


@dataclasses.dataclass(frozen=True)
class _CsvTaskNames:
    """A ``ScheduleKind.task_name`` for a CSV order: each compute task named as the CSV wrote it.

    Attributes:
      cells: each compute task of the order, with the cell it came from.
    """

    cells: tuple[tuple[Task, _Cell], ...]

    def __call__(self, task: Task) -> str:
        """``task`` as the CSV's action and where it is, e.g. ``1F0 (rank 1, line 2, column 3)``;
        a pass of a backward the CSV wrote whole (split by the CSV's other actions or by weight
        delaying) as that pass of it, e.g. ``0I0 of 0B0 (rank 0, line 1, column 4)``."""
        cells = dict(self.cells)
        cell = cells.get(task) or cells[Task(B, task.where, task.micro_batch)]
        action = _action(task)
        written = action if action == cell.token else f"{action} of {cell.token}"
        return f"{written} (rank {cell.line - 1}, {cell})"


def _cell_tasks(token: str, cell: _Cell) -> list[Task]:
    """The compute tasks of one CSV cell, in order (none for an empty cell).

    Raises:
      ValueError: naming the cell and the token when it is no compute action.
    """
    token = token.strip()
    if not token:
        return []
    overlap = _OVERLAP.fullmatch(token)
    if overlap:
        return [t for sub in overlap[1].split(";") for t in _cell_tasks(sub, cell)]
    match = _ACTION.fullmatch(token)
    if match and match[2] in _COMPUTE and match[3]:
        return [Task(_COMPUTE[match[2]], int(match[1]), int(match[3]))]
    why = (f"torch's lowered {match[2]} action; meshpar places transfers and gradient reductions itself, so "
           f"leave it out" if match and match[2] in _LOWERED else "not an action")
    raise ValueError(f"schedule: {cell} (rank {cell.line - 1}): {token!r} is {why}; expected a compute action "
                     f"<stage><F|I|W|B><micro-batch> (e.g. 0F0, 1I0, 1W0, 0B1) or (a;b)OVERLAP_F_B")


def _read_cells(text: str) -> list[_Row]:
    """Per line (rank), its compute tasks and the cell each came from."""
    rows = []
    for line, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [(task, cell) for column, token in enumerate(row, start=1)
                 for cell in [_Cell(line, column, token.strip())] for task in _cell_tasks(token, cell)]
        if not cells:
            raise ValueError(f"schedule: line {line} (rank {line - 1}) runs no compute action; every rank runs "
                             f"at least one stage")
        rows.append(cells)
    if not rows:
        raise ValueError("schedule: the CSV has no lines; expected one line of actions per rank")
    return rows


def _split_whole_backwards(rows: list[_Row]) -> tuple[list[_Row], bool]:
    """The rows with backwards all whole or all split, and whether split: where any backward is
    split, a whole one becomes its input pass then its weight pass (module doc)."""
    split = any(t.kind in (I, W) for row in rows for t, _ in row)
    if not split:
        return rows, False
    out = [[(part, cell) for t, cell in row
            for part in ((Task(I, t.where, t.micro_batch), Task(W, t.where, t.micro_batch)) if t.kind is B else (t,))]
           for row in rows]
    return out, True


def _stage_ranks(rows: list[_Row]) -> dict[int, int]:
    """Stage -> the rank (line) running it.

    Raises:
      ValueError: a stage on two ranks, or stage numbers with gaps.
    """
    rank_of: dict[int, tuple[int, _Cell]] = {}
    for rank, row in enumerate(rows):
        for task, cell in row:
            first = rank_of.setdefault(task.where, (rank, cell))
            if first[0] != rank:
                raise ValueError(f"schedule: stage {task.where} runs on rank {first[0]} ({first[1]}) and on rank "
                                 f"{rank} ({cell}); a stage runs on one rank")
    stages = sorted(rank_of)
    if stages != list(range(len(stages))):
        missing = sorted(set(range(stages[-1] + 1)) - set(stages))
        raise ValueError(f"schedule: the CSV runs stages {stages}, without stage {missing[0]}; expected stages "
                         f"0 .. S-1")
    return {s: rank for s, (rank, _) in rank_of.items()}


def _placement(stage_rank: dict[int, int], num_ranks: int) -> StagePlacement:
    """The placement (loop or V) putting every stage on the rank ``stage_rank`` gives.

    Raises:
      ValueError: naming the stages of a rank when neither placement does (or the ranks run
        different numbers of stages).
    """
    S, P = len(stage_rank), num_ranks

    def fits(placement: StagePlacement) -> bool:
        # The V places exactly two stages per rank; both place the same number on each.
        places_all = S % P == 0 and (placement is StagePlacement.LOOP or S == 2 * P)
        return places_all and all(placement.mesh_of(s, P) == r for s, r in stage_rank.items())

    placements = [p for p in (StagePlacement.LOOP, StagePlacement.V) if fits(p)]
    if not placements:
        per_rank = [sorted(s for s, r in stage_rank.items() if r == rank) for rank in range(P)]
        raise ValueError(f"schedule: the ranks run stages {per_rank}; meshpar places stages in a loop (rank r runs "
                         f"stages r, r+P, r+2P, ...) or a V (rank r runs stages r and 2P-1-r), the same number on "
                         f"each rank; renumber the stages to one of these")
    return placements[0]


def _check_tasks(rows: list[_Row], num_stages: int, split: bool) -> int:
    """The micro-batches ``M``: each stage runs a forward and a backward (whole, or input and
    weight pass) of each of ``0 .. M-1``, once.

    Raises:
      ValueError: naming a repeated action's cells, or a missing action.
    """
    seen: dict[Task, _Cell] = {}
    for row in rows:
        for task, cell in row:
            if task in seen:
                raise ValueError(f"schedule: {cell} runs {_action(task)} again, first run at {seen[task]}")
            seen[task] = cell
    M = 1 + max(t.micro_batch for t in seen)
    kinds = (F, I, W) if split else (F, B)
    for stage in range(num_stages):
        for m in range(M):
            for kind in kinds:
                if Task(kind, stage, m) not in seen:
                    raise ValueError(f"schedule: no action {_action(Task(kind, stage, m))}: each stage runs "
                                     f"{'F, I and W' if split else 'F and B'} of every micro-batch 0 .. {M - 1} "
                                     f"once")
    return M


def parse_schedule_csv(text: str, name: str) -> ScheduleKind:
    """The order in ``text`` (torch's compute-only CSV, module doc) as a ``ScheduleKind`` named
    ``name``, of size ``(S, P, M)`` = (stages, lines, micro-batches) and one placement.

    Raises:
      ValueError: naming ``schedule`` and what is wrong: the line and column of a token that is
        no compute action, a stage on two ranks, a placement neither a loop nor a V, a missing
        or repeated action, or the actions of a cycle (each with its rank, line and column) when
        the order deadlocks.
    """
    rows, split = _split_whole_backwards(_read_cells(text))
    stage_rank = _stage_ranks(rows)
    placement = _placement(stage_rank, len(rows))
    S, P = len(stage_rank), len(rows)
    M = _check_tasks(rows, S, split)
    kind = ScheduleKind(name, FixedOrder(tuple(tuple(t for t, _ in row) for row in rows)), placement,
                        virtual_stages=S > P, places_weight_passes=split, stages_per_mesh=S // P, size=(S, P, M),
                        task_name=_CsvTaskNames(tuple(pair for row in rows for pair in row)))
    # Deadlocks show on the plainest stage graph; make_schedule names a cycle in the CSV's actions.
    make_schedule(kind, S, M, [(s, s + 1) for s in range(S - 1)], num_meshes=P)
    return kind


def load_schedule_csv(path: str | os.PathLike[str], name: str | None = None) -> ScheduleKind:
    """The order in the CSV file ``path`` (``parse_schedule_csv``), named ``name`` (default: the
    file's stem), for ``PipeshardParallel(schedule=...)``.

    Raises:
      ValueError: as ``parse_schedule_csv``, the message prefixed with ``path``.
    """
    path = Path(path)
    try:
        return parse_schedule_csv(path.read_text(), path.stem if name is None else name)
    except ValueError as e:
        raise ValueError(f"{e} (in {path})") from None


def _action(task: Task) -> str:
    """``task`` in torch's notation: ``<stage><F|I|W|B><micro-batch>``."""
    return f"{task.where}{task.kind.value}{task.micro_batch}"


def format_schedule_csv(sequences: Sequence[Sequence[Task]]) -> str:
    """``sequences`` (per mesh, its compute tasks) as torch's compute-only CSV, one line per mesh."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows([_action(t) for t in seq] for seq in sequences)
    return out.getvalue()


def save_schedule_csv(schedule: PipelineSchedule, path: str | os.PathLike[str]) -> None:
    """Writes ``schedule``'s per-mesh order to ``path`` (``format_schedule_csv``); loading it
    (``load_schedule_csv``) gives the same order.

    Raises:
      TypeError: naming ``schedule`` when it is no ``PipelineSchedule``.
    """
    if not isinstance(schedule, PipelineSchedule):
        raise TypeError(f"schedule: expected a PipelineSchedule (e.g. parallel.get_executable(...).schedule), "
                        f"got {type(schedule).__name__}")
    Path(path).write_text(format_schedule_csv(schedule.sequences))
