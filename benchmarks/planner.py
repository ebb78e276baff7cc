"""Planner benchmark: what each automatic planner picks, predicted and measured.

    python -m benchmarks.planner [--json PATH] [--models gpt ut] [--repeat N] [--quick]
        [--no-cpu] [--no-simulated] [--planners meshpar ...]

- ``cpu``: 8 CPU devices in this process. For GPT and U-Transformer with 8 layers (7 candidate
  cut points), every configuration of a grid (1, 2 or 4 stages cut evenly; each (data, model)
  shape; 2, 4 or 8 micro-batches, and 1 for one stage; 1F1B) is predicted by meshpar's cost model
  (``passes.planner_meshpar.predict``) and measured (median of ``N`` steps after one that
  compiles), and so are each planner's pick and plain ``jax.jit`` data parallelism over all 8
  devices. Reports the rank correlation (Spearman) of predicted and measured steps and each
  pick against the best measured configuration.
- ``simulated``: a 96-layer GPT (hidden 12288, 2048 tokens) on ``dgx_h100`` and
  ``aws_p3_8xlarge`` clusters of 16 to 1,024 GPUs, 80 GB (resp. 16 GB) per device: each
  planner's pick, predicted step time, peak memory per device and planning time; and ATP's
  2D tensor-parallel mesh for one of its layers against Megatron's 1D, on 8 to 64 GPUs.

Records (``--json``): one per measured or planned configuration::

    {"part", "model", "config", "source", "predicted_step_s", "measured_step_s", "planning_s", "peak_memory_bytes", ...}

Prints progress lines while it runs and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence

__all__ = ["main", "spearman", "table"]

CPU_DEVICES = 8
GRID_STAGES = (1, 2, 4)
GRID_MICRO_BATCHES = (2, 4, 8)
BATCH = 16


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
    shapes = "+".join(f"{s.shape[0]}x{s.shape[1]}" for s in plan.stages)
    layers = "|".join(f"{s.start}-{s.stop - 1}" for s in plan.stages)
    return f"S={plan.num_stages} [{layers}] {shapes} M={plan.num_micro_batches} {plan.schedule}"


def _cpu_models(names: Sequence[str]):
    from examples.gpt import GPT, gpt_batch, gpt_loss
    from examples.u_transformer import UTransformer, ut_batch, ut_loss

    out = {}
    if "gpt" in names:
        model = GPT(num_stages=8)
        out["gpt"] = (model, gpt_batch(0, BATCH, model.seq_len, model.vocab_size), gpt_loss)
    if "ut" in names:
        out["ut"] = (UTransformer(num_stages=8), ut_batch(0, BATCH), ut_loss)
    return out


def _state(model, x):
    import jax
    import optax
    from flax.training import train_state

    params = model.init(jax.random.PRNGKey(0), x)
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))


def _measure(run, state, batch, repeat: int) -> float:
    import jax

    state, _ = run(state, batch)  # compiles
    jax.block_until_ready(state)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        state, loss = run(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _data_parallel(step, state, batch):
    """Plain jax.jit over every device: the batch sharded over them, the state replicated."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import numpy as np

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    state = jax.device_put(state, replicated)
    batch = jax.device_put(batch, sharded)
    return jax.jit(step, out_shardings=(replicated, replicated)), state, batch


def _grid(profile, cluster, hardware, quick: bool):
    from meshpar.passes.planner_meshpar import StagePlan, _shapes, predict

    L = profile.num_layers
    plans = []
    for S in GRID_STAGES:
        per = L // S
        # One stage and one micro-batch: one SPMD program (PipeshardParallel.single_program).
        for M in ((1,) if S == 1 else ()) + GRID_MICRO_BATCHES:
            b = profile.batch_size // M
            shapes = [sh for sh in _shapes(CPU_DEVICES // S) if b % sh[0] == 0]
            if quick:
                shapes = shapes[:1] + shapes[-1:] if len(shapes) > 1 else shapes
            for shape in shapes:
                stages = [StagePlan(k * per, (k + 1) * per if k < S - 1 else L, shape) for k in range(S)]
                plans.append(predict(profile, cluster, hardware, stages, M, "1f1b", planner="grid"))
    return plans


def run_cpu(args, emit) -> None:
    import jax

    import meshpar
    from examples.train_step import supervised_step
    from meshpar.cluster import Cluster
    from meshpar.planning import (PLANNERS, ParallelismPlan, calibrate, compiled_tensor_parallel, measure_hardware,
                                  plan_parallelism, profile_step)

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
        hardware = calibrate(measured_hardware, step, (state, batch), (1,), devices, cluster, profile)
        emit({"part": "cpu", "model": name, "config": "hardware", "source": "calibrated",
              "compute_scale": hardware.compute_scale, "tp_bytes_scale": tp_scale})
        measured: dict[str, float] = {}

        def measure(plan, source: str) -> None:
            key = _config(plan)
            if key not in measured:
                wrapper = ParallelismPlan(plan, (), profile, devices, cluster, 0.0)
                run = meshpar.parallelize(step, method=wrapper.method)
                measured[key] = _measure(run, state, batch, args.repeat)
            emit({"part": "cpu", "model": name, "config": key, "source": source,
                  "predicted_step_s": plan.predicted_step_s, "measured_step_s": measured[key],
                  "peak_memory_bytes": max(plan.peak_memory_bytes)})

        for plan in _grid(profile, cluster, hardware, args.quick):
            measure(plan, "grid")
        for planner in args.planners:
            if planner not in PLANNERS:
                continue
            start = time.perf_counter()
            chosen = plan_parallelism(step, state, batch, planner=planner, hardware=hardware, devices=devices,
                                      cluster=cluster, schedules=("1f1b",))
            planning = time.perf_counter() - start
            measure(chosen.best, f"pick:{planner}")
            emit({"part": "cpu", "model": name, "config": _config(chosen.best), "source": f"planning:{planner}",
                  "planning_s": planning})
        jitted, dp_state, dp_batch = _data_parallel(step, state, batch)
        emit({"part": "cpu", "model": name, "config": f"jax.jit data parallel over {len(devices)}",
              "source": "jax.jit", "measured_step_s": _measure(jitted, dp_state, dp_batch, args.repeat)})


def _gpt96(batch: int):
    from meshpar.passes.layer_profile import LayerProfile, ModelProfile

    h, seq = 12288, 2048
    layer = LayerProfile(flops=24 * seq * h * h, param_bytes=12 * h * h * 2, optimizer_bytes=12 * h * h * 12,
                         activation_bytes=34 * seq * h, boundary_bytes=seq * h * 2, tp_bytes=2 * seq * h * 2)
    return ModelProfile.uniform(96, layer, batch, "gpt96")


def run_simulated(args, emit) -> None:
    from meshpar.cluster import Cluster
    from meshpar.passes.planner_meshpar import Hardware, NoPlanFits
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
                plans = PLANNERS[planner](profile, cluster, hardware, budget, None, None, ("1f1b", "eager_1f1b"))
            except NoPlanFits as e:
                emit({"part": "simulated", "model": "gpt96", "config": f"{cluster_name} x{cluster.num_devices}",
                      "source": f"pick:{planner}", "error": str(e), "planning_s": time.perf_counter() - start})
                continue
            best = plans[0]
            emit({"part": "simulated", "model": "gpt96", "config": f"{cluster_name} x{cluster.num_devices}: "
                  + _config(best), "source": f"pick:{planner}", "predicted_step_s": best.predicted_step_s,
                  "peak_memory_bytes": max(best.peak_memory_bytes), "planning_s": time.perf_counter() - start})


def run_atp(emit) -> None:
    """ATP's choice of a 2D tensor-parallel mesh for one layer of the 96-layer GPT (batch 8),
    against Megatron's 1D ``(N, 1)``, on the simulated clusters."""
    from meshpar.cluster import Cluster
    from meshpar.passes.planner_atp import choose_mesh

    for cluster_name, make, per_host in (("dgx_h100", Cluster.dgx_h100, 8), ("aws_p3_8xlarge", Cluster.aws_p3_8xlarge, 4)):
        for n in (8, 16, 32, 64):
            choice = choose_mesh(make(max(1, n // per_host)), n, 8, 2048, 12288)
            megatron = next(c for c in choice.ranked if c.mesh == (n, 1))
            emit({"part": "atp", "model": "gpt96 layer", "config": f"{cluster_name}, TP over {n}",
                  "source": "atp", "mesh": list(choice.best.mesh), "comm_s": choice.best.total_s,
                  "megatron_comm_s": megatron.total_s})


def table(records: Sequence[dict]) -> str:
    """The markdown summary: per CPU model, the grid's rank correlation, the best measured
    configuration, each pick and jax.jit; then the simulated picks."""
    lines = ["| part | model | source | configuration | predicted ms | measured ms | vs best measured | planning s |",
             "|---|---|---|---|---|---|---|---|"]
    for model in sorted({r["model"] for r in records if r["part"] == "cpu" and r["model"] != "-"}):
        rows = [r for r in records if r["part"] == "cpu" and r["model"] == model]
        grid = [r for r in rows if r["source"] == "grid"]
        best = min((r["measured_step_s"] for r in rows if "measured_step_s" in r), default=float("nan"))
        rho = spearman([r["predicted_step_s"] for r in grid], [r["measured_step_s"] for r in grid])
        lines.append(f"| cpu | {model} | grid ({len(grid)} configurations) | Spearman ρ predicted vs measured "
                     f"= {rho:.2f} | | {best * 1e3:.1f} (best) | | |")
        for r in rows:
            if r["source"] == "grid" or "measured_step_s" not in r:
                continue
            planning = next((p["planning_s"] for p in rows if r["source"].startswith("pick:")
                             and p["source"] == r["source"].replace("pick:", "planning:")), None)
            pred = f"{r['predicted_step_s'] * 1e3:.1f}" if "predicted_step_s" in r else ""
            lines.append(f"| cpu | {model} | {r['source']} | {r['config']} | {pred} | {r['measured_step_s'] * 1e3:.1f} "
                         f"| {r['measured_step_s'] / best:.2f}x | {'' if planning is None else f'{planning:.2f}'} |")
    for r in records:
        if r["part"] != "simulated":
            continue
        if "error" in r:
            lines.append(f"| simulated | gpt96 | {r['source']} | {r['config']}: {r['error'][:90]} | | | | "
                         f"{r['planning_s']:.2f} |")
        else:
            lines.append(f"| simulated | gpt96 | {r['source']} | {r['config']}, peak "
                         f"{r['peak_memory_bytes'] / 1e9:.1f} GB | {r['predicted_step_s'] * 1e3:.0f} | | | "
                         f"{r['planning_s']:.2f} |")
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
    parser.add_argument("--models", nargs="+", default=["gpt", "ut"], choices=["gpt", "ut"])
    parser.add_argument("--planners", nargs="+", default=["meshpar", "amp", "galvatron", "alpa_dp"])
    parser.add_argument("--repeat", type=int, default=3, help="timed steps per configuration (default 3)")
    parser.add_argument("--quick", action="store_true", help="two shapes per (stages, micro-batches) on the grid")
    parser.add_argument("--no-cpu", action="store_true", help="skip the measured CPU part")
    parser.add_argument("--no-simulated", action="store_true", help="skip the simulated clusters")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error("--repeat: expected a positive number of steps")
    records: list[dict] = []
    start = time.perf_counter()

    def emit(record: dict) -> None:
        records.append(record)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in record.items() if k != "part"}
        print(f"[{time.perf_counter() - start:6.1f} s] {record['part']}: {shown}", flush=True)

    if not args.no_cpu:
        import jax

        jax.config.update("jax_num_cpu_devices", CPU_DEVICES)
        run_cpu(args, emit)
    if not args.no_simulated:
        run_simulated(args, emit)
        run_atp(emit)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
