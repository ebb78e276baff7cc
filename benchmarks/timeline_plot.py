"""Draws pipeline timelines (``passes.program.timeline.Timeline``) like the paper's Fig. 4.

One panel per timeline, stacked over a shared time axis in milliseconds; in
each, one row per lane (``Timeline.lanes()``: a stage's mesh, then the links
out of it) and one box per event, colored by task kind, with its
micro-batch number written in boxes wide enough to hold it. Works for
simulated and measured timelines alike, so a prediction can be drawn over
the measurement of the same schedule.

matplotlib is optional (``pip install meshpar[plot]``); importing this
module does not need it.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshpar.passes.program.tasks import TaskKind
from meshpar.passes.program.timeline import Timeline

__all__ = ["KIND_COLORS", "plot_timelines"]

KIND_COLORS: dict[TaskKind, str] = {
    TaskKind.FORWARD: "#4c72b0",
    TaskKind.BACKWARD: "#dd8452",
    TaskKind.BACKWARD_INPUT: "#c44e52",
    TaskKind.BACKWARD_WEIGHT: "#55a868",
    TaskKind.SEND_ACT: "#8c8c8c",
    TaskKind.SEND_GRAD: "#b07aa1",
}

_KIND_NAMES = {
    TaskKind.FORWARD: "F: forward",
    TaskKind.BACKWARD: "B: backward",
    TaskKind.BACKWARD_INPUT: "I: backward, input",
    TaskKind.BACKWARD_WEIGHT: "W: backward, weight",
    TaskKind.SEND_ACT: "A: activation transfer",
    TaskKind.SEND_GRAD: "G: gradient transfer",
}

_FONT_PT = 7
_POINTS_PER_INCH = 72


def plot_timelines(timelines: Sequence[Timeline], titles: Sequence[str], path: str) -> None:
    """Writes one panel per timeline, titled ``titles[i]``, to ``path`` (format from its suffix).

    Raises:
      ValueError: ``titles`` and ``timelines`` differ in length, or there is no timeline.
      ImportError: matplotlib is not installed.
    """
    if len(timelines) != len(titles) or not timelines:
        raise ValueError(f"titles: expected one per timeline ({len(timelines)}), got {len(titles)}")
    # A bare Figure, not pyplot: no GUI backend and no global state touched.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = [t.lanes() for t in timelines]
    rows = [max(len(ls), 1) for ls in lanes]
    width_in = 12.0
    fig = Figure(figsize=(width_in, 0.8 + sum(0.35 * r + 0.5 for r in rows)))
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": rows})[:, 0]
    span_ms = max(t.makespan for t in timelines) * 1e3 or 1.0
    kinds = [k for k in TaskKind if any(e.task.kind is k for t in timelines for e in t.events)]
    for ax, timeline, title, ls in zip(axes, timelines, titles, lanes):
        ax.set_yticks(range(len(ls)), [str(lane) for lane in ls])
        ax.set_ylim(len(ls) - 0.5, -0.5)  # the first lane on top
        ax.set_title(f"{title} ({timeline.source}, {timeline.makespan * 1e3:.2f} ms)", fontsize=9, loc="left")
        ax.grid(axis="x", linewidth=0.3)
    axes[-1].set_xlim(0, span_ms)
    axes[-1].set_xlabel("time (ms)")
    fig.legend(handles=[Patch(color=KIND_COLORS[k], label=_KIND_NAMES[k]) for k in kinds],
               loc="upper center", ncol=max(len(kinds), 1), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.4 / fig.get_figheight()))
    # Laid out, the axes' width is known: a digit is about 0.6 em wide.
    char_ms = span_ms * 0.6 * _FONT_PT / (axes[-1].get_position().width * width_in * _POINTS_PER_INCH)
    for ax, timeline, ls in zip(axes, timelines, lanes):
        row = {lane: i for i, lane in enumerate(ls)}
        for e in timeline.events:
            start, width = e.start * 1e3, (e.end - e.start) * 1e3
            y = row[e.lane]
            ax.broken_barh([(start, width)], (y - 0.4, 0.8), facecolors=KIND_COLORS[e.task.kind],
                           edgecolors="white", linewidth=0.5)
            label = str(e.task.micro_batch)
            if width >= char_ms * (len(label) + 1):
                ax.text(start + width / 2, y, label, ha="center", va="center", fontsize=_FONT_PT, color="white")
    fig.savefig(path, dpi=150)
