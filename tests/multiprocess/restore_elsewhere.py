"""One process restoring the two-process checkpoint test's checkpoints under other layouts:
python restore_elsewhere.py DIRECTORY (the checkpoint; DIRECTORY.losses.npy its run's losses;
DIRECTORY-scanned and DIRECTORY-scanned.losses.npy the scanned GPT's).

Saved by 2 processes with 2 stages on (2, 2) meshes (mp_checkpoint_worker.py); restored here,
in one process with 8 CPU devices:
- the two-stage MLP under 2 stages on one device each, and into a plain jax.jit state on one device;
- the GPT whose 4 blocks are one nn.scan under 4 stages (one block each, on one device each),
  and into a plain jax.jit state on one device.
Each trains the steps after the checkpoint; their losses equal the uninterrupted run's to float
tolerance (another layout may reassociate sums).
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import TensorParallel, make_state, mse  # noqa: E402


def batch(seed):
    """mp_checkpoint_worker.py's batches."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}


def on_one_device(initial):
    """``initial``'s structure as a plain jax.jit state on one device."""
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
        np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype), sharding=one_device), initial)


def restore_and_train(name, checkpoint, abstract, run, batches, losses):
    """Restores ``checkpoint`` as ``abstract`` says, then runs ``run`` on ``batches``: every leaf
    where ``abstract`` puts it, every loss equal to ``losses``'."""
    state = meshpar.checkpoint.restore(checkpoint, abstract)
    for got, struct in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        assert got.sharding == struct.sharding, name
    for b, want in zip(batches, losses, strict=True):
        state, loss = run(state, b)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, err_msg=name)
    print(f"restored under {name}: the next steps match", flush=True)


directory = sys.argv[1]
losses = np.load(directory + ".losses.npy")
batches = [batch(seed) for seed in range(4)]
initial = make_state(TensorParallel(), batches[0]["x"][:1])
step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(1, 1), devices=jax.devices()[:2]))
restore_and_train("2 stages on one device each", directory, meshpar.checkpoint.state_shardings(
    step, initial, batches[0]), step, batches[2:], losses[2:])
restore_and_train("a jax.jit state on one device", directory, on_one_device(initial),
                  jax.jit(supervised_step(mse)), batches[2:], losses[2:])

# mp_checkpoint_worker.py's scanned GPT, saved after its first step.
scanned = GPT(scan_layers=True, num_layers=4)
gpt_batches = [gpt_batch(seed, 8, scanned.seq_len, scanned.vocab_size) for seed in range(3)]
gpt_losses = np.load(directory + "-scanned.losses.npy")
gpt_initial = make_state(scanned, gpt_batches[0]["x"][:1])
four_stages = meshpar.parallelize(supervised_step(gpt_loss), method=meshpar.PipeshardParallel(
    num_micro_batches=2, num_stages=4, stage_mesh_shape=(1, 1), devices=jax.devices()[:4]))
restore_and_train("4 stages on one device each (the scanned GPT)", directory + "-scanned",
                  meshpar.checkpoint.state_shardings(four_stages, gpt_initial, gpt_batches[0]), four_stages,
                  gpt_batches[1:], gpt_losses)
restore_and_train("a jax.jit state on one device (the scanned GPT)", directory + "-scanned",
                  on_one_device(gpt_initial), jax.jit(supervised_step(gpt_loss)), gpt_batches[1:], gpt_losses)
print("ALL OK", flush=True)
