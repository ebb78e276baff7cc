"""The two-process checkpoint test's scanned GPT, restored by plain orbax into a jax.jit state:
python restore_with_plain_orbax.py DIRECTORY (the checkpoint mp_checkpoint_worker.py saved of the
GPT whose 4 blocks are one nn.scan, cut into one stage per process; DIRECTORY.losses.npy the
losses of its uninterrupted run's next 2 steps).

First with meshpar not imported: orbax's StandardCheckpointer restores every leaf onto one
device, the target read from the checkpoint's own metadata. Then the model (examples/gpt.py,
whose stage markers are meshpar's and are identities under jax.jit) gives the TrainState, which
orbax restores into as any orbax user would; the leaves equal the first restore's, and 2 steps
under jax.jit give the uninterrupted run's losses (to float tolerance: one device sums in
another order than the pipeline).
"""

import sys

import jax
import numpy as np
import orbax.checkpoint as ocp

directory = sys.argv[1]
one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
metadata = ocp.StandardCheckpointer().metadata(directory).item_metadata
plain = ocp.StandardCheckpointer().restore(directory, jax.tree.map(
    lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=one_device), metadata))
assert not any(name.split(".")[0] == "meshpar" for name in sys.modules), "meshpar was imported"
stacked = plain["params"]["params"]["blocks"]
print(f"restored {len(jax.tree.leaves(plain))} leaves with plain orbax, meshpar not imported; a stacked kernel: "
      f"{jax.tree.leaves(stacked)[0].shape}", flush=True)

from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import make_state  # noqa: E402

scanned = GPT(scan_layers=True, num_layers=4)
batches = [gpt_batch(seed, 8, scanned.seq_len, scanned.vocab_size) for seed in range(3)]
initial = make_state(scanned, batches[0]["x"][:1])
target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(np.asarray(x).dtype),
                                                     sharding=one_device), initial)
state = ocp.StandardCheckpointer().restore(directory, target)
restored, first = ocp.tree.to_flat_dict(state), ocp.tree.to_flat_dict(plain)
assert restored.keys() == first.keys(), sorted(restored.keys() ^ first.keys())
for key, got in restored.items():
    np.testing.assert_array_equal(np.asarray(got), np.asarray(first[key]), err_msg=".".join(key), strict=True)
step = jax.jit(supervised_step(gpt_loss))
for b, want in zip(batches[1:], np.load(directory + ".losses.npy"), strict=True):
    state, loss = step(state, b)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
print("the next steps under jax.jit match the uninterrupted run", flush=True)
print("ALL OK", flush=True)
