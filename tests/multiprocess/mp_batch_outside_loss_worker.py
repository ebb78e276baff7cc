"""One process of the global-batch-outside-the-loss test: python mp_batch_outside_loss_worker.py PID NPROC PORT.

Two processes of 4 CPU devices, (data, model, pipeline) = (4, 1, 2) under 1F1B with 4
micro-batches: stage 0's mesh is process 0's devices, stage 1's process 1's. Each process
feeds only its own 8 of the 16 rows, as a global ``jax.Array`` over all 8 devices, and the step
reads the batch outside the loss function too: docs/multiprocess.md's masked mean (a normaliser computed
in the step from the mask) and a metric of the batch returned from the step. Three steps
against ``jax.jit`` of the same step on one local device over the full batch: the loss and the
metric read on both processes, every parameter shard each process holds. Placing the global
batch elsewhere without a planned move is refused with an error naming it.
"""

import sys
import time

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import meshpar  # noqa: E402
from examples.mlp import MLP  # noqa: E402
from meshpar.passes.program.step_instructions import MoveMicroBatches, PlaceInputs
from meshpar.runtime.placement import put  # noqa: E402
from pipeline_models import assert_local_shards_close, make_state  # noqa: E402

STEPS = 3


def masked_step(state, batch):
    """docs/multiprocess.md's masked mean, with the normaliser computed from the whole batch's mask in
    the step, and a metric of the batch (the masked mean target) returned beside the loss."""
    count = jnp.maximum(batch["mask"].sum(), 1)

    def loss_fn(params):
        err = jnp.sum((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["mask"]) / count

    loss, grads = meshpar.value_and_grad(loss_fn, reduction="sum")(state.params)
    target_mean = jnp.sum(batch["y"] * batch["mask"][:, None]) / count
    return state.apply_gradients(grads=grads), loss, target_mean


rng = np.random.default_rng(0)
full = {"x": rng.standard_normal((16, 6)).astype(np.float32),
        "y": rng.standard_normal((16, 4)).astype(np.float32),
        # Rows 8-15 (process 1's) mostly padding: a wrong normaliser or a mix of rows shows.
        "mask": np.array([1] * 7 + [0] + [1, 0, 0, 1, 0, 0, 0, 1], np.float32)}
with jax.default_device(jax.local_devices()[0]):
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=2), full["x"][:1])
    ref_state, want = state, []
    for _ in range(STEPS):
        ref_state, loss, metric = jax.jit(masked_step)(ref_state, full)
        want.append((float(loss), float(metric)))

rows = NamedSharding(Mesh(np.array(jax.devices()), ("rows",)), P("rows"))
mine = slice(8 * pid, 8 * (pid + 1))
batch = {k: jax.make_array_from_process_local_data(rows, v[mine], v.shape) for k, v in full.items()}
parallel = meshpar.parallelize(masked_step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(4, 1), schedule="1f1b"))
# The compiler planned it: the mask, x and y fed per micro-batch from where their rows lie, the
# mask and y (read by the normaliser and the metric) also moved whole to the meshes reading them.
compiled = parallel.get_compiled(state, batch)
(placing,) = [ins for ins in compiled.step if isinstance(ins, PlaceInputs)]
feeding = [ins.batch for ins in compiled.step if isinstance(ins, MoveMicroBatches)]
names = {i: jax.tree_util.keystr(path) for i, (path, _) in
         enumerate(jax.tree_util.tree_flatten_with_path((state, batch))[0]) if i >= len(jax.tree.leaves(state))}
moved_whole = sorted(names[p.leaf] for p in placing.global_batches)
assert moved_whole == ["[1]['mask']", "[1]['y']"], moved_whole
assert sorted({names[f.leaf] for f in feeding}) == ["[1]['mask']", "[1]['x']", "[1]['y']"], feeding
print(f"process {pid}: planned whole moves of {moved_whole} and micro-batch feeds", flush=True)
par_state = state
start = time.perf_counter()
for i, (want_loss, want_metric) in enumerate(want):
    par_state, loss, metric = parallel(par_state, batch)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(metric), want_metric, rtol=1e-5, atol=1e-7)
    print(f"process {pid}: step {i} loss {float(loss):.6f} and metric {float(metric):.6f} match", flush=True)
print(f"process {pid}: {STEPS} steps in {time.perf_counter() - start:.1f} s (first compiles)", flush=True)
checked = assert_local_shards_close(par_state.params, ref_state.params, rtol=1e-4, atol=1e-4)
assert checked > 0, "this process holds no parameters"
print(f"process {pid}: {checked} parameter shards match", flush=True)
# Placing such an array anywhere else without a planned move is refused naming it, never JAX's
# fetch error.
try:
    put(batch["x"], NamedSharding(Mesh(np.array(jax.devices()[:4]), ("a",)), P()), "batch leaf 'x'")
    raise AssertionError("a global array was placed without a planned move")
except ValueError as e:
    assert "batch leaf 'x'" in str(e) and "no move planned" in str(e) and "batch_argnums" in str(e), e
print(f"process {pid}: unplanned placement refused", flush=True)
print(f"process {pid}: ALL OK", flush=True)
jax.distributed.shutdown()
