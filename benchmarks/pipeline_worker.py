"""One process of ``python -m benchmarks.pipeline`` (the child side).

Either one host of an emulated cluster (started by ``EmulatedCluster(2, 4, G)
.run(["-m", "benchmarks.pipeline_worker", ...])``, joined through
:func:`benchmarks.emulated_cluster.initialize_from_env`, pinned to a core of
its own), or, with
``--single-process``, one process with 8 CPU devices that it splits into two
emulated hosts of 4 for the planner.

Per case (``benchmarks.pipeline_cases.CASES``) and method (``METHODS``):

1. compile and run one step (warm-up: compile, plan agreement, connections);
2. one serialized traced step (``ParallelizedStep.trace(serialize=True)``:
   each instruction runs alone), written to ``<trace-dir>/<case>-<method>-
   serialized.json`` (``.p<i>`` per process): the parent reads each task's
   isolated duration from it for the simulator's prediction;
3. ``--repeat`` timed steps, each feeding the next the state it returned: a
   step's time runs from a barrier to this process's outputs being ready;
   the parent takes the max over processes, then the median over steps;
4. for ``--trace-methods``, one traced step as it normally runs, written to
   ``<trace-dir>/<case>-<method>.json``, for the timeline figures.

Each process appends JSON lines to ``<--out>/p<process>.jsonl``, flushed per
record: ``{"kind": "method", ...}`` with its step times, the compiled
schedule (to rebuild it for the simulator: its stages, its meshes and which
mesh runs each stage, edges, per-mesh weight delays; ``schedule_spec``), the
per-stage peak of live micro-batches, and the planner's estimate of every
transfer, ``{"kind": "done"}``, or ``{"kind": "error", ...}`` before
exiting non-zero. Every multi-process wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback

from benchmarks.pipeline_cases import CASES, METHODS, SINGLE_PROCESS_METHODS, build_step
from benchmarks.worker_records import RecordWriter


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the p<process>.jsonl record files")
    p.add_argument("--trace-dir", required=True, help="directory for the Chrome traces")
    p.add_argument("--cases", nargs="+", default=[c.name for c in CASES], help="case names (default all)")
    p.add_argument("--methods", nargs="+", default=[m.name for m in METHODS], choices=[m.name for m in METHODS])
    p.add_argument("--trace-methods", nargs="*", default=[], help="methods to trace as they normally run")
    p.add_argument("--repeat", type=int, default=5, help="timed steps per method")
    p.add_argument("--link-rate", type=float, required=True, help="inter-host bytes/s, for the planner")
    p.add_argument("--single-process", action="store_true", help="8 CPU devices in this one process")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each barrier and wait")
    return p.parse_args(argv)


def slug(text: str) -> str:
    """``gpt (2, 2, 2)`` -> ``gpt-2-2-2``: a case name as a file name."""
    return "-".join(text.replace("(", " ").replace(")", " ").replace(",", " ").split())


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.single_process:
        import jax

        jax.config.update("jax_num_cpu_devices", 8)
    else:
        from benchmarks.emulated_cluster import ENV_PROCESS_ID, initialize_from_env

        # Each emulated host computes on its own core, as real hosts do: left to share the
        # machine's cores, a host computing alone runs up to twice as fast as when both do,
        # and isolated task times would not be the pipeline's. Before the backend starts, so
        # XLA sizes its thread pool to the one core.
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[int(os.environ[ENV_PROCESS_ID]) % len(cores)]})
        initialize_from_env()
    import jax

    out = RecordWriter(args.out, jax.process_index(), {"process": jax.process_index()})
    try:
        _run(args, out)
    except Exception as e:  # noqa: BLE001 -- reported to the parent, then exit non-zero
        out.write({"kind": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        return 1
    out.write({"kind": "done"})
    return 0


def schedule_spec(schedule) -> dict:
    """What the parent needs to rebuild ``schedule`` (``benchmarks.pipeline``'s ``_schedule``):
    its name and sizes, its meshes (several stages share one with virtual stages), edges and
    per-mesh weight delays."""
    return {"name": schedule.name, "num_stages": schedule.num_stages, "num_meshes": schedule.num_meshes,
            "stage_mesh": list(schedule.stage_mesh), "num_micro_batches": schedule.num_micro_batches,
            "edges": [list(e) for e in schedule.edges],
            "weight_delays": None if schedule.weight_delays is None else list(schedule.weight_delays)}


def _transfer_estimates(executable, method, cluster) -> list[dict]:
    """Per transfer of the program: what it is and the planner's estimated seconds (none for an edge
    between two stages of one mesh)."""
    from meshpar.passes.pipeline.edge_transfer import Direction, TransferKind
    from meshpar.reshard import plan_between

    out = []
    for t in executable.program.transfers:
        num_bytes = t.dtype.itemsize * math.prod(t.shape)
        if t.kind is TransferKind.LOCAL:
            seconds = 0.0  # both stages on one mesh (virtual stages): the value does not move
        elif t.kind is TransferKind.SIGNAL:
            seconds = cluster.latency + 1 / cluster.inter_host_bandwidth
        elif t.kind is TransferKind.DEVICE_PUT:
            seconds = num_bytes / cluster.intra_host_bandwidth
        else:
            seconds = plan_between(t.shape, t.dtype, t.src, t.dst, strategy=method.resharding,
                                   balancer="ensemble", cluster=cluster).estimated_time
        out.append({"edge": t.edge, "activation": t.direction is Direction.ACTIVATION,
                    "bytes": num_bytes, "seconds": seconds})
    return out


def _run(args: argparse.Namespace, out: RecordWriter) -> None:
    import jax

    import meshpar
    from meshpar.passes.pipeline.edge_transfer import TransferKind
    from meshpar.runtime.coordination import kv_client, wait_ready

    me, nproc = jax.process_index(), jax.process_count()
    devices = jax.devices()
    # Two hosts of 4 devices: the real processes, or emulated inside one.
    host_of = (lambda d: d.id // 4) if nproc == 1 else None
    cluster = meshpar.Cluster.from_devices(devices, host_of=host_of, inter_host_bandwidth=args.link_rate)
    client = kv_client() if nproc > 1 else None
    counter = [0]

    def barrier(name: str) -> None:
        if client is not None:
            counter[0] += 1
            client.wait_at_barrier(f"meshpar-pipeline/{counter[0]}/{name}", int(args.timeout * 1000))

    cases = [c for c in CASES if c.name in args.cases]
    methods = [m for m in (SINGLE_PROCESS_METHODS if nproc == 1 else METHODS) if m.name in args.methods]
    for case in cases:
        for method in methods:
            tag = f"{slug(case.name)}-{method.name}"
            start = time.perf_counter()
            step, state, batch = build_step(case, method, cluster, args.timeout)
            executable = step.get_executable(state, batch)

            def run(state):
                new_state, loss = step(state, batch)
                wait_ready(jax.tree.leaves((new_state, loss)), args.timeout, f"{case.name} {method.name} step")
                return new_state, loss

            state, loss = run(state)
            compile_s = time.perf_counter() - start
            barrier(f"{tag}/serialized")
            step.trace(os.path.join(args.trace_dir, f"{tag}-serialized.json"), state, batch, serialize=True)
            times = []
            for i in range(args.repeat):
                barrier(f"{tag}/{i}")
                t0 = time.perf_counter()
                state, loss = run(state)
                times.append(time.perf_counter() - t0)
            if method.name in args.trace_methods:
                barrier(f"{tag}/trace")
                step.trace(os.path.join(args.trace_dir, f"{tag}.json"), state, batch)
            schedule = executable.schedule
            loss_here = loss.is_fully_addressable
            out.write({
                "kind": "method", "model": case.model, "config": list(case.config), "case": case.name,
                "method": method.name, "batch": case.batch, "step_times_s": times, "compile_s": compile_s,
                "loss": float(loss) if loss_here else None,
                "overlap": not all(t.kind is TransferKind.COLLECTIVE for t in executable.program.transfers
                                   if t.kind is not TransferKind.LOCAL),
                "schedule": schedule_spec(schedule),
                "transfers": _transfer_estimates(executable, method, cluster),
                "peak_live_activations": executable.peak_live_activations,
                "serialized_trace": f"{tag}-serialized.json",
            })
            print(f"process {me}: {case.name} {method.name}: compile+first step {compile_s:.1f} s, "
                  f"steps {[round(t * 1e3) for t in times]} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
