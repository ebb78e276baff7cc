"""One process of the two-process V-schedule test: python mp_v_schedule_worker.py PID NUM_PROCESSES PORT.

Each process owns four devices. ZB-V runs GPT in 4 stages on 2 meshes (one per process: stages
0 and 3 on process 0, 1 and 2 on process 1, so both arms of the V cross processes and its turn
stays inside one), DualPipeV the U-Transformer in 8 stages on 4 meshes (two per process). Each
process checks the loss where it lives and every parameter shard it holds against the same step
under jax.jit on one local device.
"""

import os
import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from examples.u_transformer import UTransformer, ut_batch, ut_loss  # noqa: E402
from meshpar.passes.pipeline.edge_transfer import TransferKind  # noqa: E402
from pipeline_models import assert_local_shards_close, make_state  # noqa: E402

local = jax.local_devices()[0]
for schedule, name, model, batch, loss, num_meshes, shape in (
        ("zb_v", "gpt", GPT(num_stages=4), gpt_batch(0, 16, 8, 64), gpt_loss, 2, (2, 2)),
        ("dualpipev", "ut", UTransformer(num_stages=8), ut_batch(0, 16), ut_loss, 4, (2, 1))):
    step = supervised_step(loss)
    with jax.default_device(local):
        state = make_state(model, batch["x"][:1])
        ref_state, ref_losses = state, []
        for _ in range(2):
            ref_state, ref_loss = jax.jit(step)(ref_state, batch)
            ref_losses.append(float(ref_loss))
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=2 * num_meshes, num_stages=2 * num_meshes, stages_per_mesh=2, stage_mesh_shape=shape,
        schedule=schedule))
    par_state = state
    for i in range(2):
        par_state, par_loss = parallel(par_state, batch)
        if par_loss.is_fully_addressable:
            np.testing.assert_allclose(float(par_loss), ref_losses[i], rtol=1e-5)
    checked = assert_local_shards_close(par_state.params, ref_state.params)
    assert checked > 0, "this process holds no parameters"
    kinds = {t.kind for t in parallel.get_executable(par_state, batch).program.transfers}
    assert TransferKind.P2P in kinds and TransferKind.LOCAL in kinds, kinds
    print(f"process {pid}: {schedule} {name} on {num_meshes} meshes matches ({checked} shards, moves "
          f"{sorted(k.value for k in kinds)})", flush=True)
print(f"process {pid}: ALL OK", flush=True)
os._exit(0)
