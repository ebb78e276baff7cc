"""One process of the four-process test: python mp_four_worker.py PID NUM_PROCESSES PORT.

4 processes x 2 CPU devices, (data, model, pipeline) = (2, 2, 2): each stage mesh spans two
processes, its data axis across them and its model axis inside one. A GPT with tied
embeddings (the embedding read by both stages, its gradient sent home) trains two steps
with each gradient reduction against the same steps under jax.jit on one local device: the
loss read on every process, every parameter shard held here; once with the same numpy batch
on every process, once with each process feeding only its own quarter as a global array.
"""

import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 2)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import assert_steps_match, make_state  # noqa: E402

assert jax.device_count() == 8, jax.devices()
model = GPT(num_stages=2, num_layers=2, tie_embeddings=True)
batch = gpt_batch(0, 16, model.seq_len, model.vocab_size)
step = supervised_step(gpt_loss)
with jax.default_device(jax.local_devices()[0]):
    state = make_state(model, batch["x"][:1])
    ref_state, ref_losses = state, []
    for _ in range(2):
        ref_state, loss = jax.jit(step)(ref_state, batch)
        ref_losses.append(float(loss))


def check(name, feed):
    _, checked = assert_steps_match(parallel, state, feed, ref_state, ref_losses)
    print(f"process {pid}: {name} matches ({checked} shards)", flush=True)


# Each process its own quarter of the rows, as a global batch over every device.
rows = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("rows",)),
                                  jax.sharding.PartitionSpec("rows"))
mine = slice(4 * pid, 4 * (pid + 1))
global_batch = {k: jax.make_array_from_process_local_data(rows, v[mine], v.shape) for k, v in batch.items()}
for reduction, feed, fed in (("per_step", batch, "the same numpy batch"),
                             ("per_micro_batch", global_batch, "a global batch fed by its four processes")):
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), gradient_reduction=reduction))
    mesh = parallel.get_executable(state, feed).stage_meshes[0]
    assert len({d.process_index for d in mesh.devices[:, 0]}) == 2, mesh.devices
    check(f"gradient_reduction={reduction}, {fed},", feed)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
