"""One process of ``python -m benchmarks.pipeline`` (the child side).

Either one host of an emulated cluster (started by ``EmulatedCluster(H, D, G)
.run(["-m", "benchmarks.pipeline_worker", ...])`` with the ``hosts = (H, D)``
of every case it is given, joined through
:func:`benchmarks.emulated_cluster.initialize_from_env`, pinned to one core),
or, with ``--single-process``, one process with 8 CPU devices that it splits
into each case's emulated hosts for the planner.

Pinning: with more hosts than cores, consecutive hosts share a core
(``process * cores // processes``). Meshes are cut host-major, so the hosts
sharing a core are one stage mesh's: a mesh computes on its own core,
whether it runs alone (the serialized step) or beside the others, and the
isolated task times are the pipeline's.

Per case (``benchmarks.pipeline_cases.CASES``) and method (``METHODS``):

1. compile and run one step (warm-up: compile, plan agreement, connections);
2. ``--serialized-steps`` serialized traced steps
   (``ParallelizedStep.trace(serialize=True)``: each instruction runs alone),
   written to ``<trace-dir>/<case>-<method>-serialized-<i>.json`` (``.p<i>``
   per process): the parent takes each task's isolated duration, the median
   over them, for the simulator's prediction; the last one's peak live bytes
   per device are recorded (``live_bytes``, measured) with what
   ``predict_live_bytes`` predicts from its profile (``predicted_live_bytes``);
3. ``--repeat`` timed steps, each feeding the next the state it returned: a
   step's time runs from a barrier to this process's outputs being ready;
   the parent takes the max over processes, then the median over steps;
4. for ``--trace-methods``, one traced step as it normally runs, written to
   ``<trace-dir>/<case>-<method>.json``, for the timeline figures.

Each process appends JSON lines to ``<--out>/p<process>.jsonl``, flushed per
record: ``{"kind": "method", ...}`` with its step times, the compiled
schedule (to rebuild it for the simulator: its stages, its meshes and which
mesh runs each stage, edges, per-mesh weight delays; ``schedule_spec``), the
per-stage peak of live micro-batches, the planner's estimate of every
transfer, and for the gradient accounting (``benchmarks.pipeline``):

- ``link_bytes``: ``{"tx_bytes", "rx_bytes", "steps"}``, what this host's
  link carried over the timed steps (its interface counters, read after the
  first step's barrier and after a barrier behind the last step), ``None``
  in one process;
- ``gradients``: per stage, its parameter gradient bytes on each device and
  its mesh's data-axis rings (``gradient_stages``);
- ``per_step_stages``: the stages whose gradients the program reduces once
  per step (a ``ReduceGradients``); the others reduce inside each backward;
- ``move_link_bytes``: payload bytes per step the planned moves send from
  one host to another (``move_link_bytes``);

then ``{"kind": "done"}``, or ``{"kind": "error", ...}`` before exiting
non-zero. Every multi-process wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import traceback
from collections.abc import Callable

from benchmarks.pipeline_cases import CASES, METHODS, SINGLE_PROCESS_METHODS, SpmdBaseline, build_spmd_step, build_step
from benchmarks.worker_records import RecordWriter

# The stage meshes' data axis (``PipeshardParallel``'s default ``data_axis``, as ``build_step`` leaves it).
DATA_AXIS = "data"


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the p<process>.jsonl record files")
    p.add_argument("--trace-dir", required=True, help="directory for the Chrome traces")
    p.add_argument("--cases", nargs="+", default=[c.name for c in CASES], help="case names (default all)")
    p.add_argument("--methods", nargs="+", default=[m.name for m in METHODS], choices=[m.name for m in METHODS])
    p.add_argument("--trace-methods", nargs="*", default=[], help="methods to trace as they normally run")
    p.add_argument("--repeat", type=int, default=5, help="timed steps per method")
    p.add_argument("--serialized-steps", type=int, default=3,
                   help="serialized traced steps per method, whose isolated task times the simulator takes "
                        "the median of")
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
        from benchmarks.emulated_cluster import ENV_NUM_PROCESSES, ENV_PROCESS_ID, initialize_from_env

        # Each emulated host computes on one core, as real hosts do: left to share the
        # machine's cores, a host computing alone runs up to twice as fast as when all do,
        # and isolated task times would not be the pipeline's. Hosts sharing a core are one
        # mesh's (module doc). Before the backend starts, so XLA sizes its thread pool to it.
        cores = sorted(os.sched_getaffinity(0))
        me, hosts = int(os.environ[ENV_PROCESS_ID]), int(os.environ[ENV_NUM_PROCESSES])
        os.sched_setaffinity(0, {cores[me * len(cores) // hosts]})
        initialize_from_env()
    import jax

    out = RecordWriter(args.out, jax.process_index(), {"process": jax.process_index()})
    try:
        _run(args, out)
    except Exception as e:  # noqa: BLE001 -- reported to the parent, then exit non-zero
        out.write({"kind": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        # Exit now, not through interpreter shutdown: with a peer stuck (inside an XLA launch,
        # where no signal reaches it) jax.distributed's shutdown barrier would wait for it.
        os._exit(1)
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


def _bytes_record(live_bytes) -> dict:
    """A ``LiveBytes`` as JSON: per device id, the peak total and activation bytes."""
    return {"total": {str(d): n for d, n in live_bytes.total.items()},
            "activations": {str(d): n for d, n in live_bytes.activations.items()}}


def _transfer_estimates(executable, method, cluster) -> list[dict]:
    """Per transfer of the program: what it is and the planner's estimated seconds
    (``meshpar.passes.planning.calibration.estimated_transfer_s``)."""
    from meshpar.passes.program.moves import Direction
    from meshpar.passes.planning.calibration import estimated_transfer_s

    return [{"edge": t.edge, "activation": t.direction is Direction.ACTIVATION,
             "bytes": t.dtype.itemsize * math.prod(t.shape),
             "seconds": estimated_transfer_s(t, cluster, method.resharding)}
            for t in executable.program.transfers]


def gradient_stages(executable, host_of: Callable[[int], int]) -> list[dict]:
    """Per stage, what one reduction of its parameter gradients over its mesh's data axis moves.

    ``device_bytes``: the bytes of the stage's parameter gradients each device of its mesh holds
    (the shards of its ``ReduceGradient``s: every parameter it reads, each sharded as the
    stage's accumulator; the tied embedding counts on both stages that read it). ``rings``: per
    position on the mesh's other axes, the hosts (``host_of`` a device id) of its data-axis
    devices in data order, the ring one all-reduce runs on. ``mesh``: the stage's mesh."""
    import numpy as np

    from meshpar.passes.program.step_instructions import ReduceGradient

    device_bytes = [0] * len(executable.stage_meshes)
    for ins in executable.step_program:
        if isinstance(ins, ReduceGradient):
            device_bytes[ins.stage] += ins.aval.dtype.itemsize * math.prod(ins.sharding.shard_shape(ins.aval.shape))
    out = []
    for stage, mesh in enumerate(executable.stage_meshes):
        by_data = np.moveaxis(mesh.devices, mesh.axis_names.index(DATA_AXIS), -1)
        rings = [[host_of(d.id) for d in ring] for ring in by_data.reshape(-1, by_data.shape[-1])]
        out.append({"stage": stage, "mesh": executable.home[stage], "device_bytes": device_bytes[stage],
                    "rings": rings})
    return out


def per_step_stages(executable) -> list[int]:
    """The stages whose gradients the pipeline program reduces once per step: those of its
    ``ReduceGradients``; every other stage's backward reduces its micro-batch's itself."""
    from meshpar.passes.program.pipeline_instructions import ReduceGradients

    return sorted(s for instructions in executable.program.instructions for ins in instructions
                  if isinstance(ins, ReduceGradients) for s in ins.stages)


def move_link_bytes(executable, host_of: Callable[[int], int]) -> int | None:
    """Payload bytes per step the step's planned moves send from one host (``host_of`` a device
    id) to another.

    Every move a step makes: each boundary transfer once per micro-batch, each parameter fetched
    from its owner's mesh, each gradient sent back there and each move around the pipeline
    once. A point-to-point move sends exactly its hop program's pieces (``hop_program``: no
    byte twice), each hop between two hosts once; ``jax.device_put`` and local moves stay in
    one process, so on one host. ``None`` when a move runs as a collective program, whose pieces
    are padded to one static shape: its bytes are not the plan's."""
    from meshpar.passes.program.moves import TransferKind
    from meshpar.passes.program.step_instructions import FetchParameter, ReduceGradient, RunMove
    from meshpar.passes.program.resharding_programs import HopProgram

    M = executable.num_micro_batches
    step = list(executable.step_program)
    uses = [(t.move_key, M) for t in executable.program.transfers]
    uses += [(ins.via.move_key, 1) for ins in step if isinstance(ins, FetchParameter)]
    uses += [(ins.move.move_key, 1) for ins in step if isinstance(ins, ReduceGradient) and ins.move is not None]
    uses += [(ins.via.move_key, 1) for ins in step if isinstance(ins, RunMove)]
    total = 0
    for key, times in uses:
        planned = executable.moves.of(key)
        planned = planned.carry or planned  # a signal's byte rides its carrier
        if planned.key.kind is TransferKind.COLLECTIVE:
            return None
        if isinstance(planned.program, HopProgram):
            pieces = planned.program.piece_shapes
            total += times * planned.key.dtype.itemsize * sum(
                math.prod(pieces[h.piece]) for step in planned.program.steps for h in step
                if host_of(h.src_device) != host_of(h.dst_device))
    return total


def _waited(step: Callable, batch, timeout_s: float, what: str) -> Callable:
    """``state -> (state, loss)``: one call of ``step`` on ``batch``, returning once its outputs
    are ready here (bounded by ``timeout_s``, naming ``what``)."""
    import jax

    from meshpar.runtime.coordination import wait_ready

    def run(state):
        new_state, loss = step(state, batch)
        wait_ready(jax.tree.leaves((new_state, loss)), timeout_s, what)
        return new_state, loss

    return run


def _run_spmd(args: argparse.Namespace, out: RecordWriter, case, method: SpmdBaseline, tag: str, devices,
              barrier: Callable[[str], None]) -> None:
    """One SPMD baseline row: compile, one warm-up step, ``--repeat`` timed steps as for the
    pipeline's rows; its bytes per device from XLA's memory analysis of the compiled step."""
    import jax

    from benchmarks.spmd_pipeline import bubble, memory_bytes_per_device

    start = time.perf_counter()
    step, state, batch, config = build_spmd_step(case, method, devices)
    compiled = step.lower(state, batch).compile()

    run = _waited(compiled, batch, args.timeout, f"{case.name} {method.name} step")
    state, loss = run(state)
    compile_s = time.perf_counter() - start
    times = []
    for i in range(args.repeat):
        barrier(f"{tag}/{i}")
        t0 = time.perf_counter()
        state, loss = run(state)
        times.append(time.perf_counter() - t0)
    memory = memory_bytes_per_device(compiled)
    out.write({
        "kind": "method", "spmd": True, "model": case.model, "config": list(case.config), "case": case.name,
        "method": method.name, "batch": case.batch, "step_times_s": times, "compile_s": compile_s,
        "loss": float(loss), "num_micro_batches": case.micro_batches,
        "repeats": method.repeats, "num_stages": config.stages, "bubble": bubble(case.micro_batches, method.repeats,
                                                                                  config.stages),
        "memory": memory,
    })
    print(f"process {jax.process_index()}: {case.name} {method.name}: compile+first step {compile_s:.1f} s, "
          f"steps {[round(t * 1e3) for t in times]} ms", flush=True)


def _run(args: argparse.Namespace, out: RecordWriter) -> None:
    import jax

    import meshpar
    from benchmarks.emulated_cluster import interface_counters
    from meshpar.passes.program.moves import TransferKind
    from meshpar.passes.simulation.live_bytes import predict_live_bytes
    from meshpar.runtime.coordination import kv_client

    me, nproc = jax.process_index(), jax.process_count()
    devices = jax.devices()
    client = kv_client() if nproc > 1 else None
    counter = [0]

    def barrier(name: str) -> None:
        if client is not None:
            counter[0] += 1
            client.wait_at_barrier(f"meshpar-pipeline/{counter[0]}/{name}", int(args.timeout * 1000))

    cases = [c for c in CASES if c.name in args.cases]
    methods = [m for m in (SINGLE_PROCESS_METHODS if nproc == 1 else METHODS) if m.name in args.methods]
    for case in cases:
        hosts, per_host = case.hosts
        if nproc > 1 and nproc != hosts:
            raise ValueError(f"case {case.name!r} runs on {hosts} hosts, but this cluster has {nproc}")
        # The case's hosts: the real processes, or emulated inside one on its first devices.
        host_of = (lambda d: d.id // per_host) if nproc == 1 else None
        case_devices = devices[:hosts * per_host] if nproc == 1 else devices
        cluster = meshpar.Cluster.from_devices(case_devices, host_of=host_of, inter_host_bandwidth=args.link_rate)
        for method in (m for m in methods if m.name in case.methods):
            tag = f"{slug(case.name)}-{method.name}"
            if isinstance(method, SpmdBaseline):
                _run_spmd(args, out, case, method, tag, case_devices, barrier)
                continue
            start = time.perf_counter()
            step, state, batch = build_step(case, method, cluster, args.timeout, case_devices)
            executable = step.get_executable(state, batch)

            run = _waited(step, batch, args.timeout, f"{case.name} {method.name} step")
            state, loss = run(state)
            compile_s = time.perf_counter() - start
            serialized, outside, traced = [], [], None
            for i in range(args.serialized_steps):
                barrier(f"{tag}/serialized/{i}")
                serialized.append(f"{tag}-serialized-{i}.json")
                _, traced = step.trace(os.path.join(args.trace_dir, serialized[-1]), state, batch, serialize=True)
                outside.append(traced.outside_pipeline_s)
            times, before, link_bytes = [], None, None
            for i in range(args.repeat):
                barrier(f"{tag}/{i}")
                if before is None and nproc > 1:
                    before = interface_counters()
                t0 = time.perf_counter()
                state, loss = run(state)
                times.append(time.perf_counter() - t0)
            if before is not None:
                # Behind every process's last step: what the others sent here has all arrived.
                barrier(f"{tag}/counted")
                after = interface_counters()
                link_bytes = {**{k: after[k] - before[k] for k in after}, "steps": args.repeat}
            if method.name in args.trace_methods:
                barrier(f"{tag}/trace")
                step.trace(os.path.join(args.trace_dir, f"{tag}.json"), state, batch)
            schedule = step.get_compiled(state, batch).schedule
            out.write({
                "kind": "method", "model": case.model, "config": list(case.config), "case": case.name,
                "method": method.name, "batch": case.batch, "step_times_s": times, "compile_s": compile_s,
                "loss": float(loss),
                "overlap": not all(t.kind is TransferKind.COLLECTIVE for t in executable.program.transfers
                                   if t.kind is not TransferKind.LOCAL),
                "schedule": schedule_spec(schedule),
                "transfers": _transfer_estimates(executable, method, cluster),
                "peak_live_activations": executable.peak_live_activations,
                "serialized_traces": serialized, "outside_pipeline_s": outside,
                "live_bytes": _bytes_record(traced.live_bytes),
                "predicted_live_bytes": _bytes_record(predict_live_bytes(executable.program, traced.memory_profile)),
                "gradient_reduction": method.gradient_reduction, "link_bytes": link_bytes, "gradients": gradient_stages(executable, cluster.host_of),
                "per_step_stages": per_step_stages(executable),
                "move_link_bytes": move_link_bytes(executable, cluster.host_of),
            })
            print(f"process {me}: {case.name} {method.name}: compile+first step {compile_s:.1f} s, "
                  f"steps {[round(t * 1e3) for t in times]} ms", flush=True)


if __name__ == "__main__":
    sys.exit(main())
