"""One process of the multi-process reshard test: python mp_reshard_worker.py PID NUM_PROCESSES PORT.

Prints one line per check and exits 0 when every check passed.
"""

import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshpar  # noqa: E402
from meshpar.runtime.coordination import CoordinationError  # noqa: E402

by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(nproc)]
checks = 0


def check(y, expected, dst):
    global checks
    assert y.sharding == dst
    expected = np.asarray(expected)
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    checks += 1


def run(src_devices, dst_devices, src_spec, dst_spec, shape, dtype, **kwargs):
    src = NamedSharding(Mesh(np.array(src_devices).reshape(2, -1), ("x", "y")), src_spec)
    dst = NamedSharding(Mesh(np.array(dst_devices).reshape(2, -1), ("x", "y")), dst_spec)
    expected = (np.arange(np.prod(shape)) % 251).reshape(shape).astype(dtype)
    x = jax.make_array_from_callback(shape, src, lambda index: expected[index], dtype=expected.dtype)
    y = meshpar.reshard(x, dst, **kwargs)
    check(y, expected, dst)


# Source mesh on process 0, destination on process 1: every byte crosses processes.
half = [by_process[0][:2] + by_process[1][:2], by_process[0][2:] + by_process[1][2:]]
for executor in ("p2p", "collective"):
    for strategy in meshpar.STRATEGIES:
        for src_spec, dst_spec in [(P("x"), P(None, "y")), (P(None, ("x", "y")), P()), (P(), P(("x", "y")))]:
            run(by_process[0], by_process[1], src_spec, dst_spec, (8, 8, 2), np.float32, strategy=strategy,
                executor=executor)
    for dtype in (jnp.bfloat16, np.int8, np.bool_, np.uint32, np.float16):
        run(by_process[0], by_process[1], P("x", "y"), P("y"), (4, 6), dtype, chunks=3, executor=executor)
    # Meshes spanning both processes (two devices of each on either side).
    for strategy in meshpar.STRATEGIES:
        run(half[0], half[1], P("x"), P(None, "x"), (8, 8), np.float32, strategy=strategy, executor=executor)
        run(half[1], half[0], P(("x", "y")), P("y", "x"), (8, 8), np.int32, strategy=strategy, executor=executor)
# p2p extras: gated rounds, a destination within the sender's own process, uneven chunks, scalars.
run(by_process[0], by_process[1], P("x"), P(None, "y"), (8, 10), np.float32, order="rounds", chunks=3)
run(half[0], half[1], P(None, "y"), P("x"), (6, 14), np.float32, chunks=4)
run(by_process[1], by_process[0], P("x", "y"), P(), (6, 10), np.int32, strategy="send_recv")
scalar_src = NamedSharding(Mesh(np.array(by_process[0][:1]), ("x",)), P())
scalar_dst = NamedSharding(Mesh(np.array(half[1]).reshape(2, 2), ("x", "y")), P())
s = jax.make_array_from_callback((), scalar_src, lambda index: np.float32(7.5), dtype=np.float32)
check(meshpar.reshard(s, scalar_dst), np.float32(7.5), scalar_dst)
print(f"process {pid}: {checks} reshard checks passed", flush=True)

# A plan the processes disagree on fails fast on both sides, naming both plans.
src = NamedSharding(Mesh(np.array(by_process[0]).reshape(2, 2), ("x", "y")), P("x"))
dst = NamedSharding(Mesh(np.array(by_process[1]).reshape(2, 2), ("x", "y")), P(None, "y"))
x = jax.make_array_from_callback((8, 8), src, lambda index: np.zeros((8, 8), np.float32)[index], dtype=np.float32)
try:
    meshpar.reshard(x, dst, strategy="broadcast" if pid == 0 else "send_recv", timeout_s=30)
    raise AssertionError("a mismatched plan was executed")
except CoordinationError as e:
    assert "disagree" in str(e) and "send_recv" in str(e) and "broadcast" in str(e), e
    print(f"process {pid}: mismatch raised: {str(e)[:120]}", flush=True)

# A call the other process never makes times out with a message instead of hanging.
shape = (8, 8) if pid == 0 else (16, 8)
x = jax.make_array_from_callback(shape, src, lambda index: np.zeros(shape, np.float32)[index], dtype=np.float32)
try:
    meshpar.reshard(x, dst, timeout_s=3)
    raise AssertionError("an unmatched call went ahead")
except CoordinationError as e:
    assert "did not reach the same call within 3 s" in str(e), e
    print(f"process {pid}: unmatched call timed out: {str(e)[:120]}", flush=True)

print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
