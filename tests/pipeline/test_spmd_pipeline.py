"""The stock-JAX circular SPMD pipeline baseline (benchmarks/spmd_pipeline.py): its loss and
every gradient equal the same GPT under plain jax.jit on one device, for several (S, D, M, R);
one Adam step equals the jitted reference's; a wrong layer order is caught; bad configurations
fail by name; the memory figures are per device."""

import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from repo_paths import ROOT_DIR

from benchmarks import spmd_pipeline as sp
from examples.gpt import GPT, gpt_batch, gpt_loss

SIZE = dict(vocab_size=64, seq_len=8, d_model=32, num_heads=4, num_layers=4)
BATCH = 16
TOL = dict(rtol=1e-5, atol=1e-5)
# (stages, data, micro_batches, repeats)
CASES = [(2, 2, 2, 1), (2, 2, 4, 1), (2, 2, 2, 2), (2, 2, 4, 2), (4, 1, 4, 1)]

_jitted: dict = {}
_reference: dict = {}


def _config(S, D, M, R, **kw):
    args = dict(data=D, stages=S, micro_batches=M, repeats=R, batch=BATCH, model_size=SIZE)
    return sp.SpmdPipelineConfig(**{**args, **kw})


def _mesh(S, D):
    return sp.spmd_mesh(jax.devices()[:S * D], D, S)


def _host_inputs():
    return sp.init_gpt_params(SIZE, 0), gpt_batch(0, BATCH, SIZE["seq_len"], SIZE["vocab_size"])


def _reference_loss_and_grads(params, batch):
    """GPT(scan_layers=True) under jax.jit on one device, no pipelining."""
    if "fn" not in _reference:
        net = GPT(scan_layers=True, **SIZE)
        _reference["fn"] = jax.jit(jax.value_and_grad(lambda p, b: gpt_loss(net.apply({"params": p}, b["x"]), b["y"])))
    loss, grads = _reference["fn"](params, batch)
    return float(loss), jax.tree.map(np.asarray, grads)


def _pipelined_loss_and_grads(case, gpt_params, batch):
    """The SPMD pipeline's loss and gradients, the gradients mapped back to GPT's [L, ...] layout."""
    S, D, M, R = case
    mesh = _mesh(S, D)
    if case not in _jitted:
        _jitted[case] = sp.loss_and_grads(_config(*case), mesh)
    params = sp.pipeline_params(gpt_params, R, S)
    params = sp.place(params, sp.state_shardings(params, mesh))
    placed = sp.place(batch, sp.batch_shardings(mesh))
    loss, grads = _jitted[case](params, placed)
    return float(loss), sp.gpt_params_from_pipeline(jax.tree.map(np.asarray, grads))


def _assert_trees_close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, **TOL, err_msg=jax.tree_util.keystr(path))


# In CI the two cases that catch the most (a wrong circular-buffer slot shows only at M=4 R=2,
# a roll the wrong way only at S=4); the others are slow.
CI_CASES = {(2, 2, 4, 2), (4, 1, 4, 1)}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in CI_CASES else pytest.mark.slow) for c in CASES],
                         ids=[f"S{s}-D{d}-M{m}-R{r}" for s, d, m, r in CASES])
def test_loss_and_grads_equal_jit(case):
    params, batch = _host_inputs()
    want_loss, want_grads = _reference_loss_and_grads(params, batch)
    loss, grads = _pipelined_loss_and_grads(case, params, batch)
    np.testing.assert_allclose(loss, want_loss, **TOL)
    _assert_trees_close(grads, want_grads)
    # Every block's gradient is nonzero, so a layer the pipeline skipped would show.
    assert all(np.abs(g).reshape(g.shape[0], -1).max(axis=1).min() > 0
               for g in jax.tree.leaves(grads["blocks"]))


def test_wrong_layer_order_is_caught():
    """The same pipeline fed the layers reversed: loss and gradients no longer match, so the
    equality above can fail."""
    params, batch = _host_inputs()
    want_loss, want_grads = _reference_loss_and_grads(params, batch)
    reversed_params = dict(params, blocks=jax.tree.map(lambda x: x[::-1], params["blocks"]))
    loss, grads = _pipelined_loss_and_grads((2, 2, 4, 2), reversed_params, batch)
    assert abs(loss - want_loss) > 1e-3
    with pytest.raises(AssertionError):
        _assert_trees_close(grads, want_grads)


def test_pipeline_params_layer_order():
    """Layer l = r S k + s k + j lands at [r, s, j], and the inverse gives the stack back."""
    L, R, S = 12, 2, 3
    gpt = {"blocks": {"stack": {"block": {"w": np.arange(L * 2).reshape(L, 2)}}}, "head": {"b": np.ones(3)}}
    out = sp.pipeline_params(gpt, R, S)
    w = out["stages"]["w"]
    k = L // (R * S)
    assert w.shape == (R, S, k, 2)
    for r in range(R):
        for s in range(S):
            for j in range(k):
                np.testing.assert_array_equal(w[r, s, j], gpt["blocks"]["stack"]["block"]["w"][r * S * k + s * k + j])
    back = sp.gpt_params_from_pipeline(out)
    np.testing.assert_array_equal(back["blocks"]["stack"]["block"]["w"], gpt["blocks"]["stack"]["block"]["w"])
    np.testing.assert_array_equal(back["head"]["b"], gpt["head"]["b"])
    with pytest.raises(ValueError, match="repeats"):
        sp.pipeline_params(gpt, 5, S)


@pytest.fixture(scope="module")
def train_step():
    """The full train step at S=2, D=2, M=4, R=2, compiled, and what its arguments hold per
    device (read before the step donates them)."""
    config = _config(2, 2, 4, 2)
    mesh = _mesh(2, 2)
    step, state, batch = sp.build_train_step(config, mesh)
    compiled = step.lower(state, batch).compile()
    device = mesh.devices.flat[0]
    shard_bytes = sum(s.data.nbytes for x in jax.tree.leaves((state, batch))
                      for s in x.addressable_shards if s.device == device)
    stacked_bytes = sum(x.nbytes for x in jax.tree.leaves(state["params"]["stages"]))
    global_bytes = sum(x.nbytes for x in jax.tree.leaves((state, batch)))
    return dict(config=config, compiled=compiled, state=state, batch=batch, shard_bytes=shard_bytes,
                stacked_bytes=stacked_bytes, global_bytes=global_bytes)


def test_memory_bytes_are_per_device(train_step):
    mem = sp.memory_bytes_per_device(train_step["compiled"])
    for key in ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"):
        assert mem[key] > 0, key
    assert mem["peak_bytes"] == mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
    # The compiled module is one device's: its arguments are that device's shards...
    assert mem["argument_bytes"] == train_step["shard_bytes"]
    # ...which hold half the stacked blocks (params and both Adam moments) and half the batch,
    # well under the global size.
    assert mem["argument_bytes"] <= train_step["global_bytes"] - 3 * train_step["stacked_bytes"] / 2
    # The state is donated: its outputs reuse the argument buffers.
    assert mem["alias_bytes"] > 0


def test_train_step_equals_jit_adam(train_step):
    """One step of the pipelined train step = the same optax.adam(1e-3) step of GPT under jax.jit."""
    config = train_step["config"]
    params, batch = sp.init_gpt_params(SIZE, 0), gpt_batch(0, BATCH, SIZE["seq_len"], SIZE["vocab_size"])
    net = GPT(scan_layers=True, **SIZE)
    tx = optax.adam(1e-3)

    @jax.jit
    def reference(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: gpt_loss(net.apply({"params": p}, batch["x"]), batch["y"]))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    want_params, want_opt, want_loss = reference(params, tx.init(params), batch)
    state, loss = train_step["compiled"](train_step["state"], train_step["batch"])
    np.testing.assert_allclose(float(loss), float(want_loss), **TOL)
    got = jax.tree.map(np.asarray, state)
    _assert_trees_close(sp.gpt_params_from_pipeline(got["params"]), jax.tree.map(np.asarray, want_params))
    adam, want_adam = got["opt_state"][0], want_opt[0]
    assert int(adam.count) == 1
    _assert_trees_close(sp.gpt_params_from_pipeline(adam.mu), jax.tree.map(np.asarray, want_adam.mu))
    assert config.iterations == 4 * 2 + 2 - 1


@pytest.mark.parametrize("kwargs, name", [
    (dict(data=0), "data"),
    (dict(stages=2, micro_batches=1), "micro_batches"),
    (dict(repeats=3), "repeats"),
    (dict(batch=12), "batch"),
    (dict(model_parallel=2), "model_parallel"),
    (dict(model_size={k: v for k, v in SIZE.items() if k != "num_heads"}), "model_size"),
    (dict(model_size=dict(SIZE, tie_embeddings=True)), "model_size"),
    (dict(model_size=dict(SIZE, num_layers=5)), "num_layers"),
])
def test_bad_config_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        _config(2, 2, 4, 1, **kwargs)


def test_bad_mesh_names_the_argument():
    with pytest.raises(ValueError, match="devices"):
        sp.spmd_mesh(jax.devices()[:3], 2, 2)
    with pytest.raises(ValueError, match="mesh"):
        sp.loss_and_grads(_config(2, 2, 4, 1), _mesh(4, 1))


def test_mesh_is_stage_major_and_bubble():
    mesh = _mesh(2, 2)
    assert mesh.axis_names == ("stage", "data")
    assert [[d.id for d in row] for row in mesh.devices] == [[0, 1], [2, 3]]
    assert sp.bubble(4, 1, 2) == pytest.approx(1 / 5)
    assert sp.bubble(4, 2, 2) == pytest.approx(1 / 9)


def test_import_starts_no_jax():
    code = "import sys, benchmarks.spmd_pipeline; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(ROOT_DIR))
