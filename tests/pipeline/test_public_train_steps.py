"""Train steps written as public flax code writes them (``examples/flax_lm.py``: flax's lm1b
pattern, normaliser inside the loss function, metrics outside it, logical partitioning;
``examples/flax_image_classifier.py``: flax's imagenet pattern with BatchNorm), changed only to
``meshpar.value_and_grad`` and stage markers, against ``jax.jit`` on one device (the exact case)
and against ``jax.jit`` run per micro-batch (BatchNorm, which cannot be exact)."""

import jax
import numpy as np
import pytest

import meshpar
from examples import flax_image_classifier as classifier
from examples import flax_lm as lm
from pipeline_models import MoveCounter, assert_trees_close

M = 4


@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_the_lm1b_pattern_equals_jit(schedule):
    V = 2 if schedule == "zb_v" else 1
    state = lm.make_state(lm.PaddedLM(num_blocks=2 * V), lm.lm_batch(0)["inputs"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2 * V, stage_mesh_shape=(2, 2),
                                       schedule=schedule, stages_per_mesh=V, logical_axis_rules=lm.LOGICAL_AXIS_RULES)
    parallel = meshpar.parallelize(lm.train_step, method=method)
    ref = par = state
    for step in range(3):
        batch = lm.lm_batch(step)
        assert not batch["targets"][:len(batch["targets"]) // M].any(), "the first micro-batch is padding only"
        ref, want = jax.jit(lm.train_step)(ref, batch)
        par, got = parallel(par, batch)
        np.testing.assert_allclose(float(got["loss"] / got["denominator"]), float(want["loss"] / want["denominator"]),
                                   rtol=1e-5)
        assert_trees_close(got, want, rtol=1e-5, atol=1e-5)
    assert_trees_close(par.params, ref.params, rtol=1e-4, atol=1e-4)
    kernel = par.params["Block_0"]["Dense_0"]["kernel"]
    assert kernel.value.sharding.spec == jax.sharding.PartitionSpec(None, "model"), "the rules map 'mlp' to 'model'"
    assert "loss and gradients exactly" in parallel.get_executable(par, lm.lm_batch(0)).describe()


def _per_micro_batch_reference(state, batch):
    """flax's imagenet step with each micro-batch a batch of its own: gradients and new
    statistics averaged, one update; the metrics of the micro-batches' logits together."""
    size = len(batch["label"]) // M
    host = jax.device_get(state)

    def loss_fn(params, rows):
        logits, new = host.apply_fn({"params": params, "batch_stats": host.batch_stats}, rows["image"],
                                    mutable=["batch_stats"])
        l2 = sum((x ** 2).sum() for x in jax.tree.leaves(params) if x.ndim > 1)
        return classifier.cross_entropy_loss(logits, rows["label"]) + classifier.WEIGHT_DECAY * 0.5 * l2, (new, logits)

    runs = [jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(host.params, jax.tree.map(
        lambda v: v[m * size:(m + 1) * size], batch)) for m in range(M)]
    mean = lambda *xs: sum(xs) / M  # noqa: E731
    grads = jax.tree.map(mean, *[g for _, g in runs])
    stats = jax.tree.map(mean, *[aux[0]["batch_stats"] for (_, aux), _ in runs])
    logits = np.concatenate([np.asarray(aux[1]) for (_, aux), _ in runs])
    return host.apply_gradients(grads=grads, batch_stats=stats), classifier.compute_metrics(logits, batch["label"])


def test_the_imagenet_pattern_with_batch_norm_warns_and_runs_per_micro_batch():
    state = classifier.make_state(classifier.image_batch(0)["image"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:2])
    parallel = meshpar.parallelize(classifier.train_step, method=method)
    batch = classifier.image_batch(0)
    want_state, want = _per_micro_batch_reference(state, batch)
    with pytest.warns(meshpar.MicroBatchingWarning, match=r"not exact.*flax_image_classifier\.py:\d+ \(ConvNet"):
        got_state, got = parallel(state, batch)
    assert_trees_close(got, want, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_state.params, want_state.params, rtol=1e-5, atol=1e-6)
    assert_trees_close(got_state.batch_stats, want_state.batch_stats, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"exact: .*flax_image_classifier\.py:\d+"):
        meshpar.parallelize(classifier.make_train_step(exact=True), method=method)(state, batch)


def test_the_lm1b_eval_step_runs_in_the_trained_pipeline_moving_no_parameter(monkeypatch):
    """flax's ``eval_step(params, batch)`` (no gradient), under the train step's method: its
    metrics equal jax.jit's, and calling it between train steps moves no parameter."""
    state = lm.make_state(lm.PaddedLM(), lm.lm_batch(0)["inputs"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2),
                                       logical_axis_rules=lm.LOGICAL_AXIS_RULES)
    train, evaluate = meshpar.parallelize(lm.train_step, method=method), meshpar.parallelize(lm.eval_step,
                                                                                            method=method)
    ref = par = state
    for step in range(2):
        batch = lm.lm_batch(step)
        ref, _ = jax.jit(lm.train_step)(ref, batch)
        par, _ = train(par, batch)
        with monkeypatch.context() as patch:
            counter = MoveCounter(patch, jax.tree_util.tree_leaves_with_path(par.params))
            got = evaluate(par.params, lm.lm_batch(10 + step))
        assert_trees_close(got, jax.jit(lm.eval_step)(ref.params, lm.lm_batch(10 + step)), rtol=1e-5, atol=1e-5)
        if step:
            assert counter.moved == [], counter.moved
    assert "forward_only" in evaluate.get_executable(par.params, lm.lm_batch(0)).describe()
