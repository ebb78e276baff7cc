"""One process of ``python -m benchmarks.resharding real`` (the child side).

Emulated cluster: ``EmulatedCluster.run(["-m", "benchmarks.resharding.real_worker", ...])``
starts one copy per emulated host; each joins ``jax.distributed`` through
:func:`benchmarks.emulated_cluster.initialize_from_env` and runs every case x
method in the same order. Single host (``--single-host``): one plain process
with 8 virtual CPU devices, comparing ``jax.device_put`` with
``meshpar.reshard``.

For each case x method, every process: builds the source array once per case
(``jax.make_array_from_callback``; processes without a source device hold no
shard), makes one warm-up call (compile, plan agreement), checks its shards
of the result against numpy, then times ``--repeat`` calls of ``reshard`` +
``block_until_ready``, each preceded by a barrier across all processes, and
meets the others at one more barrier before moving on (senders return while
their receivers are still receiving; their next setup must not steal CPU
from the last repeat). A process owning no device of either mesh takes no
part, as ``reshard``'s contract allows: it only joins the barriers (calling
``reshard`` there would compile the whole program for nothing). The parent
takes the max over processes of each repeat. On a single host the source
array is rebuilt (untimed) before every call: ``jax.device_put`` of an array
it has already put can return in ~0.5 ms.

Each process appends JSON lines to ``<--out>/p<process>.jsonl`` as it goes
(flushed per record, so the parent can report progress and keep partial
results if the run is killed):

- ``{"kind": "case", ...}`` (process 0 only): the case's meshes, bytes, and
  the link lower bound of the exact task executed, planned with
  ``inter_host_bandwidth = --link-rate`` and latency 0.
- ``{"kind": "method", ...}``: this process's role, warm-up time, repeat
  times, verification result and (process 0) the plan's shape.
- ``{"kind": "done"}`` at the end; ``{"kind": "error", ...}`` before exiting
  non-zero on an exception.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import time
import traceback

from benchmarks.resharding.real import METHODS, RealCase, real_cases, single_host_cases


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resharding.real_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the p<process>.jsonl record files")
    p.add_argument("--single-host", action="store_true", help="one process, 8 virtual devices, vs jax.device_put")
    p.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
    p.add_argument("--suites", nargs="+", default=None, help="n_to_m and/or one_to_m (default: both)")
    p.add_argument("--methods", nargs="+", default=None, help="strategy/balancer pairs (default: all 9)")
    p.add_argument("--mib", type=float, default=32.0, help="tensor size in MiB")
    p.add_argument("--devices-per-host", type=int, default=4)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--link-rate", type=float, required=True, help="measured inter-host bytes/s")
    p.add_argument("--plan-rate", type=float, default=None,
                   help="inter-host bytes/s the planner assumes (default: --link-rate)")
    p.add_argument("--intra-rate", type=float, default=2e9, help="planner's intra-host bytes/s")
    p.add_argument("--latency", type=float, default=1e-3, help="planner's per-message seconds")
    p.add_argument("--chunks", type=int, default=None, help="force the broadcast chunk count")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for each barrier / plan agreement")
    return p.parse_args(argv)


class _Out:
    def __init__(self, directory: str, process: int) -> None:
        self._f = open(os.path.join(directory, f"p{process}.jsonl"), "a", buffering=1)

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import jax

    if args.single_host:
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        from benchmarks.emulated_cluster import initialize_from_env

        initialize_from_env()  # before anything touches a JAX backend

    me = jax.process_index()
    out = _Out(args.out, me)
    try:
        _run(args, out)
    except BaseException as e:
        out.write({"kind": "error", "process": me, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-4000:]})
        raise
    out.write({"kind": "done", "process": me})
    if not args.single_host:
        jax.distributed.shutdown()
    return 0


def _machine_busy_s() -> float:
    """Seconds of non-idle CPU time of the whole machine so far (all processes, kernel included)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return 0.0
    idle = ticks[3] + ticks[4]  # idle + iowait
    return (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK")


def _expected(shape: tuple[int, ...]):
    import numpy as np

    n = int(np.prod(shape))
    # Exact in float32 up to 2**24 elements (64 MiB): every element differs,
    # so a misplaced box or a wrong offset fails the check.
    return (np.arange(n, dtype=np.int64) % (1 << 24)).astype(np.float32).reshape(shape)


def _run(args: argparse.Namespace, out: _Out) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import meshpar
    from meshpar.passes.transfer_program import lower_plan
    from meshpar.passes.unit_tasks import decompose

    me = jax.process_index()
    nproc = jax.process_count()
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(nproc)]
    methods = [tuple(m.split("/")) for m in args.methods] if args.methods else list(METHODS)
    if args.single_host:
        cases = single_host_cases(args.mib, names=args.cases, suites=args.suites)
        methods = [("device_put", "-"), ("broadcast", "ensemble")]
    else:
        cases = real_cases(args.mib, args.devices_per_host, names=args.cases, suites=args.suites)
    client = None
    if nproc > 1:
        from jax._src import distributed

        client = distributed.global_state.client

    def barrier(name: str) -> None:
        if client is not None:
            client.wait_at_barrier(f"meshpar-real/{name}", int(args.timeout * 1000))

    for case in cases:
        names = ("x", "y")

        def mesh(rows):
            return Mesh(np.array([[by_process[p][k] for p, k in row] for row in rows]), names)

        src_mesh, dst_mesh = mesh(case.src_rows), mesh(case.dst_rows)
        src = NamedSharding(src_mesh, meshpar.ShardingSpec.parse(case.src_spec).to_partition_spec(names))
        dst = NamedSharding(dst_mesh, meshpar.ShardingSpec.parse(case.dst_spec).to_partition_spec(names))
        if args.single_host:
            # Rows of each mesh are emulated hosts (as in tests/test_reshard.py);
            # devices no mesh uses get hosts of their own.
            host_of = {d.id: h for h, row in enumerate([*src_mesh.devices, *dst_mesh.devices]) for d in row}
            cluster = meshpar.Cluster.from_devices(
                jax.devices(), host_of=lambda d: host_of.get(d.id, 100 + d.id),
                inter_host_bandwidth=args.link_rate, intra_host_bandwidth=args.intra_rate, latency=args.latency)
        else:
            cluster = meshpar.Cluster.from_devices(
                jax.devices(), inter_host_bandwidth=args.plan_rate or args.link_rate,
                intra_host_bandwidth=args.intra_rate, latency=args.latency)
        expected = _expected(case.shape)

        def build():
            return jax.make_array_from_callback(case.shape, src, lambda index: expected[index], dtype=np.float32)

        x = build()
        mine = {d.id for d in jax.local_devices()}
        role = "+".join(r for r, m in (("src", src_mesh), ("dst", dst_mesh)) if mine & {d.id for d in m.devices.flat})
        case_info_written = False
        for strategy, balancer in methods:
            tag = f"{case.suite}/{case.name}/{strategy}/{balancer}"
            if not role:
                # Owns no device of either mesh: takes no part (reshard's
                # contract), and skips compiling a program it would not run.
                def call():
                    return None
            elif strategy == "device_put":
                def call():
                    return jax.device_put(x, dst).block_until_ready()
            else:
                def call():
                    return meshpar.reshard(x, dst, strategy=strategy, balancer=balancer, chunks=args.chunks,
                                           cluster=cluster, timeout_s=args.timeout).block_until_ready()
            barrier(f"{tag}/warmup")
            if args.single_host:
                # A fresh source per call: on CPU, jax.device_put of an array it
                # has already put returns in ~0.5 ms (its shards can alias the
                # source's), which would time nothing.
                x = build()
            t0 = time.perf_counter()
            y = call()
            warmup = time.perf_counter() - t0
            checked = 0
            ok = True
            if y is not None:
                ok = y.sharding == dst
                for shard in y.addressable_shards:
                    checked += 1
                    if not np.array_equal(np.asarray(shard.data), expected[shard.index]):
                        ok = False
            del y
            times = []
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            busy0, wall0 = _machine_busy_s(), time.perf_counter()
            for r in range(args.repeat):
                barrier(f"{tag}/{r}")
                if args.single_host:
                    x = build()
                t0 = time.perf_counter()
                y = call()
                times.append(time.perf_counter() - t0)
                del y
            # Senders return before their receivers finish (sockets buffer);
            # nobody may start the next case's setup while the last repeat runs.
            barrier(f"{tag}/end")
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            machine = (_machine_busy_s() - busy0) / max(time.perf_counter() - wall0, 1e-9)
            record = {
                "kind": "method", "suite": case.suite, "case": case.name, "strategy": strategy,
                "balancer": balancer, "process": me, "role": role or "none", "warmup_s": warmup,
                "times": times, "cpu_s": cpu, "machine_cores": machine,
                "verified": ok if checked else None, "checked_shards": checked,
            }
            if me == 0 and strategy != "device_put":
                plan = meshpar.plan_for(x, dst, strategy=strategy, balancer=balancer, chunks=args.chunks,
                                        cluster=cluster)
                program = lower_plan(plan)
                record["plan"] = {
                    "estimated_s": plan.estimated_time, "unit_tasks": len(plan.tasks), "rounds": plan.num_rounds,
                    "chunks": sorted({t.chunks for t in plan.tasks}), "steps": len(program.steps),
                    "ppermutes": sum(len(s.shapes) for s in program.steps),
                }
                if not case_info_written:
                    task = plan.task
                    link = dataclasses.replace(cluster, inter_host_bandwidth=args.link_rate, latency=0.0)
                    lb = meshpar.plan_resharding(task, link, strategy="send_recv", balancer="naive").lower_bound
                    moved = 0
                    for u in decompose(task):
                        holders = {task.host_of(s) for s in u.senders}
                        moved += u.nbytes * len({task.host_of(r) for r in u.receivers} - holders)
                    out.write({
                        "kind": "case", "suite": case.suite, "case": case.name, "shape": list(case.shape),
                        "src": f"{case.src_spec}{tuple(src_mesh.devices.shape)}",
                        "dst": f"{case.dst_spec}{tuple(dst_mesh.devices.shape)}",
                        "tensor_bytes": task.nbytes, "bytes_moved": moved,
                        "link_lower_bound_s": lb if not args.single_host else None,
                        "link_rate": args.link_rate,
                    })
                    case_info_written = True
            out.write(record)
        if me == 0 and not case_info_written:  # single host with device_put only
            out.write({"kind": "case", "suite": case.suite, "case": case.name, "shape": list(case.shape),
                       "tensor_bytes": int(expected.nbytes), "bytes_moved": None, "link_lower_bound_s": None})
        del x, expected


if __name__ == "__main__":
    sys.exit(main())
