"""One process of the two-process pipeline test: python mp_pipeline_worker.py PID NUM_PROCESSES PORT.

(data, model, pipeline) = (2, 2, 2): stage 0's mesh is process 0's four devices, stage 1's
process 1's. Each process checks the parameters it holds, and the loss where it lives,
against the same step under jax.jit on one local device: the GPT with the default
transfers (p2p across processes), an MLP with the collective ones and with eager-1F1B, ZB-H1
and weight delaying, a step with aux metrics, an integer value between stages, a whole-batch
count and global-norm clipping; one traced step writes a trace per process. Then process 1 skips a
step: process 0 must fail within its timeout naming the transfer it waited for.
"""

import os
import sys
import tempfile
import time

import jax

import meshpar.distributed

jax.config.update("jax_num_cpu_devices", 4)
pid, nproc, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

import meshpar  # noqa: E402
from examples.gpt import GPT, gpt_batch, gpt_loss  # noqa: E402
from examples.mlp import MLP  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from meshpar.passes.program.timeline import LaneKind
from meshpar.passes.simulation.timeline import read_chrome_trace
from meshpar.runtime.coordination import CoordinationError, kv_client  # noqa: E402
from pipeline_models import assert_local_shards_close, make_state, mse  # noqa: E402

model = GPT(num_stages=2)
batch = gpt_batch(0, 16, 8, 64)
local = jax.local_devices()[0]
with jax.default_device(local):
    state = make_state(model, batch["x"][:1])
    step = supervised_step(gpt_loss)
    reference = jax.jit(step)
    ref_state, ref_losses = state, []
    for _ in range(3):
        ref_state, loss = reference(ref_state, batch)
        ref_losses.append(float(loss))

parallel = meshpar.parallelize(
    step, method=meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2))
)
par_state = state
for i in range(3):
    par_state, loss = parallel(par_state, batch)
    np.testing.assert_allclose(float(loss), ref_losses[i], rtol=1e-5)
    print(f"process {pid}: step {i} loss {float(loss):.6f} matches", flush=True)

checked = assert_local_shards_close(par_state.params, ref_state.params)
assert checked > 0, "this process holds no parameters"
print(f"process {pid}: {checked} parameter shards match", flush=True)

# The collective executor, on a small MLP.
rng = np.random.default_rng(0)
mlp_batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
mlp = MLP(features=(16, 16, 16, 4), num_stages=2)
with jax.default_device(local):
    mlp_state = make_state(mlp, mlp_batch["x"][:1])
    mlp_step = supervised_step(mse)
    want_state, want_loss = jax.jit(mlp_step)(mlp_state, mlp_batch)
collective = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), executor="collective"))


def check_mlp_step(run):
    """One step of ``run`` against jax.jit's: the loss where it lives, every shard held here."""
    got_state, got_loss = run(mlp_state, mlp_batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        for shard in got.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-5, atol=1e-6)


check_mlp_step(collective)
print(f"process {pid}: collective transfers match", flush=True)

# Each process feeding only its own rows, the JAX way: a global batch built with
# jax.make_array_from_process_local_data, over all 8 devices (micro-batches of whole shards)
# or over one device per process (micro-batches within a shard); equal to jax.jit on the
# full batch, the loss readable on both processes.
everywhere = jax.sharding.Mesh(np.array(jax.devices()), ("rows",))
one_each = jax.sharding.Mesh(np.array([jax.devices()[0], jax.devices()[4]]), ("rows",))
for mesh, M in ((everywhere, 4), (everywhere, 8), (one_each, 4)):
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    mine = slice(8 * pid, 8 * (pid + 1))
    global_batch = {k: jax.make_array_from_process_local_data(sharding, v[mine], v.shape) for k, v in mlp_batch.items()}
    fed = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
        num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2)))
    got_state, got_loss = fed(mlp_state, global_batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        for shard in got.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), np.asarray(want)[shard.index], rtol=1e-5, atol=1e-6)
    print(f"process {pid}: global batch over {mesh.devices.size} devices, M={M}, matches", flush=True)

# A parameter held on one stage's process, read whole on every process (as docs/multiprocess.md says).
everywhere = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(jax.devices()), ("all",)), jax.sharding.PartitionSpec())
for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
    np.testing.assert_allclose(np.asarray(meshpar.reshard(got, everywhere)), np.asarray(want), rtol=1e-5, atol=1e-6)
print(f"process {pid}: every parameter read whole on every process", flush=True)

# Each process passing only its own rows as numpy: a clear error on every process, never
# training on a mix of processes' rows.
own_rows = {k: v[8 * pid: 8 * (pid + 1)] for k, v in mlp_batch.items()}
try:
    meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2)))(mlp_state, own_rows)
    raise AssertionError("different numpy batches per process were not refused")
except ValueError as e:
    assert "batch_argnums" in str(e) and "make_array_from_process_local_data" in str(e), e
print(f"process {pid}: per-process numpy rows refused", flush=True)

# The overlap-friendly schedules, backward weight delaying included, across processes.
for schedule, weight_delay in (("eager_1f1b", True), ("zb_h1", False), ("1f1b", "auto")):
    run = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), schedule=schedule, weight_delay=weight_delay))
    check_mlp_step(run)
    print(f"process {pid}: {schedule} with weight_delay={weight_delay} matches", flush=True)

# Gradients reduced once per step (the default: both stages run as 2 replicas, one reduction
# per mesh) and per micro-batch, across processes, with M = 1 and 8.
for M in (1, 8):
    for reduction in ("per_step", "per_micro_batch"):
        run_m = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
            num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2), gradient_reduction=reduction))
        check_mlp_step(run_m)
        replicas = [g.copies for g in run_m.get_compiled(mlp_state, mlp_batch).gradients.stages]
        assert replicas == ([2, 2] if reduction == "per_step" else [1, 1]), replicas
        print(f"process {pid}: gradient_reduction={reduction} M={M} matches", flush=True)

# Stage meshes whose data axis spans both processes (one device of each per mesh): the
# replicas' gradients are all-reduced across processes once per step (per micro-batch in the
# other row), and the executor connects each mesh's devices before the first step.
spanning = [jax.sharding.Mesh(np.array([jax.devices()[k], jax.devices()[4 + k]]).reshape(2, 1), ("data", "model"))
            for k in (0, 1)]
for reduction in ("per_step", "per_micro_batch"):
    for _ in range(2):
        run_m = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
            num_micro_batches=4, stage_meshes=spanning, gradient_reduction=reduction))
        check_mlp_step(run_m)
    print(f"process {pid}: data axis across processes, gradient_reduction={reduction} matches", flush=True)

# One traced step of the last of those: each process writes its own trace, with its own
# stage's compute and the transfers it receives (stage i's mesh is process i's).
_, step_trace = run.trace(os.path.join(tempfile.gettempdir(), f"mp_pipeline_trace_{port}.json"), mlp_state, mlp_batch)
# Bytes are measured on this process's devices only, activations among them.
assert step_trace.live_bytes.total and set(step_trace.live_bytes.total) <= {d.id for d in jax.local_devices()}, \
    step_trace.live_bytes
assert step_trace.live_bytes.peak_activation_bytes > 0, step_trace.live_bytes
mine_path = os.path.join(tempfile.gettempdir(), f"mp_pipeline_trace_{port}.p{pid}.json")
mine = read_chrome_trace(mine_path)
os.remove(mine_path)
schedule = run.get_compiled(mlp_state, mlp_batch).schedule
compute = [e for e in mine.events if e.lane.kind is LaneKind.COMPUTE]
assert sorted(str(e.task) for e in compute) == sorted(
    str(t) for t in schedule.order if t.kind.is_compute and t.where == pid), mine
assert all(e.lane.src == pid for e in compute), mine
received = [e for e in mine.events if e.lane.kind is LaneKind.LINK]
assert received and all(e.lane.dst == pid for e in received), mine
print(f"process {pid}: trace has only its own stage's compute ({len(compute)} tasks, {len(received)} arrivals)",
      flush=True)

# The patterns of a typical flax/optax step, across processes: aux metrics (a mean and a count),
# an integer value crossing the stages, a whole-batch count computed before the gradient, and
# global-norm clipping, whose partial norms and scale move between the processes' meshes.
class _IndexAcross(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        index = jnp.argmax(h, axis=-1)
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(h) + jax.nn.one_hot(index, 4)


def pattern_step(state, batch):
    count = jnp.sum(batch["w"])

    def loss_fn(params):
        out = state.apply_fn(params, batch["x"])
        err = jnp.sum((out - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["w"]) / count, {"err": jnp.mean(err), "hits": jnp.sum(err < 4.0)}

    (loss, aux), grads = meshpar.value_and_grad(loss_fn, has_aux=True, reduction="sum")(state.params)
    return state.apply_gradients(grads=grads), loss, aux, optax.tree.norm(grads)


pattern_batch = dict(mlp_batch, w=(np.arange(16) % 3 != 0).astype(np.float32))
with jax.default_device(local):
    pattern_state = make_state(_IndexAcross(), mlp_batch["x"][:1]).replace(
        tx=optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-3, eps=1e-5)))
    pattern_state = pattern_state.replace(opt_state=pattern_state.tx.init(pattern_state.params))
    want = jax.jit(pattern_step)(pattern_state, pattern_batch)
got = meshpar.parallelize(pattern_step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2)))(pattern_state, pattern_batch)
assert float(want[3]) > 0.1, "the clip must be active"
for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    for shard in g.addressable_shards:
        np.testing.assert_allclose(np.asarray(shard.data), np.asarray(w)[shard.index], rtol=1e-5, atol=1e-6)
print(f"process {pid}: aux, integer values, whole-batch count and global-norm clipping match", flush=True)

# Upper-bound transfers: one byte per move, across processes too.
signal = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), resharding="signal"))
_, signal_loss = signal(mlp_state, mlp_batch)
assert np.isfinite(float(signal_loss))
print(f"process {pid}: signal transfers ran", flush=True)

# A peer that stops joining: process 1 runs one step, then skips the next.
skipping = meshpar.parallelize(mlp_step, method=meshpar.PipeshardParallel(
    num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), timeout_s=5))
skipping(mlp_state, mlp_batch)
client = kv_client()
if pid == 0:
    start = time.monotonic()
    try:
        jax.block_until_ready(skipping(mlp_state, mlp_batch))
        raise AssertionError("a step whose peer never sent its gradients returned")
    except CoordinationError as e:
        elapsed = time.monotonic() - start
        assert "pipeline transfers" in str(e) and "gradient of act0.0 stage 1 -> 0" in str(e), e
        assert elapsed < 30, elapsed
        print(f"process {pid}: skipped peer detected in {elapsed:.1f} s: {str(e)[:160]}", flush=True)
    client.key_value_set("mp_pipeline_worker/failed_as_expected", "yes")
else:
    client.blocking_key_value_get("mp_pipeline_worker/failed_as_expected", 120_000)
print(f"process {pid}: ALL OK", flush=True)
# Transfers of the abandoned step stay pending, and jax.distributed.shutdown
# would wait for them: leave without it, process 1 first.
if pid == 0:
    time.sleep(1.0)
os._exit(0)
