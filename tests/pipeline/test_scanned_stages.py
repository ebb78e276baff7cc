"""Stacked layers cut into stages: a GPT whose blocks are one nn.scan (with and without remat in
the body), an nnx.scan stack and a hand-written lax.scan over a stacked array, each cut into
stages inside the scan and checked against jax.jit on one device; each stage holds only its
slice of the stacked parameters and their optimizer state, and the user gets the stack back
whole (one array over the pieces' devices, no copy, when the pieces are even)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from meshpar.passes.program.stacked_leaves import STACK_AXIS
from meshpar.passes.program.step_values import RefKind
from pipeline_models import NnxScannedStack, assert_trees_close, mse, nnx_mse_step, run_both

L = 8


def _gpt_state(optimizer, remat=False, num_layers=L):
    model = GPT(scan_layers=True, remat_blocks=remat, num_layers=num_layers)
    batch = gpt_batch(0, 16, model.seq_len, model.vocab_size)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    tx = {"sgd": optax.sgd(0.1),
          "adam": optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-5))}[optimizer]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx), batch


def _method(stages, **kw):
    return meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(1, 1), devices=jax.devices()[:stages],
                                     **kw)


CUTS = {"2 stages": (2, dict(num_stages=2)), "4 stages": (4, dict(num_stages=4)),
        "3 + 5": (2, dict(auto_layers=L, cut_points=(2,)))}


def _stacked_leaves(state):
    """The scanned blocks' parameters and their Adam moments."""
    return [x for path, x in jax.tree_util.tree_leaves_with_path(state) if "'blocks'" in jax.tree_util.keystr(path)]


def _param_avals(stage):
    """The stage's parameter inputs of two or more dimensions."""
    return [a for a, r in zip(stage.jaxpr.in_avals, stage.inputs) if r.kind is RefKind.PARAM and len(a.shape) > 1]


def _bytes_per_device(tree):
    per_device = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return per_device


def _check_run(cut, optimizer, remat, steps=2):
    stages, kw = CUTS[cut]
    state, batch = _gpt_state(optimizer, remat)
    ref, par, parallel = run_both(supervised_step(gpt_loss), state, batch, _method(stages, **kw), steps=steps)
    assert_trees_close(par, ref)
    return state, batch, par, parallel


@pytest.mark.slow
def test_a_gpt_scanned_in_one_nn_scan_cut_into_4_stages_equals_jit_and_each_stage_holds_its_slice():
    state, batch, par, parallel = _check_run("4 stages", "adam", remat=False)
    executable = parallel.get_executable(par, batch)
    compiled = parallel.get_compiled(par, batch)
    # Each stage reads two layers of every stacked parameter, nothing more.
    stacked_inputs = [[a.shape for a in _param_avals(s) if a.shape[0] == 2] for s in compiled.graph.stages]
    assert all(len(shapes) == 11 for shapes in stacked_inputs), stacked_inputs
    whole_kernels = {np.shape(x) for x in jax.tree.leaves(state.params["params"]["blocks"]) if np.ndim(x) == 3}
    assert len(whole_kernels) == 4 and not any(a.shape in whole_kernels for s in compiled.graph.stages
                                               for a in _param_avals(s))
    # The stacks come back whole, over the four stage meshes' devices: the next step splits
    # them into views of their shards.
    for x in _stacked_leaves(par):
        assert x.shape[0] == L and x.sharding.mesh.axis_names[0] == STACK_AXIS
        assert len(x.sharding.device_set) == 4
    # The arrays the step returned come back as the pieces they were joined from; another array
    # over the same devices and sharding (here: the same buffers rewrapped) is split into views.
    rewrapped = jax.tree.map(lambda x: jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data for s in x.addressable_shards]) if isinstance(x, jax.Array) else x, par)
    pieces = executable.stacked_leaves.split(jax.tree.leaves((rewrapped, batch)), timeout_s=10.0)
    first = _stacked_leaves(par)[0]
    piece = next(p for p in pieces if isinstance(p, jax.Array) and p.shape == (2, *first.shape[1:])
                 and p.dtype == first.dtype)
    shard_buffers = {s.data.unsafe_buffer_pointer() for x in _stacked_leaves(par) for s in x.addressable_shards}
    assert piece.addressable_shards[0].data.unsafe_buffer_pointer() in shard_buffers
    compiled = executable.compiled_count()
    parallel(par, batch)
    assert executable.compiled_count() == compiled
    # Parameters and optimizer state per device, against the uncut stack's on one device.
    uncut = sum(_bytes_per_device(jax.device_put(state, jax.devices()[0])).values())
    worst = max(_bytes_per_device(par).values())
    assert worst <= 0.3 * uncut, (worst, uncut)


@pytest.mark.slow
def test_an_uneven_cut_3_plus_5_with_remat_in_the_scan_equals_jit_and_comes_back_on_the_first_mesh():
    _, batch, par, parallel = _check_run("3 + 5", "sgd", remat=True)
    executable = parallel.get_executable(par, batch)
    compiled = parallel.get_compiled(par, batch)
    sizes = {s.index: sorted({a.shape[0] for a in _param_avals(s) if a.shape[0] in (3, 5)})
             for s in compiled.graph.stages}
    assert sizes == {0: [3], 1: [5]}
    first_mesh = {d.id for d in executable.meshes[0].devices.flat}
    for x in _stacked_leaves(par):
        assert {d.id for d in x.sharding.device_set} == first_mesh
    # remat stays in the scanned body of every piece.
    bodies = [e.params["jaxpr"].jaxpr for s in compiled.graph.stages for e in s.jaxpr.eqns
              if e.primitive.name == "scan"]
    assert len(bodies) == 2 and all(any(e.primitive.name == "remat2" for e in b.eqns) for b in bodies)


@pytest.mark.slow
@pytest.mark.parametrize("remat", [False, True])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("cut", sorted(CUTS))
def test_every_cut_optimizer_and_remat_equals_jit(cut, optimizer, remat):
    _check_run(cut, optimizer, remat)


@pytest.mark.slow  # CI runs the even rule in the main job's --scan-layers test
def test_num_stages_on_a_model_whose_only_structure_is_one_scan_cuts_it_evenly():
    state, batch = _gpt_state("sgd")
    parallel = meshpar.parallelize(supervised_step(gpt_loss), method=_method(4, num_stages=4))
    parallel(state, batch)
    graph = parallel.get_compiled(state, batch).graph
    lengths = [e.params["length"] for s in graph.stages for e in s.jaxpr.eqns if e.primitive.name == "scan"]
    assert lengths == [2, 2, 2, 2]


def test_more_stages_than_scanned_layers_is_an_error_naming_num_stages():
    state, batch = _gpt_state("sgd", num_layers=2)
    parallel = meshpar.parallelize(supervised_step(gpt_loss), method=_method(4, num_stages=4))
    with pytest.raises(ValueError, match=r"num_stages: 4 stages asked for, but the loss's layer scans have 2"):
        parallel(state, batch)


@pytest.mark.slow  # CI runs this case in the two-process test
def test_an_nnx_scan_stack_cut_into_2_stages_equals_nnx_jit():
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}

    def make():
        model = NnxScannedStack(8, 4, nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2, eps=1e-5), wrt=nnx.Param)

    model, optimizer = make()
    ref_model, ref_optimizer = make()
    step = meshpar.parallelize(nnx_mse_step, method=_method(2, num_stages=2, batch_argnums=(2,)))
    for _ in range(2):
        loss = step(model, optimizer, batch)
        ref_loss = nnx.jit(nnx_mse_step)(ref_model, ref_optimizer, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param))
    assert_trees_close(nnx.state(optimizer, nnx.OptState), nnx.state(ref_optimizer, nnx.OptState))
    assert model.blocks.kernel[...].shape == (4, 8, 8)


@pytest.mark.slow  # CI runs this case in the two-process test
def test_a_hand_written_lax_scan_over_a_stacked_array_cut_unevenly_equals_jit():
    rng = np.random.default_rng(1)
    params = {"layers": {"w": (rng.standard_normal((5, 8, 8)) / 3).astype(np.float32),
                         "b": np.zeros((5, 8), np.float32)},
              "out": (rng.standard_normal((8, 4)) / 3).astype(np.float32)}
    batch = {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
    tx = optax.adam(1e-2, eps=1e-5)

    def step(state, batch):
        params, opt_state = state

        def loss_fn(p):
            h, _ = jax.lax.scan(lambda h, layer: (jnp.tanh(h @ layer["w"] + layer["b"]), None), batch["x"],
                                p["layers"])
            return mse(h @ p["out"], batch["y"])

        loss, grads = meshpar.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    state = (params, tx.init(params))
    ref, par, parallel = run_both(step, state, batch, _method(2, num_stages=2), steps=2)
    assert_trees_close(par, ref)
    graph = parallel.get_compiled(par, batch).graph
    assert [e.params["length"] for s in graph.stages for e in s.jaxpr.eqns if e.primitive.name == "scan"] == [3, 2]
