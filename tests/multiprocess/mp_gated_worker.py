"""One process of the three-process round-gate test: python mp_gated_worker.py PID 3 PORT.

Three processes of 4 CPU devices, meshes laid so that consecutive plan rounds send into a
host from different hosts (the moves ``passes.round_gates`` gates): every gated move must equal
numpy bit for bit, ungated and host-waited ("rounds") ones too, and the gated plans must hold
gates. Prints ``process PID: ALL OK`` when every check passed.
"""

import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60, timeout_s=60)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshpar  # noqa: E402
from meshpar.reshard import prepare_reshard  # noqa: E402

by_process = [[d for d in jax.devices() if d.process_index == p] for p in range(nproc)]
# (source rows, destination rows) per layout; hosts are processes.
LAYOUTS = {
    "two sources, two destinations": ([by_process[0][:2], by_process[1][:2]], [by_process[1][2:], by_process[2][:2]]),
    "one source host, two destinations": ([by_process[0][:2], by_process[0][2:]], [by_process[1][:2], by_process[2][:2]]),
    "two sources, one destination host": ([by_process[0][:2], by_process[1][:2]], [by_process[2][:2], by_process[2][2:]]),
}
CASES = [("two sources, two destinations", P(), P("x", "y"), "broadcast"),
         ("two sources, two destinations", P(None, ("x", "y")), P("y"), "send_recv"),
         ("one source host, two destinations", P(), P("y", "x"), "broadcast"),
         ("one source host, two destinations", P(None, ("x", "y")), P("y"), "send_recv"),
         ("two sources, one destination host", P("x"), P(None, ("x", "y")), "broadcast")]
gated = 0
for layout, src_spec, dst_spec, strategy in CASES:
    src_rows, dst_rows = LAYOUTS[layout]
    src = NamedSharding(Mesh(np.array(src_rows), ("x", "y")), src_spec)
    dst = NamedSharding(Mesh(np.array(dst_rows), ("x", "y")), dst_spec)
    for shape, dtype in (((8, 8), np.float32), ((12, 20), np.int32)):
        expected = (np.arange(np.prod(shape)) % 251).reshape(shape).astype(dtype)
        x = jax.make_array_from_callback(shape, src, lambda index: expected[index], dtype=expected.dtype)
        for order in ("gated", "eager", "rounds"):
            executable, _ = prepare_reshard(shape, dtype, src, dst, strategy=strategy, order=order)
            gated += order == "gated" and bool(executable.gates)
            for _ in range(2):
                y = meshpar.reshard(x, dst, strategy=strategy, order=order, timeout_s=60)
                assert y.sharding == dst
                for shard in y.addressable_shards:
                    np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
        print(f"process {pid}: {layout} {src_spec} -> {dst_spec} {strategy} {shape} ok", flush=True)
assert gated >= len(CASES), f"only {gated} gated moves had gates"
print(f"process {pid}: ALL OK", flush=True)
