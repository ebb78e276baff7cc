"""A pipeline step's timeline: which task ran where, from when to when.

Both the schedule simulator (``passes.schedule_simulator``, predicted) and the
runtime's step tracer (``runtime.step_trace``, measured) produce a
``Timeline``; ``chrome_trace`` writes either as a Chrome / Perfetto trace
(open it at https://ui.perfetto.dev or chrome://tracing), and
``benchmarks/timeline_plot.py`` draws it like the paper's Fig. 4.

A lane is a resource that runs one thing at a time: a mesh (compute of
every stage it hosts, and transfers that block it) or the link between two
meshes (transfers that overlap with compute).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

from ..program.tasks import Task
from ..program.timeline import Lane, LaneKind, Timeline, TimelineEvent, timeline_of

__all__ = ["merge_timelines", "clip_to_dependencies", "chrome_trace", "write_chrome_trace", "read_chrome_trace"]


def chrome_trace(timeline: Timeline, process: int = 0) -> dict[str, Any]:
    """The Chrome trace-event JSON object: one complete ("X") event per task, one thread per lane,
    times in microseconds; args carry the task kind, stage or edge and micro-batch."""
    lanes = timeline.lanes()
    tid = {lane: i for i, lane in enumerate(lanes)}
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": process, "args": {"name": f"meshpar {timeline.source}"}},
    ]
    for lane in lanes:
        events.append({"ph": "M", "name": "thread_name", "pid": process, "tid": tid[lane], "args": {"name": str(lane)}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": process, "tid": tid[lane],
                       "args": {"sort_index": tid[lane]}})
    for e in timeline.events:
        events.append({
            "ph": "X", "name": str(e.task), "cat": e.task.kind.name.lower(), "pid": process, "tid": tid[e.lane],
            "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
            "args": {"kind": e.task.kind.value, "where": e.task.where, "micro_batch": e.task.micro_batch,
                     "lane_kind": e.lane.kind.value, "lane_src": e.lane.src, "lane_dst": e.lane.dst},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"source": timeline.source, "origin_s": timeline.origin}}


def write_chrome_trace(path: str, timeline: Timeline, process: int = 0) -> None:
    """Writes ``chrome_trace(timeline, process)`` to ``path``."""
    with open(path, "w") as f:
        json.dump(chrome_trace(timeline, process), f)


def read_chrome_trace(trace: dict[str, Any] | str) -> Timeline:
    """The ``Timeline`` back from ``chrome_trace``'s output (a dict or a path)."""
    from ..program.tasks import TaskKind

    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    events = []
    for e in trace["traceEvents"]:
        if e["ph"] != "X":
            continue
        args = e["args"]
        lane = Lane(LaneKind(args["lane_kind"]), args["lane_src"], args["lane_dst"])
        task = Task(TaskKind(args["kind"]), args["where"], args["micro_batch"])
        events.append(TimelineEvent(task, lane, e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6))
    other = trace["otherData"]
    return Timeline(tuple(sorted(events, key=lambda e: (e.start, e.lane.sort_key()))), other["source"],
                    other.get("origin_s", 0.0))


def merge_timelines(timelines: Sequence[Timeline], source: str) -> Timeline:
    """One ``Timeline`` of the events of several (e.g. one per process of a step), placed on
    their common clock by their origins."""
    wrong = [type(t).__name__ for t in timelines if not isinstance(t, Timeline)]
    if wrong:
        raise TypeError(f"timelines: expected Timeline objects, got {wrong[0]}")
    events = [dataclasses.replace(e, start=e.start + t.origin, end=e.end + t.origin)
              for t in timelines for e in t.events]
    return timeline_of(events, source)


def clip_to_dependencies(
    timeline: Timeline, edges: Sequence[tuple[int, int]], split_backward: bool
) -> Timeline:
    """``timeline`` with each event starting no earlier than its data dependencies in it end.

    A process infers a start from what it saw; after merging several processes' timelines, a
    transfer received on one can be clipped to the end of the task that produced its value on
    another. Dependencies end before their dependents, so one walk by end time suffices.
    """
    from ..program.tasks import task_dependencies

    ends: dict[Task, float] = {}
    events = []
    for e in sorted(timeline.events, key=lambda e: e.end):
        start = max([e.start] + [ends[d] for d in task_dependencies(e.task, edges, split_backward) if d in ends])
        events.append(dataclasses.replace(e, start=min(start, e.end)))
        ends[e.task] = e.end
    return Timeline(tuple(sorted(events, key=lambda e: (e.start, e.lane.sort_key()))), timeline.source,
                    timeline.origin)

