"""meshpar.checkpoint in one process with 8 CPU devices: a parallelized step's state saved as one
orbax checkpoint after 2 steps and restored, by a fresh step, where that step keeps it, trains on
bit for bit as if never interrupted; plain orbax reads it; a save killed midway commits nothing;
host values round-trip; bad arguments are named."""

import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from pipeline_models import TensorParallel, make_state, mse

METHOD = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2))


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}


def _initial_state():
    return make_state(TensorParallel(), _batch(0)["x"][:1])


def _step():
    return meshpar.parallelize(supervised_step(mse), method=METHOD)


def _assert_bitwise_equal(actual, expected):
    for (path, e), a in zip(jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e), err_msg=jax.tree_util.keystr(path), strict=True)


def test_resumed_training_is_bitwise_equal_to_uninterrupted_training(tmp_path):
    batches = [_batch(seed) for seed in range(4)]
    step = _step()
    state, losses = _initial_state(), []
    for i, batch in enumerate(batches):
        state, loss = step(state, batch)
        losses.append(loss)
        if i == 1:
            meshpar.checkpoint.save(tmp_path / "ckpt", state)
            saved = state

    # A fresh step, as a new process would make: where it keeps the state comes from compiling it.
    resumed_step = _step()
    abstract = meshpar.checkpoint.state_shardings(resumed_step, _initial_state(), batches[0])
    resumed = meshpar.checkpoint.restore(tmp_path / "ckpt", abstract)
    for (path, want), got, struct in zip(jax.tree_util.tree_leaves_with_path(saved), jax.tree.leaves(resumed),
                                         jax.tree.leaves(abstract)):
        # Equivalent, not equal: the step returns P("model", None) as P("model",).
        assert got.sharding == struct.sharding and got.sharding.is_equivalent_to(want.sharding, want.ndim), \
            jax.tree_util.keystr(path)
    _assert_bitwise_equal(resumed, saved)
    assert type(resumed) is type(saved)

    for batch, loss in zip(batches[2:], losses[2:]):
        resumed, resumed_loss = resumed_step(resumed, batch)
        np.testing.assert_array_equal(np.asarray(resumed_loss), np.asarray(loss))
    _assert_bitwise_equal(resumed, state)
    assert int(resumed.step) == 4


def test_state_shardings_are_where_the_step_keeps_each_leaf_before_any_step_runs():
    state, batch = _initial_state(), _batch(0)
    step = _step()
    abstract = meshpar.checkpoint.state_shardings(step, state, batch)
    meshes = [set(m.devices.flat) for m in step.get_executable(state, batch).meshes]
    kernel = abstract.params["params"]["Dense_0"]["kernel"].value
    assert kernel.shape == (6, 16) and kernel.dtype == np.float32
    assert kernel.sharding.spec == jax.sharding.PartitionSpec(None, "model")
    assert set(kernel.sharding.device_set) == meshes[0]
    assert set(abstract.params["params"]["Dense_1"]["bias"].sharding.device_set) == meshes[1]
    # Adam's step count is read on both stage meshes: one array replicated over both.
    count = abstract.opt_state[0].count
    assert set(count.sharding.device_set) == meshes[0] | meshes[1] and count.sharding.is_fully_replicated
    # The Python int step counter: an int32 scalar, as the step places it.
    assert abstract.step.shape == () and abstract.step.dtype == np.int32

    stepped, _ = step(state, batch)
    for (path, struct), leaf in zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(stepped)):
        assert struct.sharding.is_equivalent_to(leaf.sharding, leaf.ndim), jax.tree_util.keystr(path)
    # Only shapes matter: a state and batch that were never materialised give the same.
    shapes = jax.eval_shape(_initial_state), jax.eval_shape(lambda: batch)
    assert jax.tree.leaves(meshpar.checkpoint.state_shardings(_step(), *shapes)) == jax.tree.leaves(abstract)


def test_host_values_round_trip(tmp_path):
    """The initial state's Python int step counter, and numbers and numpy arrays in any pytree,
    come back as arrays of the dtype the step places them as; the resumed step matches."""
    state, batch = _initial_state(), _batch(0)
    assert isinstance(state.step, int)
    meshpar.checkpoint.save(tmp_path / "initial", state)
    step = _step()
    restored = meshpar.checkpoint.restore(tmp_path / "initial",
                                          meshpar.checkpoint.state_shardings(step, state, batch))
    assert restored.step.dtype == np.int32 and int(restored.step) == 0
    _assert_bitwise_equal(step(restored, batch), step(state, batch))

    values = {"count": 3, "scale": 0.5, "flag": True, "table": np.arange(6, dtype=np.float64).reshape(2, 3)}
    meshpar.checkpoint.save(tmp_path / "values", values)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    abstract = {"count": jax.ShapeDtypeStruct((), np.int32, sharding=device),
                "scale": jax.ShapeDtypeStruct((), np.float32, sharding=device),
                "flag": jax.ShapeDtypeStruct((), np.bool_, sharding=device),
                "table": jax.ShapeDtypeStruct((2, 3), np.float32, sharding=device)}
    restored = meshpar.checkpoint.restore(tmp_path / "values", abstract)
    assert all(leaf.sharding == device for leaf in restored.values())
    _assert_bitwise_equal(restored, {"count": np.int32(3), "scale": np.float32(0.5), "flag": np.bool_(True),
                                     "table": np.arange(6, dtype=np.float32).reshape(2, 3)})


def test_the_readmes_restore_into_jax_jit_takes_a_fresh_train_state(tmp_path):
    """docs/checkpoints.md, "Restoring under another layout": a new job restores into a plain
    ``jax.jit`` state made from a fresh flax TrainState, whose step counter is a Python int
    (issue 41: ``x.shape`` on it raised). The documented abstract state restores it as an int32
    scalar; an abstract state leaving the int as it is gets the saved count back as an int.
    Either way the leaves equal the saved ones bit for bit and jax.jit trains on as the
    uninterrupted steps do."""
    batches = [_batch(seed) for seed in range(4)]
    losses, saved = _train_saving_after_two(_step(), _initial_state(), batches, tmp_path / "ckpt")

    fresh = _initial_state()
    assert isinstance(fresh.step, int)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    readme = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=one_device), fresh)
    numbers_kept = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device) if isinstance(x, jax.Array) else x, fresh)
    for name, abstract in (("README", readme), ("numbers kept", numbers_kept)):
        resumed = meshpar.checkpoint.restore(tmp_path / "ckpt", abstract)
        _assert_bitwise_equal(resumed.replace(step=np.asarray(resumed.step, np.int32)), saved)
        if name == "README":
            assert resumed.step.dtype == np.int32 and resumed.step.sharding == one_device
        else:
            assert type(resumed.step) is int and resumed.step == 2
        run = jax.jit(supervised_step(mse))
        for batch, want in zip(batches[2:], losses[2:]):
            resumed, loss = run(resumed, batch)
            np.testing.assert_allclose(float(loss), want, rtol=1e-5, err_msg=name)
        assert int(resumed.step) == 4, name


def test_a_number_leaf_names_a_checkpoint_holding_other_than_its_scalar(tmp_path):
    meshpar.checkpoint.save(tmp_path / "ckpt", {"count": 3, "table": np.zeros((2, 3), np.float32)})
    restored = meshpar.checkpoint.restore(tmp_path / "ckpt", {"count": 0})
    assert type(restored["count"]) is int and restored["count"] == 3
    with pytest.raises(ValueError, match=r"abstract_state\['table'\]: expected float32\[\], but the checkpoint "
                                         r"holds float32\[2, 3\]"):
        meshpar.checkpoint.restore(tmp_path / "ckpt", {"table": 0.0})
    with pytest.raises(ValueError, match=r"abstract_state\['count'\]: expected float32\[\], but the checkpoint "
                                         r"holds int32\[\]"):
        meshpar.checkpoint.restore(tmp_path / "ckpt", {"count": 0.0})
    with pytest.raises(TypeError, match=r"abstract_state\['count'\]: expected a jax.ShapeDtypeStruct with a "
                                        r"sharding .* or a number, got 'three'"):
        meshpar.checkpoint.restore(tmp_path / "ckpt", {"count": "three"})


# -- bad arguments ------------------------------------------------------------------------


def test_state_shardings_rejects_a_batch_leaf_and_what_is_no_step():
    state, batch = _initial_state(), _batch(0)
    with pytest.raises(ValueError, match=r"args\[1\]\['x'\]: the step keeps it on no mesh \(a batch leaf"):
        meshpar.checkpoint.state_shardings(_step(), state, batch, argnum=1)
    with pytest.raises(ValueError, match=r"argnum: expected the index of one of the 2 arguments, got 2"):
        meshpar.checkpoint.state_shardings(_step(), state, batch, argnum=2)
    with pytest.raises(TypeError, match=r"step: expected a meshpar.parallelize\(...\) step, got function"):
        meshpar.checkpoint.state_shardings(supervised_step(mse), state, batch)


def test_save_refuses_an_existing_directory_and_what_it_cannot_write(tmp_path):
    values = {"w": np.ones(3, np.float32)}
    meshpar.checkpoint.save(tmp_path / "ckpt", values)
    with pytest.raises(FileExistsError, match=r"directory: .*ckpt already exists"):
        meshpar.checkpoint.save(tmp_path / "ckpt", values)
    with pytest.raises(TypeError, match=r"directory: expected a path, got 3"):
        meshpar.checkpoint.save(3, values)
    with pytest.raises(TypeError, match=r"state\['name'\]: expected an array or a number, got str"):
        meshpar.checkpoint.save(tmp_path / "text", {"name": "adam"})
    with pytest.raises(TypeError, match=r"state\['key'\]: a typed PRNG key array; keep jax.random.key_data"):
        meshpar.checkpoint.save(tmp_path / "key", {"key": jax.random.key(0)})
    assert not (tmp_path / "text").exists() and not (tmp_path / "key").exists()


def test_restore_names_a_missing_directory_and_mismatched_leaves(tmp_path):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    meshpar.checkpoint.save(tmp_path / "ckpt", {"w": np.ones(3, np.float32)})
    with pytest.raises(FileNotFoundError, match=r"directory: no checkpoint at .*elsewhere"):
        meshpar.checkpoint.restore(tmp_path / "elsewhere", {"w": jax.ShapeDtypeStruct((3,), np.float32, sharding=device)})
    with pytest.raises(TypeError, match=r"abstract_state\['w'\]: expected a jax.ShapeDtypeStruct with a sharding"):
        meshpar.checkpoint.restore(tmp_path / "ckpt", {"w": jax.ShapeDtypeStruct((3,), np.float32)})
    with pytest.raises(ValueError, match=r"abstract_state\['w'\]: expected float32\[4\], but the checkpoint holds float32\[3\]"):
        meshpar.checkpoint.restore(tmp_path / "ckpt", {"w": jax.ShapeDtypeStruct((4,), np.float32, sharding=device)})
    with pytest.raises(ValueError, match=r"abstract_state\['b'\]: not in the checkpoint at .*ckpt, whose 1 leaves are named like \['w'\]"):
        meshpar.checkpoint.restore(tmp_path / "ckpt", {"b": jax.ShapeDtypeStruct((3,), np.float32, sharding=device)})


def test_state_shardings_of_a_scan_stacked_model_are_where_the_step_keeps_it(tmp_path):
    """A GPT whose blocks are one nn.scan, cut inside the scan: the step keeps each stacked leaf
    as one array over both stages' devices, and state_shardings says so per leaf of the user's
    state (the layout's inputs are the per-stage pieces, more of them than leaves); a restored
    state lands there and steps on bit for bit."""
    model = GPT(scan_layers=True, num_layers=2)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(1, 1),
                                       devices=jax.devices()[:2])
    step = meshpar.parallelize(supervised_step(gpt_loss), method=method)
    abstract = meshpar.checkpoint.state_shardings(step, state, batch)
    stepped, _ = step(state, batch)
    wrong = [jax.tree_util.keystr(path) for (path, struct), leaf in
             zip(jax.tree_util.tree_leaves_with_path(abstract), jax.tree.leaves(stepped))
             if not struct.sharding.is_equivalent_to(leaf.sharding, leaf.ndim)]
    assert not wrong, f"{len(wrong)} leaves placed elsewhere than the step keeps them: {wrong[:5]}"
    stacked = [s for path, s in jax.tree_util.tree_leaves_with_path(abstract.params)
               if "'blocks'" in jax.tree_util.keystr(path)]
    assert stacked and all(set(s.sharding.device_set) == set(jax.devices()[:2]) for s in stacked)

    meshpar.checkpoint.save(tmp_path / "ckpt", stepped)
    restored = meshpar.checkpoint.restore(tmp_path / "ckpt", abstract)
    _assert_bitwise_equal(step(restored, batch), step(stepped, batch))


def _train_saving_after_two(step, state, batches, path):
    """Runs ``step`` over ``batches`` from ``state``, saving the state to ``path`` after the second
    step: every step's loss, and the saved state."""
    losses = []
    for i, batch in enumerate(batches):
        state, loss = step(state, batch)
        losses.append(float(loss))
        if i == 1:
            meshpar.checkpoint.save(path, state)
            saved = state
    return losses, saved


def _trained_gpt(num_stages, method, steps):
    """A GPT (its parameters the same whatever ``num_stages``: only its stage markers move) and
    ``steps`` batches, its initial state, and the parallelized step under ``method``."""
    model = GPT(num_stages=num_stages, num_layers=4, d_model=16)
    batches = [gpt_batch(seed, 8, model.seq_len, model.vocab_size) for seed in range(steps)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["x"][:1])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    return batches, state, meshpar.parallelize(supervised_step(gpt_loss), method=method)


def test_a_checkpoint_restores_under_another_layout_and_into_a_jit_state(tmp_path):
    """Saved with 2 stages on (2, 2) meshes, restored under 4 stages on one device each and
    into a plain jax.jit state on one device: every leaf lands where the new step keeps it,
    bit for bit, and the next steps equal the uninterrupted run's (another layout may
    reassociate sums: float tolerance)."""
    two = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2))
    batches, state, step = _trained_gpt(2, two, 4)
    losses, saved = _train_saving_after_two(step, state, batches, tmp_path / "ckpt")

    four = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=4, stage_mesh_shape=(1, 1),
                                     devices=jax.devices()[:4])
    _, fresh, four_step = _trained_gpt(4, four, 1)
    abstract = meshpar.checkpoint.state_shardings(four_step, fresh, batches[0])
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    plain = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=one_device), saved)
    for name, target, run in (("4 stages", abstract, four_step), ("jax.jit", plain, jax.jit(supervised_step(gpt_loss)))):
        resumed = meshpar.checkpoint.restore(tmp_path / "ckpt", target)
        for (path, got), struct in zip(jax.tree_util.tree_leaves_with_path(resumed), jax.tree.leaves(target)):
            assert got.sharding == struct.sharding, (name, jax.tree_util.keystr(path))
        _assert_bitwise_equal(resumed, saved)
        for batch, want in zip(batches[2:], losses[2:]):
            resumed, loss = run(resumed, batch)
            np.testing.assert_allclose(float(loss), want, rtol=1e-5, err_msg=name)


def test_plain_orbax_restores_a_pipelined_state_into_one_device(tmp_path):
    """The state of a 2-stage pipeline on (2, 2) meshes, saved by meshpar, is one orbax
    checkpoint: orbax's StandardCheckpointer restores it onto one device bit for bit, and a
    checkpoint orbax wrote restores through meshpar.checkpoint.restore where the step keeps it."""
    step = _step()
    state, _ = step(_initial_state(), _batch(0))
    meshpar.checkpoint.save(tmp_path / "meshpar", state)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[7])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=one_device), state)
    restored = ocp.StandardCheckpointer().restore(tmp_path / "meshpar", target)
    assert all(leaf.sharding == one_device for leaf in jax.tree.leaves(restored))
    _assert_bitwise_equal(restored, state)

    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "orbax", restored)
    abstract = meshpar.checkpoint.state_shardings(step, _initial_state(), _batch(0))
    _assert_bitwise_equal(step(meshpar.checkpoint.restore(tmp_path / "orbax", abstract), _batch(1)),
                          step(state, _batch(1)))


_KILLED_MID_SAVE = """
import os, signal, sys
import jax
import numpy as np
import meshpar
import meshpar.checkpoint as checkpoint

directory = sys.argv[1]
state = {"a": jax.numpy.arange(8.0), "b": jax.numpy.ones((4, 4))}
meshpar.checkpoint.save(os.path.join(directory, "1"), state)
serialize = checkpoint._ProcessChunksHandler.serialize

async def killed_midway(self, values, infos, args=None):
    await serialize(self, values[:1], infos[:1], args[:1] if args else None)  # the first array's chunks
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint._ProcessChunksHandler.serialize = killed_midway
meshpar.checkpoint.save(os.path.join(directory, "2"), jax.tree.map(lambda x: x + 1, state))
"""


def test_a_save_killed_midway_leaves_the_previous_checkpoint_and_commits_nothing(tmp_path):
    """A process killed while writing checkpoint 2 (its first array written): checkpoint 1
    restores bit for bit, directory 2 is not there (orbax writes under a temporary name and
    renames on commit), and restoring it names no checkpoint there; a new save to 2 succeeds."""
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, str(tmp_path)], capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert not (tmp_path / "2").exists() and any(p.name.startswith("2.") for p in tmp_path.iterdir())
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"a": jax.ShapeDtypeStruct((8,), np.float32, sharding=device),
              "b": jax.ShapeDtypeStruct((4, 4), np.float32, sharding=device)}
    _assert_bitwise_equal(meshpar.checkpoint.restore(tmp_path / "1", target),
                          {"a": np.arange(8, dtype=np.float32), "b": np.ones((4, 4), np.float32)})
    with pytest.raises(FileNotFoundError, match=r"directory: no checkpoint at .*2 \(none, or one not committed\)"):
        meshpar.checkpoint.restore(tmp_path / "2", target)
    meshpar.checkpoint.save(tmp_path / "2", {"a": np.zeros(8, np.float32), "b": np.zeros((4, 4), np.float32)})
    assert float(meshpar.checkpoint.restore(tmp_path / "2", target)["b"].sum()) == 0.0
