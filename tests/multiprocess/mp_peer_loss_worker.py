"""One process of the peer-loss test: python mp_peer_loss_worker.py PID NUM_PROCESSES PORT MODE.

A two-stage MLP pipeline, one stage per process, with timeout_s = TIMEOUT_S. Both processes run
one step; then process 1 goes, MODE saying how: ``kill`` (SIGKILL) or ``stop`` (SIGSTOP, a frozen
process), printing ``process 1: gone at <time.time()>`` first. Process 0 runs a second step and
prints what it raised, then leaves as any program would, through JAX's exit handlers; the test
times that exit.
"""

import os
import signal
import sys
import time

import jax

import meshpar.distributed

TIMEOUT_S = 10

jax.config.update("jax_num_cpu_devices", 1)
pid, nproc, port, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout_s=TIMEOUT_S, initialization_timeout=60)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.mlp import MLP  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from meshpar.runtime.coordination import kv_client  # noqa: E402
from pipeline_models import make_state, mse  # noqa: E402

rng = np.random.default_rng(0)
batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
with jax.default_device(jax.local_devices()[0]):
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=2), batch["x"][:1])
step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(1, 1), timeout_s=TIMEOUT_S))
jax.block_until_ready(step(state, batch))
print(f"process {pid}: first step done", flush=True)

client = kv_client()
if pid == 1:
    # Leave only once process 0 has its first step's outputs: under load it may still be pulling
    # the shared loss from this process, and the test is about a peer lost in the second step.
    client.blocking_key_value_get("peer_loss/first_done", 60_000)
    client.key_value_set("peer_loss/going", mode)
    print(f"process 1: gone at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGSTOP)
    time.sleep(600)  # a stopped process stays here until the test kills it

client.key_value_set("peer_loss/first_done", "1")
client.blocking_key_value_get("peer_loss/going", 60_000)
time.sleep(0.5)  # a killed peer's sockets are closed by then
start = time.monotonic()
try:
    jax.block_until_ready(step(state, batch))
    print("process 0: the second step returned without its peer", flush=True)
except Exception as e:
    print(f"process 0: {type(e).__name__} after {time.monotonic() - start:.1f} s: {e}", flush=True)
    raise
