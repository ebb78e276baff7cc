"""One process restoring the two-process checkpoint test's checkpoint under other layouts:
python restore_elsewhere.py DIRECTORY (the checkpoint; DIRECTORY.losses.npy its run's losses).

Saved by 2 processes with 2 stages on (2, 2) meshes (mp_checkpoint_worker.py); restored here,
in one process with 8 CPU devices, under 2 stages on one device each and into a plain
jax.jit state on one device. Each trains the 2 steps after the checkpoint; their losses equal
the uninterrupted run's to float tolerance (another layout may reassociate sums).
"""

import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import TensorParallel, make_state, mse  # noqa: E402



def batch(seed):
    """mp_checkpoint_worker.py's batches."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}


directory = sys.argv[1]
losses = np.load(directory + ".losses.npy")
batches = [batch(seed) for seed in range(4)]
initial = make_state(TensorParallel(), batches[0]["x"][:1])
step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(1, 1), devices=jax.devices()[:2]))
one_device = jax.sharding.SingleDeviceSharding(jax.devices()[3])
targets = {
    "2 stages on one device each": (meshpar.checkpoint.state_shardings(step, initial, batches[0]), step),
    "a jax.jit state on one device": (jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype),
                                       sharding=one_device), initial), jax.jit(supervised_step(mse))),
}
for name, (abstract, run) in targets.items():
    state = meshpar.checkpoint.restore(directory, abstract)
    for got, struct in zip(jax.tree.leaves(state), jax.tree.leaves(abstract)):
        assert got.sharding == struct.sharding, name
    for b, want in zip(batches[2:], losses[2:]):
        state, loss = run(state, b)
        np.testing.assert_allclose(float(loss), want, rtol=1e-5, err_msg=name)
    print(f"restored under {name}: the next steps match", flush=True)
print("ALL OK", flush=True)
