"""What meshpar's planner picks for the emulated cluster's U-Transformer case, and why.

    python -m benchmarks.planner_emulated [--link-mb-s 30] [--json PATH]

The case is ``benchmarks.pipeline``'s ``u_transformer (4, 1, 2)``: a U-Transformer of 8
blocks (``UT_SIZE``, 32 images of 32x32), 2 emulated hosts of 4 CPU devices, each host one
process on one core, linked at 0.25 Gbit/s (30 MB/s of TCP payload measured). There it ran
ZB-V 1.78x faster than ZB-H1 and DualPipeV fastest of all (BENCHMARKS.md), because the V puts
stage ``r`` and ``3 - r`` on mesh ``r``, so the three long skips stay on their host.

Planning needs what one emulated host computes, so this process pins itself to one core and
makes 4 CPU devices (what an emulated host has), measures and calibrates them on the step as
``plan_parallelism`` does (``measure_hardware``, ``calibrate``, ``calibrate_pipeline``), then
plans for two such hosts: each device a quarter of the core (the hosts compute in parallel, the
4 devices of one host share its core), the link at ``--link-mb-s``. Prints, predicted:

- the pick of the full search (every schedule, 1 or 2 stages per mesh, device subsets);
- the best plan of each schedule on the case's own layout (2 meshes of ``(4, 1)``, one per
  host, 4 micro-batches, 2 or 4 stages), to set beside the measured emulated rows;
- the best V plan (``zb_v``, ``dualpipev``) anywhere, and how far it is from the pick.

Records (``--json``): ``{"part": "emulated", "config", "source", "predicted_step_s", ...}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Sequence

from benchmarks.planner import _config, progress_emitter, save_records

__all__ = ["main"]

HOSTS = 2
DEVICES_PER_HOST = 4
BATCH = 32
MICRO_BATCHES = 4
V_SCHEDULES = ("zb_v", "dualpipev")


def _host_hardware():
    """``(profile, hardware)`` of the case's step, calibrated on this process's 4 devices."""
    import jax
    import optax
    from flax.training import train_state

    from benchmarks.pipeline_cases import UT_HW, UT_SIZE
    from examples.train_step import supervised_step
    from examples.u_transformer import UTransformer, ut_batch, ut_loss
    from meshpar.calibration import calibrate, calibrate_pipeline, measure_hardware
    from meshpar.cluster import Cluster
    from meshpar.passes.planning import planner_meshpar
    from meshpar.step_profile import compiled_tensor_parallel, profile_step

    net = UTransformer(num_stages=8, **UT_SIZE)
    batch = ut_batch(0, BATCH, UT_HW)
    params = net.init(jax.random.PRNGKey(0), batch["x"][:1])
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))
    step = supervised_step(ut_loss)
    devices = tuple(jax.devices())
    host = Cluster.from_devices(list(devices))
    args = (state, batch)
    profile = profile_step(step, args, (1,), "u_transformer")
    profile, _ = compiled_tensor_parallel(profile, step, args, (1,), devices)
    hardware = calibrate(measure_hardware(devices), step, args, (1,), devices, host, profile, planner_meshpar)
    hardware, _ = calibrate_pipeline(hardware, step, args, (1,), devices, host, profile, planner_meshpar)
    return profile, hardware, host


def run(link_mb_s: float, emit) -> None:
    from meshpar.cluster import Cluster
    from meshpar.passes.planning.planner_meshpar import plan
    from meshpar.passes.planning.protocol import NoPlanFits, PlanConstraints
    from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES

    profile, host_hardware, host = _host_hardware()
    # The hosts compute in parallel; a host's 4 devices share its one core.
    hardware = dataclasses.replace(host_hardware, device_flops=host_hardware.total_flops / DEVICES_PER_HOST,
                                   total_flops=float("inf"))
    cluster = Cluster.uniform(HOSTS, DEVICES_PER_HOST, inter_host_bandwidth=link_mb_s * 1e6,
                              intra_host_bandwidth=host.intra_host_bandwidth, latency=host.latency)
    emit({"part": "emulated", "config": "hardware", "source": "one host calibrated",
          **{k: v for k, v in dataclasses.asdict(hardware).items() if k != "op_s"}})
    start = time.perf_counter()
    plans = plan(profile, cluster, hardware, PlanConstraints())
    planning = time.perf_counter() - start
    pick = plans[0]
    emit({"part": "emulated", "config": _config(pick), "source": "pick", "predicted_step_s": pick.predicted_step_s,
          "planning_s": planning, "summary": pick.summary()})
    # Each schedule on the measured case's layout: a mesh per host, (4, 1) each.
    for name in SCHEDULES:
        for per_mesh in (1, 2):
            constraints = PlanConstraints(num_stages=HOSTS * per_mesh, num_micro_batches=MICRO_BATCHES,
                                          schedules=(name,), stages_per_mesh=(per_mesh,), device_subsets=False)
            try:
                ranked = plan(profile, cluster, hardware, constraints)
            except NoPlanFits:
                continue
            case = [p for p in ranked if p.num_meshes == HOSTS]
            if case:
                emit({"part": "emulated", "config": _config(case[0]), "source": f"case layout: {name}",
                      "predicted_step_s": case[0].predicted_step_s})
    best_v = plan(profile, cluster, hardware, PlanConstraints(schedules=V_SCHEDULES))[0]
    emit({"part": "emulated", "config": _config(best_v), "source": "best V", "predicted_step_s": best_v.predicted_step_s,
          "vs_pick": best_v.predicted_step_s / pick.predicted_step_s, "summary": best_v.summary()})


def table(records: Sequence[dict]) -> str:
    rows = [r for r in records if r["part"] == "emulated" and "predicted_step_s" in r]
    lines = ["| source | plan | predicted ms |", "|---|---|---|"]
    lines += [f"| {r['source']} | {r['config']} | {r['predicted_step_s'] * 1e3:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.planner_emulated", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-mb-s", type=float, default=30.0,
                        help="the hosts' link in MB/s of payload (default 30: 0.25 Gbit/s as measured)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if not args.link_mb_s > 0:
        parser.error("--link-mb-s: expected a positive rate")
    # One emulated host: one core, 4 devices.
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES_PER_HOST)
    records: list[dict] = []
    run(args.link_mb_s, progress_emitter(records))
    save_records(args.json, records)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
