"""``python -m meshpar.schedule_chart``: draws a schedule's simulated step, one lane per mesh.

::

    python -m meshpar.schedule_chart interleaved_zb --meshes 4 --micro-batches 8 --stages-per-mesh 2
    python -m meshpar.schedule_chart --csv my_order.csv --png my_order.png

The schedule is a registered name (``meshpar.SCHEDULES``) or a CSV in torch's action format
(``meshpar.load_schedule_csv``), placed on a chain of ``P * v`` stages. The step comes from the
schedule simulator (``passes.simulation.schedule_simulator``) with every stage's forward, input
pass and weight pass taking the given times (one unit each by default, the zero-bubble paper's
``T_F = T_B = T_W``; a whole backward takes input + weight) and transfers the given time (none
by default). The chart always goes to stdout as text: one lane per mesh, each task written as
torch writes it (``2F0``: stage 2's forward of micro-batch 0; ``I`` input pass, ``W`` weight
pass, ``B`` whole backward), ``.`` idle, coloured on a terminal; the title gives the bubble
fraction (``SimulatedStep.bubble_fraction``). ``--png`` also draws it with matplotlib (the
``plot`` extra), ``--save-csv`` writes the order as CSV to edit and load back.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Sequence

from meshpar.passes.pipeline.scheduling.pipeline_schedule import (
    SCHEDULES, PipelineSchedule, ScheduleKind, make_schedule, schedule_kind,
)
from meshpar.passes.pipeline.scheduling.schedule_csv import load_schedule_csv, save_schedule_csv
from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.simulation.schedule_simulator import SimulatedStep, StageSeconds, TaskDurations, simulate

__all__ = ["PassTimes", "Chart", "chart", "main", "png_chart", "text_chart"]

# Task kind -> (ANSI colour code on a terminal, matplotlib colour: the timeline plots' hues, name).
_STYLE = {
    TaskKind.FORWARD: ("34", "#4c72b0", "forward"),
    TaskKind.BACKWARD_INPUT: ("31", "#c44e52", "backward input pass"),
    TaskKind.BACKWARD_WEIGHT: ("32", "#55a868", "backward weight pass"),
    TaskKind.BACKWARD: ("33", "#dd8452", "whole backward"),
}
_LEGEND = ", ".join(f"{kind.value} {name}" for kind, (_, _, name) in _STYLE.items()) + ", . idle"


@dataclasses.dataclass(frozen=True)
class PassTimes:
    """Every stage's pass times and every transfer's, in any one unit (finite, non-negative)."""

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    transfer: float = 0.0

    def __post_init__(self) -> None:
        if not max(self.forward, self.backward_input, self.backward_weight) > 0:
            raise ValueError(f"--forward, --backward-input, --backward-weight: expected a positive time for at least "
                             f"one pass, got {self.forward}, {self.backward_input}, {self.backward_weight}")

    def durations(self, num_stages: int) -> TaskDurations:
        """Task durations for a chain of ``num_stages`` stages (a whole backward: input + weight)."""
        stage = StageSeconds(self.forward, self.backward_input + self.backward_weight, self.backward_input,
                             self.backward_weight)
        edges = num_stages - 1
        return TaskDurations((stage,) * num_stages, (self.transfer,) * edges, (self.transfer,) * edges)


@dataclasses.dataclass(frozen=True)
class Chart:
    """A schedule and its simulated step.

    Attributes:
      schedule: the schedule on a chain of ``num_stages`` stages.
      step: its step simulated with ``times``.
      times: the pass times it was simulated with.
    """

    schedule: PipelineSchedule
    step: SimulatedStep
    times: PassTimes

    @property
    def title(self) -> str:
        """The schedule, its size, the bubble fraction and the step length."""
        s, t = self.schedule, self.times
        return (f"{s.name}: {s.num_meshes} meshes, {s.num_stages} stages, {s.num_micro_batches} micro-batches; "
                f"bubble {self.step.bubble_fraction:.1%}, step {self.step.step_seconds:g} "
                f"(F {t.forward:g}, I {t.backward_input:g}, W {t.backward_weight:g}, transfer {t.transfer:g})")

    def lanes(self) -> list[list[tuple[Task, float, float]]]:
        """Per mesh, its compute tasks as ``(task, start, end)`` in start order."""
        out: list[list[tuple[Task, float, float]]] = [[] for _ in range(self.schedule.num_meshes)]
        for e in self.step.timeline.events:
            if e.task.kind.is_compute:
                out[self.schedule.stage_mesh[e.task.where]].append((e.task, e.start, e.end))
        return out


def chart(schedule: str | ScheduleKind, num_meshes: int, num_micro_batches: int, stages_per_mesh: int,
          times: PassTimes = PassTimes()) -> Chart:
    """``schedule`` (a name or a ``ScheduleKind``) on ``num_meshes * stages_per_mesh`` chained
    stages, simulated with ``times``.

    Raises:
      ValueError: naming the argument the schedule cannot take (``check_stage_placement``: e.g.
        ``num_micro_batches`` not a multiple of the meshes for ``interleaved_1f1b``, fewer than
        ``2P`` for the V schedules, or other than a CSV order's own), or negative times.
    """
    S = num_meshes * stages_per_mesh
    built = make_schedule(schedule, S, num_micro_batches, [(s, s + 1) for s in range(S - 1)], num_meshes=num_meshes)
    return Chart(built, simulate(built, times.durations(S)), times)


def _label(task: Task) -> str:
    return f"{task.where}{task.kind.value}{task.micro_batch}"


def _paint(text: str, kind: TaskKind, colour: bool) -> str:
    return f"\033[{_STYLE[kind][0]}m{text}\033[0m" if colour else text


def text_chart(c: Chart, colour: bool = False) -> str:
    """The chart as text: the title, one line per mesh, a legend. A time unit (the shortest
    pass) is one cell as wide as the longest label and a space; a task fills the cells of its
    span with its label, idle cells are dots; ``colour`` adds ANSI colours by task kind."""
    lanes = c.lanes()
    unit = min(d for d in (c.times.forward, c.times.backward_input, c.times.backward_weight) if d > 0)
    width = 1 + max(len(_label(t)) for lane in lanes for t, _, _ in lane)

    def column(t: float) -> int:
        return round(t / unit * width)

    lines = [c.title]
    for mesh, lane in enumerate(lanes):
        row, at = [], 0
        for task, start, end in lane:
            begin, stop = max(column(start), at), max(column(end), at)
            row.append("." * (begin - at))
            cell = _label(task)[:max(stop - begin - 1, 0)].ljust(stop - begin)
            row.append(_paint(cell, task.kind, colour))
            at = stop
        lines.append(f"mesh {mesh} |" + "".join(row).rstrip())
    lines.append(_LEGEND)
    return "\n".join(lines) + "\n"


def png_chart(c: Chart, path: str | os.PathLike[str]) -> None:
    """Draws the chart to ``path`` (format from its suffix): one lane per mesh, a box per task
    coloured by its kind and labelled where wide enough, the title above.

    Raises:
      ValueError: naming ``--png`` when matplotlib (the ``plot`` extra) is not installed.
    """
    try:
        # A bare Figure, not pyplot: no GUI backend, no global state.
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ValueError("--png: drawing a PNG needs matplotlib; install it with pip install 'meshpar[plot]'") from e
    lanes = c.lanes()
    width_in, font_pt = 12.0, 6
    fig = Figure(figsize=(width_in, 1.4 + 0.4 * len(lanes)))
    ax = fig.add_subplot()
    # A label fits a box whose width holds its characters (about 0.6 em each).
    points_per_unit = 0.9 * width_in * 72 / max(c.step.step_seconds, 1e-12)
    for mesh, lane in enumerate(lanes):
        for task, start, end in lane:
            ax.broken_barh([(start, end - start)], (mesh - 0.4, 0.8), facecolors=_STYLE[task.kind][1],
                           edgecolors="white", linewidth=0.5)
            if (end - start) * points_per_unit >= 0.6 * font_pt * len(_label(task)):
                ax.text((start + end) / 2, mesh, _label(task), ha="center", va="center", fontsize=font_pt,
                        color="white")
    ax.set_yticks(range(len(lanes)), [f"mesh {m}" for m in range(len(lanes))])
    ax.invert_yaxis()
    ax.set_xlabel("time (units of the pass times)")
    ax.set_title(c.title, fontsize=8)
    kinds = sorted({t.kind for lane in lanes for t, _, _ in lane}, key=list(_STYLE).index)
    fig.legend(handles=[Patch(color=_STYLE[k][1], label=f"{k.value}: {_STYLE[k][2]}") for k in kinds],
               loc="lower center", ncol=len(kinds), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=150)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m meshpar.schedule_chart", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", nargs="?", help=f"a registered schedule: {', '.join(SCHEDULES)}")
    p.add_argument("--csv", metavar="FILE", help="a schedule in torch's CSV action format, instead of NAME")
    p.add_argument("--meshes", type=int, metavar="P", help="meshes (default with --csv: the file's ranks)")
    p.add_argument("--micro-batches", type=int, metavar="M", help="micro-batches (default with --csv: the file's)")
    p.add_argument("--stages-per-mesh", type=int, metavar="V",
                   help="stages per mesh (default: the schedule's own; 2 for other virtual-stage schedules; else 1)")
    p.add_argument("--forward", type=float, default=1.0, help="a forward's time (default 1)")
    p.add_argument("--backward-input", type=float, default=1.0, help="an input pass's time (default 1)")
    p.add_argument("--backward-weight", type=float, default=1.0, help="a weight pass's time (default 1)")
    p.add_argument("--transfer", type=float, default=0.0, help="a transfer's time (default 0)")
    p.add_argument("--png", metavar="OUT", help="also draw the chart to this PNG (needs matplotlib)")
    p.add_argument("--save-csv", metavar="OUT", help="also write the schedule's order as CSV, to edit and load back")
    return p


def _schedule_and_size(args: argparse.Namespace) -> tuple[str | ScheduleKind, int, int, int]:
    """The schedule and ``(meshes, micro-batches, stages per mesh)`` the arguments ask for.

    Raises:
      ValueError: naming the argument missing, repeated, or not a schedule.
    """
    if (args.name is None) == (args.csv is None):
        raise ValueError("NAME, --csv: give a registered schedule name or --csv FILE, exactly one of them")
    kind = schedule_kind(args.name) if args.csv is None else load_schedule_csv(args.csv)
    own_meshes, own_micro_batches = (None, None) if kind.size is None else kind.size[1:]
    P = own_meshes if args.meshes is None else args.meshes
    M = own_micro_batches if args.micro_batches is None else args.micro_batches
    if P is None or M is None:
        raise ValueError(f"--meshes, --micro-batches: {kind.name} runs at any size; pass both")
    v = kind.stages_per_mesh or (2 if kind.virtual_stages else 1)
    return kind, P, M, v if args.stages_per_mesh is None else args.stages_per_mesh


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line (module doc) on ``argv`` (default ``sys.argv[1:]``); exits with
    status 2 and the argument's error on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        schedule, P, M, v = _schedule_and_size(args)
        c = chart(schedule, P, M, v, PassTimes(args.forward, args.backward_input, args.backward_weight,
                                                args.transfer))
        sys.stdout.write(text_chart(c, colour=sys.stdout.isatty() and "NO_COLOR" not in os.environ))
        if args.png:
            png_chart(c, args.png)
            print(f"wrote {args.png}")
        if args.save_csv:
            save_schedule_csv(c.schedule, args.save_csv)
            print(f"wrote {args.save_csv}")
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
