"""One process of the two-process scanned-stack test: python mp_scanned_worker.py PID NUM_PROCESSES PORT.

A GPT whose 8 blocks are one nn.scan, cut inside the scan into 2 stages, one per process (each
stage mesh (2, 2) on its process's four devices): evenly (4 + 4: each stack comes back as one
array over both processes' devices) and unevenly (3 + 5: gathered on process 0's mesh by
cross-process moves), Adam after global-norm clipping. Each process checks every shard it holds
of the state, and the loss where it lives, against jax.jit on one local device.
"""

import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from meshpar.passes.pipeline.stacked_leaves import STACK_AXIS  # noqa: E402
from pipeline_models import assert_local_shards_close  # noqa: E402

model = GPT(scan_layers=True, num_layers=8)
batch = gpt_batch(0, 16, model.seq_len, model.vocab_size)
step = supervised_step(gpt_loss)
with jax.default_device(jax.local_devices()[0]):
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-5))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    ref_state, ref_losses = state, []
    for _ in range(2):
        ref_state, loss = jax.jit(step)(ref_state, batch)
        ref_losses.append(float(loss))

for name, options in (("4 + 4", dict(num_stages=2)), ("3 + 5", dict(auto_layers=8, cut_points=(2,)))):
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=2, stage_mesh_shape=(2, 2), **options))
    par_state = state
    for i in range(2):
        par_state, loss = parallel(par_state, batch)
        if loss.is_fully_addressable:
            np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    checked = assert_local_shards_close(par_state, ref_state)
    kernel = par_state.params["params"]["blocks"]["stack"]["block"]["mlp_up"]["kernel"].value
    spans = STACK_AXIS in kernel.sharding.mesh.axis_names and len({d.process_index for d in kernel.sharding.device_set}) == 2
    assert spans == (name == "4 + 4"), (name, kernel.sharding)
    print(f"process {pid}: scanned GPT cut {name} matches ({checked} shards)", flush=True)
print(f"process {pid}: ALL OK", flush=True)
