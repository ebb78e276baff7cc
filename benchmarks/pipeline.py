"""End-to-end pipeline benchmark: the paper's Fig. 7 and Fig. 9 methods, and issue 22's gradient
reductions, measured and simulated.

    python -m benchmarks.pipeline [--link-gbit G] [--repeat N] [--cases C ...] [--methods M ...]
        [--json PATH] [--png DIR] [--no-emulated] [--no-single-process]

Runs every case of ``benchmarks.pipeline_cases`` with each of its methods
(``--methods`` narrows them): GPT at (2, 2, 2) and (4, 1, 2) and the
U-Transformer at (4, 1, 2) with the paper's ``send_recv``, ``alpa``,
``broadcast``, ``overlap``, ``ours``, ``zb_h1``, ``interleaved``, ``zb_v``,
``dualpipev`` and ``upper_bound``; the tied-embedding GPT at (2, 2, 2) on 4 hosts x 2 devices
with ``per_step`` and ``per_micro_batch`` gradient reduction (see that
module), on

- ``emulated``: the case's emulated hosts (2 x 4 CPU devices for the
  paper's cases, 4 x 2 for ``gpt_tied``), one process each, links shaped
  to ``G`` Gbit/s (default 0.25: the links, not the two cores, are the
  bottleneck, as NICs are on a real cluster); one cluster per host shape;
  needs root;
- ``single_process``: 8 CPU devices in one process (transfers are
  ``jax.device_put``; ``send_recv`` and ``alpa`` would repeat ``overlap``).

Per (cluster, case, method): the measured step (median over ``N`` steps of
the slower process), and the schedule simulator's prediction
(``passes.schedule_simulator``) from each task's isolated duration and each
transfer's, the medians over three serialized traced steps (a move's
measured time includes its latency; a move no trace recorded takes the
planner's estimate at the measured link rate), plus the step's work around
the pipeline program (``outside_pipeline_s``: inputs placed, micro-batches
combined, gradients reduced and moved, the update, outputs assembled; each
instruction alone in the same serialized steps, the slowest process's, the
median over the steps). In one process every mesh
computes on the same two cores, so the simulator runs their compute in turn
(``simulate(cores=...)``); each emulated host has its own core. The schedule
simulated is the one the worker ran, on its meshes: ``interleaved`` runs two
stages per mesh (interleaved 1F1B), the others one. ``move_latency_s`` is the
median over measured moves of their time minus the planner's bandwidth
estimate.

Memory (issue 24): per row, ``peak_bytes_per_device`` is the largest over
devices of the bytes the runtime held at once (``StepTrace.live_bytes``:
parameters, optimizer state, gradients, residuals, activations in flight and
received), ``predicted_peak_bytes_per_device`` what
``passes.simulation.live_bytes.predict_live_bytes`` predicts from the
program and the measured profile, and ``peak_activation_bytes_per_device``
(and predicted) the schedule's part alone. ``spmd_circular`` rows (the
stock-JAX circular pipeline, ``benchmarks.spmd_pipeline``, R = 1 and 2) take
them from XLA's memory analysis of the compiled step: peak = arguments +
outputs - aliased + temporaries, activations = temporaries (which hold its
saved iteration inputs, and also its gradients before the update); their
bubble is ``(S - 1) / (R M + S - 1)``, the other rows' the simulator's. The share ``link busy / mesh compute`` of each case is printed
for 1F1B: the busiest link's transfer time per step over the busiest mesh's
compute time per step. ``interleaved`` rows have no target: ``targets``
prints their speed over ``upper_bound``'s for information.

Gradient reduction (``gpt_tied``: each stage mesh's data axis spans two
hosts, its model axis stays inside one, so all of a data-axis reduction
crosses the links, and nothing else a stage computes does):

- link bytes per step: the sum over hosts of what each host's link sent
  (its interface's ``tx_bytes``, read by the workers inside their
  namespaces around the timed steps), over the steps. Every byte between
  two hosts leaves one host's link once, so this counts it once;
- moves: the payload per step of the moves between meshes, from the plans
  the step ran (``pipeline_worker.move_link_bytes``): the boundary
  activations and cotangents per micro-batch, the tied embedding fetched to
  the last stage and its gradient sent back per step. Counted from the plans,
  not measured: the counters cannot tell which flow a byte was;
- gradients = link bytes - moves. What is not a move's payload counts as
  gradient traffic: the moves' headers and transport framing and the
  coordination service's barriers (a few percent and KBs) land there, so the
  figure errs high, against its target, never in its favour;
- one reduction: what reducing every stage's parameter gradients once sends
  over the links: per data-axis ring of ``D`` devices each sends
  ``2 (D - 1) / D`` of its gradient bytes to the next, counted when that
  one is on another host (``reduction_host_bytes``). ``gradients / one
  reduction`` is about 1 for ``per_step`` and ``M`` for ``per_micro_batch``;
- reductions per step: those bytes at the measured link rate, on each
  mesh's busiest host link (``M`` of them per step for a stage reducing in
  every backward, one for a stage the program reduces once per step); the
  prediction adds a per-step reduction to the simulator as
  ``TaskDurations.reduction``, priced so because no trace records it (a
  per-micro-batch one is inside the measured backward already). The
  simulator models the pipeline program alone: the tied embedding's fetch
  before it, its gradient's move back after the reduction and the update
  are in the measured step, not in the prediction.

Records (``--json``), one per (cluster, case, method)::

    {"model", "config", "method", "cluster", "measured_step_s", "predicted_step_s", "samples_per_s",
     "step_times_s", "over_upper_bound", "prediction_error", "transfer_share", "num_stages",
     "num_meshes", "num_micro_batches", "repeats", "bubble", "peak_bytes_per_device",
     "predicted_peak_bytes_per_device", "peak_activation_bytes_per_device",
     "predicted_peak_activation_bytes_per_device", "move_latency_s", "link_gbit",
     "gradient_reduction", "link_bytes_per_step", "move_link_bytes", "gradient_link_bytes",
     "one_reduction_bytes", "gradient_over_one_reduction", "reduction_s", "mesh_task_s", ...}

(``spmd_circular`` rows: ``method`` is ``"spmd_circular"`` for both R, ``repeats`` says which;
no prediction, ``predicted_*`` ``None``.)

``--png DIR`` draws the measured 1F1B (``overlap``) and eager-1F1B
(``ours``) timelines of one case (``--png-case``) per cluster, and the
simulated ones beside them (matplotlib: ``pip install -e ".[plot]"``).

Importing this module touches neither JAX nor the network.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

from benchmarks.pipeline_cases import CASES, GRADIENT_METHODS, METHODS, Case
from benchmarks.worker_records import ProgressPrinter, read_records, worker_env, write_json

__all__ = ["aggregate", "gradient_table", "main", "reduction_host_bytes", "table", "targets"]

TARGET_OVER_UPPER_BOUND = 0.95
TARGET_OVER_ALPA_UT = 1.3
TARGET_PREDICTION_ERROR = 0.15
TARGET_PREDICTION_ERROR_ONE_PROCESS = 0.25
TARGET_MEMORY_PREDICTION_ERROR = 0.10
# Issue 24: ours over the best circular SPMD pipeline's samples/s at M = 2S and 4S, and its
# activation bytes per device over spmd_circular's (R = 1) at M = 4S.
TARGET_OVER_SPMD = 1.2
TARGET_ACTIVATIONS_OVER_SPMD = 0.5
SPMD_METHOD = "spmd_circular"
# Issue 25: zb_v within this factor of the fastest schedule of a configuration.
TARGET_ZB_V_OVER_BEST = 1.05
SCHEDULE_METHODS = ("overlap", "ours", "zb_h1", "interleaved", "zb_v", "dualpipev")
# Gradient reduction (issue 22): per_step's gradient link bytes within this factor of one
# reduction either way, its step at most this share of per_micro_batch's, and the case sized so
# per_micro_batch's reductions are at least this share of its step.
TARGET_GRADIENT_BYTES = 1.1
TARGET_PER_STEP_OVER_PER_MICRO_BATCH = 0.75
TARGET_REDUCTION_SHARE = 0.30
PLOT_METHODS = ("overlap", "ours")
# Rows without a target of their own: targets() prints them for information only.
INFO_METHODS = ("interleaved",)
# Bytes/s of a copy between two CPU devices of one process, for the planner's
# estimates in single-process runs (order of magnitude of memcpy on this class
# of machine; those transfers are a few percent of a step either way).
SINGLE_PROCESS_COPY_BPS = 5e9


def _trace_files(trace_dir: str, name: str) -> list[str]:
    """The trace ``name`` as one process wrote it, or its ``.p<i>`` files from several."""
    stem, ext = os.path.splitext(name)
    single = os.path.join(trace_dir, name)
    if os.path.exists(single):
        return [single]
    return sorted(os.path.join(trace_dir, f) for f in os.listdir(trace_dir)
                  if f.startswith(stem + ".p") and f.endswith(ext))


def merged_timeline(trace_dir: str, name: str, source: str, schedule):
    """Every process's events of one traced step of ``schedule``, in one ``Timeline`` on the
    machine's clock, each transfer starting once its value was computed on the sending process."""
    from meshpar.passes.simulation.timeline import clip_to_dependencies, merge_timelines, read_chrome_trace

    paths = _trace_files(trace_dir, name)
    if not paths:
        raise FileNotFoundError(f"no trace {name} in {trace_dir}")
    merged = merge_timelines([read_chrome_trace(p) for p in paths], source)
    return clip_to_dependencies(merged, schedule.edges, schedule.split_backward)


def _schedule(spec: dict):
    """The schedule a worker ran, from its record's ``schedule`` (``pipeline_worker.schedule_spec``):
    on ``num_meshes`` meshes (a record without it: one stage per mesh), each stage on the mesh
    the schedule places it on, as the worker's was."""
    from meshpar.passes.pipeline.scheduling.pipeline_schedule import make_schedule

    schedule = make_schedule(spec["name"], spec["num_stages"], spec["num_micro_batches"],
                             [tuple(e) for e in spec["edges"]], spec["weight_delays"], spec.get("num_meshes"))
    if "stage_mesh" in spec and list(schedule.stage_mesh) != list(spec["stage_mesh"]):
        raise ValueError(f"schedule {spec['name']}: rebuilt with stages on meshes {list(schedule.stage_mesh)}, but "
                         f"the worker ran them on {list(spec['stage_mesh'])}")
    return schedule


def _durations(first: dict, schedule, trace_dir: str, reduction: Sequence[float] = ()):
    """Measured isolated compute per stage (several per mesh with virtual stages) and transfers
    per edge, each the median over the serialized steps' tasks, and ``reduction``: per mesh, its
    per-step gradient reduction's seconds (empty: none). A transfer no trace recorded (a move
    no process received) takes the planner's estimate.

    Returns the ``TaskDurations`` and the move latency: the median over the measured moves
    between meshes of their seconds minus the planner's bandwidth estimate, what a move costs
    beyond its bytes (``None`` with none measured)."""
    from meshpar.passes.simulation.schedule_simulator import (
        TaskDurations, stage_seconds_from, transfer_seconds_from,
    )

    timelines = [merged_timeline(trace_dir, name, "measured, serialized", schedule)
                 for name in first["serialized_traces"]]
    stages = stage_seconds_from(timelines, schedule.num_stages)
    num_edges = len(schedule.edges)
    act, grad = [0.0] * num_edges, [0.0] * num_edges
    for t in first["transfers"]:
        (act if t["activation"] else grad)[t["edge"]] += t["seconds"]
    measured_act, measured_grad = transfer_seconds_from(timelines, num_edges)
    gaps = [m - e for measured, estimated in ((measured_act, act), (measured_grad, grad))
            for (p, c), m, e in zip(schedule.edges, measured, estimated)
            if m is not None and schedule.stage_mesh[p] != schedule.stage_mesh[c] and e > 0]
    act = [e if m is None else m for e, m in zip(act, measured_act)]
    grad = [e if m is None else m for e, m in zip(grad, measured_grad)]
    latency = statistics.median(gaps) if gaps else None
    return TaskDurations(tuple(stages), tuple(act), tuple(grad), tuple(reduction)), latency


def _outside_pipeline_s(group: Sequence[dict]) -> float:
    """The step's work around the pipeline program, each instruction alone: per serialized step
    the slowest process's, the median over the steps (0 for records without it)."""
    steps = [g.get("outside_pipeline_s") or [] for g in group]
    n = min(len(s) for s in steps)
    return statistics.median([max(s[i] for s in steps) for i in range(n)]) if n else 0.0


def _peak(group: Sequence[dict], field: str, part: str) -> int | None:
    """The largest per-device bytes of ``field`` (``live_bytes`` or ``predicted_live_bytes``)
    over every process's devices."""
    values = [n for g in group if g.get(field) for n in g[field][part].values()]
    return max(values) if values else None


def _mesh_compute(durations, schedule) -> list[float]:
    """Per mesh, the seconds per step of the compute tasks of every stage it runs."""
    compute = [0.0] * schedule.num_meshes
    for s, seconds in enumerate(durations.stages):
        compute[schedule.stage_mesh[s]] += schedule.num_micro_batches * (seconds.forward + seconds.backward)
    return compute


def _share(durations, schedule) -> float:
    """Per step: the busiest link's transfer seconds over the busiest mesh's compute seconds.

    A link joins two meshes, one way: every edge between stages on those meshes shares it (with
    virtual stages, several edges); a mesh computes every stage it runs. Edges inside one mesh
    move nothing over a link."""
    M = schedule.num_micro_batches
    mesh = schedule.stage_mesh
    links: dict[tuple[int, int], float] = {}
    for e, (p, c) in enumerate(schedule.edges):
        if mesh[p] == mesh[c]:
            continue
        links[(mesh[p], mesh[c])] = links.get((mesh[p], mesh[c]), 0.0) + M * durations.activation[e]
        links[(mesh[c], mesh[p])] = links.get((mesh[c], mesh[p]), 0.0) + M * durations.gradient[e]
    return max(links.values(), default=0.0) / max(_mesh_compute(durations, schedule))


def reduction_host_bytes(stage: dict) -> dict[int, float]:
    """Per host, the bytes its link sends in one all-reduce of a stage's parameter gradients over
    its mesh's data axis (``stage``: a worker's ``gradient_stages`` entry).

    A ring all-reduce (reduce-scatter, then all-gather) of ``D`` devices: each sends
    ``2 (D - 1) / D`` of its ``device_bytes`` to the next device of its ring in data order, over
    a link when that one is on another host. One ring per position on the mesh's other axes
    (each model-axis device reduces its own shard with its data-axis peers)."""
    out: dict[int, float] = {}
    for ring in stage["rings"]:
        D = len(ring)
        for i, host in enumerate(ring):
            if host != ring[(i + 1) % D]:
                out[host] = out.get(host, 0.0) + 2 * (D - 1) / D * stage["device_bytes"]
    return out


def _gradient_accounting(group: Sequence[dict], num_micro_batches: int, num_meshes: int,
                         link_rate_Bps: float) -> tuple[dict, list[float]]:
    """What a method's gradient reductions cost per step, and what its links carried (module doc).

    ``reduction_s``: per mesh, seconds per step of its reductions at ``link_rate_Bps`` on its
    busiest host link, ``M`` per step for a stage reducing in every backward, one for a stage of
    ``per_step_stages``. Byte counts per step; ``None`` where the workers recorded none (one
    process has no links; records from before the accounting). Returned beside the fields: per
    mesh, the seconds of its one per-step reduction for the simulator (empty when no stage
    reduces once per step)."""
    first = group[0]
    stages = first.get("gradients") or []
    per_step = set(first.get("per_step_stages") or [])
    reduction_s, per_step_s = [0.0] * num_meshes, [0.0] * num_meshes
    one = 0.0
    for stage in stages:
        hosts = reduction_host_bytes(stage)
        one += sum(hosts.values())
        seconds = max(hosts.values(), default=0.0) / link_rate_Bps
        reduction_s[stage["mesh"]] += seconds * (1 if stage["stage"] in per_step else num_micro_batches)
        if stage["stage"] in per_step:
            per_step_s[stage["mesh"]] += seconds
    counted = [g.get("link_bytes") for g in group]
    link, received = None, None
    if all(counted):
        link = sum(c["tx_bytes"] / c["steps"] for c in counted)
        received = sum(c["rx_bytes"] / c["steps"] for c in counted)
    moves = first.get("move_link_bytes")
    gradient = link - moves if link is not None and moves is not None else None
    return {
        "gradient_reduction": first.get("gradient_reduction"),
        "per_step_stages": sorted(per_step),
        "link_bytes_per_step": link,
        "link_rx_bytes_per_step": received,
        "move_link_bytes": moves,
        "gradient_link_bytes": gradient,
        "one_reduction_bytes": one if stages else None,
        "gradient_over_one_reduction": gradient / one if gradient is not None and one > 0 else None,
        "reduction_s": reduction_s,
    }, per_step_s if per_step else []


def aggregate(lines: Sequence[dict], trace_dir: str, cluster: str, num_processes: int,
              link_rate_Bps: float) -> list[dict]:
    """One record per (case, method) every process reported, with the simulator's prediction and
    the gradient accounting (``link_rate_Bps``: bytes/s of the links the reductions run over)."""
    from meshpar.passes.simulation.schedule_simulator import simulate

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in lines:
        if r.get("kind") == "method":
            groups.setdefault((r["case"], r["method"]), []).append(r)
    records = []
    for (case, method), group in groups.items():
        if len(group) < num_processes:
            continue
        group.sort(key=lambda r: r["process"])
        first = group[0]
        n = min(len(g["step_times_s"]) for g in group)
        per_step = [max(g["step_times_s"][i] for g in group) for i in range(n)]
        measured = statistics.median(per_step)
        if first.get("spmd"):
            records.append(_spmd_record(group, cluster, per_step, measured))
            continue
        schedule = _schedule(first["schedule"])
        gradients, per_step_reduction = _gradient_accounting(group, schedule.num_micro_batches, schedule.num_meshes,
                                                             link_rate_Bps)
        durations, move_latency = _durations(first, schedule, trace_dir, per_step_reduction)
        # One process's meshes share its cores; each emulated host computes on its own core.
        cores = [0] * schedule.num_meshes if num_processes == 1 else None
        simulated = simulate(schedule, durations, overlap=first["overlap"], cores=cores)
        outside = _outside_pipeline_s(group)
        predicted = simulated.step_seconds + outside
        losses = [g["loss"] for g in group if g["loss"] is not None]
        records.append({
            "model": first["model"], "config": first["config"], "method": method, "cluster": cluster,
            "case": case, "measured_step_s": measured, "predicted_step_s": predicted,
            "simulated_pipeline_s": simulated.step_seconds, "outside_pipeline_s": outside,
            "samples_per_s": first["batch"] / measured, "step_times_s": per_step,
            "prediction_error": predicted / measured - 1,
            "predicted_bubble": simulated.bubble_fraction,
            "transfer_share": _share(durations, schedule),
            # Per mesh: a reduction inside each backward is part of these measured seconds.
            "mesh_task_s": _mesh_compute(durations, schedule),
            "stage_seconds": [vars(s) for s in durations.stages],
            "transfer_seconds": {"activation": list(durations.activation), "gradient": list(durations.gradient)},
            "weight_delays": first["schedule"]["weight_delays"],
            "schedule": first["schedule"], "overlap": first["overlap"],
            "num_stages": schedule.num_stages, "num_meshes": schedule.num_meshes,
            "peak_live_activations": [max(g["peak_live_activations"][s] for g in group)
                                      for s in range(schedule.num_stages)],
            "compile_s": max(g["compile_s"] for g in group),
            "num_micro_batches": schedule.num_micro_batches, "repeats": None,
            "bubble": simulated.bubble_fraction,
            "move_latency_s": move_latency,
            "peak_bytes_per_device": _peak(group, "live_bytes", "total"),
            "predicted_peak_bytes_per_device": _peak(group, "predicted_live_bytes", "total"),
            "peak_activation_bytes_per_device": _peak(group, "live_bytes", "activations"),
            "predicted_peak_activation_bytes_per_device": _peak(group, "predicted_live_bytes", "activations"),
            "loss": losses[0] if losses else None,
            **gradients,
        })
    bound = {(r["case"], r["cluster"]): r["measured_step_s"] for r in records if r["method"] == "upper_bound"}
    for r in records:
        b = bound.get((r["case"], r["cluster"]))
        r["over_upper_bound"] = b / r["measured_step_s"] if b else None
    order = {m.name: i for i, m in enumerate(METHODS)}
    cases = {c.name: i for i, c in enumerate(CASES)}
    return sorted(records, key=lambda r: (cases.get(r["case"], 99), order.get(r["method"], 99), r.get("repeats") or 0))


def _spmd_record(group: Sequence[dict], cluster: str, per_step: list[float], measured: float) -> dict:
    """A circular SPMD pipeline row: measured like the others; its bytes per device from XLA's
    memory analysis (the largest over processes), its bubble ``(S - 1) / (R M + S - 1)``; no
    simulator prediction (it is one XLA program, not a schedule of ours)."""
    first = group[0]
    losses = [g["loss"] for g in group if g["loss"] is not None]
    return {
        "model": first["model"], "config": first["config"], "method": SPMD_METHOD, "cluster": cluster,
        "case": first["case"], "measured_step_s": measured, "predicted_step_s": None,
        "samples_per_s": first["batch"] / measured, "step_times_s": per_step, "prediction_error": None,
        "num_micro_batches": first["num_micro_batches"], "repeats": first["repeats"],
        "num_stages": first["num_stages"], "num_meshes": 1, "bubble": first["bubble"],
        "predicted_bubble": first["bubble"], "weight_delays": None, "peak_live_activations": None,
        "peak_bytes_per_device": max(g["memory"]["peak_bytes"] for g in group),
        "predicted_peak_bytes_per_device": None,
        "peak_activation_bytes_per_device": max(g["memory"]["temp_bytes"] for g in group),
        "predicted_peak_activation_bytes_per_device": None,
        "memory": first["memory"], "compile_s": max(g["compile_s"] for g in group),
        "loss": losses[0] if losses else None, "over_upper_bound": None,
    }


def row_name(r: dict) -> str:
    """A record's method as tables show it: ``spmd_circular R=2`` for the SPMD baseline."""
    return f"{r['method']} R={r['repeats']}" if r["method"] == SPMD_METHOD else r["method"]


def table(records: Sequence[dict]) -> str:
    """Markdown: one row per (cluster, case, method); bytes per device in MB (1e6 bytes),
    measured / predicted."""
    lines = ["| cluster | case | method | step (ms) | predicted (ms) | error | samples/s | bubble | "
             "peak MB/device | activations MB/device | upper bound / step | weight delays | peak live | "
             "stages / meshes |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ub = f"{r['over_upper_bound']:.2f}" if r.get("over_upper_bound") else "-"
        delays = r["weight_delays"] if r["weight_delays"] is not None else "-"
        placed = f"{r['num_stages']} / {r['num_meshes']}" if "num_meshes" in r else "-"
        predicted = "-" if r["predicted_step_s"] is None else f"{r['predicted_step_s'] * 1e3:.0f}"
        error = "-" if r["prediction_error"] is None else f"{r['prediction_error'] * 100:+.0f}%"
        bubble = "-" if r.get("bubble") is None else f"{r['bubble']:.2f}"
        peak = f"{_mb(r.get('peak_bytes_per_device'))} / {_mb(r.get('predicted_peak_bytes_per_device'))}"
        acts = (f"{_mb(r.get('peak_activation_bytes_per_device'))} / "
                f"{_mb(r.get('predicted_peak_activation_bytes_per_device'))}")
        lines.append(
            f"| {r['cluster']} | {r['case']} | {row_name(r)} | {r['measured_step_s'] * 1e3:.0f} | {predicted} | "
            f"{error} | {r['samples_per_s']:.0f} | {bubble} | {peak} | {acts} | {ub} | {delays} | "
            f"{r['peak_live_activations'] or '-'} | {placed} |")
    return "\n".join(lines)


def _mb(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / 1e6:.1f}"


def gradient_table(records: Sequence[dict]) -> str:
    """Markdown: one row per (cluster, case, method) of ``GRADIENT_METHODS``, the step split into
    the busiest mesh's serialized tasks and its gradient reductions at the link rate, and what the
    links carried per step (MB = 1e6 bytes; module doc)."""
    lines = ["| cluster | case | method | step (ms) | predicted (ms) | error | mesh tasks (ms) | reductions (ms) | "
             "reductions / step | link MB/step | moves MB/step | gradients MB/step | one reduction (MB) | "
             "gradients / one reduction |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if r["method"] not in GRADIENT_METHODS:
            continue
        reductions = max(r["reduction_s"])
        ratio = r["gradient_over_one_reduction"]
        lines.append(
            f"| {r['cluster']} | {r['case']} | {r['method']} | {r['measured_step_s'] * 1e3:.0f} | "
            f"{r['predicted_step_s'] * 1e3:.0f} | {r['prediction_error'] * 100:+.0f}% | "
            f"{max(r['mesh_task_s']) * 1e3:.0f} | {reductions * 1e3:.0f} | "
            f"{reductions / r['measured_step_s'] * 100:.0f}% | {_mb(r['link_bytes_per_step'])} | "
            f"{_mb(r['move_link_bytes'])} | {_mb(r['gradient_link_bytes'])} | {_mb(r['one_reduction_bytes'])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} |")
    return "\n".join(lines)


def _gradient_targets(case: Case, per_step: dict, per_micro_batch: dict) -> list[tuple[bool, str]]:
    """Issue 22's targets on one case's two emulated gradient rows: ``(met, text)`` each."""
    out = []
    share = max(per_micro_batch["reduction_s"]) / per_micro_batch["measured_step_s"]
    out.append((share >= TARGET_REDUCTION_SHARE,
                f"{case.name}: per_micro_batch's gradient reductions {share * 100:.0f}% of its step "
                f"(sized for >= {TARGET_REDUCTION_SHARE * 100:.0f}%)"))
    ratio = per_step["gradient_over_one_reduction"]
    if ratio is not None:
        out.append((1 / TARGET_GRADIENT_BYTES <= ratio <= TARGET_GRADIENT_BYTES,
                    f"{case.name}: per_step's gradient link bytes {ratio:.2f}x one reduction per step "
                    f"(target within {TARGET_GRADIENT_BYTES}x)"))
    speed = per_step["measured_step_s"] / per_micro_batch["measured_step_s"]
    out.append((speed <= TARGET_PER_STEP_OVER_PER_MICRO_BATCH,
                f"{case.name}: per_step's step {speed:.2f}x per_micro_batch's "
                f"(target <= {TARGET_PER_STEP_OVER_PER_MICRO_BATCH})"))
    worst = max(abs(per_step["prediction_error"]), abs(per_micro_batch["prediction_error"]))
    out.append((worst <= TARGET_PREDICTION_ERROR,
                f"{case.name}: simulator {per_step['prediction_error'] * 100:+.0f}% on per_step, "
                f"{per_micro_batch['prediction_error'] * 100:+.0f}% on per_micro_batch "
                f"(target within {TARGET_PREDICTION_ERROR * 100:.0f}%)"))
    return out


def targets(records: Sequence[dict]) -> list[str]:
    """The issues' targets, on the emulated cluster; one line each, ``met`` or ``MISSED``.

    Gradient reduction (a case with ``per_step`` and ``per_micro_batch`` rows): the case is
    sized so per-micro-batch reductions are a real share of the step, ``per_step``'s gradient
    link bytes are one reduction's, its step is faster, and the simulator predicts both.

    ``INFO_METHODS`` (``interleaved``) have no target: a line ``info`` each gives their speed
    over ``upper_bound``'s and their prediction error, and the simulator's target leaves them
    out."""
    out = []
    by = {(r["cluster"], r["case"], r["method"]): r for r in records}

    def line(ok: bool, text: str) -> None:
        out.append(f"{'met   ' if ok else 'MISSED'} {text}")

    for case in CASES:
        get = lambda m: by.get(("emulated", case.name, m))  # noqa: E731
        ours, bound, alpa = get("ours"), get("upper_bound"), get("alpa")
        overlap, broadcast = get("overlap"), get("broadcast")
        if ours and bound:
            ratio = bound["measured_step_s"] / ours["measured_step_s"]
            line(ratio >= TARGET_OVER_UPPER_BOUND,
                 f"{case.name}: ours at {ratio:.2f}x the upper bound's speed (target >= {TARGET_OVER_UPPER_BOUND})")
        if case.model == "u_transformer" and ours and alpa:
            ratio = alpa["measured_step_s"] / ours["measured_step_s"]
            line(ratio >= TARGET_OVER_ALPA_UT, f"{case.name}: ours {ratio:.2f}x alpa (target >= {TARGET_OVER_ALPA_UT})")
        if overlap and broadcast:
            ratio = broadcast["measured_step_s"] / overlap["measured_step_s"]
            line(ratio > 1, f"{case.name}: overlap {ratio:.2f}x broadcast (target > 1)")
        if ours and overlap:
            ratio = overlap["measured_step_s"] / ours["measured_step_s"]
            line(ratio >= 1, f"{case.name}: ours {ratio:.2f}x overlap (target >= 1)")
        per_step, per_micro_batch = get("per_step"), get("per_micro_batch")
        if per_step and per_micro_batch:
            for ok, text in _gradient_targets(case, per_step, per_micro_batch):
                line(ok, text)
        for method in INFO_METHODS:
            r = get(method)
            if r and bound:
                ratio = bound["measured_step_s"] / r["measured_step_s"]
                out.append(f"info   {case.name}: {method} at {ratio:.2f}x the upper bound's speed, predicted "
                           f"{r['prediction_error'] * 100:+.0f}% (no target)")
        for ok, text in _spmd_targets(case, [r for r in records if r["cluster"] == "emulated" and r["case"] == case.name]):
            line(ok, text)
        for cluster in ("emulated", "single_process"):
            for ok, text in _v_targets(case, cluster, {m: by.get((cluster, case.name, m)) for m in SCHEDULE_METHODS}):
                line(ok, text)
    for cluster, target in (("emulated", TARGET_PREDICTION_ERROR), ("single_process", TARGET_PREDICTION_ERROR_ONE_PROCESS)):
        errors = [r for r in records if r["cluster"] == cluster and r["method"] not in INFO_METHODS
                  and r["prediction_error"] is not None]
        if errors:
            worst = max(errors, key=lambda r: abs(r["prediction_error"]))
            within = sum(abs(r["prediction_error"]) <= target for r in errors)
            line(within == len(errors),
                 f"simulator within {target * 100:.0f}% on {within} of {len(errors)} {cluster} steps "
                 f"(worst {worst['prediction_error'] * 100:+.0f}%: {worst['case']} {worst['method']})")
    memory = [r for r in records if r.get("predicted_peak_bytes_per_device") and r.get("peak_bytes_per_device")]
    if memory:
        error = lambda r: r["predicted_peak_bytes_per_device"] / r["peak_bytes_per_device"] - 1  # noqa: E731
        worst = max(memory, key=lambda r: abs(error(r)))
        line(abs(error(worst)) <= TARGET_MEMORY_PREDICTION_ERROR,
             f"memory prediction within {abs(error(worst)) * 100:.1f}% of every measured peak "
             f"({len(memory)} rows; worst {worst['cluster']} {worst['case']} {worst['method']}; "
             f"target <= {TARGET_MEMORY_PREDICTION_ERROR * 100:.0f}%)")
    return out


def _v_targets(case: Case, cluster: str, rows: dict[str, dict | None]) -> list[tuple[bool, str]]:
    """Issue 25's targets on one case and cluster: ``zb_v`` at least as fast as ``zb_h1`` and
    ``interleaved``, and within 5% of the fastest of every schedule's row."""
    zb_v = rows.get("zb_v")
    if zb_v is None:
        return []
    out = []
    for other in ("zb_h1", "interleaved"):
        r = rows.get(other)
        if r is not None:
            ratio = r["measured_step_s"] / zb_v["measured_step_s"]
            out.append((ratio >= 1, f"{case.name} ({cluster}): zb_v {ratio:.2f}x {other} (target >= 1)"))
    best = min((r for r in rows.values() if r is not None), key=lambda r: r["measured_step_s"])
    over = zb_v["measured_step_s"] / best["measured_step_s"]
    out.append((over <= TARGET_ZB_V_OVER_BEST, f"{case.name} ({cluster}): zb_v's step {over:.2f}x the fastest "
                                               f"schedule's ({best['method']}; target <= {TARGET_ZB_V_OVER_BEST})"))
    return out


def _spmd_targets(case: Case, rows: Sequence[dict]) -> list[tuple[bool, str]]:
    """Issue 24's targets on one case's emulated rows: ``ours`` against the faster circular SPMD
    pipeline (R = 1 or 2) at M >= 2S, and at M = 4S its activation bytes (and 1F1B's) against
    R = 1's."""
    spmd = [r for r in rows if r["method"] == SPMD_METHOD]
    by = {r["method"]: r for r in rows if r["method"] != SPMD_METHOD}
    ours, stages = by.get("ours"), case.config[2]
    if not spmd or ours is None or case.micro_batches < 2 * stages:
        return []
    best = max(spmd, key=lambda r: r["samples_per_s"])
    ratio = ours["samples_per_s"] / best["samples_per_s"]
    out = [(ratio >= TARGET_OVER_SPMD,
            f"{case.name}: ours {ratio:.2f}x spmd_circular R={best['repeats']} samples/s (the faster R; "
            f"target >= {TARGET_OVER_SPMD})")]
    remat = by.get("ours_remat")
    if remat is not None:
        out.append((True, f"{case.name}: ours_remat {remat['samples_per_s'] / best['samples_per_s']:.2f}x "
                          f"spmd_circular R={best['repeats']} samples/s (information, no target)"))
    circular = next((r for r in spmd if r["repeats"] == 1), None)
    if case.micro_batches == 4 * stages and circular is not None:
        for method in ("overlap", "ours", "ours_remat"):
            r = by.get(method)
            if r and r.get("peak_activation_bytes_per_device"):
                share = r["peak_activation_bytes_per_device"] / circular["peak_activation_bytes_per_device"]
                out.append((share <= TARGET_ACTIVATIONS_OVER_SPMD,
                            f"{case.name}: {method}'s activation bytes per device {share:.2f}x spmd_circular's "
                            f"temp bytes (R=1; target <= {TARGET_ACTIVATIONS_OVER_SPMD})"))
    return out


def _progress(prefix: str) -> Callable[[list[dict], float], list[str]]:
    """A ``ProgressPrinter`` report: a line per method record and per error, once each."""
    seen: set = set()

    def report(lines: list[dict], elapsed: float) -> list[str]:
        out = []
        for r in lines:
            key = (r.get("process"), r.get("case"), r.get("method"), r.get("kind"))
            if r.get("kind") not in ("method", "error") or key in seen:
                continue
            seen.add(key)
            if r["kind"] == "error":
                out.append(f"[{elapsed:6.0f}s] {prefix}process {r['process']}: ERROR {r['error']}")
            else:
                steps = " ".join(f"{t * 1e3:.0f}" for t in r["step_times_s"])
                out.append(f"[{elapsed:6.0f}s] {prefix}process {r['process']}: {r['case']} {r['method']}: "
                           f"compile+first step {r['compile_s']:.1f} s; steps {steps} ms")
        return out

    return report


def _selected(args: argparse.Namespace) -> list[Case]:
    """The ``--cases`` that run at least one of the ``--methods``, in ``CASES`` order."""
    return [c for c in CASES if c.name in args.cases and set(c.methods) & set(args.methods)]


def _worker_argv(args: argparse.Namespace, cases: Sequence[Case], out: str, traces: str, rate: float) -> list[str]:
    argv = ["-m", "benchmarks.pipeline_worker", "--out", out, "--trace-dir", traces, "--link-rate", repr(rate),
            "--repeat", str(args.repeat), "--serialized-steps", str(args.serialized_steps),
            "--timeout", repr(args.step_timeout), "--cases", *[c.name for c in cases],
            "--methods", *args.methods]
    if args.png:
        argv += ["--trace-methods", *PLOT_METHODS]
    return argv


def _env() -> dict[str, str]:
    return {**worker_env(), "TF_CPP_MIN_LOG_LEVEL": "2"}


def _run_emulated(args: argparse.Namespace, traces: str, start: float) -> tuple[list[dict], list[str]]:
    """One emulated cluster per host shape of the selected cases, one after another."""
    from benchmarks.emulated_cluster import EmulatedCluster

    traces = os.path.join(traces, "emulated")
    os.makedirs(traces, exist_ok=True)
    ok, why = EmulatedCluster.available()
    if not ok:
        return [], [f"emulated cluster unavailable: {why}"]
    records: list[dict] = []
    errors: list[str] = []
    cases = _selected(args)
    for hosts, per_host in dict.fromkeys(c.hosts for c in cases):
        on_these = [c for c in cases if c.hosts == (hosts, per_host)]
        print(f"emulated cluster: {hosts} hosts x {per_host} CPU devices, {args.link_gbit:g} Gbit/s tbf-shaped links",
              flush=True)
        with EmulatedCluster(hosts, per_host, args.link_gbit, timeout_s=args.timeout) as cluster:
            rate = cluster.measure_link_rate(0, 1)
            print(f"measured link rate host0 -> host1: {rate / 1e6:.1f} MB/s", flush=True)
            with tempfile.TemporaryDirectory(prefix="meshpar-pipeline-") as out:
                errors += cluster.run_reporting(_worker_argv(args, on_these, out, traces, rate), env=_env(),
                                                timeout_s=args.timeout, what="emulated pipeline run",
                                                progress=ProgressPrinter(out, _progress("emulated "), start))
                lines = read_records(out)
        errors += [f"emulated, process {r['process']}: {r['error']}" for r in lines if r.get("kind") == "error"]
        got = aggregate(lines, traces, "emulated", hosts, rate)
        for r in got:
            r.update(link_gbit=args.link_gbit, link_rate_Bps=rate)
        records += got
    return records, errors


def _run_single(args: argparse.Namespace, traces: str, start: float) -> tuple[list[dict], list[str]]:
    traces = os.path.join(traces, "single_process")
    os.makedirs(traces, exist_ok=True)
    # One process: every transfer is an in-memory copy, for the planner too.
    rate = SINGLE_PROCESS_COPY_BPS
    print("single process: 8 CPU devices", flush=True)
    with tempfile.TemporaryDirectory(prefix="meshpar-pipeline-") as out:
        progress = ProgressPrinter(out, _progress("single_process "), start)
        progress.start()
        try:
            proc = subprocess.run([sys.executable, *_worker_argv(args, _selected(args), out, traces, rate),
                                   "--single-process"],
                                  env={**os.environ, **_env()}, timeout=args.timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return [], [f"single-process run overran {args.timeout:g} s"]
        finally:
            progress.stop.set()
            progress.join()
            progress.poll()
        lines = read_records(out)
    errors = [] if proc.returncode == 0 else [f"single-process run failed:\n{proc.stderr[-3000:]}"]
    records = aggregate(lines, traces, "single_process", 1, rate)
    for r in records:
        r.update(link_gbit=None, link_rate_Bps=None)
    return records, errors


def _plot(args: argparse.Namespace, traces: str, records: Sequence[dict]) -> list[str]:
    """Per cluster: the measured and the simulated timelines of ``PLOT_METHODS`` on ``--png-case``."""
    from benchmarks.pipeline_worker import slug
    from benchmarks.timeline_plot import plot_timelines
    from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate

    os.makedirs(args.png, exist_ok=True)
    written = []
    for cluster in ("emulated", "single_process"):
        cluster_traces = os.path.join(traces, cluster)
        by = {r["method"]: r for r in records if r["cluster"] == cluster and r["case"] == args.png_case}
        if not all(m in by for m in PLOT_METHODS):
            continue
        timelines, titles = [], []
        for method in PLOT_METHODS:
            r = by[method]
            schedule = _schedule(r["schedule"])
            label = "1F1B" if method == "overlap" else "eager-1F1B + weight delay"
            measured = merged_timeline(cluster_traces, f"{slug(args.png_case)}-{method}.json", "measured", schedule)
            timelines.append(measured)
            titles.append(f"{method} ({label}), median step {r['measured_step_s'] * 1e3:.0f} ms; one traced step")
            durations = TaskDurations(tuple(StageSeconds(**s) for s in r["stage_seconds"]),
                                      tuple(r["transfer_seconds"]["activation"]),
                                      tuple(r["transfer_seconds"]["gradient"]))
            cores = [0] * schedule.num_meshes if cluster == "single_process" else None
            simulated = simulate(schedule, durations, overlap=r["overlap"], cores=cores)
            timelines.append(simulated.timeline)
            titles.append(f"{method} ({label}), predicted from isolated task times")
        path = os.path.join(args.png, f"timeline-{cluster}-{slug(args.png_case)}.png")
        plot_timelines(timelines, titles, path)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-gbit", type=float, default=0.25, help="emulated link rate (default 0.25)")
    parser.add_argument("--repeat", type=int, default=5, help="timed steps per method (default 5)")
    parser.add_argument("--serialized-steps", type=int, default=3,
                        help="serialized traced steps per method, whose medians the simulator takes (default 3)")
    parser.add_argument("--cases", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    parser.add_argument("--methods", nargs="+", default=[m.name for m in METHODS], choices=[m.name for m in METHODS])
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--png", help="write timeline figures into this directory")
    plottable = [c.name for c in CASES if set(PLOT_METHODS) <= set(c.methods)]
    default_png = "u_transformer (4, 1, 2)"
    parser.add_argument("--png-case", default=default_png, choices=plottable,
                        help=f"the case whose timelines --png draws (default {default_png})")
    parser.add_argument("--trace-dir", help="keep every traced step's Chrome trace here (default: discarded)")
    parser.add_argument("--no-emulated", action="store_true", help="skip the emulated cluster")
    parser.add_argument("--no-single-process", action="store_true", help="skip the single-process rows")
    parser.add_argument("--timeout", type=float, default=1500.0, help="bound on each run of the workers, s")
    parser.add_argument("--step-timeout", type=float, default=300.0, help="bound on each wait inside the workers, s")
    args = parser.parse_args(argv)
    if args.serialized_steps < 1:
        # The simulator's prediction and the memory rows are made from the serialized steps.
        parser.error(f"--serialized-steps: expected at least 1, got {args.serialized_steps}")
    start = time.perf_counter()
    records: list[dict] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="meshpar-pipeline-traces-") as scratch:
        traces = args.trace_dir or scratch
        os.makedirs(traces, exist_ok=True)
        if not args.no_emulated:
            got, errs = _run_emulated(args, traces, start)
            records, errors = records + got, errors + errs
        if not args.no_single_process:
            got, errs = _run_single(args, traces, start)
            records, errors = records + got, errors + errs
        if records:
            shares = {(r["cluster"], r["case"]): r["transfer_share"] for r in records if r["method"] == "overlap"}
            print("\nUnder 1F1B (overlap), the busiest link's transfer time per step over the busiest mesh's "
                  "compute time per step (planner estimates over measured isolated compute):")
            for (cluster, case), share in shares.items():
                print(f"  {cluster} {case}: {share * 100:.0f}%")
            print("\nStep time: median over steps of the slower process; predicted by the schedule simulator.\n")
            print(table(records))
            if any(r["method"] in GRADIENT_METHODS for r in records):
                print("\nGradient reduction: the busiest mesh's serialized tasks per step (a reduction in every "
                      "backward included) and its gradient reductions per step at the link rate; bytes per step "
                      "over all hosts' links (interface tx counters), the planned moves' payload, the rest as "
                      "gradients, and one reduction of every stage's gradients.\n")
                print(gradient_table(records))
            print("\nTargets (emulated cluster):")
            print("\n".join(targets(records)))
        if args.png and records:
            for path in _plot(args, traces, records):
                print(f"wrote {path}")
    for e in errors:
        print(f"ERROR: {e}", file=sys.stderr)
    write_json(args.json, records)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 1 if errors or not records else 0


if __name__ == "__main__":
    sys.exit(main())
