"""One process of a job started by a real launcher: mpirun ... python mp_mpirun_worker.py DEVICES.

DEVICES CPU devices per process, 8 in the job: ``meshpar.distributed.initialize()`` finds the
coordinator, the job's size and this process's index from mpirun's variables alone. A 2-layer
GPT trains three steps under 1F1B on two (data, model) = (2, 2) stage meshes: with 4 devices per
process each stage is one process's, with 2 each stage spans two processes along its data axis.
Every process reads each step's loss and checks it against the same steps under jax.jit on one
local device, then every parameter shard it holds; it prints its launch and step times (for
BENCHMARKS.md, "Launchers").
"""

import sys
import time

import jax

import meshpar.distributed

started = time.perf_counter()
devices = int(sys.argv[1])
jax.config.update("jax_num_cpu_devices", devices)
meshpar.distributed.initialize(timeout_s=60, initialization_timeout=60)
pid, nproc = jax.process_index(), jax.process_count()
assert jax.device_count() == 8 == devices * nproc, (jax.device_count(), devices, nproc)
joined = time.perf_counter() - started
print(f"process {pid}: joined as process {pid} of {nproc} with {devices} devices each "
      f"in {joined:.2f} s", flush=True)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import assert_local_shards_close, make_state  # noqa: E402

model = GPT(num_stages=2, num_layers=2)
batch = gpt_batch(0, 16, model.seq_len, model.vocab_size)
step = supervised_step(gpt_loss)
with jax.default_device(jax.local_devices()[0]):
    state = make_state(model, batch["x"][:1])
    ref_state, ref_losses = state, []
    for _ in range(3):
        ref_state, loss = jax.jit(step)(ref_state, batch)
        ref_losses.append(float(loss))

parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), schedule="1f1b", timeout_s=60))
t0 = time.perf_counter()
executable = parallel.get_executable(state, batch)
compiled = time.perf_counter() - t0
for stage, mesh in enumerate(executable.stage_meshes):
    spanned = sorted({d.process_index for d in mesh.devices.flat})
    # 4 devices a stage: one process's when it has 4, two processes' when each has 2.
    assert len(spanned) == 4 // devices, (stage, mesh.devices)
    print(f"process {pid}: stage {stage} on processes {spanned}", flush=True)

step_s = []
for i, want in enumerate(ref_losses):
    t0 = time.perf_counter()
    state, loss = parallel(state, batch)
    got = float(loss)
    step_s.append(time.perf_counter() - t0)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    print(f"process {pid}: step {i} loss {got:.6f} matches jax.jit", flush=True)
checked = assert_local_shards_close(state.params, ref_state.params, rtol=1e-4)
assert checked > 0, "this process holds no parameters"
print(f"process {pid}: {checked} parameter shards match", flush=True)
print(f"process {pid}: times: initialize {joined:.2f} s, compile {compiled:.2f} s, steps "
      + ", ".join(f"{1e3 * s:.0f}" for s in step_s) + " ms", flush=True)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
