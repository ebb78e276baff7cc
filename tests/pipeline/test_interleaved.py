"""Interleaved 1F1B (virtual stages: several stages per mesh) against the same step under
jax.jit on one device, in one process with 8 devices."""

import jax
import numpy as np
import pytest

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.mlp import MLP
from examples.train_step import supervised_step
from examples.u_transformer import UTransformer, ut_batch, ut_loss
from meshpar.passes.program.moves import TransferKind
from pipeline_models import assert_trees_close, make_state, mse, run_both


def _run_both(model, batch, loss, num_meshes, num_micro_batches, steps=2, **options):
    """Both steps ``steps`` times; returns the states and the parallelized step."""
    state = make_state(model, batch["x"][:1])
    step = supervised_step(loss)
    method = meshpar.PipeshardParallel(
        num_micro_batches=num_micro_batches, num_stages=2 * num_meshes, stages_per_mesh=2,
        stage_mesh_shape=(8 // num_meshes, 1), schedule="interleaved_1f1b", **options)
    return run_both(step, state, batch, method, steps)


def _mlp_batch(n=32, d=6, k=4):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


@pytest.mark.parametrize("num_meshes, rounds", [
    pytest.param(p, r, marks=() if (p, r) in {(2, 1), (2, 4), (4, 2)} else pytest.mark.slow)
    for p in (2, 4) for r in (1, 2, 4)])
def test_mlp_interleaved_matches_jit_and_places_stage_k_on_mesh_k_mod_P(num_meshes, rounds):
    S, M = 2 * num_meshes, num_meshes * rounds
    ref_state, par_state, parallel = _run_both(MLP(features=(16,) * 7 + (4,), num_stages=S), _mlp_batch(), mse,
                                               num_meshes, M)
    assert_trees_close(par_state.params, ref_state.params)
    assert_trees_close(par_state.opt_state, ref_state.opt_state)
    executable = parallel.get_executable(par_state, _mlp_batch())
    schedule = parallel.get_compiled(par_state, _mlp_batch()).schedule
    assert executable.program.stage_mesh == tuple(s % num_meshes for s in range(S))
    assert len(executable.meshes) == num_meshes and len(executable.program.instructions) == num_meshes
    # Every parameter stays on the mesh of the stage that owns it.
    leaves = jax.tree.leaves(par_state.params)
    assert {frozenset(leaf.sharding.device_set) for leaf in leaves} == {
        frozenset(m.devices.flat) for m in executable.meshes}
    # The runtime held what the schedule says, stage by stage.
    sim = [schedule.sequences[schedule.stage_mesh[s]] for s in range(S)]
    for s, seq in enumerate(sim):
        live = held = 0
        for t in seq:
            if t.where == s:
                live += {"F": 1, "B": -1}[t.kind.value]
                held = max(held, live)
        assert executable.peak_live_activations[s] == held


CI = {("gpt", 2, 2)}


@pytest.mark.parametrize("name,num_meshes,rounds", [
    pytest.param(n, p, r, marks=() if (n, p, r) in CI else pytest.mark.slow)
    for n in ("gpt", "ut") for p in (2, 4) for r in (1, 2, 4)])
def test_examples_interleaved_match_jit(name, num_meshes, rounds):
    """GPT and U-Transformer (whose long skips join stages on one mesh too) with 2 and 4 meshes,
    two stages each, and M = P, 2P, 4P micro-batches."""
    S, M = 2 * num_meshes, num_meshes * rounds
    if name == "gpt":
        model, batch, loss = GPT(num_stages=S), gpt_batch(0, 32, 8, 64), gpt_loss
    else:
        model, batch, loss = UTransformer(num_stages=S), ut_batch(0, 32), ut_loss
    ref_state, par_state, parallel = _run_both(model, batch, loss, num_meshes, M)
    assert_trees_close(par_state.params, ref_state.params)
    assert {t.kind for t in parallel.get_executable(par_state, batch).program.transfers} == {TransferKind.DEVICE_PUT}


@pytest.mark.slow
def test_a_skip_between_stages_on_one_mesh_is_not_a_move():
    """U-Transformer in 6 stages on 2 meshes (3 each): its skips from stage 1 to 3 and from 0 to
    4 stay on their mesh."""
    batch = ut_batch(0, 16)
    state = make_state(UTransformer(num_stages=6), batch["x"][:1])
    step = supervised_step(ut_loss)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=6, stages_per_mesh=3, schedule="interleaved_1f1b"))
    par_state, par_loss = parallel(state, batch)
    ref_state, ref_loss = jax.jit(step)(state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par_state.params, ref_state.params)
    executable = parallel.get_executable(par_state, batch)
    local = [t for t in executable.program.transfers if t.kind is TransferKind.LOCAL]
    assert {(t.src_stage, t.dst_stage) for t in local} == {(1, 3), (3, 1), (0, 4), (4, 0)}
    assert "local: both stages on one mesh, no move" in executable.describe()


def test_interleaved_with_weight_delay_and_p2p_moves_matches_jit():
    ref_state, par_state, _ = _run_both(MLP(features=(16,) * 7 + (4,), num_stages=4), _mlp_batch(), mse, 2, 4,
                                        weight_delay=True, executor="p2p")
    assert_trees_close(par_state.params, ref_state.params)


@pytest.mark.parametrize("kwargs,match", [
    (dict(schedule="1f1b", stages_per_mesh=2, num_stages=4), r"schedule: '1f1b' runs one stage per mesh"),
    (dict(schedule="interleaved_1f1b", stages_per_mesh=2, num_stages=4, num_micro_batches=3),
     r"num_micro_batches: interleaved_1f1b with virtual stages needs a multiple of 2"),
    (dict(schedule="interleaved_1f1b", stages_per_mesh=3, num_stages=4), r"stages_per_mesh"),
])
def test_bad_virtual_stage_options_name_the_argument_before_tracing(kwargs, match):
    kwargs.setdefault("num_micro_batches", 4)
    with pytest.raises(ValueError, match=match):
        method = meshpar.PipeshardParallel(**kwargs)
        # Stage counts known only from the model are checked when the step first compiles.
        meshpar.parallelize(supervised_step(mse), method=method)(
            make_state(MLP(features=(8, 4), num_stages=4), _mlp_batch()["x"][:1]), _mlp_batch())


def test_stage_meshes_fewer_than_stages_mean_virtual_stages():
    devices = np.array(jax.devices())
    meshes = [jax.sharding.Mesh(devices[:4].reshape(4, 1), ("data", "model")),
              jax.sharding.Mesh(devices[4:].reshape(2, 2), ("data", "model"))]
    batch = _mlp_batch()
    model = MLP(features=(16,) * 7 + (4,), num_stages=4)
    state = make_state(model, batch["x"][:1])
    step = supervised_step(mse)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=4, stage_meshes=meshes, schedule="interleaved_1f1b"))
    par_state, _ = parallel(state, batch)
    ref_state, _ = jax.jit(step)(state, batch)
    assert_trees_close(par_state.params, ref_state.params)
    executable = parallel.get_executable(par_state, batch)
    assert executable.stage_meshes == (meshes[0], meshes[1], meshes[0], meshes[1])
