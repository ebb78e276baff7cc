"""Train steps as flax/optax users write them, under meshpar.parallelize, against jax.jit on one
device: aux outputs and BatchNorm, integer, bool and key values between stages, PRNG folding per
micro-batch, loss reductions and masked means, and updates combining several meshes
(global-norm clipping). Where micro-batching changes the semantics (BatchNorm statistics, keys
folded per micro-batch) the reference is jax.jit run per micro-batch and combined as documented."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import meshpar
from pipeline_models import TwoStages, assert_trees_close

M = 4
METHOD = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2))


def _batch(n=16, d=6, k=4, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


def _state(model, x, tx=None, **variables):
    params = model.init(jax.random.key(0), x[:1])
    return train_state.TrainState.create(apply_fn=model.apply, params=params["params"],
                                         tx=tx or optax.adam(1e-2, eps=1e-5))


def _micro(batch, m):
    return jax.tree.map(lambda v: v[m * (len(v) // M):(m + 1) * (len(v) // M)], batch)


def _run(step, state, *args, steps=2):
    """``steps`` steps of ``step`` under jax.jit and meshpar.parallelize, each side its own state."""
    parallel = meshpar.parallelize(step, method=METHOD)
    ref, par = state, state
    for _ in range(steps):
        ref_out = jax.jit(step)(ref, *args)
        par_out = parallel(par, *args)
        ref, par = ref_out[0], par_out[0]
    return ref_out, par_out, parallel


# -- aux outputs ---------------------------------------------------------------------------


def _aux_step(aux_reduction=None, reduction=None):
    def step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"])
            loss = jnp.mean((out - batch["y"]) ** 2)
            aux = {"mse": loss, "hits": jnp.sum(jnp.abs(out - batch["y"]) < 0.5).astype(jnp.int32),
                   "pred": out, "peak": jnp.max(out)}
            return loss, aux

        (loss, aux), grads = meshpar.value_and_grad(loss_fn, has_aux=True, aux_reduction=aux_reduction,
                                                    reduction=reduction)(state.params)
        return state.apply_gradients(grads=grads), loss, aux

    return step


def test_aux_defaults_equal_jit_mean_count_and_concatenation():
    batch = _batch()
    state = _state(TwoStages(), batch["x"])
    (ref, ref_loss, ref_aux), (par, par_loss, par_aux), _ = _run(_aux_step({"peak": "last"}), state, batch)
    assert_trees_close(par.params, ref.params)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    # Mean of equal micro-batch means, sum of counts, concatenated per-example values.
    np.testing.assert_allclose(float(par_aux["mse"]), float(ref_aux["mse"]), rtol=1e-5)
    assert par_aux["hits"].dtype == jnp.int32 and int(par_aux["hits"]) == int(ref_aux["hits"])
    np.testing.assert_allclose(np.asarray(par_aux["pred"]), np.asarray(ref_aux["pred"]), rtol=1e-5, atol=1e-6)
    # "last": the last micro-batch's value, as jax.jit computes it on that micro-batch.
    last = jax.jit(lambda s, b: jnp.max(s.apply_fn({"params": s.params}, b["x"])))
    np.testing.assert_allclose(float(par_aux["peak"]), float(last(jax.jit(_aux_step())(state, batch)[0], _micro(batch, M - 1))),
                               rtol=1e-5)


def test_aux_reduction_sum_and_errors():
    batch = _batch()
    state = _state(TwoStages(), batch["x"])
    # Per-micro-batch semantics (reduction="mean"): each block's aux is its own batch's mean.
    _, (_, _, aux), _ = _run(_aux_step({"mse": meshpar.AuxReduction.SUM, "hits": "sum", "pred": "concat",
                                        "peak": "mean"}, reduction="mean"), state, batch, steps=1)

    def block_mses(num_blocks):
        size = len(batch["x"]) // num_blocks
        return [float(jnp.mean((state.apply_fn({"params": state.params}, batch["x"][b * size:(b + 1) * size])
                                - batch["y"][b * size:(b + 1) * size]) ** 2)) for b in range(num_blocks)]

    # METHOD's meshes run each stage as 2 data-parallel replicas, and each replica's block
    # combines as a micro-batch does (docs/micro_batching.md): the sum is over M * 2 blocks.
    np.testing.assert_allclose(float(aux["mse"]), sum(block_mses(2 * M)), rtol=1e-5)
    whole = meshpar.parallelize(_aux_step({"mse": "sum"}, reduction="mean"), method=dataclasses.replace(
        METHOD, gradient_reduction="per_micro_batch"))(state, batch)
    np.testing.assert_allclose(float(whole[2]["mse"]), sum(block_mses(M)), rtol=1e-5)
    with pytest.raises(ValueError, match="aux_reduction: aux leaf .* combine it with 'concat'") as error:
        meshpar.parallelize(_aux_step({"pred": "mean"}), method=METHOD)(state, batch)
    assert "test_train_patterns.py:" in str(error.value), "the error names the user's value_and_grad call"
    with pytest.raises(ValueError, match="aux_reduction: .*'mean' needs floating"):
        meshpar.parallelize(_aux_step({"hits": "mean"}), method=METHOD)(state, batch)
    with pytest.raises(ValueError, match="aux_reduction: expected"):
        meshpar.value_and_grad(lambda p: (p, p), has_aux=True, aux_reduction="median")
    with pytest.raises(ValueError, match="aux_reduction: given, but has_aux=False"):
        meshpar.value_and_grad(lambda p: p, aux_reduction="sum")
    with pytest.raises(ValueError, match="reduction: expected"):
        meshpar.value_and_grad(lambda p: p, reduction="max")


def test_parameters_computed_in_the_step_are_rejected_naming_the_line():
    batch = _batch()
    state = _state(TwoStages(), batch["x"])

    def step(state, batch):
        scaled = jax.tree.map(lambda p: p * 2.0, state.params)
        loss, grads = meshpar.value_and_grad(
            lambda p: jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2))(scaled)
        return state.apply_gradients(grads=grads), loss

    with pytest.raises(ValueError, match=r"computed inside the step \(meshpar.value_and_grad at .*test_train_patterns.py:"):
        meshpar.parallelize(step, method=METHOD)(state, batch)


def test_value_and_grad_matches_jax_outside_a_pipeline():
    def f(a, b, c):
        return jnp.sum(a * b) + c, {"b": b}

    args = (jnp.arange(3.0), jnp.ones(3), 2.0)
    for argnums in (0, (0, 2), (1,)):
        got = meshpar.value_and_grad(f, argnums, has_aux=True)(*args)
        want = jax.value_and_grad(f, argnums, has_aux=True)(*args)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    grads, aux = meshpar.grad(f, 1, has_aux=True)(*args)
    np.testing.assert_array_equal(grads, jnp.arange(3.0))


def test_argnums_tuple_and_grad_with_aux_in_a_pipeline():
    batch = _batch()
    state = _state(TwoStages(), batch["x"])

    def step(state, batch):
        def loss_fn(x_scale, params):
            out = state.apply_fn({"params": params}, batch["x"] * x_scale)
            return jnp.mean((out - batch["y"]) ** 2), jnp.mean(out)

        grads, mean_out = meshpar.grad(loss_fn, argnums=(1,), has_aux=True)(jnp.float32(1.5), state.params)
        return state.apply_gradients(grads=grads[0]), mean_out

    (ref, ref_mean), (par, par_mean), _ = _run(step, state, batch)
    assert_trees_close(par.params, ref.params)
    np.testing.assert_allclose(float(par_mean), float(ref_mean), rtol=1e-5)


# -- BatchNorm -------------------------------------------------------------------------------


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        # No bias before the norm (it cancels, and its zero gradient is rounding noise).
        h = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(8, use_bias=False)(x))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(jax.nn.relu(h))


class _BNState(train_state.TrainState):
    batch_stats: dict


def _bn_step(state, batch):
    def loss_fn(params):
        out, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["x"],
                                      mutable=["batch_stats"])
        return jnp.mean((out - batch["y"]) ** 2), updates["batch_stats"]

    (loss, stats), grads = meshpar.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=stats), loss


def test_batch_norm_stats_are_the_mean_of_per_micro_batch_updates():
    batch = _batch()
    model = _BatchNormNet()
    variables = model.init(jax.random.key(0), batch["x"][:2])
    state = _BNState.create(apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                            tx=optax.adam(1e-2, eps=1e-5))
    parallel = meshpar.parallelize(_bn_step, method=METHOD)

    @jax.jit
    def reference(state, batch):
        # The documented semantics: each micro-batch normalises with its own statistics; the
        # step's loss and gradients are the micro-batches' means, and so are the new stats.
        def loss_fn(params, mb):
            out, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, mb["x"],
                                          mutable=["batch_stats"])
            return jnp.mean((out - mb["y"]) ** 2), updates["batch_stats"]

        runs = [jax.value_and_grad(loss_fn, has_aux=True)(state.params, _micro(batch, m)) for m in range(M)]
        mean = lambda *xs: sum(xs) / M  # noqa: E731
        loss = mean(*[r[0][0] for r in runs])
        stats = jax.tree.map(mean, *[r[0][1] for r in runs])
        grads = jax.tree.map(mean, *[r[1] for r in runs])
        return state.apply_gradients(grads=grads).replace(batch_stats=stats), loss

    ref, par = state, state
    for k in range(2):
        ref, ref_loss = reference(ref, batch)
        if k == 0:
            with pytest.warns(meshpar.MicroBatchingWarning, match="micro-batching is not exact"):
                par, par_loss = parallel(par, batch)
        else:
            par, par_loss = parallel(par, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    assert_trees_close(par.batch_stats, ref.batch_stats)
    # The running statistics moved, and they live on the mesh of the stage computing them.
    assert not np.allclose(np.asarray(par.batch_stats["BatchNorm_0"]["mean"]), 0.0)
    stage0 = parallel.get_executable(par, batch).meshes[0]
    assert par.batch_stats["BatchNorm_0"]["mean"].sharding.mesh.devices.tolist() == stage0.devices.tolist()


# -- integer, bool and key values between stages; PRNG folding --------------------------------


class _Tokens(nn.Module):
    """Embeds tokens; hands the next stage a padding mask (bool), an argmax index (int) and a
    dropout key derived on this stage (a typed key), none of which has a cotangent."""

    @nn.compact
    def __call__(self, tok, key):
        mask = tok != 0
        h = nn.Embed(10, 8)(tok)
        index = jnp.argmax(h[..., 0], axis=-1)
        sub = jax.random.fold_in(key, 7)
        meshpar.mark_stage_boundary()
        keep = jax.random.bernoulli(sub, 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0.0) * mask[..., None]
        picked = jnp.take_along_axis(h, index[:, None, None], axis=1)[:, 0]
        return nn.Dense(3)(jnp.sum(h, axis=1) + picked), keep


def _token_batch(n=16, t=5):
    rng = np.random.default_rng(1)
    tok = rng.integers(0, 10, (n, t)).astype(np.int32)
    tok[:, -1] = 0
    return {"tok": tok, "y": rng.standard_normal((n, 3)).astype(np.float32)}


def _token_loss(apply_fn, params, batch, key):
    out, keep = apply_fn({"params": params}, batch["tok"], key)
    return jnp.mean((out - batch["y"]) ** 2), keep


def _token_step(fold_rng=True):
    def step(state, batch, key):
        (loss, keep), grads = meshpar.value_and_grad(
            lambda p: _token_loss(state.apply_fn, p, batch, key), has_aux=True, fold_rng=fold_rng)(state.params)
        return state.apply_gradients(grads=grads), loss, keep

    return step


def _folded_reference(state, batch, key, fold):
    """jax.jit run per micro-batch with key ``fold_in(key, m)`` (or ``key``), combined as documented."""
    @jax.jit
    def run(state, batch, key):
        runs = [jax.value_and_grad(lambda p, m=m: _token_loss(state.apply_fn, p, _micro(batch, m),
                                                              jax.random.fold_in(key, m) if fold else key),
                                   has_aux=True)(state.params) for m in range(M)]
        grads = jax.tree.map(lambda *g: sum(g) / M, *[r[1] for r in runs])
        return (state.apply_gradients(grads=grads), sum(r[0][0] for r in runs) / M,
                jnp.concatenate([r[0][1] for r in runs]))

    return run(state, batch, key)


@pytest.mark.parametrize("key_kind, fold_rng", [
    ("typed", True), ("raw", False), pytest.param("typed", False, marks=pytest.mark.slow),
    pytest.param("raw", True, marks=pytest.mark.slow)])
def test_int_bool_and_key_values_cross_stages_and_keys_fold_per_micro_batch(key_kind, fold_rng):
    batch = _token_batch()
    key = jax.random.key(3) if key_kind == "typed" else jax.random.PRNGKey(3)
    model = _Tokens()
    params = model.init(jax.random.key(0), batch["tok"][:1], jax.random.key(1))["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2, eps=1e-5))
    parallel = meshpar.parallelize(_token_step(fold_rng), method=METHOD)
    par, par_loss, keep = parallel(state, batch, key)
    ref, ref_loss, ref_keep = _folded_reference(state, batch, key, fold_rng)
    np.testing.assert_array_equal(np.asarray(keep), np.asarray(ref_keep))
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    per_mb = np.asarray(keep).reshape(M, -1)
    # Folded: every micro-batch draws its own mask; not folded: all draw the same one.
    assert (len({m.tobytes() for m in per_mb}) == M) if fold_rng else (len({m.tobytes() for m in per_mb}) == 1)
    executable = parallel.get_executable(state, batch, key)
    compiled = parallel.get_compiled(state, batch, key)
    crossing = [compiled.graph.stages[p].jaxpr.out_avals[r.slot] for p, _, r in compiled.graph.edges()]
    assert {str(a.dtype) for a in crossing} >= {"bool", "int32", "key<fry>" if key_kind == "typed" else "uint32"}
    # Only floating values send cotangents back.
    assert len(executable.program.transfers) == len(crossing) + sum(a.dtype == jnp.float32 for a in crossing)


class _DropoutNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dropout(0.3, deterministic=not train)(jnp.tanh(nn.Dense(8)(x)))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(nn.Dropout(0.3, deterministic=not train)(h))


def test_flax_dropout_rngs_draw_per_micro_batch_keys():
    batch = _batch()
    state = _state(_DropoutNet(), batch["x"])
    key = jax.random.PRNGKey(5)

    def loss(params, mb, k):
        out = state.apply_fn({"params": params}, mb["x"], rngs={"dropout": k})
        return jnp.mean((out - mb["y"]) ** 2)

    def step(state, batch, key):
        value, grads = meshpar.value_and_grad(lambda p: loss(p, batch, key))(state.params)
        return state.apply_gradients(grads=grads), value

    @jax.jit
    def reference(state, batch, key):
        runs = [jax.value_and_grad(loss)(state.params, _micro(batch, m), jax.random.fold_in(key, m)) for m in range(M)]
        grads = jax.tree.map(lambda *g: sum(g) / M, *[r[1] for r in runs])
        return state.apply_gradients(grads=grads), sum(r[0] for r in runs) / M

    # Each micro-batch whole on its mesh: as data-parallel replicas each would fold its replica
    # index in too (tests/pipeline/test_gradient_reduction.py).
    method = dataclasses.replace(METHOD, gradient_reduction="per_micro_batch")
    par, par_loss = meshpar.parallelize(step, method=method)(state, batch, key)
    ref, ref_loss = reference(state, batch, key)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    # jax.jit of the same step on the whole batch draws other masks: a different loss.
    assert abs(float(jax.jit(step)(state, batch, key)[1]) - float(par_loss)) > 1e-4


# -- loss reductions and masked means ---------------------------------------------------------


def test_sum_reduction_equals_jit_of_a_summed_loss():
    batch = _batch()
    state = _state(TwoStages(), batch["x"], tx=optax.sgd(1e-3))

    def step(state, batch):
        def loss_fn(params):
            return jnp.sum((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshpar.value_and_grad(loss_fn, reduction="sum")(state.params)
        return state.apply_gradients(grads=grads), loss

    (ref, ref_loss), (par, par_loss), _ = _run(step, state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par.params, ref.params)


def _masked_step(state, batch):
    # The recipe: a count over the whole batch, computed in the step before the gradient; the
    # loss sums its micro-batch's masked errors over that count; reduction="sum" adds them up.
    count = jnp.maximum(jnp.sum(batch["w"]), 1.0)

    def loss_fn(params):
        err = jnp.sum((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2, axis=-1)
        return jnp.sum(err * batch["w"]) / count

    loss, grads = meshpar.value_and_grad(loss_fn, reduction="sum")(state.params)
    return state.apply_gradients(grads=grads), loss, count


def test_masked_mean_recipe_equals_jit_even_with_a_fully_masked_micro_batch():
    batch = _batch()
    w = np.ones(16, np.float32)
    w[:4] = 0.0  # micro-batch 0 is all padding
    w[9] = 0.0
    batch["w"] = w
    state = _state(TwoStages(), batch["x"])
    (ref, ref_loss, ref_count), (par, par_loss, par_count), parallel = _run(_masked_step, state, batch)
    assert np.isfinite(float(par_loss))
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert float(par_count) == float(ref_count) == 11.0
    assert_trees_close(par.params, ref.params)
    # The count is a whole-batch value, computed before the pipeline, not per micro-batch.
    executable = parallel.get_executable(state, batch)
    compiled = parallel.get_compiled(state, batch)
    assert compiled.split.before and compiled.micro_batching.per_micro_batch.count(False) >= 1


# -- updates combining meshes -----------------------------------------------------------------


def test_global_norm_clipping_and_logging_match_jit():
    batch = _batch()
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(1e-2, eps=1e-5))
    state = _state(TwoStages(), batch["x"], tx=tx)

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss, optax.tree.norm(grads)

    (ref, ref_loss, ref_norm), (par, par_loss, par_norm), parallel = _run(step, state, batch, steps=3)
    assert float(ref_norm) > 0.05, "the clip must be active for the test to mean anything"
    np.testing.assert_allclose(float(par_norm), float(ref_norm), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
    assert_trees_close(par.opt_state, ref.opt_state)
    # Only scalars cross meshes around the pipeline: mesh 1's partial norms (for the clip and
    # the logged norm) packed into one transfer, and the clip's scale and flag sent back.
    split = parallel.get_compiled(par, batch).split
    moves = split.moved()
    assert [(m.src, m.dst) for m in moves] == [(1, 0), (0, 1), (0, 1)]
    assert len(moves[0].values) == 4 and all(split.avals[v].shape == () for m in moves for v in m.values)


def test_a_step_guarding_its_gradient_call_with_except_exception_matches_jit():
    # meshpar's traces at the micro-batch's size stop at the gradient call by raising past the
    # step (autodiff.LossTraced); a user's own ``except Exception`` must not catch that.
    batch = _batch()
    state = _state(TwoStages(), batch["x"])

    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        try:
            loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        except Exception as e:
            raise RuntimeError("the train step failed") from e
        return state.apply_gradients(grads=grads), loss

    (ref, ref_loss), (par, par_loss), _ = _run(step, state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par.params, ref.params)
