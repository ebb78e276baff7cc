"""benchmarks.pipeline: aggregation, prediction and targets on synthetic worker output (one stage
per mesh, and interleaved 1F1B's two per mesh), the interleaved row's step built on its meshes,
and the CLI end to end in one process (the emulated-cluster run is ``slow``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks import pipeline
from benchmarks.pipeline_cases import CASES, METHODS, SINGLE_PROCESS_METHODS
from benchmarks.pipeline_worker import schedule_spec
from meshpar.passes.pipeline.pipeline_schedule import make_schedule
from meshpar.passes.pipeline.pipeline_tasks import Task, TaskKind
from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate
from meshpar.passes.simulation.timeline import Lane, LaneKind, TimelineEvent, timeline_of, write_chrome_trace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
F, B = TaskKind.FORWARD, TaskKind.BACKWARD


INTERLEAVED = make_schedule("interleaved_1f1b", 4, 4, [(0, 1), (1, 2), (2, 3)], num_meshes=2)


def _serialized_traces(trace_dir, name, seconds, schedule=None):
    """One file per process, as ``trace`` writes them with one process per mesh: mesh r's compute
    on process r, in its sequence of ``schedule`` (default: 1F1B, one stage per mesh), each task
    taking ``seconds[stage][kind]``, one after another."""
    schedule = schedule or make_schedule("1f1b", len(seconds), 4, [(0, 1)])
    stem, ext = os.path.splitext(name)
    for r, sequence in enumerate(schedule.sequences):
        t, events = 0.0, []
        for task in sequence:
            dt = seconds[task.where][task.kind]
            events.append(TimelineEvent(task, Lane(LaneKind.COMPUTE, r), t, t + dt))
            t += dt
        write_chrome_trace(os.path.join(trace_dir, f"{stem}.p{r}{ext}"), timeline_of(events, "measured"), r)


def _line(process, method, times, overlap=True, transfer_s=0.01):
    """A worker's record of a 2-stage 1F1B step, as workers wrote it before they recorded meshes."""
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


def _interleaved_line(process, times, activation_s, gradient_s):
    """A worker's record of the interleaved row: 4 stages on 2 meshes, process r running mesh r."""
    transfers = [{"edge": e, "activation": activation, "bytes": 1, "seconds": seconds[e]}
                 for e in range(len(INTERLEAVED.edges))
                 for activation, seconds in ((True, activation_s), (False, gradient_s))]
    return {
        "kind": "method", "process": process, "model": "gpt", "config": [4, 1, 2], "case": "gpt (4, 1, 2)",
        "method": "interleaved", "batch": 256, "step_times_s": times, "compile_s": 5.0,
        "loss": 1.0 if process else None, "overlap": True, "schedule": schedule_spec(INTERLEAVED),
        "transfers": transfers,
        # Per stage; stages 0 and 2 on process 0's mesh, 1 and 3 on process 1's.
        "peak_live_activations": [4, 0, 2, 0] if process == 0 else [0, 3, 0, 1],
        "serialized_trace": "interleaved-serialized.json",
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


def test_aggregate_simulates_the_interleaved_schedule_on_its_meshes(tmp_path):
    # Mesh 1 (stages 1 and 3) computes 4 x (30 + 50 + 30 + 60) ms = 0.68 s per step.
    seconds = [{F: 0.02, B: 0.04}, {F: 0.03, B: 0.05}, {F: 0.02, B: 0.04}, {F: 0.03, B: 0.06}]
    activation, gradient = (0.01, 0.02, 0.03), (0.02, 0.04, 0.06)
    _serialized_traces(str(tmp_path), "interleaved-serialized.json", seconds, INTERLEAVED)
    _serialized_traces(str(tmp_path), "upper_bound-serialized.json", [{F: 0.04, B: 0.08}, {F: 0.05, B: 0.11}])
    lines = [_interleaved_line(p, t, activation, gradient) for p, t in ((0, [0.8, 0.9, 0.85]), (1, [0.9, 0.8, 0.8]))]
    lines += [_line(p, "upper_bound", [0.72, 0.72, 0.72]) for p in (0, 1)]
    records = pipeline.aggregate(lines, str(tmp_path), "emulated", 2)
    # In METHODS' order: interleaved after zb_h1, before upper_bound.
    assert [r["method"] for r in records] == ["interleaved", "upper_bound"]
    by = {r["method"]: r for r in records}
    r = by["interleaved"]
    assert (r["num_stages"], r["num_meshes"]) == (4, 2)
    assert (by["upper_bound"]["num_stages"], by["upper_bound"]["num_meshes"]) == (2, 2)
    assert r["schedule"]["stage_mesh"] == [0, 1, 0, 1]
    assert r["measured_step_s"] == pytest.approx(0.9)
    assert r["peak_live_activations"] == [4, 3, 2, 1]
    assert r["over_upper_bound"] == pytest.approx(0.72 / 0.9)
    # Durations per stage (two per process), read from each mesh's lane.
    assert [s["forward"] for s in r["stage_seconds"]] == pytest.approx([0.02, 0.03, 0.02, 0.03])
    assert [s["backward"] for s in r["stage_seconds"]] == pytest.approx([0.04, 0.05, 0.04, 0.06])
    # The prediction is the interleaved schedule's on two meshes: stages sharing a mesh share its
    # lane, so the step is at least mesh 1's compute.
    stages = tuple(StageSeconds(s[F], s[B], s[B] / 2, s[B] / 2) for s in seconds)
    durations = TaskDurations(stages, activation, gradient)
    simulated = simulate(INTERLEAVED, durations, overlap=True)
    assert r["predicted_step_s"] == pytest.approx(simulated.step_seconds)
    assert r["predicted_bubble"] == pytest.approx(simulated.bubble_fraction)
    assert r["predicted_step_s"] >= 0.68
    # Links between meshes: 0 -> 1 carries edge 0's and 2's activations and edge 1's gradient
    # (4 x 80 ms), 1 -> 0 the others (4 x 100 ms); over mesh 1's 0.68 s.
    assert r["transfer_share"] == pytest.approx(0.40 / 0.68)

    text = pipeline.table(records)
    assert "| emulated | gpt | (4, 1, 2) | interleaved | 900 |" in text
    assert text.splitlines()[2].endswith("| 4 / 2 |")
    got = pipeline.targets(records)
    assert got == ["info   gpt (4, 1, 2): interleaved at 0.80x the upper bound's speed, predicted "
                   f"{r['prediction_error'] * 100:+.0f}% (no target)",
                   got[-1]]
    # The simulator's target is the paper's methods' alone.
    assert "worst: gpt (4, 1, 2) upper_bound" in got[-1]


def test_schedule_is_rebuilt_on_the_workers_meshes():
    assert pipeline._schedule(schedule_spec(INTERLEAVED)) == INTERLEAVED
    # Records without meshes: one stage per mesh.
    old = {"name": "1f1b", "num_stages": 2, "num_micro_batches": 4, "edges": [[0, 1]], "weight_delays": None}
    assert pipeline._schedule(old) == make_schedule("1f1b", 2, 4, [(0, 1)])
    assert pipeline._schedule(old).num_meshes == 2
    with pytest.raises(ValueError, match="ran them on"):
        pipeline._schedule({**schedule_spec(INTERLEAVED), "stage_mesh": [0, 0, 1, 1]})


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
    assert [m.name for m in METHODS] == ["send_recv", "alpa", "broadcast", "overlap", "ours", "zb_h1", "interleaved",
                                         "upper_bound"]
    by = {m.name: m for m in METHODS}
    assert by["ours"].schedule == "eager_1f1b" and by["ours"].weight_delay == "auto"
    assert by["interleaved"].schedule == "interleaved_1f1b" and by["interleaved"].stages_per_mesh == 2
    assert by["interleaved"].executor == "auto" and by["interleaved"].weight_delay is False
    assert all(m.stages_per_mesh == 1 for m in METHODS if m.name != "interleaved")
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
         "--methods", "overlap", "ours", "interleaved", "upper_bound", "--repeat", "2", "--json", str(path),
         "--png", str(tmp_path), "--png-case", "gpt (4, 1, 2)"],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    records = json.loads(path.read_text())
    assert {(x["cluster"], x["method"]) for x in records} == {
        ("single_process", m) for m in ("overlap", "ours", "interleaved", "upper_bound")}
    for x in records:
        assert {"model", "config", "method", "cluster", "measured_step_s", "predicted_step_s",
                "samples_per_s"} <= x.keys()
        assert x["model"] == "gpt" and x["config"] == [4, 1, 2]
        assert x["measured_step_s"] > 0 and x["predicted_step_s"] > 0
        assert len(x["step_times_s"]) == 2
        assert (x["num_stages"], x["num_meshes"]) == ((4, 2) if x["method"] == "interleaved" else (2, 2))
    png = tmp_path / "timeline-single_process-gpt-4-1-2.png"
    assert png.stat().st_size > 10_000
    assert "process 0: gpt (4, 1, 2) ours" in r.stdout  # a progress line
    assert "Targets" in r.stdout
    assert "| single_process | gpt | (4, 1, 2) | interleaved |" in r.stdout


def test_interleaved_builds_four_stages_on_two_meshes():
    import jax

    import meshpar
    from benchmarks.pipeline_cases import build_step
    from benchmarks.pipeline_worker import _transfer_estimates

    method = {m.name: m for m in METHODS}["interleaved"]
    case = {c.name: c for c in CASES}["gpt (4, 1, 2)"]
    cluster = meshpar.Cluster.from_devices(jax.devices(), host_of=lambda d: d.id // 4, inter_host_bandwidth=3e7)
    step, state, batch = build_step(case, method, cluster, 120.0)
    executable = step.get_executable(state, batch)
    schedule = executable.schedule
    assert (schedule.name, schedule.num_stages, schedule.num_meshes) == ("interleaved_1f1b", 4, 2)
    assert schedule.stage_mesh == (0, 1, 0, 1)
    assert len(executable.meshes) == 2 and all(m.devices.shape == (4, 1) for m in executable.meshes)
    assert [executable.meshes.index(m) for m in executable.stage_meshes] == [0, 1, 0, 1]
    # What the worker records rebuilds the schedule the step runs.
    assert pipeline._schedule(schedule_spec(schedule)) == schedule
    estimates = _transfer_estimates(executable, method, cluster)
    assert sorted({t["edge"] for t in estimates}) == list(range(len(schedule.edges)))
    assert all(t["seconds"] > 0 for t in estimates)


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
