"""Evaluation steps (no meshpar gradient) pipelined forward-only on the train step's stage meshes,
against jax.jit on one device: metrics over the batch combine exactly, per-example outputs
concatenate, and alternating train and eval steps moves no parameter."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshpar
from examples.mlp import MLP
from meshpar.passes.pipeline.scheduling.pipeline_schedule import FORWARD_ONLY_SCHEDULES, StagePlacement, make_schedule
from meshpar.passes.program.tasks import TaskKind
from pipeline_models import MoveCounter, TensorParallel, TwoStages, assert_trees_close, make_state

M = 4


def _batch(n=16, d=6, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "label": rng.integers(0, k, n).astype(np.int32)}


def _cross_entropy(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def eval_step(state, batch):
    """flax's examples' eval step: metrics over the batch, plus the per-example predictions."""
    logits = state.apply_fn(state.params, batch["x"])
    return {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]),
            "loss": _cross_entropy(logits, batch["label"]),
            "pred": jnp.argmax(logits, -1)}


def train_step(state, batch):
    def loss_fn(params):
        return _cross_entropy(state.apply_fn(params, batch["x"]), batch["label"])

    loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _assert_metrics_equal(got, want):
    np.testing.assert_allclose(float(got["accuracy"]), float(want["accuracy"]), rtol=1e-5)
    np.testing.assert_allclose(float(got["loss"]), float(want["loss"]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got["pred"]), np.asarray(want["pred"]))


def _train_then_eval(monkeypatch, model, method, steps=2):
    """``steps`` train steps of ``model`` under ``method`` and jax.jit, an eval step after each,
    then the next train step: every result equal to jax.jit's. Returns the eval step, the
    moves of the state's leaves during the last eval call, and the state it evaluated."""
    batch = _batch(d=8 if isinstance(model, MLP) else 6)
    state = make_state(model, batch["x"][:1])
    train, evaluate = meshpar.parallelize(train_step, method=method), meshpar.parallelize(eval_step, method=method)
    ref_train, ref_eval = jax.jit(train_step), jax.jit(eval_step)
    par, ref = state, state
    for step in range(steps):
        par, loss = train(par, batch)
        ref, ref_loss = ref_train(ref, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        if step == steps - 1:
            with monkeypatch.context() as patch:
                counter = MoveCounter(patch, jax.tree_util.tree_leaves_with_path(par))
                metrics = evaluate(par, batch)
        else:
            metrics = evaluate(par, batch)
        _assert_metrics_equal(metrics, ref_eval(ref, batch))
    par, loss = train(par, batch)
    ref, ref_loss = ref_train(ref, batch)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    return evaluate, counter.moved, par, batch


# (2, 2): kernels sharded over each stage mesh's model axis, as flax partitions them.
CASES = [((2, 1), TwoStages), ((2, 2), TensorParallel)]


def _method(stage_mesh_shape):
    return meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=stage_mesh_shape,
                                     devices=jax.devices()[:2 * stage_mesh_shape[0] * stage_mesh_shape[1]])


@pytest.mark.parametrize("stage_mesh_shape, model", CASES)
def test_eval_step_equals_jit_forward_only(stage_mesh_shape, model):
    method = _method(stage_mesh_shape)
    batch = _batch()
    state = make_state(model(), batch["x"][:1])
    evaluate = meshpar.parallelize(eval_step, method=method)
    _assert_metrics_equal(evaluate(state, batch), jax.jit(eval_step)(state, batch))
    compiled = evaluate.get_compiled(state, batch)
    # Forwards and activation transfers only; the mean metrics add up the micro-batches' shares
    # of the whole batch's (exactly), the predictions concatenate.
    assert {t.kind for t in compiled.schedule.order} == {TaskKind.FORWARD, TaskKind.SEND_ACT}
    assert [r.value for r in compiled.micro_batching.aux] == ["sum", "sum", "concat"]
    described = evaluate.get_executable(state, batch).describe()
    assert "schedule forward_only, no backward" in described
    assert "gradient" not in described.split("\n", 1)[1].replace("its gradient sent back", "")


@pytest.mark.parametrize("stage_mesh_shape, model", CASES)
def test_eval_between_train_steps_moves_no_parameter(monkeypatch, stage_mesh_shape, model):
    method = _method(stage_mesh_shape)
    evaluate, moved, state, batch = _train_then_eval(monkeypatch, model(), method)
    # Not a parameter, nor the optimizer state the eval step does not read, moves.
    assert moved == []
    # The counter sees moves: a fresh state's parameters are placed on the stage meshes.
    fresh = make_state(model(), batch["x"][:1])
    with monkeypatch.context() as patch:
        counter = MoveCounter(patch, jax.tree_util.tree_leaves_with_path(fresh.params))
        evaluate(fresh, batch)
    assert {m.split(" ", 1)[1] for m in counter.moved} == {str(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        fresh.params)}
    # Each parameter lives where the train step keeps it: on its stage's mesh only.
    compiled = evaluate.get_compiled(state, batch)
    for path, leaf in jax.tree_util.tree_leaves_with_path(state.params):
        stage = 0 if "Dense_0" in str(path) else 1
        assert set(leaf.sharding.device_set) == set(compiled.stage_meshes[stage].devices.flat)


def test_eval_under_zb_v_moves_no_parameter(monkeypatch):
    """ZB-V places stages 0 and 3 on mesh 0, 1 and 2 on mesh 1: the eval step's forward-only
    schedule keeps that V placement."""
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=4, stages_per_mesh=2, stage_mesh_shape=(2, 1),
                                       devices=jax.devices()[:4], schedule="zb_v")
    evaluate, moved, state, batch = _train_then_eval(monkeypatch, MLP(features=(16, 16, 16, 4), num_stages=4), method)
    assert moved == []
    compiled = evaluate.get_compiled(state, batch)
    assert compiled.schedule.name == "forward_only_v" and compiled.schedule.stage_mesh == (0, 1, 1, 0)


def _plain_eval(params, batch):
    """A model without stage markers."""
    h = jnp.tanh(jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"])
    logits = h @ params["w3"]
    return {"accuracy": jnp.mean(jnp.argmax(logits, -1) == batch["label"]), "pred": jnp.argmax(logits, -1)}


def _plain_params():
    rng = np.random.default_rng(1)
    return {name: jnp.asarray(rng.standard_normal(shape), jnp.float32)
            for name, shape in (("w1", (6, 32)), ("w2", (32, 32)), ("w3", (32, 4)))}


def test_eval_without_markers_is_an_error_naming_auto_layers():
    evaluate = meshpar.parallelize(_plain_eval, method=_method((2, 1)))
    with pytest.raises(ValueError, match="num_stages: 2 stages asked for, but the model calls "
                                         "meshpar.mark_stage_boundary\\(\\) nowhere.*auto_layers=2"):
        evaluate(_plain_params(), _batch())


def test_eval_without_markers_cut_by_auto_layers_equals_jit():
    params, batch = _plain_params(), _batch()
    evaluate = meshpar.parallelize(_plain_eval, method=meshpar.PipeshardParallel(
        num_micro_batches=M, num_stages=2, auto_layers=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4]))
    got, want = evaluate(params, batch), jax.jit(_plain_eval)(params, batch)
    np.testing.assert_allclose(float(got["accuracy"]), float(want["accuracy"]), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(got["pred"]), np.asarray(want["pred"]))
    assert evaluate.get_compiled(params, batch).graph.num_stages == 2


def test_eval_step_differentiating_with_jax_grad_is_still_refused():
    """A step differentiating while JAX traces is no evaluation step: the error shows meshpar's form."""
    batch = _batch()
    state = make_state(TwoStages(), batch["x"][:1])

    def jax_grad_step(state, batch):
        return jax.grad(lambda p: _cross_entropy(state.apply_fn(p, batch["x"]), batch["label"]))(state.params)

    evaluate = meshpar.parallelize(jax_grad_step, method=meshpar.PipeshardParallel(
        num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4]))
    with pytest.raises(ValueError, match="it differentiates with jax.grad"):
        evaluate(state, batch)


@pytest.mark.parametrize("placement_kind, num_meshes, stages_per_mesh", [
    (StagePlacement.LOOP, 2, 1), (StagePlacement.LOOP, 2, 2), (StagePlacement.V, 2, 2), (StagePlacement.V, 3, 2)])
def test_forward_only_schedule_runs_each_forward_once_on_its_placement(placement_kind, num_meshes, stages_per_mesh):
    kind = FORWARD_ONLY_SCHEDULES[placement_kind]
    S = num_meshes * stages_per_mesh
    schedule = make_schedule(kind, S, 3, [(s, s + 1) for s in range(S - 1)], num_meshes=num_meshes)
    assert schedule.forward_only and not schedule.split_backward
    assert sorted((t.where, t.micro_batch) for t in schedule.order if t.kind is TaskKind.FORWARD) == \
        [(s, m) for s in range(S) for m in range(3)]
    assert {t.kind for t in schedule.order} == {TaskKind.FORWARD, TaskKind.SEND_ACT}
    assert schedule.stage_mesh == tuple(placement_kind.mesh_of(s, num_meshes) for s in range(S))
