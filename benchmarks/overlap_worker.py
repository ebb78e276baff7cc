"""One process of ``python -m benchmarks.overlap`` (the child side).

Started by ``EmulatedCluster(2, 4, G).run(["-m", "benchmarks.overlap_worker", ...])``:
two emulated hosts, one process each, 4 CPU devices each, joined through
:func:`benchmarks.emulated_cluster.initialize_from_env`
(``meshpar.distributed.initialize``: gloo and a cross-host transfer server).

Roles. Process 0 (host 0) owns the source mesh, its 4 devices as (2, 2)
``("x", "y")``, holding a float32 ``(256 * M, 1024)`` tensor of ``--mib M``
MiB sharded ``P("x")``, and runs the *stage-sized compute*: a jitted chain of
``k`` matmuls ``a <- tanh(a @ w)`` on a ``(4, N, N)`` array sharded over the
same 4 devices (one ``N x N`` matmul per device per step, no communication;
``k`` is a runtime argument, so changing it recompiles nothing). Process 1
(host 1) owns the destination mesh, its 4 devices as (2, 2), and receives
the tensor as ``P(None, "y")`` through ``meshpar.reshard(..., strategy=
"broadcast", balancer="ensemble", executor=E)``. Both processes call
``reshard`` every time (p2p requires every process of the job to call it).

Per executor ``E`` (``--executors``, default p2p then collective):

1. Warm-up: one transfer (plan agreement, compile, connections; process 1
   checks its shards against numpy) and one compute.
2. Calibration: the transfer alone is timed (median of 3); then ``k`` is
   scaled until the compute alone takes 0.9-1.1x as long (up to 6 tries,
   accepted within 0.7-1.3x), so that no overlap gives a ratio near 2.
   Every decision is shared through the key-value store (each process
   publishes its value, all take the max), so both processes run the same
   loop.
3. ``--repeat`` rounds, each timing, in this order, after a barrier each:
   the compute alone (process 0 runs it, process 1 idles), the transfer
   alone (both call ``reshard``; process 1 waits for its result), and both
   together (process 0 dispatches the reshard, then the compute, and waits
   for the compute; process 1 calls ``reshard`` and waits for its result).
   A process's time runs from the barrier to its own wait's end; the
   parent takes the max over processes of each repeat. The round ends at a
   barrier too, so a late receiver never overlaps the next measurement.

Every multi-process wait is bounded by ``--timeout``: barriers and
key-value reads by the coordination service's deadline, result waits by
:func:`benchmarks.resharding.real_worker.ready`.

Each process appends JSON lines to ``<--out>/p<process>.jsonl``, flushed
per record: ``{"kind": "calibration", ...}`` (process 0, per executor: the
``k`` chosen and the tries), ``{"kind": "executor", ...}`` (per executor:
this process's ``compute``/``transfer``/``both`` times per repeat and its
verification), ``{"kind": "done"}``, or ``{"kind": "error", ...}`` before
exiting non-zero.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

from benchmarks.resharding.real_worker import ready

EXECUTORS = ("p2p", "collective")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.overlap_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the p<process>.jsonl record files")
    p.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=EXECUTORS)
    p.add_argument("--mib", type=float, default=8.0, help="tensor size in MiB")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--matmul-n", type=int, default=256, help="N of each device's N x N matmul")
    p.add_argument("--link-rate", type=float, required=True, help="measured inter-host bytes/s (for the planner)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each barrier, exchange and wait")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import jax

    from benchmarks.emulated_cluster import initialize_from_env

    initialize_from_env()  # before anything touches a JAX backend
    me = jax.process_index()
    f = open(os.path.join(args.out, f"p{me}.jsonl"), "a", buffering=1)

    def write(record: dict) -> None:
        f.write(json.dumps(record) + "\n")
        f.flush()

    try:
        _run(args, write)
    except BaseException as e:
        write({"kind": "error", "process": me, "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()[-4000:]})
        raise
    write({"kind": "done", "process": me})
    jax.distributed.shutdown()
    return 0


def _run(args: argparse.Namespace, write) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    import meshpar
    from meshpar.runtime.coordination import kv_client

    me, nproc = jax.process_index(), jax.process_count()
    if nproc != 2:
        raise RuntimeError(f"the overlap benchmark runs on 2 processes, got {nproc}")
    client = kv_client()
    timeout_ms = int(args.timeout * 1000)
    by_process = [sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id) for p in range(nproc)]
    if any(len(devs) != 4 for devs in by_process):
        raise RuntimeError(f"the overlap benchmark needs 4 devices per process, got {[len(d) for d in by_process]}")
    counter = [0]

    def barrier(name: str) -> None:
        client.wait_at_barrier(f"meshpar-overlap/{name}", timeout_ms)

    def allmax(value: float) -> float:
        """The max over processes of ``value`` (every process calls, in the same order)."""
        counter[0] += 1
        key = f"meshpar-overlap/allmax/{counter[0]}"
        client.key_value_set(f"{key}/{me}", json.dumps(value))
        values = [value if p == me else json.loads(client.blocking_key_value_get(f"{key}/{p}", timeout_ms))
                  for p in range(nproc)]
        return max(values)

    # The tensor: host 0's (2, 2) mesh, P("x") -> host 1's (2, 2) mesh, P(None, "y").
    rows = max(2, 2 * round(args.mib * 2**20 / 4 / 1024 / 2))
    shape = (rows, 1024)
    expected = (np.arange(rows * 1024, dtype=np.int64) % (1 << 24)).astype(np.float32).reshape(shape)
    names = ("x", "y")
    src = NamedSharding(Mesh(np.array(by_process[0]).reshape(2, 2), names), P("x"))
    dst = NamedSharding(Mesh(np.array(by_process[1]).reshape(2, 2), names), P(None, "y"))
    x = jax.make_array_from_callback(shape, src, lambda index: expected[index], dtype=np.float32)
    cluster = meshpar.Cluster.from_devices(jax.devices(), inter_host_bandwidth=args.link_rate,
                                           intra_host_bandwidth=2e9, latency=1e-3)

    # The compute: process 0 only, on the source mesh's devices.
    n = args.matmul_n
    compute = None
    if me == 0:
        mesh = Mesh(np.array(by_process[0]), ("d",))
        a0 = jax.device_put(np.random.default_rng(0).standard_normal((4, n, n), dtype=np.float32),
                            NamedSharding(mesh, P("d")))
        w = jax.device_put((np.random.default_rng(1).standard_normal((n, n)) / np.sqrt(n)).astype(np.float32),
                           NamedSharding(mesh, P()))

        @jax.jit
        def chain(a, w, k):
            return jax.lax.fori_loop(0, k, lambda i, a: jnp.tanh(a @ w), a)

        def compute(k: int):
            return chain(a0, w, jnp.int32(k))

    def run_compute(k: int) -> None:
        if compute is not None:
            ready(compute(k), args.timeout, f"compute of {k} matmul steps")

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for executor in args.executors:
        tag = f"{executor}"

        def reshard():
            return meshpar.reshard(x, dst, strategy="broadcast", balancer="ensemble", cluster=cluster,
                                   executor=executor, timeout_s=args.timeout)

        def transfer() -> None:
            ready(reshard(), args.timeout, f"{executor} reshard")

        def both(k: int) -> None:
            y = reshard()  # dispatched first: the transfer is in flight ...
            if compute is not None:
                ready(compute(k), args.timeout, f"compute of {k} matmul steps alongside a {executor} reshard")
            ready(y, args.timeout, f"{executor} reshard alongside compute")  # ... the receiver waits for it

        # 1. Warm-up and verification.
        barrier(f"{tag}/warmup")
        y = ready(reshard(), args.timeout, f"{executor} reshard warm-up")
        checked, ok = 0, y.sharding == dst
        for shard in y.addressable_shards:
            checked += 1
            ok = ok and np.array_equal(np.asarray(shard.data), expected[shard.index])
        del y
        run_compute(1)
        barrier(f"{tag}/warmup-end")

        # 2. Calibration: the transfer alone, then k so the compute alone matches it.
        transfer_times = []
        for r in range(3):
            barrier(f"{tag}/calibrate-transfer/{r}")
            transfer_times.append(allmax(timed(transfer)))
        barrier(f"{tag}/calibrate-transfer/end")
        target = statistics.median(transfer_times)
        k, tries = 4, []
        for attempt in range(6):
            compute_times = []
            for r in range(2):
                barrier(f"{tag}/calibrate-compute/{attempt}/{r}")
                compute_times.append(allmax(timed(lambda: run_compute(k))))
            t = statistics.median(compute_times)
            tries.append({"k": k, "compute_s": t})
            if 0.9 <= t / target <= 1.1:
                break
            # Scale k by the ratio (the chain is linear in k), at most 8x per try.
            k = int(allmax(max(1, round(k * min(8.0, max(0.125, target / max(t, 1e-6)))))))
        else:
            # Six tries: keep the closest.
            best = min(tries, key=lambda c: abs(c["compute_s"] / target - 1.0))
            k = best["k"]
        if me == 0:
            write({"kind": "calibration", "executor": executor, "k": k, "transfer_s": target,
                   "transfer_times_s": transfer_times, "tries": tries, "matmul_n": n,
                   "tensor_bytes": int(expected.nbytes), "shape": list(shape)})

        # 3. Timed rounds: compute alone, transfer alone, both.
        times: dict[str, list[float]] = {"compute": [], "transfer": [], "both": []}
        for r in range(args.repeat):
            barrier(f"{tag}/{r}/compute")
            times["compute"].append(timed(lambda: run_compute(k)))
            barrier(f"{tag}/{r}/transfer")
            times["transfer"].append(timed(transfer))
            barrier(f"{tag}/{r}/both")
            times["both"].append(timed(lambda: both(k)))
        barrier(f"{tag}/end")
        write({"kind": "executor", "executor": executor, "process": me, "role": "src" if me == 0 else "dst",
               "k": k, "times": times, "verified": ok if checked else None, "checked_shards": checked})


if __name__ == "__main__":
    sys.exit(main())
