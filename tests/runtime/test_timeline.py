"""passes.timeline: events, lanes, the Chrome trace round trip and merging by origin."""

from __future__ import annotations

import json

import pytest

from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.program.timeline import Lane, LaneKind, Timeline, TimelineEvent, timeline_of
from meshpar.passes.simulation.timeline import (
    chrome_trace, clip_to_dependencies, merge_timelines, read_chrome_trace, write_chrome_trace,
)

F, A = TaskKind.FORWARD, TaskKind.SEND_ACT
MESH0, MESH1, LINK = Lane(LaneKind.COMPUTE, 0), Lane(LaneKind.COMPUTE, 1), Lane(LaneKind.LINK, 0, 1)


def test_lanes_and_events_validate():
    with pytest.raises(ValueError, match="link lane needs dst"):
        Lane(LaneKind.LINK, 0)
    with pytest.raises(ValueError, match="compute lane has no dst"):
        Lane(LaneKind.COMPUTE, 0, 1)
    with pytest.raises(ValueError, match="F0.0: ends at 1 before it starts at 2"):
        TimelineEvent(Task(F, 0, 0), MESH0, 2, 1)


def test_timeline_of_shifts_to_zero_and_keeps_the_origin():
    t = timeline_of([TimelineEvent(Task(A, 0, 0), LINK, 12.0, 12.5), TimelineEvent(Task(F, 0, 0), MESH0, 10.0, 12.0)],
                    "measured")
    assert [(str(e.task), e.start, e.end) for e in t.events] == [("F0.0", 0.0, 2.0), ("A0.0", 2.0, 2.5)]
    assert t.origin == 10.0 and t.makespan == 2.5
    assert t.lanes() == [MESH0, LINK]


def test_chrome_trace_round_trip(tmp_path):
    t = timeline_of([TimelineEvent(Task(F, 0, 1), MESH0, 1.0, 1.25), TimelineEvent(Task(A, 0, 1), LINK, 1.25, 2.0),
                     TimelineEvent(Task(F, 1, 1), MESH1, 2.0, 3.0)], "measured")
    trace = chrome_trace(t, process=3)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["ts"], e["dur"], e["pid"]) for e in complete] == [
        ("F0.1", 0.0, 250000.0, 3), ("A0.1", 250000.0, 750000.0, 3), ("F1.1", 1e6, 1e6, 3)]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == ["link 0 -> 1", "mesh 0", "mesh 1"]
    path = tmp_path / "t.json"
    write_chrome_trace(str(path), t)
    assert json.loads(path.read_text())["otherData"] == {"source": "measured", "origin_s": 1.0}
    assert read_chrome_trace(str(path)) == t


def test_merge_places_processes_on_one_clock():
    # Process 1 starts its first task 0.5 s after process 0 started its own.
    p0 = timeline_of([TimelineEvent(Task(F, 0, 0), MESH0, 100.0, 100.5)], "measured")
    p1 = timeline_of([TimelineEvent(Task(F, 1, 0), MESH1, 100.5, 101.0)], "measured")
    assert p1.events[0].start == 0.0
    merged = merge_timelines([p1, p0], "both")
    assert [(str(e.task), e.start, e.end) for e in merged.events] == [("F0.0", 0.0, 0.5), ("F1.0", 0.5, 1.0)]
    assert merged == Timeline(merged.events, "both", 100.0)


def test_clip_to_dependencies_starts_a_received_transfer_when_its_value_was_computed():
    # Process 1 saw A0.0 from its launch at 100.0; process 0 computed F0.0 until 100.5.
    p0 = timeline_of([TimelineEvent(Task(F, 0, 0), MESH0, 100.0, 100.5)], "measured")
    p1 = timeline_of([TimelineEvent(Task(A, 0, 0), LINK, 100.0, 100.75),
                      TimelineEvent(Task(F, 1, 0), MESH1, 100.75, 101.0)], "measured")
    merged = clip_to_dependencies(merge_timelines([p0, p1], "both"), [(0, 1)], split_backward=False)
    assert [(str(e.task), e.start, e.end) for e in merged.events] == [
        ("F0.0", 0.0, 0.5), ("A0.0", 0.5, 0.75), ("F1.0", 0.75, 1.0)]


def test_merge_rejects_what_is_not_a_timeline():
    with pytest.raises(TypeError, match="timelines: expected Timeline objects, got dict"):
        merge_timelines([{"events": ()}], "both")
