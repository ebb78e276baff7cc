"""A train state handed back as the step returned it is not placed again: the pipeline
executor uses an input leaf as it is where it is the array the last step returned at an output
whose array, fed back once, placing returned unchanged (``PipelineExecutable._place_inputs``).
Anything else the caller passes is placed as before."""

import jax
import numpy as np
import pytest

import meshpar
import meshpar.runtime.placing_inputs as placing_inputs
from examples.train_step import supervised_step
from pipeline_models import TwoStages, make_state, mse


@pytest.fixture
def setup():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(TwoStages(), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(1, 1), schedule="1f1b",
                                       devices=jax.devices()[:2])
    return batch, state, meshpar.parallelize(supervised_step(mse), method=method), jax.jit(supervised_step(mse))


def _placed_leaves(monkeypatch):
    placed: list[str] = []
    place = placing_inputs.place

    def counted(value, placement, what="a value"):
        placed.append(what)
        return place(value, placement, what)

    monkeypatch.setattr(placing_inputs, "place", counted)
    return placed


def _steps(reference, parallel, state, batch, steps):
    """``steps`` steps of both from ``state``, each state handed back as returned, the losses equal."""
    ref_state, par_state = state, state
    for _ in range(steps):
        ref_state, ref_loss = reference(ref_state, batch)
        par_state, par_loss = parallel(par_state, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    return ref_state, par_state


def _param_leaf_numbers(state, batch):
    """The flattened argument numbers of the parameters and Adam's moments (state, batch)."""
    leaves = jax.tree_util.tree_leaves_with_path((state, batch))
    return {n for n, (path, _) in enumerate(leaves) if "params" in jax.tree_util.keystr(path)
            or "mu" in jax.tree_util.keystr(path) or "nu" in jax.tree_util.keystr(path)}


def test_a_state_handed_back_is_not_placed_again(setup, monkeypatch):
    batch, state, parallel, reference = setup
    ref_state, par_state = _steps(reference, parallel, state, batch, 3)
    placed = _placed_leaves(monkeypatch)
    par_state, par_loss = parallel(par_state, batch)
    ref_state, ref_loss = reference(ref_state, batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    params = _param_leaf_numbers(par_state, batch)
    assert len(params) >= 12  # 2 layers x (kernel, bias) x (parameter, mu, nu)
    again = [w for w in placed if int(w.rsplit(" ", 1)[-1]) in params]
    assert not again, f"placed again though handed back as returned: {again}"
    for got, want in zip(jax.tree.leaves(par_state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_a_leaf_the_caller_replaced_is_placed(setup, monkeypatch):
    batch, state, parallel, reference = setup
    ref_state, par_state = _steps(reference, parallel, state, batch, 2)

    def doubled_first_kernel(s):
        kernel = np.asarray(s.params["params"]["Dense_0"]["kernel"]) * 2
        params = {"params": {**s.params["params"], "Dense_0": {**s.params["params"]["Dense_0"], "kernel": kernel}}}
        return s.replace(params=params)

    placed = _placed_leaves(monkeypatch)
    par_state, par_loss = parallel(doubled_first_kernel(par_state), batch)
    ref_state, ref_loss = reference(doubled_first_kernel(ref_state), batch)
    np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert any(w.startswith("step input leaf") for w in placed)
    for got, want in zip(jax.tree.leaves(par_state.params), jax.tree.leaves(ref_state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
