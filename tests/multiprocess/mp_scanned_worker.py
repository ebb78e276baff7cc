"""One process of the two-process scanned-stack test:
python mp_scanned_worker.py PID NUM_PROCESSES PORT [--every-case] (without it, the 3 + 5 cut and
the remat case are left to the slow run).

A GPT whose 8 blocks are one nn.scan, cut inside the scan into 2 stages, one per process (each
stage mesh (2, 2) on its process's four devices): evenly (4 + 4: each stack comes back as one
array over both processes' devices) and unevenly (3 + 5: gathered on process 0's mesh by
cross-process moves), Adam after global-norm clipping; then into 4 stages of (1, 2) meshes with
nn.remat in the scanned body and SGD; an nnx.scan stack; a hand-written lax.scan over a stacked
array cut 3 + 2. Each process checks every shard it holds of the state, and the loss where it
lives, against jax.jit (nnx.jit) on one local device.
"""

import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
every_case = "--every-case" in sys.argv[4:]  # else the cases CI's default run covers
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from flax.training import train_state  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from meshpar.passes.program.stacked_leaves import STACK_AXIS
from pipeline_models import NnxScannedStack, assert_local_shards_close, nnx_mse_step  # noqa: E402

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

cuts = [("4 + 4", dict(num_stages=2))] + ([("3 + 5", dict(auto_layers=8, cut_points=(2,)))] if every_case else [])
for name, options in cuts:
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=2, stage_mesh_shape=(2, 2), **options))
    par_state = state
    for i in range(2):
        par_state, loss = parallel(par_state, batch)
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    checked = assert_local_shards_close(par_state, ref_state)
    kernel = par_state.params["params"]["blocks"]["stack"]["block"]["mlp_up"]["kernel"].value
    spans = STACK_AXIS in kernel.sharding.mesh.axis_names and len({d.process_index for d in kernel.sharding.device_set}) == 2
    assert spans == (name == "4 + 4"), (name, kernel.sharding)
    print(f"process {pid}: scanned GPT cut {name} matches ({checked} shards)", flush=True)


def check(name, step, state, batch, method, steps=2):
    with jax.default_device(jax.local_devices()[0]):
        ref_state, ref_losses = state, []
        for _ in range(steps):
            ref_state, loss = jax.jit(step)(ref_state, batch)
            ref_losses.append(float(loss))
    parallel = meshpar.parallelize(step, method=method)
    par_state = state
    for i in range(steps):
        par_state, loss = parallel(par_state, batch)
        np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    checked = assert_local_shards_close(par_state, ref_state)
    print(f"process {pid}: {name} matches ({checked} shards)", flush=True)


if every_case:
    remat = GPT(scan_layers=True, num_layers=8, remat_blocks=True)
    with jax.default_device(jax.local_devices()[0]):
        remat_state = train_state.TrainState.create(
            apply_fn=remat.apply, params=remat.init(jax.random.PRNGKey(0), batch["x"][:1]), tx=optax.sgd(0.1))
    check("scanned GPT with remat cut into 4 stages (SGD)", step, remat_state, batch,
          meshpar.PipeshardParallel(num_micro_batches=2, num_stages=4, stage_mesh_shape=(1, 2)))

rng = np.random.default_rng(1)
small = {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
layers = {"w": (rng.standard_normal((5, 8, 8)) / 3).astype(np.float32), "b": np.zeros((5, 8), np.float32)}
lax_params = {"layers": layers, "out": (rng.standard_normal((8, 4)) / 3).astype(np.float32)}
adam = optax.adam(1e-2, eps=1e-5)


def lax_step(state, batch):
    params, opt_state = state

    def loss_fn(p):
        h, _ = jax.lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), batch["x"], p["layers"])
        return jnp.mean((h @ p["out"] - batch["y"]) ** 2)

    loss, grads = meshpar.value_and_grad(loss_fn)(params)
    updates, opt_state = adam.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), loss


with jax.default_device(jax.local_devices()[0]):
    lax_state = (lax_params, adam.init(lax_params))
check("hand-written lax.scan cut 3 + 2", lax_step, lax_state, small,
      meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2)))


def make_nnx():
    with jax.default_device(jax.local_devices()[0]):
        model = NnxScannedStack(8, 4, nnx.Rngs(0))
        return model, nnx.Optimizer(model, adam, wrt=nnx.Param)


model, optimizer = make_nnx()
ref_model, ref_optimizer = make_nnx()
nnx_parallel = meshpar.parallelize(nnx_mse_step, method=meshpar.PipeshardParallel(
    num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2), batch_argnums=(2,)))
for _ in range(2):
    loss = nnx_parallel(model, optimizer, small)
    with jax.default_device(jax.local_devices()[0]):
        ref_loss = nnx.jit(nnx_mse_step)(ref_model, ref_optimizer, small)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
checked = assert_local_shards_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
checked += assert_local_shards_close(nnx.state(optimizer, nnx.OptState), nnx.state(ref_optimizer, nnx.OptState))
print(f"process {pid}: nnx.scan stack cut into 2 stages matches ({checked} shards)", flush=True)
print(f"process {pid}: ALL OK", flush=True)
