"""Exact micro-batching: losses written for the whole batch (normalisers inside the loss
function, means, label smoothing, weight decay, aux metrics, padded rows) equal jax.jit on one
device under meshpar's micro-batches; losses that mix rows after parameters enter (BatchNorm, a
max over the batch) are named at compile time, and match a per-micro-batch reference."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn

import meshpar
from meshpar.passes import jax_ir
from meshpar import MicroBatchingWarning
from meshpar.passes.pipeline.cutting.exact_micro_batching import (plan_exact_micro_batching,
                                                                   rewrite_loss)
from meshpar.passes.pipeline.cutting.row_kinds import RowKind, analyze_row_kinds
from pipeline_models import assert_trees_close, make_state

M = 4
B, T, V, D = 16, 5, 7, 6


class TokenModel(nn.Module):
    """Embeds T tokens, ``blocks`` tanh(Dense) blocks each followed by a stage marker, projects to
    V logits per token."""

    blocks: int = 1

    @nn.compact
    def __call__(self, tokens):
        h = nn.Embed(V, D)(tokens)
        for _ in range(self.blocks):
            h = jnp.tanh(nn.Dense(8)(h))
            meshpar.mark_stage_boundary()
        return nn.Dense(V)(h)


def _batch(seed=0, padded_micro_batch=True):
    rng = np.random.default_rng(seed)
    weights = (rng.random((B, T)) < 0.6).astype(np.float32)
    if padded_micro_batch:
        weights[:B // M] = 0.0  # the first micro-batch is all padding
    return {"tokens": rng.integers(0, V, (B, T)).astype(np.int32),
            "targets": rng.integers(0, V, (B, T)).astype(np.int32), "weights": weights}


def _xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)


# Each form is the loss function's body as public flax/optax code writes it.
LOSSES = {
    # flax's lm1b / wmt examples: weighted cross-entropy over the batch's token count, inside loss_fn.
    "normaliser_inside": lambda logits, b: (_xent(logits, b["targets"]) * b["weights"]).sum() / b["weights"].sum(),
    "label_smoothing": lambda logits, b: (optax.softmax_cross_entropy(
        logits, optax.smooth_labels(jax.nn.one_hot(b["targets"], V), 0.1)) * b["weights"]).sum()
        / jnp.maximum(b["weights"].sum(), 1.0),
    "per_token_mean": lambda logits, b: jnp.mean(_xent(logits, b["targets"])),
    "sum": lambda logits, b: jnp.sum(_xent(logits, b["targets"]) * b["weights"]),
    "mean_of_means": lambda logits, b: jnp.mean(
        (_xent(logits, b["targets"]) * b["weights"]).sum(-1) / jnp.maximum(b["weights"].sum(-1), 1.0)),
}


def _step(form, weight_decay=0.0, exact=False):
    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch["tokens"])
            loss = LOSSES[form](logits, batch)
            if weight_decay:
                loss = loss + weight_decay * sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params))
            hits = (jnp.argmax(logits, -1) == batch["targets"]) * batch["weights"]
            return loss, {"accuracy": hits.sum() / jnp.maximum(batch["weights"].sum(), 1.0),
                          "tokens": batch["weights"].sum(), "per_row": hits.sum(-1)}

        (loss, aux), grads = meshpar.value_and_grad(loss_fn, has_aux=True, exact=exact)(state.params)
        return state.apply_gradients(grads=grads), loss, aux

    return step


def _against_jit(step, batch, schedule="1f1b", steps=3, stage_mesh_shape=(2, 1), stages_per_mesh=1):
    state = make_state(TokenModel(blocks=2 * stages_per_mesh - 1), batch["tokens"][:1], learning_rate=1e-2)
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2 * stages_per_mesh,
                                       stage_mesh_shape=stage_mesh_shape, schedule=schedule,
                                       stages_per_mesh=stages_per_mesh,
                                       devices=jax.devices()[:2 * int(np.prod(stage_mesh_shape))])
    parallel = meshpar.parallelize(step, method=method)
    ref, par = state, state
    with warnings.catch_warnings():
        warnings.simplefilter("error", MicroBatchingWarning)
        for _ in range(steps):
            ref, ref_loss, ref_aux = jax.jit(step)(ref, batch)
            par, par_loss, par_aux = parallel(par, batch)
            assert np.isfinite(float(par_loss))
            np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5, atol=1e-6)
            assert_trees_close(par_aux, ref_aux, rtol=1e-5, atol=1e-6)
    assert_trees_close(par.params, ref.params, rtol=1e-4, atol=1e-4)
    return parallel, par


@pytest.mark.parametrize("form", sorted(LOSSES))
def test_loss_forms_equal_jit(form):
    _against_jit(_step(form), _batch())


def test_weight_decay_and_zb_v_equal_jit():
    """A batch-independent term added to the loss (split evenly over the shares), under ZB-V's
    two stages per mesh and data-parallel replicas."""
    parallel, state = _against_jit(_step("normaliser_inside", weight_decay=1e-3), _batch(seed=1), schedule="zb_v",
                                   stage_mesh_shape=(2, 1), stages_per_mesh=2)
    described = parallel.get_executable(state, _batch(seed=1)).describe()
    assert "micro-batches combine: loss and gradients exactly" in described
    assert re.search(r"\b3 value\(s\) of the batch alone computed once on the whole batch", described), described


def test_random_masks_equal_jit_without_nan():
    for seed in range(2):
        batch = _batch(seed=10 + seed)
        batch["weights"] = (np.random.default_rng(seed).random((B, T)) < 0.3).astype(np.float32)
        _against_jit(_step("normaliser_inside"), batch, steps=1)


def test_normaliser_outside_loss_fn_equals_jit():
    """docs/micro_batching.md's recipe: the count computed in the step, the loss a masked sum over it."""
    def step(state, batch):
        count = jnp.maximum(batch["weights"].sum(), 1.0)

        def loss_fn(params):
            logits = state.apply_fn(params, batch["tokens"])
            return (_xent(logits, batch["targets"]) * batch["weights"]).sum() / count

        loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, {"count": count}

    _against_jit(step, _batch(), stage_mesh_shape=(1, 1))


# -- what cannot be exact --------------------------------------------------------------------


class BatchNormModel(nn.Module):
    """Dense, BatchNorm over the batch, a stage marker, Dense: flax's image-classifier pattern."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(jax.nn.relu(h))


def _bn_step(exact=False):
    def step(state, batch_stats, batch):
        def loss_fn(params):
            logits, updates = state.apply_fn({"params": params, "batch_stats": batch_stats}, batch["x"],
                                             mutable=["batch_stats"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
            return loss, updates["batch_stats"]

        (loss, new_stats), grads = meshpar.value_and_grad(loss_fn, has_aux=True, exact=exact)(state.params)
        return state.apply_gradients(grads=grads), new_stats, loss

    return step


def _bn_setup():
    rng = np.random.default_rng(3)
    batch = {"x": rng.standard_normal((B, D)).astype(np.float32), "y": rng.integers(0, 4, (B,)).astype(np.int32)}
    model = BatchNormModel()
    variables = model.init(jax.random.key(0), batch["x"][:2])
    from flax.training import train_state
    state = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                          tx=optax.sgd(0.1))
    return state, variables["batch_stats"], batch


def test_batch_norm_warns_naming_its_line_and_matches_per_micro_batch():
    state, stats, batch = _bn_setup()
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:2], batch_argnums=(2,))
    parallel = meshpar.parallelize(_bn_step(), method=method)
    with pytest.warns(MicroBatchingWarning, match=r"micro-batching is not exact.*test_exact_micro_batching\.py:\d+"):
        new_state, _, loss = parallel(state, stats, batch)
    # Reference: each micro-batch a batch of its own under jax.jit, losses and gradients averaged.
    def micro_loss(params, rows):
        logits, _ = state.apply_fn({"params": params, "batch_stats": stats}, rows["x"], mutable=["batch_stats"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, rows["y"]).mean()

    size = B // M
    parts = [jax.jit(jax.value_and_grad(micro_loss))(state.params, jax.tree.map(lambda v: v[m * size:(m + 1) * size],
                                                                                batch)) for m in range(M)]
    want_loss = np.mean([float(l) for l, _ in parts])
    want_grads = jax.tree.map(lambda *g: sum(g) / M, *[g for _, g in parts])
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    assert_trees_close(new_state.params, state.apply_gradients(grads=want_grads).params, rtol=1e-5, atol=1e-6)
    described = parallel.get_executable(state, stats, batch).describe()
    assert "by mean (per micro-batch" in described and "not exact: " in described


def test_batch_norm_under_exact_raises_naming_the_operation():
    state, stats, batch = _bn_setup()
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:2], batch_argnums=(2,))
    with pytest.raises(ValueError, match=r"exact: .*cannot reproduce.*test_exact_micro_batching\.py:\d+"):
        meshpar.parallelize(_bn_step(exact=True), method=method)(state, stats, batch)


def test_explicit_mean_with_an_inner_normaliser_warns_that_it_differs_from_jit():
    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn(params, batch["tokens"])
            return LOSSES["normaliser_inside"](logits, batch)

        loss, grads = meshpar.value_and_grad(loss_fn, reduction="mean")(state.params)
        return state.apply_gradients(grads=grads), loss

    batch = _batch(padded_micro_batch=False)
    state = make_state(TokenModel(), batch["tokens"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:2])
    with pytest.warns(MicroBatchingWarning, match="reduction='mean'.*differs from jax.jit"):
        meshpar.parallelize(step, method=method)(state, batch)


def test_argument_errors():
    with pytest.raises(ValueError, match="exact: True asks for the inferred"):
        meshpar.value_and_grad(lambda p: p, reduction="mean", exact=True)
    with pytest.raises(TypeError, match="exact: expected a bool"):
        meshpar.value_and_grad(lambda p: p, exact="yes")


# -- the analysis alone, on hand-written losses ------------------------------------------------


def _kinds(loss, *operands, per_micro_batch, num_diff=1):
    micro = jax.make_jaxpr(loss)(*[o[0] for o in operands])
    whole = jax.make_jaxpr(loss)(*[o[1] for o in operands])
    kinds = [RowKind.CONST] * num_diff + [RowKind.ROW if p else RowKind.CONST for p in per_micro_batch]
    return analyze_row_kinds(micro, whole, kinds)


def _pair(shape, rows_axis=0, micro=4, whole=16):
    return tuple(jax.ShapeDtypeStruct(tuple(n if k != rows_axis else r for k, n in enumerate(shape)), jnp.float32)
                 for r in (micro, whole))


def test_kinds_of_row_mixing_operations_name_each():
    w = (jax.ShapeDtypeStruct((3,), jnp.float32),) * 2
    x = _pair((16, 3))
    cases = {
        "reduce_max": lambda w, x: jnp.max(x * w),
        "sub": lambda w, x: jnp.sum(x * w - jnp.mean(x * w, axis=0)),  # BatchNorm-like centring
        "log": lambda w, x: jnp.log(jnp.sum(jnp.exp(x * w))),  # a logsumexp over the rows
        "dot_general": lambda w, x: jax.nn.logsumexp((x * w) @ (x * w).T),  # contrastive logits
    }
    for primitive, loss in cases.items():
        kinds = _kinds(loss, w, x, per_micro_batch=[True])
        assert kinds.outputs[0] is RowKind.MIXED, primitive
        assert kinds.inexact and kinds.inexact[0].primitive == primitive, (primitive, kinds.inexact)
        assert "test_exact_micro_batching.py" in kinds.inexact[0].where


def test_kinds_of_linear_losses_are_partial_with_whole_batch_scalars():
    w = (jax.ShapeDtypeStruct((3,), jnp.float32),) * 2
    x = _pair((16, 3))
    kinds = _kinds(lambda w, x: jnp.mean(x * w) + 0.5 * jnp.sum(w ** 2), w, x, per_micro_batch=[True])
    assert kinds.outputs == (RowKind.PARTIAL,) and not kinds.inexact
    assert [e.value for e in kinds.literals] == [48.0], "the mean divides by the whole batch's 16 * 3 entries"
    assert len(kinds.split_terms) == 1, "the weight decay term is split over the shares"


def test_a_scan_carrying_a_row_sum_stays_partial():
    w = (jax.ShapeDtypeStruct((2, 3), jnp.float32),) * 2
    x = _pair((16, 3))

    def loss(w, x):
        def layer(total, wl):
            return total + jnp.mean(jnp.tanh(x * wl)), None
        return jax.lax.scan(layer, 0.0, w)[0]

    kinds = _kinds(loss, w, x, per_micro_batch=[True])
    assert kinds.outputs == (RowKind.PARTIAL,) and not kinds.inexact
    assert [e.value for e in kinds.literals] == [48.0] and len(kinds.split_terms) == 1


def test_plan_hoists_the_batch_count_and_the_shares_sum_to_the_whole_loss():
    """Evaluated directly: the rewritten per-micro-batch loss, fed the hoisted count computed on
    the whole batch, sums over micro-batches to the loss of the whole batch, and so do the
    gradients."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal(3).astype(np.float32)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    mask = (rng.random(16) < 0.5).astype(np.float32)
    mask[:4] = 0.0

    def loss(w, x, mask):
        return jnp.sum(jnp.tanh(x @ w) ** 2 * mask) / mask.sum() + 0.1 * jnp.sum(w ** 2)

    micro = jax.make_jaxpr(loss)(w, x[:4], mask[:4])
    whole = jax.make_jaxpr(loss)(w, x, mask)
    plan = plan_exact_micro_batching(micro, whole, 1, [True, True], frozenset(), ())
    assert plan.exact and len(plan.hoisted) == 1
    share = rewrite_loss(micro, plan, M)
    count = mask.sum()

    def summed(w):
        return sum(jax_ir.eval_jaxpr(share.jaxpr, share.consts, w, x[m * 4:(m + 1) * 4], mask[m * 4:(m + 1) * 4],
                                     count)[0] for m in range(M))

    np.testing.assert_allclose(float(summed(w)), float(loss(w, x, mask)), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(summed)(w)), np.asarray(jax.grad(loss)(w, x, mask)), rtol=1e-5)


def test_a_guarded_normaliser_is_affine_and_constants_hidden_from_rewrites_are_named():
    w = (jax.ShapeDtypeStruct((3,), jnp.float32),) * 2
    x = _pair((16, 3))
    # jnp.where(count > 0, total / count, 0.0): the zero branch is a term split over the shares.
    guarded = _kinds(lambda w, x: jnp.where(w[0] > 0, jnp.sum(x * w) / 16.0, 0.0), w, x, per_micro_batch=[True])
    assert guarded.outputs == (RowKind.PARTIAL,) and len(guarded.split_terms) == 1

    @jax.custom_jvp
    def batch_mean(v):
        return jnp.mean(v)

    batch_mean.defjvp(lambda primals, tangents: (batch_mean(*primals), jnp.mean(*tangents)))
    hidden = _kinds(lambda w, x: batch_mean(jnp.sum(x * w, axis=1)), w, x, per_micro_batch=[True])
    assert hidden.outputs == (RowKind.MIXED,)
    assert "constant that depends on the batch size inside a custom derivative" in str(hidden.inexact[0])


def test_traces_at_other_batch_sizes_stop_at_the_gradient_call():
    """The step is traced whole once, at the batch's size; the traces at the micro-batch's (and a
    replica's) size read only its gradient call, so the update after it is traced once, and
    the step still equals jax.jit."""
    from pipeline_models import TwoStages

    updates_traced = []

    def train_step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        updates_traced.append(batch["x"].shape[0])
        return state.apply_gradients(grads=grads), loss

    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32),
             "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(TwoStages(), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 1),
                                       devices=jax.devices()[:4])
    got_state, got_loss = meshpar.parallelize(train_step, method=method)(state, batch)
    assert updates_traced == [16], updates_traced  # once, whole: none at 4 rows (a micro-batch) or 2 (a replica)
    want_state, want_loss = jax.jit(train_step)(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
