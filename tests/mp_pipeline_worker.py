"""One process of the two-process pipeline test: python mp_pipeline_worker.py PID NUM_PROCESSES PORT.

(data, model, pipeline) = (2, 2, 2): stage 0's mesh is process 0's four devices, stage 1's
process 1's. Each process checks the parameters it holds, and the loss where it lives,
against the same step under jax.jit on one local device.
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 4)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid, initialization_timeout=60)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from pipeline_models import make_state, make_step  # noqa: E402

model = GPT(num_stages=2)
batch = gpt_batch(0, 16, 8, 64)
local = jax.local_devices()[0]
with jax.default_device(local):
    state = make_state(model, batch["x"][:1])
    step = make_step(gpt_loss)
    reference = jax.jit(step)
    ref_state, ref_losses = state, []
    for _ in range(3):
        ref_state, loss = reference(ref_state, batch)
        ref_losses.append(float(loss))

parallel = meshpar.parallelize(
    step, method=meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2))
)
par_state = state
for i in range(3):
    par_state, loss = parallel(par_state, batch)
    if loss.is_fully_addressable:
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
        print(f"process {pid}: step {i} loss {float(loss):.6f} matches", flush=True)

checked = 0
for got, want in zip(jax.tree.leaves(par_state.params), jax.tree.leaves(ref_state.params)):
    for shard in got.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-5, atol=1e-5)
        checked += 1
assert checked > 0, "this process holds no parameters"
print(f"process {pid}: {checked} parameter shards match", flush=True)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
