"""One process of a job started with plain ``jax.distributed.initialize``: a p2p move across
processes must fail with a message naming ``meshpar.distributed.initialize``.

python mp_no_transfer_server_worker.py PID NUM_PROCESSES PORT
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshpar  # noqa: E402

mine = [[d for d in jax.devices() if d.process_index == p] for p in range(nproc)]
src = NamedSharding(Mesh(np.array(mine[0]), ("x",)), P("x"))
dst = NamedSharding(Mesh(np.array(mine[1]), ("x",)), P())
x = jax.make_array_from_callback((4,), src, lambda index: np.zeros(4, np.float32)[index], dtype=np.float32)
try:
    meshpar.reshard(x, dst)
    raise AssertionError("a cross-process p2p move went ahead without a transfer server")
except RuntimeError as e:
    assert "meshpar.distributed.initialize" in str(e), e
    print(f"process {pid}: clear error: {str(e)[:100]}", flush=True)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
