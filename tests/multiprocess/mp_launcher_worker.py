"""One process of a job a launcher started: python mp_launcher_worker.py [MODE].

The job's coordinator, size and this process's index come from the launcher's environment
(SLURM's, Open MPI's: real or set by tests/multiprocess/test_launchers.py), never from arguments. MODE:

- ``meshpar`` (default): ``meshpar.distributed.initialize()`` with no arguments;
- ``jax_then_meshpar``: ``jax.distributed.initialize()``, then ``meshpar.distributed.initialize()``
  (refused first with a job size the job does not have);
- ``jax_only``: ``jax.distributed.initialize()`` alone: the step must fail naming the exact
  ``meshpar.distributed.initialize(...)`` line to call instead.

Then a 2-stage pipelined MLP step (one stage per process) against ``jax.jit``'s, the loss read on
both processes.
"""

import os
import sys

import jax

# Under a real mpirun nothing sets PYTHONPATH: the examples live at the repository's root.
sys.path[1:1] = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                 os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]

import meshpar.distributed  # noqa: E402
from meshpar.passes import jax_ir  # noqa: E402

MODES = ("meshpar", "jax_then_meshpar", "jax_only")
mode = sys.argv[1] if len(sys.argv) > 1 else "meshpar"
if mode not in MODES:
    raise SystemExit(f"MODE: expected one of {MODES}, got {mode!r}")

jax.config.update("jax_num_cpu_devices", 4)
if mode == "meshpar":
    meshpar.distributed.initialize(timeout_s=60, initialization_timeout=60)
else:
    jax.distributed.initialize(initialization_timeout=60)
    if mode == "jax_then_meshpar":
        try:
            meshpar.distributed.initialize(num_processes=3)
            raise AssertionError("meshpar.distributed.initialize changed the size of a joined job")
        except ValueError as e:
            assert "already joined its job" in str(e) and "num_processes=3" in str(e), e
            print("refused to change the joined job", flush=True)
        meshpar.distributed.initialize()
coordinator, nproc, pid = jax_ir.distributed_params()
print(f"process {pid}: joined {coordinator} as process {pid} of {nproc} with {jax.device_count()} devices",
      flush=True)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.mlp import MLP, mlp_batch, mlp_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import assert_local_shards_close, make_state  # noqa: E402

batch = mlp_batch(0, 16, 6, 4)
with jax.default_device(jax.local_devices()[0]):
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=2), batch["x"][:1])
    step = supervised_step(mlp_loss)
    want_state, want_loss = jax.jit(step)(state, batch)
parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
    num_micro_batches=2, num_stages=2, stage_mesh_shape=(4, 1), timeout_s=60))

if mode == "jax_only":
    line = f"meshpar.distributed.initialize(coordinator_address={coordinator!r}, num_processes={nproc}, " \
           f"process_id={pid})"
    try:
        parallel(state, batch)
        raise AssertionError("a pipelined step moved data across processes without a transfer server")
    except RuntimeError as e:
        assert line in str(e), e
        assert "jax_cross_host_transfer_socket_address" in str(e), e
        print(f"process {pid}: error names {line}", flush=True)
else:
    got_state, loss = parallel(state, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    print(f"process {pid}: loss {float(loss):.6f} matches jax.jit", flush=True)
    assert assert_local_shards_close(got_state.params, want_state.params) > 0, "this process holds no parameters"
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
