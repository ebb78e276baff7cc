"""One process of the public-train-step test: python mp_public_lm_worker.py PID NPROC PORT SCHEDULE.

flax's lm1b pattern (``examples/flax_lm.py``: weights from the padding computed outside the
loss function, the loss divided by the batch's token count inside it, the metrics computed
outside it from the logits), on two processes of 4 CPU devices, a (data=2, model=2) mesh each,
under SCHEDULE (1F1B: 2 stages; ZB-V: 4 stages, 2 per mesh) with 4 micro-batches. Each process
feeds only its own 8 of the 16 rows as a global ``jax.Array``. Three steps against ``jax.jit``
on one local device over the full batch: the loss (the metrics' loss over their token count)
read on both processes, then every parameter shard each process holds. Only the first step
compiles: each step prints how many programs XLA compiled while it ran (the state the first
step returns spans both processes, where the state made on the host did not).
"""

import sys
import time

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port, schedule = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshpar  # noqa: E402
from examples import flax_lm as lm  # noqa: E402
from pipeline_models import assert_local_shards_close  # noqa: E402

STEPS = 3
compiles = [0]


def count_compile(event: str, duration_s: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        compiles[0] += 1


jax.monitoring.register_event_duration_secs_listener(count_compile)

V = 2 if schedule == "zb_v" else 1
batches = [lm.lm_batch(step) for step in range(STEPS)]
with jax.default_device(jax.local_devices()[0]):
    state = lm.make_state(lm.PaddedLM(num_blocks=2 * V), batches[0]["inputs"][:1])
    ref_state, want = state, []
    for batch in batches:
        ref_state, metrics = jax.jit(lm.train_step)(ref_state, batch)
        want.append(float(metrics["loss"] / metrics["denominator"]))

rows = NamedSharding(Mesh(np.array(jax.devices()), ("rows",)), P("rows"))
mine = slice(8 * pid, 8 * (pid + 1))
parallel = meshpar.parallelize(lm.train_step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2 * V, stage_mesh_shape=(2, 2), schedule=schedule, stages_per_mesh=V,
    logical_axis_rules=lm.LOGICAL_AXIS_RULES))
par_state = state
start = time.perf_counter()
for i, (batch, loss) in enumerate(zip(batches, want)):
    global_batch = {k: jax.make_array_from_process_local_data(rows, v[mine], v.shape) for k, v in batch.items()}
    compiled_before = compiles[0]
    par_state, metrics = parallel(par_state, global_batch)
    got = float(metrics["loss"] / metrics["denominator"])
    np.testing.assert_allclose(got, loss, rtol=1e-5)
    print(f"process {pid}: step {i} loss {got:.6f} matches, {compiles[0] - compiled_before} programs compiled",
          flush=True)
print(f"process {pid}: {STEPS} steps in {time.perf_counter() - start:.1f} s (first compiles)", flush=True)
checked = assert_local_shards_close(par_state.params, ref_state.params, rtol=1e-4, atol=1e-4)
assert checked > 0, "this process holds no parameters"
print(f"process {pid}: {checked} parameter shards match", flush=True)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
