"""One process of the overlap test: python mp_overlap_worker.py PID NUM_PROCESSES PORT.

The pipeline's pattern: process 0 (the sender, stage 0) dispatches a move of x to process 1's
mesh and then a compute of its own; process 1 (the receiver) is still busy with its own work
and joins the move only after process 0's compute has finished (it waits for process 0's word,
bounded). With p2p moves the sender's compute finishes meanwhile; the collective executor is a
rendezvous of both meshes, so the sender's compute queues behind it until the receiver arrives.
No timing thresholds: the sender's compute either finishes within a bounded wait or it does not.
"""

import sys
import threading

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshpar  # noqa: E402
from meshpar.runtime.coordination import kv_client  # noqa: E402

by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(nproc)]
src_mesh = Mesh(np.array(by_process[0]).reshape(2, 2), ("x", "y"))
dst_mesh = Mesh(np.array(by_process[1]).reshape(2, 2), ("x", "y"))
src, dst = NamedSharding(src_mesh, P("x")), NamedSharding(dst_mesh, P(None, "y"))
expected = (np.arange(256 * 256) % 251).astype(np.float32).reshape(256, 256)
x = jax.make_array_from_callback(expected.shape, src, lambda index: expected[index], dtype=np.float32)
compute = jax.jit(lambda a: (a @ a.T).sum(), out_shardings=NamedSharding(src_mesh, P()))
client = kv_client()
WAIT_S = {"p2p": 20.0, "collective": 5.0}

for executor in ("p2p", "collective"):
    # Plan agreement and compilation first, together, so the timed part is
    # only the move itself.
    warm = meshpar.reshard(x, dst, executor=executor)
    jax.block_until_ready(warm)
    if pid == 0:
        jax.block_until_ready(compute(x))
    client.wait_at_barrier(f"overlap/{executor}/warm", 60_000)
    if pid == 0:
        # The sender's program runs in a thread: a collective move may block
        # the thread that dispatches it until the receiver joins.
        finished = threading.Event()

        def sender() -> None:
            meshpar.reshard(x, dst, executor=executor)
            jax.block_until_ready(compute(x))
            finished.set()

        thread = threading.Thread(target=sender, daemon=True)
        thread.start()
        if finished.wait(WAIT_S[executor]):
            print(f"process 0: {executor}: sender compute finished while the receiver was busy", flush=True)
        else:
            print(f"process 0: {executor}: sender compute waited for the receiver", flush=True)
        client.key_value_set(f"overlap/{executor}/go", "1")
        thread.join(120)
        assert finished.is_set(), "the sender's compute never finished"
    else:
        client.blocking_key_value_get(f"overlap/{executor}/go", 120_000)  # busy with "its own work"
        y = meshpar.reshard(x, dst, executor=executor)
        for shard in y.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
        print(f"process 1: {executor}: the move delivered every shard", flush=True)
    client.wait_at_barrier(f"overlap/{executor}/end", 120_000)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
