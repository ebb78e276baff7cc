"""Planner benchmark: what each automatic planner picks, predicted and measured.

    python -m benchmarks.planner [--json PATH] [--models gpt ut gpt_scanned] [--repeat N] [--rounds R] [--quick]
        [--no-cpu] [--no-small] [--no-simulated] [--planners meshpar ...]

- ``cpu``: 8 CPU devices in this process. For GPT and U-Transformer with 8 layers (7 candidate
  cut points), and the GPT with its blocks in one scan, every configuration of a grid is
  predicted by meshpar's cost model (``passes.planning.planner_meshpar.predict``) and measured
  (median of ``N`` steps after one that compiles): 1, 2 or 4 stages cut evenly on all devices,
  each (data, model) shape, 2, 4 or 8 micro-batches, and 1 for one stage, under 1F1B; one
  program on the first 1, 2 or 4 devices; and every registered schedule taking virtual stages
  with 4 stages on 2 meshes (2 per mesh) and 4 or 8 micro-batches. So are each planner's pick,
  plain ``jax.jit`` data parallelism over all 8 devices, and ``jax.jit`` on one device.
  Reports the rank correlation (Spearman) of predicted and measured steps. Then the
  contenders (the grid's three best, every pick, both ``jax.jit``s) are measured again,
  interleaved over ``--rounds`` rounds, so that each pick is compared with the best of them at
  one time on a machine whose speed drifts over minutes.
- ``small``: as a user would, ``meshpar.plan_parallelism`` on the issue's small GPT (4 blocks
  in one ``nn.scan``) and on each CPU model, calibrating on its own: the planning time, the
  warnings it shows, and the pick against ``jax.jit`` on one device, ``SMALL_STEPS`` steps of
  each in alternating rounds (p50, p90 and max).
- ``simulated``: a 96-layer GPT (hidden 12288, 2048 tokens) on ``dgx_h100`` and
  ``aws_p3_8xlarge`` clusters of 16 to 1,024 GPUs, 80 GB (resp. 16 GB) per device: each
  planner's pick, predicted step time, peak memory per device and planning time; and ATP's
  2D tensor-parallel mesh for one of its layers against Megatron's 1D, on 8 to 64 GPUs.

Records (``--json``): one per measured or planned configuration::

    {"part", "model", "config", "source", "predicted_step_s", "measured_step_s", "planning_s", "peak_memory_bytes", ...}
    {"part": "small", "model", "config", "planning_s", "warnings", "pick_p50_ms", "pick_p90_ms", "pick_max_ms",
     "jit_p50_ms", "jit_p90_ms", "jit_max_ms"}

Prints progress lines while it runs and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from benchmarks.step_timing import spread_ms, time_steps

__all__ = ["main", "progress_emitter", "save_records", "spearman", "table"]

CPU_DEVICES = 8
GRID_STAGES = (1, 2, 4)
GRID_MICRO_BATCHES = (2, 4, 8)
# One program on the first n devices.
GRID_DEVICE_SUBSETS = (1, 2, 4)
# Virtual stages: this many stages on half as many meshes, with these micro-batch counts.
GRID_VIRTUAL_STAGES = 4
GRID_VIRTUAL_MICRO_BATCHES = (4, 8)
BATCH = 16
# The grid's best configurations measured again beside the picks and jax.jit.
HEAD_TO_HEAD_GRID = 3
# Steps of the pick and of jax.jit on one device in the small-model part, in rounds of SMALL_ROUND.
SMALL_STEPS = 20
SMALL_ROUND = 5


def spearman(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    import numpy as np

    def ranks(v):
        v = np.asarray(v, dtype=float)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=float)
        for value in np.unique(v):
            tie = v == value
            r[tie] = r[tie].mean()
        return r

    if len(xs) < 2:
        return float("nan")
    a, b = ranks(xs), ranks(ys)
    return float(np.corrcoef(a, b)[0, 1])


def _config(plan) -> str:
    """One line naming a ``PipelinePlan``: its stages' layers, each mesh's shape, stages per
    mesh, micro-batches and schedule (one program: its devices)."""
    layers = "|".join(f"{s.start}-{s.stop - 1}" for s in plan.stages)
    shapes = "+".join(f"{d}x{t}" for d, t in plan.mesh_shapes)
    if plan.one_program:
        return f"one program [{layers}] {shapes} on {plan.num_devices} device{'s' * (plan.num_devices > 1)}"
    return (f"S={plan.num_stages} [{layers}] {shapes} v={plan.stages_per_mesh} M={plan.num_micro_batches} "
            f"{plan.schedule}")


def _cpu_models(names: Sequence[str]):
    from examples.gpt import GPT, gpt_batch, gpt_loss
    from examples.u_transformer import UTransformer, ut_batch, ut_loss

    out = {}
    if "tiny" in names:
        # The small GPT: 4 blocks in one nn.scan.
        model = GPT(num_layers=4, scan_layers=True)
        out["tiny"] = (model, gpt_batch(0, BATCH, model.seq_len, model.vocab_size), gpt_loss)
    if "gpt" in names:
        model = GPT(num_stages=8)
        out["gpt"] = (model, gpt_batch(0, BATCH, model.seq_len, model.vocab_size), gpt_loss)
    if "ut" in names:
        out["ut"] = (UTransformer(num_stages=8), ut_batch(0, BATCH), ut_loss)
    if "gpt_scanned" in names:
        # The same GPT with its blocks in one nn.scan: the planner cuts inside the scan.
        model = GPT(scan_layers=True)
        out["gpt_scanned"] = (model, gpt_batch(0, BATCH, model.seq_len, model.vocab_size), gpt_loss)
    return out


def _state(model, x):
    import jax
    import optax
    from flax.training import train_state

    params = model.init(jax.random.PRNGKey(0), x)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def _measure(run, state, batch, repeat: int) -> float:
    return statistics.median(time_steps(run, state, batch, repeat))


def _data_parallel(step, state, batch, num_devices: int):
    """Plain jax.jit over the first ``num_devices`` devices: the batch sharded over them, the
    state replicated (one device: plain ``jax.jit`` there). The batch stays on the host, as it
    does for the pipelines, which place it every step."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpy as np

    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    state = jax.device_put(state, replicated)
    return jax.jit(step, in_shardings=(replicated, sharded), out_shardings=(replicated, replicated)), state, batch


def _head_to_head(runs: dict, rounds: int, repeat: int) -> dict[str, float]:
    """Each run's median step over ``rounds`` rounds, every round measuring every run once in
    a rotated order: the machine's drift over minutes reaches every contender alike."""
    keys = list(runs)
    samples: dict[str, list[float]] = {k: [] for k in keys}
    for r in range(rounds):
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            run, state, batch = runs[k]
            samples[k].append(_measure(run, state, batch, repeat))
    return {k: statistics.median(v) for k, v in samples.items()}


def _grid(profile, cluster, hardware, quick: bool):
    """The grid's plans (module doc), each predicted on the devices it runs on."""
    from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, check_stage_placement
    from meshpar.passes.planning.planner_meshpar import _shapes, predict
    from meshpar.passes.planning.protocol import StagePlan, first_devices

    L = profile.num_layers

    def even(S, shape):
        per = L // S
        return [StagePlan(k * per, (k + 1) * per if k < S - 1 else L, shape) for k in range(S)]

    plans = []
    for S in GRID_STAGES:
        # One stage and one micro-batch: one SPMD program (PipeshardParallel.single_program).
        for M in ((1,) if S == 1 else ()) + GRID_MICRO_BATCHES:
            b = profile.batch_size // M
            shapes = [sh for sh in _shapes(CPU_DEVICES // S) if b % sh[0] == 0]
            if quick:
                shapes = shapes[:1] + shapes[-1:] if len(shapes) > 1 else shapes
            for shape in shapes:
                plans.append(predict(profile, cluster, hardware, even(S, shape), M, "1f1b", planner="grid"))
    for n in GRID_DEVICE_SUBSETS:
        plans.append(predict(profile, first_devices(cluster, n), hardware, even(1, (n, 1)), 1, "1f1b", planner="grid"))
    meshes = GRID_VIRTUAL_STAGES // 2
    for name, kind in SCHEDULES.items():
        for M in GRID_VIRTUAL_MICRO_BATCHES if kind.virtual_stages else ():
            try:
                check_stage_placement(name, GRID_VIRTUAL_STAGES, meshes, M)
            except ValueError:
                continue
            # The widest data axis that splits a micro-batch.
            shape = max(sh for sh in _shapes(CPU_DEVICES // meshes) if (profile.batch_size // M) % sh[0] == 0)
            plans.append(predict(profile, cluster, hardware, even(GRID_VIRTUAL_STAGES, shape), M, name,
                                 planner="grid", stages_per_mesh=2))
    return plans


def run_cpu(args, emit) -> None:
    import jax

    import meshpar
    from examples.train_step import supervised_step
    from meshpar.calibration import calibrate, calibrate_pipeline, measure_hardware
    from meshpar.cluster import Cluster
    from meshpar.planning import PLANNERS, ParallelismPlan, plan_parallelism
    from meshpar.step_profile import compiled_tensor_parallel, profile_step

    devices = tuple(jax.devices())
    cluster = Cluster.from_devices(list(devices))
    measured_hardware = measure_hardware(devices)
    emit({"part": "cpu", "model": "-", "config": "hardware", "source": "measured",
          "device_flops": measured_hardware.device_flops, "total_flops": measured_hardware.total_flops,
          "dispatch_s": measured_hardware.dispatch_s})
    for name, (model, batch, loss) in _cpu_models(args.models).items():
        state = _state(model, batch["x"][:1])
        step = supervised_step(loss)
        profile = profile_step(step, (state, batch), (1,), name)
        # Sized by the compiled program and calibrated once per model, as plan_parallelism
        # does, and shared by every planner.
        profile, tp_scale = compiled_tensor_parallel(profile, step, (state, batch), (1,), devices)
        # meshpar's cost model: the baselines' predict is meshpar's (passes.planning.protocol).
        hardware = calibrate(measured_hardware, step, (state, batch), (1,), devices, cluster, profile,
                             PLANNERS["meshpar"])
        hardware, pipeline = calibrate_pipeline(hardware, step, (state, batch), (1,), devices, cluster, profile,
                                                PLANNERS["meshpar"])
        emit({"part": "cpu", "model": name, "config": "hardware", "source": "calibrated",
              "compute_scale": hardware.compute_scale, "tp_bytes_scale": tp_scale, "task_s": hardware.task_s,
              "move_s": hardware.move_s, "calibration_pipeline": pipeline})
        measured: dict[str, float] = {}
        # Compiled steps kept for the final rounds: the grid's best few so far and every pick.
        # Keeping every grid step alive ran the machine out of memory (each holds its programs).
        runs: dict[str, tuple] = {}

        def measure(plan, source: str) -> None:
            key = _config(plan)
            if key not in runs:
                # A pick the grid measured and let go is compiled again for the final rounds.
                wrapper = ParallelismPlan(plan, (), profile, devices, cluster, 0.0)
                runs[key] = (meshpar.parallelize(step, method=wrapper.method), state, batch)
            if key not in measured:
                measured[key] = _measure(*runs[key], args.repeat)
            emit({"part": "cpu", "model": name, "config": key, "source": source,
                  "predicted_step_s": plan.predicted_step_s, "measured_step_s": measured[key],
                  "peak_memory_bytes": max(plan.peak_memory_bytes)})

        grid = _grid(profile, cluster, hardware, args.quick)
        for plan in grid:
            measure(plan, "grid")
            leaders = sorted(measured, key=measured.get)[:HEAD_TO_HEAD_GRID]
            for key in [k for k in runs if k not in leaders]:
                del runs[key]
            gc.collect()
        picks: dict[str, str] = {}
        for planner in args.planners:
            if planner not in PLANNERS:
                continue
            start = time.perf_counter()
            chosen = plan_parallelism(step, state, batch, planner=planner, hardware=hardware, devices=devices,
                                      cluster=cluster)
            planning = time.perf_counter() - start
            measure(chosen.best, f"pick:{planner}")
            picks[f"pick:{planner}"] = _config(chosen.best)
            emit({"part": "cpu", "model": name, "config": _config(chosen.best), "source": f"planning:{planner}",
                  "planning_s": planning})
        jit_keys = {f"jax.jit data parallel over {len(devices)}": len(devices), "jax.jit on one device": 1}
        for key, n in jit_keys.items():
            runs[key] = _data_parallel(step, state, batch, n)
            emit({"part": "cpu", "model": name, "config": key, "source": "jax.jit",
                  "measured_step_s": _measure(*runs[key], args.repeat)})
        # The contenders again, interleaved: the grid's best few, every pick and both jax.jits.
        best_grid = sorted({_config(p) for p in grid}, key=measured.get)[:HEAD_TO_HEAD_GRID]
        contenders = {k: runs[k] for k in dict.fromkeys([*best_grid, *picks.values(), *jit_keys])}
        final = _head_to_head(contenders, args.rounds, args.repeat)
        for key in best_grid:
            emit({"part": "cpu", "model": name, "config": key, "source": "final:grid", "measured_step_s": final[key]})
        for source, key in picks.items():
            emit({"part": "cpu", "model": name, "config": key, "source": source.replace("pick:", "final:"),
                  "measured_step_s": final[key]})
        for key in jit_keys:
            emit({"part": "cpu", "model": name, "config": key, "source": "final:jax.jit",
                  "measured_step_s": final[key]})
        # The next model starts with none of this one's compiled programs alive.
        del runs, contenders
        gc.collect()
        jax.clear_caches()


def run_small(args, emit) -> None:
    """``plan_parallelism`` as a user calls it (it calibrates on its own), on the issue's small
    GPT and on each CPU model: its pick against ``jax.jit`` on one device, ``SMALL_STEPS``
    steps of each in alternating rounds of ``SMALL_ROUND``."""
    import warnings

    import meshpar
    from examples.train_step import supervised_step

    for name, (model, batch, loss) in _cpu_models(["tiny", *args.models]).items():
        state = _state(model, batch["x"][:1])
        step = supervised_step(loss)
        with warnings.catch_warnings(record=True) as shown:
            warnings.simplefilter("always")
            start = time.perf_counter()
            plan = meshpar.plan_parallelism(step, state, batch)
            planning = time.perf_counter() - start
        runs = {"pick": (meshpar.parallelize(step, method=plan.method), state, batch),
                "jit": _data_parallel(step, state, batch, 1)}
        samples: dict[str, list[float]] = {k: [] for k in runs}
        for _ in range(SMALL_STEPS // SMALL_ROUND):
            for key, (run, s, b) in runs.items():
                samples[key] += time_steps(run, s, b, SMALL_ROUND)
        record = {"part": "small", "model": name, "config": _config(plan.best), "planning_s": planning,
                  "warnings": [str(w.message) for w in shown]}
        for key, times in samples.items():
            record.update({f"{key}_{stat}": ms for stat, ms in spread_ms(times).items()})
        emit(record)


def _gpt96(batch: int):
    from meshpar.passes.planning.layer_profile import LayerProfile, ModelProfile

    h, seq = 12288, 2048
    layer = LayerProfile(flops=24 * seq * h * h, param_bytes=12 * h * h * 2, optimizer_bytes=12 * h * h * 12,
                         activation_bytes=34 * seq * h, boundary_bytes=seq * h * 2, tp_bytes=2 * seq * h * 2)
    return ModelProfile.uniform(96, layer, batch, "gpt96")


def run_simulated(args, emit) -> None:
    from meshpar.cluster import Cluster
    from meshpar.passes.planning.planner_meshpar import predict
    from meshpar.passes.planning.protocol import Hardware, NoPlanFits, PlanConstraints, first_devices
    from meshpar.planning import PLANNERS

    clusters = [("dgx_h100", Cluster.dgx_h100(n // 8), Hardware(4e14), 80e9) for n in (16, 128, 1024)]
    clusters += [("aws_p3_8xlarge", Cluster.aws_p3_8xlarge(n // 4), Hardware(1e14), 16e9) for n in (16, 128, 1024)]
    for cluster_name, cluster, hardware, budget in clusters:
        profile = _gpt96(batch=max(256, cluster.num_devices))
        for planner in args.planners:
            if planner not in PLANNERS:
                continue
            start = time.perf_counter()
            try:
                plans = PLANNERS[planner].plan(profile, cluster, hardware, PlanConstraints(budget))
            except NoPlanFits as e:
                emit({"part": "simulated", "model": "gpt96", "config": f"{cluster_name} x{cluster.num_devices}",
                      "source": f"pick:{planner}", "error": str(e), "planning_s": time.perf_counter() - start})
                continue
            planning = time.perf_counter() - start
            best = plans[0]
            # Every pick priced once more by one model, meshpar's simulator, to compare the picks.
            common = predict(profile, first_devices(cluster, best.num_devices), hardware, best.stages,
                             best.num_micro_batches, best.schedule, stages_per_mesh=best.stages_per_mesh)
            emit({"part": "simulated", "model": "gpt96", "config": f"{cluster_name} x{cluster.num_devices}: "
                  + _config(best), "source": f"pick:{planner}", "predicted_step_s": best.predicted_step_s,
                  "peak_memory_bytes": max(best.peak_memory_bytes), "planning_s": planning,
                  "simulated_step_s": common.predicted_step_s,
                  "simulated_peak_memory_bytes": max(common.peak_memory_bytes), "memory_budget_bytes": budget})


def run_atp(emit) -> None:
    """ATP's choice of a 2D tensor-parallel mesh for one layer of the 96-layer GPT (batch 8),
    against Megatron's 1D ``(N, 1)``, on the simulated clusters."""
    from meshpar.cluster import Cluster
    from meshpar.passes.planning.planner_atp import choose_mesh

    for cluster_name, make, per_host in (("dgx_h100", Cluster.dgx_h100, 8), ("aws_p3_8xlarge", Cluster.aws_p3_8xlarge, 4)):
        for n in (8, 16, 32, 64):
            choice = choose_mesh(make(max(1, n // per_host)), n, 8, 2048, 12288)
            megatron = next(c for c in choice.ranked if c.mesh == (n, 1))
            emit({"part": "atp", "model": "gpt96 layer", "config": f"{cluster_name}, TP over {n}",
                  "source": "atp", "mesh": list(choice.best.mesh), "comm_s": choice.best.total_s,
                  "megatron_comm_s": megatron.total_s})


def progress_emitter(records: list[dict]) -> Callable[[dict], None]:
    """``emit(record)``: appends ``record`` (with a ``"part"``) to ``records`` and prints it as a
    progress line, ``[seconds since this call] part: {its other fields}``."""
    start = time.perf_counter()

    def emit(record: dict) -> None:
        records.append(record)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in record.items() if k != "part"}
        print(f"[{time.perf_counter() - start:6.1f} s] {record['part']}: {shown}", flush=True)

    return emit


def save_records(path: str | None, records: Sequence[dict]) -> None:
    """Writes ``records`` to ``path`` as JSON (``--json``); nothing when ``path`` is ``None``."""
    if path:
        with open(path, "w") as f:
            json.dump(list(records), f, indent=1)


def table(records: Sequence[dict]) -> str:
    """The markdown summary: per CPU model, the grid's rank correlation, the best measured
    configuration, each pick and the jax.jit steps, each against the best of them and against
    the best candidate (a grid plan or a pick); then each small model's pick against
    jax.jit on one device; then the simulated picks, each priced by its own planner's model and
    by meshpar's simulator; then ATP's meshes."""
    lines = ["| part | model | source | configuration | predicted ms | measured ms | vs best measured "
             "| vs best candidate | planning s |", "|---|---|---|---|---|---|---|---|---|"]
    for model in sorted({r["model"] for r in records if r["part"] == "cpu" and r["model"] != "-"}):
        rows = [r for r in records if r["part"] == "cpu" and r["model"] == model]
        grid = [r for r in rows if r["source"] == "grid"]
        rho = spearman([r["predicted_step_s"] for r in grid], [r["measured_step_s"] for r in grid])
        best_grid = min((r["measured_step_s"] for r in grid), default=float("nan"))
        lines.append(f"| cpu | {model} | grid ({len(grid)} configurations, one after another) | Spearman ρ predicted "
                     f"vs measured = {rho:.2f} | | {best_grid * 1e3:.1f} (best) | | | |")
        # The ratios come from the interleaved final rounds when the run has them.
        final = [r for r in rows if r["source"].startswith("final:")]
        shown = final or [r for r in rows if r["source"].startswith("pick:") or r["source"] == "jax.jit"]
        best = min(r["measured_step_s"] for r in shown) if final else min(
            (r["measured_step_s"] for r in rows if "measured_step_s" in r), default=float("nan"))
        # Candidates: what a planner may choose (the grid's plans, the picks), not jax.jit.
        best_candidate = min((r["measured_step_s"] for r in shown if not r["source"].endswith("jax.jit")),
                             default=float("nan"))
        for r in shown:
            planner = r["source"].split(":", 1)[-1]
            pick = next((p for p in rows if p["source"] == f"pick:{planner}"), None)
            planning = next((p["planning_s"] for p in rows if p["source"] == f"planning:{planner}"), None)
            pred = f"{pick['predicted_step_s'] * 1e3:.1f}" if pick else ""
            lines.append(f"| cpu | {model} | {r['source']} | {r['config']} | {pred} | {r['measured_step_s'] * 1e3:.1f} "
                         f"| {r['measured_step_s'] / best:.2f}x | {r['measured_step_s'] / best_candidate:.2f}x "
                         f"| {'' if planning is None else f'{planning:.2f}'} |")
    small = [r for r in records if r["part"] == "small"]
    if small:
        lines += ["", "| small model | pick (plan_parallelism, calibrating itself) | planning s | warnings shown "
                  "| pick p50 / p90 / max ms | jax.jit one device p50 / p90 / max ms | pick / jax.jit (p50) |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['config']} | {r['planning_s']:.1f} | {len(r['warnings'])} "
                  f"| {r['pick_p50_ms']:.2f} / {r['pick_p90_ms']:.2f} / {r['pick_max_ms']:.2f} "
                  f"| {r['jit_p50_ms']:.2f} / {r['jit_p90_ms']:.2f} / {r['jit_max_ms']:.2f} "
                  f"| {r['pick_p50_ms'] / r['jit_p50_ms']:.2f}x |" for r in small]
    simulated = [r for r in records if r["part"] == "simulated"]
    if simulated:
        lines += ["", "| simulated gpt96 | planner | plan | own model s | meshpar's simulator s | peak GB (meshpar's "
                  "model) | planning s |", "|---|---|---|---|---|---|---|"]
    for r in simulated:
        cluster, _, plan = r["config"].partition(": ")
        planner = r["source"].replace("pick:", "")
        if "error" in r:
            lines.append(f"| {cluster} | {planner} | {r['error'][:100]} | | | | {r['planning_s']:.2f} |")
            continue
        common = (f"{r['simulated_step_s']:.2f} | {r['simulated_peak_memory_bytes'] / 1e9:.1f}"
                  f"{' (over budget)' if r['simulated_peak_memory_bytes'] > r['memory_budget_bytes'] else ''}"
                  if "simulated_step_s" in r else " | ")
        plan = plan if len(plan) <= 110 else plan[:60] + " … " + plan[-45:]
        lines.append(f"| {cluster} | {planner} | {plan} | {r['predicted_step_s']:.2f} | {common} "
                     f"| {r['planning_s']:.2f} |")
    atp = [r for r in records if r["part"] == "atp"]
    if atp:
        lines += ["", "| ATP: one layer's tensor-parallel communication | ATP's mesh (d1, d2) | ATP ms | Megatron (N, 1) ms "
                  "| ratio |", "|---|---|---|---|---|"]
        lines += [f"| {r['config']} | {tuple(r['mesh'])} | {r['comm_s'] * 1e3:.1f} | {r['megatron_comm_s'] * 1e3:.1f} "
                  f"| {r['comm_s'] / r['megatron_comm_s']:.2f} |" for r in atp]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the records here")
    models = ["gpt", "ut", "gpt_scanned"]
    parser.add_argument("--models", nargs="+", default=models, choices=models)
    parser.add_argument("--planners", nargs="+", default=["meshpar", "amp", "galvatron", "alpa_dp"])
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per configuration (default 3)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds of the final interleaved measurement of the contenders (default 5)")
    parser.add_argument("--quick", action="store_true", help="two shapes per (stages, micro-batches) on the grid")
    parser.add_argument("--no-cpu", action="store_true", help="skip the measured CPU part")
    parser.add_argument("--no-small", action="store_true", help="skip the small models' picks against jax.jit")
    parser.add_argument("--no-simulated", action="store_true", help="skip the simulated clusters")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat: expected a positive number of steps")
    if args.rounds < 1:
        parser.error("--rounds: expected a positive number of rounds")
    records: list[dict] = []
    emit = progress_emitter(records)
    if not (args.no_cpu and args.no_small):
        import jax

        jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
    if not args.no_cpu:
        run_cpu(args, emit)
    if not args.no_small:
        run_small(args, emit)
    if not args.no_simulated:
        run_simulated(args, emit)
        run_atp(emit)
    save_records(args.json, records)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
