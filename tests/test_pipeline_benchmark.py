"""benchmarks.pipeline: aggregation, prediction and targets on synthetic worker output, and the
CLI end to end in one process (the emulated-cluster run is ``slow``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import pipeline
from benchmarks.pipeline_cases import CASES, METHODS, SINGLE_PROCESS_METHODS
from meshpar.passes.pipeline.pipeline_schedule import make_schedule
from meshpar.passes.pipeline.pipeline_tasks import Task, TaskKind
from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate
from meshpar.passes.simulation.timeline import Lane, LaneKind, TimelineEvent, timeline_of, write_chrome_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F, B = TaskKind.FORWARD, TaskKind.BACKWARD


def _serialized_traces(trace_dir, name, seconds):
    """One file per process, as ``trace`` writes them with two processes: stage s's compute on
    process s, each task taking ``seconds[s][kind]``, one after another."""
    stem, ext = os.path.splitext(name)
    for s, per_kind in enumerate(seconds):
        t, events = 0.0, []
        for m in range(4):
            for kind in (F, B):
                events.append(TimelineEvent(Task(kind, s, m), Lane(LaneKind.COMPUTE, s), t, t + per_kind[kind]))
                t += per_kind[kind]
        write_chrome_trace(os.path.join(trace_dir, f"{stem}.p{s}{ext}"), timeline_of(events, "measured"), s)


def _line(process, method, times, overlap=True, transfer_s=0.01):
    return {
        "kind": "method", "process": process, "model": "gpt", "config": [4, 1, 2], "case": "gpt (4, 1, 2)",
        "method": method, "batch": 256, "step_times_s": times, "compile_s": 5.0, "loss": 1.0 if process else None,
        "overlap": overlap,
        "schedule": {"name": "1f1b", "num_stages": 2, "num_micro_batches": 4, "edges": [[0, 1]], "weight_delays": None},
        "transfers": [{"edge": 0, "activation": True, "bytes": 1, "seconds": transfer_s},
                      {"edge": 0, "activation": False, "bytes": 1, "seconds": transfer_s}],
        "peak_live_activations": [2, 0] if process == 0 else [0, 1],
        "serialized_trace": f"{method}-serialized.json",
    }


def test_aggregate_merges_processes_and_predicts_with_the_simulator(tmp_path):
    seconds = [{F: 0.02, B: 0.04}, {F: 0.03, B: 0.05}]
    lines = []
    for method, overlap, times in (("overlap", True, [[0.5, 0.4, 0.6], [0.45, 0.5, 0.5]]),
                                   ("upper_bound", True, [[0.4, 0.4, 0.4], [0.4, 0.41, 0.39]]),
                                   ("broadcast", False, [[0.7, 0.7, 0.7], [0.7, 0.7, 0.7]])):
        _serialized_traces(str(tmp_path), f"{method}-serialized.json", seconds)
        lines += [_line(p, method, times[p], overlap) for p in (0, 1)]
    lines.append(_line(0, "ours", [0.1]))  # only one process reported it: dropped
    records = pipeline.aggregate(lines, str(tmp_path), "emulated", 2)
    assert [r["method"] for r in records] == ["broadcast", "overlap", "upper_bound"]
    by = {r["method"]: r for r in records}
    # Per step the slower process, then the median.
    assert by["overlap"]["measured_step_s"] == pytest.approx(0.5)
    assert by["overlap"]["step_times_s"] == [0.5, 0.5, 0.6]
    assert by["overlap"]["peak_live_activations"] == [2, 1]
    assert by["overlap"]["samples_per_s"] == pytest.approx(256 / 0.5)
    assert by["overlap"]["over_upper_bound"] == pytest.approx(0.4 / 0.5)
    assert by["overlap"]["loss"] == 1.0
    # The prediction is the simulator's on the measured compute and the planner's transfers.
    durations = TaskDurations((StageSeconds(0.02, 0.04, 0.02, 0.02), StageSeconds(0.03, 0.05, 0.025, 0.025)),
                              (0.01,), (0.01,))
    schedule = make_schedule("1f1b", 2, 4, [(0, 1)])
    for method, overlap in (("overlap", True), ("broadcast", False)):
        expected = simulate(schedule, durations, overlap=overlap).step_seconds
        assert by[method]["predicted_step_s"] == pytest.approx(expected)
        assert by[method]["prediction_error"] == pytest.approx(expected / by[method]["measured_step_s"] - 1)
    assert by["broadcast"]["predicted_step_s"] > by["overlap"]["predicted_step_s"]
    # Busiest link: 4 x 10 ms; busiest stage: 4 x (30 + 50) ms.
    assert by["overlap"]["transfer_share"] == pytest.approx(0.04 / 0.32)

    text = pipeline.table(records)
    assert "| emulated | gpt | (4, 1, 2) | overlap | 500 |" in text
    got = pipeline.targets(records)
    assert any(t.startswith("met    gpt (4, 1, 2): overlap 1.40x broadcast") for t in got)
    assert any(t.startswith("MISSED simulator within") or t.startswith("met    simulator within") for t in got)


def test_targets_compare_the_right_methods():
    def rec(method, step, case="u_transformer (4, 1, 2)", error=0.0):
        return {"cluster": "emulated", "case": case, "method": method, "measured_step_s": step,
                "prediction_error": error}

    records = [rec("ours", 1.0), rec("upper_bound", 0.97), rec("alpa", 1.35), rec("overlap", 1.1),
               rec("broadcast", 1.2, error=0.2)]
    got = pipeline.targets(records)
    assert got == [
        "met    u_transformer (4, 1, 2): ours at 0.97x the upper bound's speed (target >= 0.95)",
        "met    u_transformer (4, 1, 2): ours 1.35x alpa (target >= 1.3)",
        "met    u_transformer (4, 1, 2): overlap 1.09x broadcast (target > 1)",
        "met    u_transformer (4, 1, 2): ours 1.10x overlap (target >= 1)",
        "MISSED simulator within 20% of every emulated step (worst: u_transformer (4, 1, 2) broadcast; target <= 15%)",
    ]
    records[0]["measured_step_s"] = 1.2
    assert pipeline.targets(records)[0].startswith("MISSED")


def test_methods_are_the_papers():
    assert [m.name for m in METHODS] == ["send_recv", "alpa", "broadcast", "overlap", "ours", "zb_h1", "upper_bound"]
    by = {m.name: m for m in METHODS}
    assert by["ours"].schedule == "eager_1f1b" and by["ours"].weight_delay == "auto"
    assert by["upper_bound"].resharding == "signal"
    assert by["overlap"].executor == "auto" and by["broadcast"].executor == "collective"
    assert {m.name for m in SINGLE_PROCESS_METHODS} == set(by) - {"send_recv", "alpa"}
    assert {(c.model, c.config) for c in CASES} == {
        ("gpt", (2, 2, 2)), ("gpt", (4, 1, 2)), ("u_transformer", (4, 1, 2))}


def test_cli_in_one_process_writes_records_and_timelines(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "pipeline.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.pipeline", "--no-emulated", "--cases", "gpt (4, 1, 2)",
         "--methods", "overlap", "ours", "upper_bound", "--repeat", "2", "--json", str(path),
         "--png", str(tmp_path), "--png-case", "gpt (4, 1, 2)"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    records = json.loads(path.read_text())
    assert {(x["cluster"], x["method"]) for x in records} == {
        ("single_process", m) for m in ("overlap", "ours", "upper_bound")}
    for x in records:
        assert {"model", "config", "method", "cluster", "measured_step_s", "predicted_step_s",
                "samples_per_s"} <= x.keys()
        assert x["model"] == "gpt" and x["config"] == [4, 1, 2]
        assert x["measured_step_s"] > 0 and x["predicted_step_s"] > 0
        assert len(x["step_times_s"]) == 2
    png = tmp_path / "timeline-single_process-gpt-4-1-2.png"
    assert png.stat().st_size > 10_000
    assert "process 0: gpt (4, 1, 2) ours" in r.stdout  # a progress line
    assert "Targets" in r.stdout


@pytest.mark.slow
def test_cli_on_the_emulated_cluster(tmp_path):
    from benchmarks.emulated_cluster import EmulatedCluster

    ok, why = EmulatedCluster.available()
    if not ok:
        pytest.skip(f"needs an emulated cluster (root, network namespaces, tc): {why}")
    path = tmp_path / "pipeline.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.pipeline", "--no-single-process", "--cases", "gpt (4, 1, 2)",
         "--methods", "broadcast", "overlap", "ours", "upper_bound", "--repeat", "2", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1500,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    records = json.loads(path.read_text())
    assert {x["method"] for x in records} == {"broadcast", "overlap", "ours", "upper_bound"}
    assert all(x["cluster"] == "emulated" and x["link_gbit"] == 0.25 for x in records)
