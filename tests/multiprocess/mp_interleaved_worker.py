"""One process of the two-process virtual-stages test:
python mp_interleaved_worker.py PID NUM_PROCESSES PORT [--every-case] (without it, DualPipeV
only: interleaved 1F1B and ZB-V are left to the slow run).

Each process owns four devices. Interleaved 1F1B runs GPT in 4 stages on 2 meshes (one per
process: every move between consecutive stages crosses processes, p2p), and U-Transformer in 8
stages on 4 meshes (two per process: moves inside a process and across); ZB-V runs GPT on 2
meshes in a V (both arms cross processes, its turn stays inside one), and so does DualPipeV. Each process checks the loss where it lives and every
parameter shard it holds against the same step under jax.jit on one local device.
"""

import os
import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
every_case = "--every-case" in sys.argv[4:]  # else the cases CI's default run covers
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)


import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from examples.u_transformer import UTransformer, ut_batch, ut_loss  # noqa: E402
from meshpar.passes.program.moves import TransferKind
from meshpar.runtime.coordination import kv_client  # noqa: E402
from pipeline_models import assert_steps_match, make_state  # noqa: E402

local = jax.local_devices()[0]
cases = [("dualpipev", "gpt", GPT(num_stages=4), gpt_batch(0, 16, 8, 64), gpt_loss, 2, (2, 2))]
if every_case:
    cases += [("interleaved_1f1b", "gpt", GPT(num_stages=4), gpt_batch(0, 16, 8, 64), gpt_loss, 2, (2, 2)),
              ("interleaved_1f1b", "ut", UTransformer(num_stages=8), ut_batch(0, 16), ut_loss, 4, (2, 1)),
              ("zb_v", "gpt", GPT(num_stages=4), gpt_batch(0, 16, 8, 64), gpt_loss, 2, (2, 2))]
for schedule, name, model, batch, loss, num_meshes, shape in cases:
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
    par_state, checked = assert_steps_match(parallel, state, batch, ref_state, ref_losses)
    kinds = {t.kind for t in parallel.get_executable(par_state, batch).program.transfers}
    assert TransferKind.P2P in kinds and (schedule == "interleaved_1f1b" or TransferKind.LOCAL in kinds), kinds
    print(f"process {pid}: {schedule} {name} on {num_meshes} meshes matches ({checked} shards, moves "
          f"{sorted(k.value for k in kinds)})", flush=True)
print(f"process {pid}: ALL OK", flush=True)
# No process leaves while a peer may still read from it.
kv_client().wait_at_barrier("mp_interleaved_worker/done", 120_000)
os._exit(0)
