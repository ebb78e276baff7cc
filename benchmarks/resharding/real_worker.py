"""One process of ``python -m benchmarks.resharding real`` (the child side).

Emulated cluster: ``EmulatedCluster.run(["-m", "benchmarks.resharding.real_worker", ...])``
starts one copy per emulated host; each joins the job through
:func:`benchmarks.emulated_cluster.initialize_from_env` (which calls
``meshpar.distributed.initialize``: gloo and a cross-host transfer server)
and runs every case x method in the same order. Single host
(``--single-host``): one plain process with 8 virtual CPU devices, comparing
``jax.device_put`` with ``meshpar.reshard``.

Methods (``--methods``, ``strategy/balancer/executor[/order]``, see
:class:`benchmarks.resharding.real.Method`):

- ``meshpar.reshard(x, dst, strategy=, balancer=, executor=, order=)``.
  With ``executor="p2p"`` EVERY process calls it, also those owning no device
  of either mesh: JAX numbers cross-process transfers with a per-process
  counter. With ``executor="collective"`` a process owning no device of
  either mesh takes no part, as ``reshard``'s contract allows: it only joins
  the barriers (calling would compile the whole program for nothing).
- ``stock_jax/-/device_put``: the source processes run
  ``jax.jit(lambda a: a, out_shardings=NamedSharding(M, dst.spec))`` with
  ``M`` the source devices arranged in the destination mesh's shape, then
  every process calls ``jax.device_put(y, dst)`` (a same-layout cross-host
  transfer; processes without source devices pass an array with no local
  shards). Skipped by all processes alike where it cannot run
  (:func:`benchmarks.resharding.real.not_applicable`).
- ``device_put/-/device_put`` (single host): ``jax.device_put(x, dst)``.

For each case, process 0 first writes the case's record (meshes, bytes, the
link lower bound). Then for each method every process: builds the source
array once per case (``jax.make_array_from_callback``; processes without a
source device hold no shard), makes one warm-up call (compile, plan
agreement, connections), checks its shards of the result against numpy,
then times ``--repeat`` calls, each preceded by a barrier across all
processes and ending when this process's result is ready (bounded by
``--timeout``), and meets the others at one more barrier before moving on
(senders return while their receivers are still receiving; their next setup
must not steal CPU from the last repeat). The parent takes the max over
processes of each repeat. On a single host the source array is rebuilt
(untimed) before every call: ``jax.device_put`` of an array it has already
put can return in ~0.5 ms.

Each process appends JSON lines to ``<--out>/p<process>.jsonl`` as it goes
(flushed per record, so the parent can report progress and keep partial
results if the run is killed):

- ``{"kind": "case", ...}`` (process 0 only): the case's meshes, bytes, and
  the link lower bound of the exact task executed, planned with
  ``inter_host_bandwidth = --link-rate`` and latency 0.
- ``{"kind": "method", ...}``: the method (strategy, balancer, executor,
  order), this process's role, warm-up time, repeat times, verification
  result and (process 0, meshpar methods) the plan's shape.
- ``{"kind": "done"}`` at the end; ``{"kind": "error", ...}`` before exiting
  non-zero on an exception.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

from benchmarks.resharding.real import (
    COMPARISON, COMPARISON_MIB, OURS_P2P, SINGLE_DEVICE_PUT, STOCK, Method, not_applicable, real_cases, single_host_cases,
    stock_mesh_shape,
)
from benchmarks.hop_trace import ArrivalWatch
from benchmarks.worker_records import RecordWriter, recording_outcome


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.resharding.real_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the p<process>.jsonl record files")
    p.add_argument("--single-host", action="store_true", help="one process, 8 virtual devices, vs jax.device_put")
    p.add_argument("--cases", nargs="+", default=None, help="case names (default: all)")
    p.add_argument("--suites", nargs="+", default=None, help="n_to_m and/or one_to_m (default: both)")
    p.add_argument("--methods", nargs="+", default=None, metavar="STRATEGY/BALANCER[/EXECUTOR[/ORDER]]",
                   help="default: the comparison set (single host: device_put and broadcast/ensemble/p2p)")
    p.add_argument("--mib", type=float, default=COMPARISON_MIB, help="tensor size in MiB")
    p.add_argument("--devices-per-host", type=int, default=4)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--link-rate", type=float, required=True, help="measured inter-host bytes/s")
    p.add_argument("--plan-rate", type=float, default=None,
                   help="inter-host bytes/s the planner assumes (default: --link-rate)")
    p.add_argument("--intra-rate", type=float, default=2e9, help="planner's intra-host bytes/s")
    p.add_argument("--latency", type=float, default=1e-3, help="planner's per-message seconds")
    p.add_argument("--chunks", type=int, default=None, help="force the broadcast chunk count")
    p.add_argument("--hop-trace", action="store_true",
                   help="p2p methods: note when each hop into this process arrived (benchmarks.hop_trace)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds for each barrier, plan agreement and wait for a result")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import jax

    if args.single_host:
        jax.config.update("jax_num_cpu_devices", 8)
    else:
        from benchmarks.emulated_cluster import initialize_from_env

        initialize_from_env()  # before anything touches a JAX backend

    me = jax.process_index()
    out = RecordWriter(args.out, me)
    recording_outcome(lambda: _run(args, out), out, me)
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


# Untimed calls added to the first method of a run (see where it is used).
EXTRA_FIRST_WARMUPS = 4
_TCP_COUNTERS = ("RetransSegs", "TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSlowStartRetrans")


def tcp_counters() -> dict[str, int]:
    """This network namespace's TCP retransmission counters (``/proc/net/snmp`` and
    ``/proc/net/netstat`` are per namespace: per emulated host)."""
    counters: dict[str, int] = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        for names, values in zip(lines[::2], lines[1::2]):
            for name, value in zip(names.split()[1:], values.split()[1:]):
                if name in _TCP_COUNTERS:
                    counters[name] = int(value)
    return counters


def _expected(shape: tuple[int, ...]):
    import numpy as np

    n = int(np.prod(shape))
    # Exact in float32 up to 2**24 elements (64 MiB): every element differs,
    # so a misplaced box or a wrong offset fails the check.
    return (np.arange(n, dtype=np.int64) % (1 << 24)).astype(np.float32).reshape(shape)


def ready(y, timeout_s: float, what: str):
    """``y`` once it is ready, giving up after ``timeout_s`` (a peer that never sends must not
    hang us); ``meshpar.runtime.coordination.wait_ready`` waits in a helper thread, so the
    caller wakes the moment ``y`` is ready (no polling interval in the timing)."""
    from meshpar.runtime.coordination import wait_ready

    if y is not None:
        wait_ready([y], timeout_s, what)
    return y


def _warm_links(by_process, mib: float, barrier) -> None:
    """Moves ``mib`` MiB once between every ordered pair of hosts, untimed.

    The first transfers between two hosts open their connections and start
    TCP from a small window; without this, whichever method the first case
    times first pays for it (case 1 measured 1.5x slower first than second).
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import meshpar
    from meshpar.runtime.coordination import wait_ready

    n = max(1, int(mib * 2**20) // 4)
    for a, sources in enumerate(by_process):
        for b, targets in enumerate(by_process):
            if a == b:
                continue
            src = NamedSharding(Mesh(np.array(sources[:1]), ("x",)), P())
            dst = NamedSharding(Mesh(np.array(targets[:1]), ("x",)), P())
            x = jax.make_array_from_callback((n,), src, lambda index: np.zeros(n, np.float32)[index], dtype=np.float32)
            y = meshpar.reshard(x, dst, executor="p2p")
            if y.addressable_shards:
                wait_ready([y], 120.0, f"warming the link {a} -> {b}")
    barrier("warm-links")


def _run(args: argparse.Namespace, out: RecordWriter) -> None:
    import dataclasses

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    import meshpar
    from meshpar.passes.resharding.hop_program import lower_to_hops
    from meshpar.passes.resharding.transfer_program import lower_plan
    from meshpar.passes.resharding.unit_tasks import decompose

    me = jax.process_index()
    nproc = jax.process_count()
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(nproc)]
    if args.methods:
        methods = [Method.parse(m) for m in args.methods]
    elif args.single_host:
        methods = [SINGLE_DEVICE_PUT, OURS_P2P]
    else:
        methods = list(COMPARISON)
    if args.single_host:
        cases = single_host_cases(args.mib, names=args.cases, suites=args.suites)
    else:
        cases = real_cases(args.mib, args.devices_per_host, names=args.cases, suites=args.suites)
    watch = ArrivalWatch()
    first_timed = True
    client = None
    if nproc > 1:
        from meshpar.passes import jax_ir

        client = jax_ir.distributed_client()

    def barrier(name: str) -> None:
        if client is not None:
            client.wait_at_barrier(f"meshpar-real/{name}", int(args.timeout * 1000))

    if nproc > 1:
        _warm_links(by_process, args.mib, barrier)
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
        owns_src = bool(mine & {d.id for d in src_mesh.devices.flat})
        role = "+".join(r for r, m in (("src", src_mesh), ("dst", dst_mesh)) if mine & {d.id for d in m.devices.flat})
        if me == 0:
            # The exact task executed; its lower bound on links of the measured
            # rate with no latency; the bytes that must cross host NICs.
            link = dataclasses.replace(cluster, inter_host_bandwidth=args.link_rate, latency=0.0)
            bound = meshpar.plan_between(case.shape, np.float32, src, dst, strategy="send_recv", balancer="naive",
                                         cluster=link)
            task = bound.task
            moved = 0
            for u in decompose(task):
                holders = {task.host_of(s) for s in u.senders}
                moved += u.nbytes * len({task.host_of(r) for r in u.receivers} - holders)
            out.write({
                "kind": "case", "suite": case.suite, "case": case.name, "shape": list(case.shape),
                "src": f"{case.src_spec}{tuple(src_mesh.devices.shape)}",
                "dst": f"{case.dst_spec}{tuple(dst_mesh.devices.shape)}",
                "src_devices": int(src_mesh.devices.size), "dst_devices": int(dst_mesh.devices.size),
                "stock_na": None if args.single_host else not_applicable(case, STOCK),
                "tensor_bytes": task.nbytes, "bytes_moved": moved,
                "link_lower_bound_s": bound.lower_bound if not args.single_host else None,
                "link_rate": args.link_rate,
            })
        for method in methods:
            strategy, balancer, executor, order = method
            if not args.single_host and not_applicable(case, method):
                continue  # every process skips alike (it depends on the case only)
            tag = f"{case.suite}/{case.name}/{method.key}"
            if strategy == "device_put":
                def call():
                    return jax.device_put(x, dst)
            elif strategy == "stock_jax":
                # On the source devices, to the destination's layout on a mesh of
                # the destination's shape; then one same-layout cross-host move.
                stock_src = NamedSharding(
                    Mesh(np.array(list(src_mesh.devices.flat)).reshape(stock_mesh_shape(case)), names), dst.spec)
                to_layout = jax.jit(lambda a: a, out_shardings=stock_src)
                absent = None if owns_src else jax.make_array_from_single_device_arrays(
                    case.shape, stock_src, [], dtype=np.float32)

                def call(to_layout=to_layout, absent=absent):
                    return jax.device_put(to_layout(x) if owns_src else absent, dst)
            elif executor == "collective" and not role:
                # Owns no device of either mesh: takes no part (reshard's
                # contract), and skips compiling a program it would not run.
                def call():
                    return None
            elif args.hop_trace and executor == "p2p":
                from meshpar.reshard import prepare_reshard

                traced, _ = prepare_reshard(case.shape, np.float32, src, dst, strategy=strategy, balancer=balancer,
                                            chunks=args.chunks, cluster=cluster, executor="p2p", order=order)

                def call(traced=traced):
                    return traced(x, timeout_s=args.timeout, on_arrival=watch.add)
            else:
                def call():
                    return meshpar.reshard(x, dst, strategy=strategy, balancer=balancer, chunks=args.chunks,
                                           cluster=cluster, executor=executor,
                                           order=order if executor == "p2p" else "eager", timeout_s=args.timeout)
            barrier(f"{tag}/warmup")
            if args.single_host:
                # A fresh source per call: on CPU, jax.device_put of an array it
                # has already put returns in ~0.5 ms (its shards can alias the
                # source's), which would time nothing.
                x = build()
            t0 = time.perf_counter()
            y = ready(call(), args.timeout, tag)
            warmup = time.perf_counter() - t0
            if first_timed:
                # Whichever method was timed first in a run had a tail the same code did not
                # have second (case 1, 0.25 Gbit/s: max 1.46-1.58x first, 1.04x second, with or
                # without round gates): a few more untimed calls leave that to the warm-up.
                for _ in range(EXTRA_FIRST_WARMUPS):
                    barrier(f"{tag}/warmup-again")
                    del y
                    y = ready(call(), args.timeout, tag)
                first_timed = False
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
            hops: list[list[dict]] = []
            cpu0 = resource.getrusage(resource.RUSAGE_SELF)
            tcp0 = tcp_counters()
            busy0, wall0 = _machine_busy_s(), time.perf_counter()
            for r in range(args.repeat):
                barrier(f"{tag}/{r}")
                if args.single_host:
                    x = build()
                watch.start()
                t0 = time.perf_counter()
                y = ready(call(), args.timeout, tag)
                times.append(time.perf_counter() - t0)
                hops.append(watch.finish(args.timeout))
                del y
            # Senders return before their receivers finish (sockets buffer);
            # nobody may start the next case's setup while the last repeat runs.
            barrier(f"{tag}/end")
            cpu1 = resource.getrusage(resource.RUSAGE_SELF)
            tcp = {k: v - tcp0.get(k, 0) for k, v in tcp_counters().items()}
            cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
            machine = (_machine_busy_s() - busy0) / max(time.perf_counter() - wall0, 1e-9)
            record = {
                "kind": "method", "suite": case.suite, "case": case.name, "strategy": strategy,
                "balancer": balancer, "executor": executor, "order": order, "process": me,
                "role": role or "none", "warmup_s": warmup, "times": times, "cpu_s": cpu,
                "machine_cores": machine, "verified": ok if checked else None, "checked_shards": checked,
                "tcp": tcp,
            }
            if any(hops):
                record["hops"] = hops
                record["host_of"] = {d.id: d.process_index for d in jax.devices()}
            if me == 0 and executor in ("p2p", "collective"):
                plan = meshpar.plan_between(case.shape, np.float32, src, dst, strategy=strategy, balancer=balancer,
                                            chunks=args.chunks, cluster=cluster)
                record["plan"] = {
                    "estimated_s": plan.estimated_time, "unit_tasks": len(plan.tasks), "rounds": plan.num_rounds,
                    "chunks": sorted({t.chunks for t in plan.tasks}),
                }
                if executor == "collective":
                    program = lower_plan(plan)
                    record["plan"].update(steps=len(program.steps),
                                          ppermutes=sum(len(s.shapes) for s in program.steps))
                else:
                    hops = lower_to_hops(plan)
                    record["plan"].update(steps=len(hops.steps), hops=hops.num_hops)
            out.write(record)
        del x, expected


if __name__ == "__main__":
    sys.exit(main())
