"""meshpar.parallelize against the same step under plain jax.jit, in one process with 8 devices."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.mlp import MLP
from examples.train_step import supervised_step
from examples.u_transformer import UTransformer, ut_batch, ut_loss
from pipeline_models import assert_trees_close, make_state, mse, run_both

CONFIGS = [(2, 2, 2), (4, 1, 2), (1, 2, 4), (1, 1, 8), (2, 1, 4)]  # (data, model, pipeline)
# The large models compile 20-60 s per configuration on 2 cores: CI runs a
# spread of them (every config and both schedules appear across the two
# models), the full grid runs with -m slow.
CI_GRID = {("gpt", (2, 2, 2), "1f1b"), ("ut", (1, 2, 4), "gpipe")}


def _grid(model):
    return [
        pytest.param(config, schedule, id=f"{'x'.join(map(str, config))}-{schedule}",
                     marks=() if (model, config, schedule) in CI_GRID else pytest.mark.slow)
        for config in CONFIGS for schedule in ("gpipe", "1f1b")
    ]


def _run_both(model, batch, loss, config, schedule, steps=3, num_micro_batches=4, executor="auto", weight_delay=False):
    data, op, pp = config
    state = make_state(model, batch["x"][:1])
    step = supervised_step(loss)
    method = meshpar.PipeshardParallel(
        num_micro_batches=num_micro_batches, num_stages=pp, stage_mesh_shape=(data, op), schedule=schedule,
        executor=executor, weight_delay=weight_delay,
    )
    return run_both(step, state, batch, method, steps)


def _mlp_batch(n=16, d=6, k=4):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


# Every transfer path: jax.device_put ("auto" in one process), the p2p
# executor and the collective one, forced.
# Every schedule runs on every path in the slow run; CI's runs 1F1B on every config and path,
# and GPipe and eager 1F1B on one (test_every_schedule_and_weight_delay covers the schedules).
EXECUTOR_GRID = [
    pytest.param(c, s, "auto", marks=() if s == "1f1b" or c == (2, 2, 2) else pytest.mark.slow)
    for c in CONFIGS for s in ("gpipe", "1f1b", "eager_1f1b")] + [
    (c, "1f1b", "p2p") for c in CONFIGS] + [((2, 2, 2), "gpipe", "collective"), ((1, 1, 8), "1f1b", "collective")]


@pytest.mark.parametrize("config, schedule, executor", EXECUTOR_GRID,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_mlp_matches_single_device_jit_on_every_transfer_path(config, schedule, executor):
    model = MLP(features=(16, 16, 16, 16, 16, 16, 16, 4), num_stages=config[2])
    ref_state, par_state, parallel = _run_both(model, _mlp_batch(), mse, config, schedule, executor=executor)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    assert int(par_state.step) == int(ref_state.step) == 3
    kinds = {t.kind for t in parallel.get_executable(par_state, _mlp_batch()).program.transfers}
    expected = {"auto": "device_put", "p2p": "p2p", "collective": "collective"}[executor]
    assert config[2] == 1 or {k.value for k in kinds} == {expected}


def test_gpt_with_p2p_transfers_matches_single_device_jit():
    ref_state, par_state, _ = _run_both(GPT(num_stages=2), gpt_batch(0, 16, 8, 64), gpt_loss, (2, 2, 2), "1f1b",
                                        executor="p2p")
    assert_trees_close(par_state.params, ref_state.params)


def test_batch_goes_per_micro_batch_to_its_stage_and_on_device_batches_stay_there():
    """No whole-batch upload to mesh 0; a batch already on devices gives the same step."""
    model = MLP(features=(16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    step = supervised_step(mse)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2))
    executable = parallel.get_executable(state, batch)
    compiled = parallel.get_compiled(state, batch)
    batch_leaves = range(len(jax.tree.leaves(state)), len(jax.tree.leaves((state, batch))))
    assert all(compiled.layout.in_placements[i].meshes == () for i in batch_leaves)
    on_device = jax.device_put(batch, jax.devices()[7])
    s1, l1 = parallel(state, batch)
    s2, l2 = parallel(state, on_device)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(l2), float(ref_loss), rtol=1e-6)
    assert float(l1) == float(l2)
    assert_trees_close(s2.params, ref_state.params)


@pytest.mark.parametrize("config, schedule", _grid("gpt"))
def test_gpt_matches_single_device_jit(config, schedule):
    ref_state, par_state, _ = _run_both(GPT(num_stages=config[2]), gpt_batch(0, 16, 8, 64), gpt_loss, config, schedule)
    assert_trees_close(par_state.params, ref_state.params)


@pytest.mark.parametrize("config, schedule", _grid("ut"))
def test_u_transformer_matches_single_device_jit(config, schedule):
    """U-Transformer's long skips cross stages: stage i feeds stage n-1-i."""
    model = UTransformer(num_stages=config[2])
    ref_state, par_state, parallel = _run_both(model, ut_batch(0, 16), ut_loss, config, schedule)
    assert_trees_close(par_state.params, ref_state.params)
    edges = parallel.get_compiled(par_state, ut_batch(0, 16)).graph.edges()
    if config[2] > 2:
        assert any(c - p > 1 for p, c, _ in edges), "expected skip connections between non-adjacent stages"


def test_state_stays_on_stage_meshes_and_nothing_recompiles():
    model = MLP(features=(16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    _, state, parallel = _run_both(model, batch, mse, (2, 2, 2), "1f1b", steps=2)
    executable = parallel.get_executable(state, batch)
    compiled = parallel.get_compiled(state, batch)
    meshes = [set(m.devices.flat) for m in executable.meshes]
    for leaf in jax.tree.leaves(state.params):
        assert set(leaf.sharding.device_set) in meshes, "a parameter left its stage mesh"
    count = executable.compiled_count()
    state, _ = parallel(state, batch)
    assert executable.compiled_count() == count
    assert parallel.get_executable(state, batch) is executable


def test_a_returned_state_is_placed_for_the_next_step_without_copies():
    from meshpar.runtime.placement import place
    from pipeline_models import TensorParallel

    batch = _mlp_batch()
    _, state, parallel = _run_both(TensorParallel(), batch, mse, (2, 2, 2), "1f1b", steps=1)
    placements = parallel.get_compiled(state, batch).layout.in_placements
    leaves = jax.tree.leaves(state)
    sharded = [x for x in jax.tree.leaves(state.params) if any(e is not None for e in x.sharding.spec)]
    assert sharded, "the model's kernels are sharded over 'model'"
    for leaf, placement in zip(leaves, placements):
        assert all(v is leaf for v in place(leaf, placement).values()) or len(placement.meshes) > 1


def test_describe_shows_stages_plans_and_schedule():
    model = MLP(features=(16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(2, 2)))
    text = parallel.get_executable(state, batch).describe()
    assert "stage 0: mesh 0 {'data': 2, 'model': 2}" in text and "stage 1: mesh 1" in text
    assert "2 stages on 2 meshes (one stage per mesh)" in text
    assert ("activation act0.0 float32[8,16] stage 0 -> 1: jax.device_put, since one process owns both meshes; "
            "across processes the plan is S0R(2, 2) -> S0R(2, 2)") in text
    forced = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
        num_micro_batches=2, stage_mesh_shape=(2, 2), executor="p2p"))
    text = forced.get_executable(state, batch).describe()
    assert "activation act0.0 float32[8,16] stage 0 -> 1: p2p: " in text and "broadcast/ensemble" in text
    assert "launch order (KIND STAGE.MICRO_BATCH; F forward," in text and "A and G: an activation" in text
    assert "its gradient sent back): F0.0" in text


# -- bad input ----------------------------------------------------------------------------


def test_num_stages_without_markers():
    model = MLP(features=(16, 4), num_stages=1)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(num_stages=2))
    with pytest.raises(ValueError, match="num_stages: 2 stages asked for, but the model calls meshpar.mark_stage_boundary"):
        step(state, batch)


def test_micro_batches_must_divide_the_batch_and_the_error_lists_the_counts_that_do():
    """The error lists every count dividing the batch (10: 1, 2, 5 and 10); one of them runs."""
    model = MLP(features=(16, 4), num_stages=2)
    batch = _mlp_batch(n=10)
    state = make_state(model, batch["x"][:1])
    step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(num_micro_batches=4))
    with pytest.raises(ValueError, match=r"^num_micro_batches: 4 does not divide the batch size 10; pass one of "
                                         r"1, 2, 5, 10, or a batch whose size 4 divides$"):
        step(state, batch)
    proposed = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(1, 1),
                                         devices=jax.devices()[:2])
    _, got_loss = meshpar.parallelize(supervised_step(mse), method=proposed)(state, batch)
    _, want_loss = jax.jit(supervised_step(mse))(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)


def test_overlapping_or_too_many_meshes():
    devices = np.array(jax.devices())
    model = MLP(features=(16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    a = jax.sharding.Mesh(devices[:4].reshape(2, 2), ("data", "model"))
    b = jax.sharding.Mesh(devices[2:6].reshape(2, 2), ("data", "model"))
    with pytest.raises(ValueError, match="stage_meshes: meshes 0 and 1 overlap on device"):
        meshpar.PipeshardParallel(stage_meshes=[a, b])
    three = [jax.sharding.Mesh(devices[i:i + 2].reshape(1, 2), ("data", "model")) for i in (0, 2, 4)]
    step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(stage_meshes=three))
    with pytest.raises(ValueError, match="stage_meshes: 3 meshes for a model with 2 stages"):
        step(state, batch)
    step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(stage_mesh_shape=(4, 2)))
    with pytest.raises(ValueError, match=r"stage_mesh_shape: \(4, 2\) does not hold the 4 devices"):
        step(state, batch)


def test_marker_inside_scan_is_rejected_with_location():
    def loss(params, batch):
        def body(h, _):
            meshpar.mark_stage_boundary()
            return jnp.tanh(h @ params["w"]), None

        h, _ = jax.lax.scan(body, batch["x"], None, length=2)
        return jnp.mean(h)

    def step(params, batch):
        value, grads = meshpar.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - g, params, grads), value

    params = {"w": jnp.ones((6, 6))}
    with pytest.raises(ValueError, match=r"mark_stage_boundary\(\) is called inside a `scan` body at .*test_parallelize.py"):
        meshpar.parallelize(step)(params, _mlp_batch())


def test_untraceable_step():
    def step(state, batch):
        if float(batch["x"].sum()) > 0:  # concrete value needed: not traceable
            return state
        return state

    with pytest.raises(TypeError, match="cannot be traced by meshpar.parallelize"):
        meshpar.parallelize(step)({"w": jnp.ones(2)}, _mlp_batch())


def test_bad_method_arguments():
    with pytest.raises(ValueError, match="num_micro_batches"):
        meshpar.PipeshardParallel(num_micro_batches=0)
    with pytest.raises(ValueError, match="schedule: unknown 'zigzag'"):
        meshpar.PipeshardParallel(schedule="zigzag")
    with pytest.raises(ValueError, match="resharding: unknown .nccl.; expected one of"):
        meshpar.PipeshardParallel(resharding="nccl")
    with pytest.raises(ValueError, match="executor: expected one of"):
        meshpar.PipeshardParallel(executor="mpi")
    with pytest.raises(ValueError, match="timeout_s"):
        meshpar.PipeshardParallel(timeout_s=0)
    with pytest.raises(ValueError, match="weight_delay: expected False, True or 'auto', got 'always'"):
        meshpar.PipeshardParallel(weight_delay="always")
    with pytest.raises(ValueError, match="weight_delay: expected False, True or 'auto', got 1"):
        meshpar.PipeshardParallel(weight_delay=1)
    with pytest.raises(ValueError, match="weight_delay: zb_h1 always splits backwards"):
        meshpar.PipeshardParallel(schedule="zb_h1", weight_delay=True)


def test_bare_partition_spec_constraints_apply_within_each_stage():
    import flax.linen as nn
    from jax.sharding import Mesh, PartitionSpec as P

    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jax.lax.with_sharding_constraint(nn.Dense(16)(x), P("data", "model"))
            meshpar.mark_stage_boundary()
            return nn.Dense(4)(jax.lax.with_sharding_constraint(x, P("data", None)))

    batch = _mlp_batch()
    with jax.set_mesh(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))):
        state = make_state(Constrained(), batch["x"][:2])
        ref_state, ref_loss = jax.jit(supervised_step(mse))(state, batch)
    method = meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(2, 2))
    par_state, par_loss = meshpar.parallelize(supervised_step(mse), method=method)(state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par_state.params, ref_state.params)


class _ScalarsAcrossStages(nn.Module):
    """A scalar parameter read by both stages and a 0-d activation crossing them (a regulariser
    of stage 0's weights; batch-independent, so micro-batching leaves the step unchanged)."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", lambda key: jnp.asarray(1.5, jnp.float32))
        dense = nn.Dense(8)
        h = dense(x) * scale
        aux = jnp.mean(dense.variables["params"]["kernel"] ** 2)
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(jnp.tanh(h)) * scale + 0.1 * aux


@pytest.mark.parametrize("executor", ["auto", "p2p"])
def test_scalars_cross_meshes(executor):
    ref_state, par_state, parallel = _run_both(_ScalarsAcrossStages(), _mlp_batch(), mse, (2, 2, 2), "1f1b",
                                               executor=executor)
    assert_trees_close(par_state.params, ref_state.params)
    graph = parallel.get_compiled(par_state, _mlp_batch()).graph
    scalar_edges = [ref for p, c, ref in graph.edges() if graph.stages[p].jaxpr.out_avals[ref.slot].shape == ()]
    assert scalar_edges, "the auxiliary term should cross the stage boundary as a 0-d value"


def test_signal_resharding_moves_one_byte_with_the_same_dependencies():
    """The upper-bound mode: every boundary move delivers zeros of the value's shape and sharding,
    made from one byte that left only once the value existed; the step runs end to end."""
    model = MLP(features=(16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), resharding="signal")
    parallel = meshpar.parallelize(supervised_step(mse), method=method)
    _, loss = parallel(state, batch)
    assert np.isfinite(float(loss))
    executable = parallel.get_executable(state, batch)
    compiled = parallel.get_compiled(state, batch)
    assert {t.kind.value for t in executable.program.transfers} == {"signal"}
    assert "signal: one byte" in executable.describe()
    transfer, forward = executable.program.transfers[0], executable.transfer_moves[0]
    value = jax.device_put(np.full(transfer.shape, 3.0, transfer.dtype), transfer.src)
    moved = forward(value)
    assert moved.sharding == transfer.dst and moved.shape == transfer.shape
    np.testing.assert_array_equal(np.asarray(moved), np.zeros(transfer.shape, transfer.dtype))


def test_signal_move_delivers_only_after_the_source_value_exists():
    """A signal move's zeros depend on the sender's value: while the shard the byte is read from
    is still being computed (a program of about a second, dispatched asynchronously), the
    destination value is never ready; afterwards it is, and it is zeros."""
    model = MLP(features=(16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), resharding="signal")
    executable = meshpar.parallelize(supervised_step(mse), method=method).get_executable(state, batch)
    transfer, forward = executable.program.transfers[0], executable.transfer_moves[0]

    @jax.jit
    def slow(piece, m):
        m = jax.lax.fori_loop(0, 12, lambda _, a: jnp.tanh(a @ a), m)
        return piece + m[0, 0] * 0.0

    full = np.full(transfer.shape, 3.0, transfer.dtype)
    first = transfer.src.mesh.devices.flat[0]
    shards = {}
    for device, index in transfer.src.addressable_devices_indices_map(transfer.shape).items():
        shards[device] = jax.device_put(full[index], device)
    square = jax.device_put(np.eye(1500, dtype=np.float32), first)
    jax.block_until_ready([*shards.values(), square])
    # Compiled first, so that the move is dispatched while the source is still computing.
    jax.block_until_ready([forward(jax.make_array_from_single_device_arrays(
        transfer.shape, transfer.src, list(shards.values()))), slow(shards[first], square)])
    shards[first] = slow(shards[first], square)
    value = jax.make_array_from_single_device_arrays(
        transfer.shape, transfer.src, [shards[d] for d in transfer.src.addressable_devices_indices_map(transfer.shape)])
    moved = forward(value)
    observed = 0
    while True:
        moved_ready = moved.is_ready()
        if shards[first].is_ready():
            break
        assert not moved_ready, "the zeros arrived before the value they stand for existed"
        observed += 1
        time.sleep(0.01)
    assert observed, "the source finished before the move could be watched; make `slow` slower"
    np.testing.assert_array_equal(np.asarray(moved), np.zeros(transfer.shape, transfer.dtype))


@pytest.mark.parametrize("schedule, weight_delay, live", [
    ("gpipe", False, [4, 4]), ("1f1b", False, [2, 1]), ("eager_1f1b", False, [3, 1]),
    ("zb_h1", False, [2, 1]), ("1f1b", True, [2, 1]), ("eager_1f1b", True, [3, 1]),
])
def test_runtime_counts_live_activations_per_stage(schedule, weight_delay, live):
    """Micro-batches whose forward residuals are held per stage at the peak of a step: M for
    GPipe, S - s for 1F1B and ZB-H1, 2(S - s) - 1 for eager-1F1B (S = 2, M = 4); weight
    delaying keeps that, and the runtime's count of waiting weight passes follows the
    schedule's stage sequences (input passes run minus weight passes run)."""
    model = MLP(features=(16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, schedule=schedule, weight_delay=weight_delay))
    parallel(state, batch)
    executable = parallel.get_executable(state, batch)
    compiled = parallel.get_compiled(state, batch)
    assert executable.peak_live_activations == live
    waiting = []
    for seq in compiled.schedule.sequences:
        held = peak = 0
        for task in seq:
            held += {"I": 1, "W": -1}.get(task.kind.value, 0)
            peak = max(peak, held)
        waiting.append(peak)
    assert executable.peak_weight_states == waiting
    assert (max(waiting) > 0) == executable.program.split_backward


# Every schedule, with and without weight delaying, M from S to 4S, against jax.jit.
SCHEDULE_VARIANTS = [(s, False) for s in ("gpipe", "1f1b", "eager_1f1b", "zb_h1")] + [
    (s, d) for s in ("gpipe", "1f1b", "eager_1f1b") for d in (True, "auto")]
SCHEDULE_GRID = [
    pytest.param(config, M, schedule, delay, id=f"{'x'.join(map(str, config))}-M{M}-{schedule}-delay_{delay}",
                 marks=() if (config, M) in {((2, 2, 2), 8), ((1, 2, 4), 4)} or (config, M, delay) == ((2, 2, 2), 2, False)
                 else pytest.mark.slow)
    for config, Ms in (((2, 2, 2), (2, 4, 8)), ((1, 2, 4), (4, 8, 16)))
    for M in Ms for schedule, delay in SCHEDULE_VARIANTS
]


@pytest.mark.parametrize("config, M, schedule, weight_delay", SCHEDULE_GRID)
def test_every_schedule_and_weight_delay_matches_single_device_jit(config, M, schedule, weight_delay):
    model = MLP(features=(16, 16, 16, 16, 16, 4), num_stages=config[2])
    ref_state, par_state, parallel = _run_both(model, _mlp_batch(), mse, config, schedule, steps=2,
                                               num_micro_batches=M, weight_delay=weight_delay)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    executable = parallel.get_executable(par_state, _mlp_batch())
    assert executable.program.split_backward == (schedule == "zb_h1" or weight_delay is not False)


@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b",
                                      pytest.param("eager_1f1b", marks=pytest.mark.slow), "zb_h1"])
def test_fewer_micro_batches_than_the_warm_up_wants_still_run(schedule):
    """M = 1 < S = 4: every warm-up is cut to the micro-batches there are."""
    model = MLP(features=(16, 16, 16, 16, 4), num_stages=4)
    ref_state, par_state, _ = _run_both(model, _mlp_batch(), mse, (1, 2, 4), schedule, steps=2, num_micro_batches=1)
    assert_trees_close(par_state.params, ref_state.params)


@pytest.mark.parametrize("schedule, weight_delay, gradient_reduction", [
    pytest.param(s, d, r, marks=() if (s, r) in {("1f1b", "per_micro_batch"), ("eager_1f1b", "per_step"),
                                                 ("zb_h1", "per_step")} else pytest.mark.slow)
    for s, d in (("1f1b", True), ("eager_1f1b", "auto"), ("zb_h1", False)) for r in ("per_micro_batch", "per_step")])
def test_split_backward_equals_whole_backward_bit_for_bit_and_compiles_once(schedule, weight_delay, gradient_reduction):
    """The activation- and weight-gradient passes together compute exactly what the whole
    backward does, and add micro-batches' gradients in the same order: the trained state is
    bitwise the unsplit 1F1B one, whether each pass is one SPMD program or runs as
    data-parallel replicas. Later steps compile nothing."""
    model = MLP(features=(16, 16, 16, 4), num_stages=2)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    runs = {}
    for name, delay in (("1f1b", False), (schedule, weight_delay)):
        parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
            num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2), schedule=name, weight_delay=delay,
            gradient_reduction=gradient_reduction))
        s, loss = parallel(state, batch)
        executable = parallel.get_executable(state, batch)
        compiled = parallel.get_compiled(state, batch)
        count = executable.compiled_count()
        s, loss = parallel(s, batch)
        assert executable.compiled_count() == count
        runs[name, delay] = (s, loss)
    (whole, whole_loss), (split, split_loss) = runs.values()
    assert float(whole_loss) == float(split_loss)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(split)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("num_stages, num_micro_batches", [(2, 4), pytest.param(4, 8, marks=pytest.mark.slow)])
def test_simulated_memory_peaks_equal_the_runtime_counts(num_stages, num_micro_batches):
    """The schedule simulator counts held residuals and weight states over time, the runtime by
    launch order: for every schedule (and 1F1B with weight delaying) and any positive durations,
    the peaks agree."""
    from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES
    from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate

    model = MLP(features=(16,) * num_stages + (4,), num_stages=num_stages)
    batch = _mlp_batch()
    state = make_state(model, batch["x"][:1])
    rng = np.random.default_rng(num_stages)
    one_per_mesh = [name for name, kind in SCHEDULES.items() if kind.stages_per_mesh is None]
    for schedule, weight_delay in [(name, False) for name in one_per_mesh] + [("1f1b", True)]:
        parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
            num_micro_batches=num_micro_batches, num_stages=num_stages, schedule=schedule, weight_delay=weight_delay))
        parallel(state, batch)
        executable = parallel.get_executable(state, batch)
        compiled = parallel.get_compiled(state, batch)
        num_edges = len(executable.program.edges)
        durations = TaskDurations(
            tuple(StageSeconds(*map(float, rng.uniform(0.1, 2, 4))) for _ in range(num_stages)),
            tuple(map(float, rng.uniform(0.1, 2, num_edges))), tuple(map(float, rng.uniform(0.1, 2, num_edges))))
        simulated = simulate(compiled.schedule, durations)
        assert list(simulated.peak_live_activations) == executable.peak_live_activations, schedule
        assert list(simulated.peak_weight_states) == executable.peak_weight_states, schedule
