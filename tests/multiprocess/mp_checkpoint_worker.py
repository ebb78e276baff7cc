"""One process of the two-process checkpoint test: python mp_checkpoint_worker.py PID NUM_PROCESSES PORT,
saving to $MESHPAR_CHECKPOINT_DIR (a directory both processes see, not yet existing).

(data, model, pipeline) = (2, 2, 2): stage 0's mesh is process 0's four devices, stage 1's process
1's, each stage's kernels sharded over its mesh's model axis. Trains 4 steps, saving after 2: one
global orbax checkpoint, each process writing the chunks it holds. A fresh step restores the checkpoint where it keeps the state
and trains 2 steps; each process checks every shard it holds, after the restore and after the 2
steps, against the uninterrupted run's, bit for bit. The same for a GPT whose blocks are one
nn.scan cut into one stage per process (each stacked leaf written by both processes).
"""

import os
import sys

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
directory = os.environ["MESHPAR_CHECKPOINT_DIR"]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import numpy as np  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import TensorParallel, make_state, mse  # noqa: E402

METHOD = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2))


def batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}


def assert_shards_equal(actual, expected):
    """Every shard of ``actual`` this process holds equals ``expected``'s on the same device, bit
    for bit; returns how many were compared."""
    compared = 0
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual)):
        theirs = {shard.device: shard for shard in want.addressable_shards}
        for shard in got.addressable_shards:
            assert shard.index == theirs[shard.device].index, jax.tree_util.keystr(path)
            np.testing.assert_array_equal(np.asarray(shard.data), np.asarray(theirs[shard.device].data),
                                          err_msg=jax.tree_util.keystr(path), strict=True)
            compared += 1
    return compared


batches = [batch(seed) for seed in range(4)]
with jax.default_device(jax.local_devices()[0]):
    initial = make_state(TensorParallel(), batches[0]["x"][:1])
step = meshpar.parallelize(supervised_step(mse), method=METHOD)
state, losses = initial, []
for i, b in enumerate(batches):
    state, loss = step(state, b)
    losses.append(loss)
    if i == 1:
        meshpar.checkpoint.save(directory, state)
        saved = state
# One global orbax checkpoint, committed: each process wrote its own chunks (its OCDBT database,
# merged by process 0), and orbax's metadata lists every leaf whole, whichever process held it.
assert {"_METADATA", "_CHECKPOINT_METADATA", "manifest.ocdbt", f"ocdbt.process_{pid}"} <= set(os.listdir(directory)), \
    os.listdir(directory)
leaves = ocp.StandardCheckpointer().metadata(directory).item_metadata
kernels = [leaves["params"]["params"][f"Dense_{s}"]["kernel"]["value"] for s in (0, 1)]
assert [tuple(k.shape) for k in kernels] == [tuple(np.shape(initial.params["params"][f"Dense_{s}"]["kernel"].value))
                                             for s in (0, 1)], kernels
print(f"process {pid}: one global checkpoint holds both stages' {len(jax.tree.leaves(leaves))} leaves", flush=True)

# A fresh step, as a restarted job would make: it places the state before any step has run.
resumed_step = meshpar.parallelize(supervised_step(mse), method=METHOD)
abstract = meshpar.checkpoint.state_shardings(resumed_step, initial, batches[0])
resumed = meshpar.checkpoint.restore(directory, abstract)
for (path, want), got, struct in zip(jax.tree_util.tree_leaves_with_path(saved), jax.tree.leaves(resumed),
                                     jax.tree.leaves(abstract)):
    assert got.sharding == struct.sharding and got.sharding.is_equivalent_to(want.sharding, want.ndim), \
        f"{jax.tree_util.keystr(path)}: restored {got.sharding}, kept {struct.sharding}, saved {want.sharding}"
print(f"process {pid}: restored {assert_shards_equal(resumed, saved)} shards as saved", flush=True)

for b, loss in zip(batches[2:], losses[2:]):
    resumed, resumed_loss = resumed_step(resumed, b)
    np.testing.assert_array_equal(np.asarray(resumed_loss), np.asarray(loss), strict=True)
compared = assert_shards_equal(resumed, state)
print(f"process {pid}: resumed training matches the uninterrupted run bit for bit ({compared} shards)", flush=True)
# A GPT whose 4 blocks are one nn.scan, cut into one stage per process (each stacked leaf's
# layers written by the process holding them): saved, restored where a fresh step keeps it,
# resumed bit for bit.
scanned = GPT(scan_layers=True, num_layers=4)
gpt_batches = [gpt_batch(seed, 8, scanned.seq_len, scanned.vocab_size) for seed in range(3)]
with jax.default_device(jax.local_devices()[0]):
    gpt_state = make_state(scanned, gpt_batches[0]["x"][:1])
gpt_method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2))
gpt_step = meshpar.parallelize(supervised_step(gpt_loss), method=gpt_method)
gpt_state, _ = gpt_step(gpt_state, gpt_batches[0])
meshpar.checkpoint.save(directory + "-scanned", gpt_state)
fresh = meshpar.parallelize(supervised_step(gpt_loss), method=gpt_method)
gpt_abstract = meshpar.checkpoint.state_shardings(fresh, gpt_state, gpt_batches[0])
gpt_resumed = meshpar.checkpoint.restore(directory + "-scanned", gpt_abstract)
for (path, got), struct in zip(jax.tree_util.tree_leaves_with_path(gpt_resumed), jax.tree.leaves(gpt_abstract)):
    assert got.sharding == struct.sharding, jax.tree_util.keystr(path)
assert_shards_equal(gpt_resumed, gpt_state)
gpt_losses = []
for b in gpt_batches[1:]:
    gpt_state, gpt_loss_value = gpt_step(gpt_state, b)
    gpt_resumed, resumed_value = fresh(gpt_resumed, b)
    np.testing.assert_array_equal(np.asarray(resumed_value), np.asarray(gpt_loss_value), strict=True)
    gpt_losses.append(float(gpt_loss_value))
print(f"process {pid}: the scanned GPT resumed bit for bit ({assert_shards_equal(gpt_resumed, gpt_state)} shards)",
      flush=True)

if pid == 0:
    # For the restore under another layout (test_multiprocess_checkpoint): the run's losses.
    np.save(directory + ".losses.npy", np.array([float(loss) for loss in losses]))
    np.save(directory + "-scanned.losses.npy", np.array(gpt_losses))
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
