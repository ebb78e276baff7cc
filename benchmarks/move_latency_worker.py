"""One process of ``python -m benchmarks.move_latency`` (the child side).

    python -m benchmarks.move_latency_worker --out DIR [--coordinator HOST:PORT --process-id I]
        [--sizes BYTES ...] [--methods p2p device_put] [--repeat N] [--timeout S]

Two processes with one CPU device each: the source array lives whole on
process 0's device, the destination is process 1's device, both as
``NamedSharding`` over a mesh of one device with ``P()`` (the same layout).
With ``--coordinator`` the process joins a job on this machine through
``meshpar.distributed.initialize`` (gloo and a cross-host transfer server);
without, it is a host of an emulated cluster
(:func:`benchmarks.emulated_cluster.initialize_from_env`, one device per host).

Methods, called by both processes alike (JAX numbers cross-process
transfers with a counter every process advances):

- ``p2p``: ``meshpar.reshard(x, dst, executor="p2p")``;
- ``device_put``: ``jax.device_put(x, dst)``; process 1's ``x`` is the
  same-sharded array with no local shards
  (``meshpar.runtime.remote.absent``).

Per size (a float32 vector, uint8 where the size is not a multiple of 4)
and method: call 0 is the warm-up (plan agreement, connections), calls
1..``--repeat`` are timed. Before each call process 0 builds a fresh
source whose values depend on the call's number (untimed), so no call can
return an earlier result; then all processes meet at a barrier, time the
call until their own result is ready (process 1: the data has arrived;
process 0: the call returned, its result having no local shard), meet at
a second barrier (nobody's next build may take CPU from a move still in
flight) and process 1 checks every element against numpy. Every wait is
bounded by ``--timeout``.

Each process appends JSON lines to ``<--out>/p<process>.jsonl``, flushed
per record:

- ``{"kind": "move", "bytes", "dtype", "method", "process", "role",
  "warmup_s", "times", "verified", "checked"}`` per size and method
  (``times``: this process's timed calls, in order; ``verified``: ``None``
  on the sender);
- ``{"kind": "done"}`` at the end; ``{"kind": "error", ...}`` before
  exiting non-zero on an exception.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from benchmarks.resharding.real_worker import ready
from benchmarks.worker_records import RecordWriter, recording_outcome

METHODS = ("p2p", "device_put")
DEFAULT_SIZES = (4, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.move_latency_worker", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the p<process>.jsonl record files")
    p.add_argument("--coordinator", help="host:port of process 0's coordinator (default: emulated cluster)")
    p.add_argument("--process-id", type=int, default=0, help="with --coordinator: this process's index")
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="bytes per move")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--repeat", type=int, default=20, help="timed calls per size and method")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for each barrier and wait for a result")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import jax

    if args.coordinator:
        import meshpar.distributed

        jax.config.update("jax_num_cpu_devices", 1)
        meshpar.distributed.initialize(args.coordinator, 2, args.process_id, timeout_s=args.timeout,
                                       initialization_timeout=max(1, int(args.timeout)))
    else:
        from benchmarks.emulated_cluster import initialize_from_env

        initialize_from_env()  # before anything touches a JAX backend
    me = jax.process_index()
    out = RecordWriter(args.out, me)
    recording_outcome(lambda: _run(args, out), out, me)
    jax.distributed.shutdown()
    return 0


def _dtype(nbytes: int):
    import numpy as np

    return np.dtype(np.uint8 if nbytes % 4 else np.float32)


def payload(nbytes: int, call: int):
    """Call ``call``'s source values: ``nbytes`` of float32 (uint8 unless a multiple of 4),
    every element distinct from its neighbours and from the previous call's."""
    import numpy as np

    if nbytes % 4:
        return ((np.arange(nbytes, dtype=np.int64) + call) % 251).astype(np.uint8)
    # Below 2**24 (float32 counts exactly there) for any call number that fits a run.
    return ((np.arange(nbytes // 4, dtype=np.int64) % (1 << 23)) + call).astype(np.float32)


def _barrier(timeout_s: float) -> Callable[[str], None]:
    from meshpar.passes import jax_ir

    client = jax_ir.distributed_client()

    def barrier(name: str) -> None:
        client.wait_at_barrier(f"meshpar-move-latency/{name}", int(timeout_s * 1000))

    return barrier


def _on_process(p: int):
    """A one-device mesh sharding on process ``p``'s first device."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    device = min((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)
    return NamedSharding(Mesh(np.array([device]), ("d",)), P())


def _run(args: argparse.Namespace, out: RecordWriter) -> None:
    import jax
    import numpy as np

    import meshpar
    from meshpar.runtime.remote import absent

    if jax.process_count() != 2:
        raise RuntimeError(f"move_latency needs 2 processes, this job has {jax.process_count()}")
    me = jax.process_index()
    src, dst = _on_process(0), _on_process(1)
    barrier = _barrier(args.timeout)
    calls = {
        "p2p": lambda x: meshpar.reshard(x, dst, executor="p2p", timeout_s=args.timeout),
        "device_put": lambda x: jax.device_put(x, dst),
    }
    for nbytes in args.sizes:
        dtype = _dtype(nbytes)
        shape = (nbytes // dtype.itemsize,)

        def build(call: int) -> jax.Array:
            if me != 0:
                return absent(shape, dtype, src)
            return jax.device_put(payload(nbytes, call), src).block_until_ready()

        for method in args.methods:
            tag = f"{nbytes}/{method}"
            times, checks = [], []
            for call in range(args.repeat + 1):
                x = build(call)
                barrier(f"{tag}/{call}/go")
                t0 = time.perf_counter()
                y = ready(calls[method](x), args.timeout, tag)
                times.append(time.perf_counter() - t0)
                barrier(f"{tag}/{call}/done")
                checks += [np.array_equal(np.asarray(s.data), payload(nbytes, call)) for s in y.addressable_shards]
                del x, y
            out.write({
                "kind": "move", "bytes": nbytes, "dtype": dtype.name, "method": method, "process": me,
                "role": "src" if me == 0 else "dst", "warmup_s": times[0], "times": times[1:],
                "verified": all(checks) if checks else None, "checked": len(checks),
            })


if __name__ == "__main__":
    sys.exit(main())
