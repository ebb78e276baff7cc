"""The programs around the pipeline compile while the compiler still traces the stages
(``runtime.early_programs``): the compiler lowers the step program before the passes tracing the
stages' replicas and parts, and an observer of the pass pipeline queues its programs on the
step's compile queue at once. Each program still compiles once, the first step compiles
nothing, and the step equals jax.jit."""

import time

import jax
import numpy as np
import optax
from flax.training import train_state

import meshpar
from compile_events import compiled
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from meshpar.passes import pipeline_driver
from meshpar.passes.program.step_instructions import RunCompute


def _clipped_adam_step():
    """The main job's recipe: a 2-stage GPT, global-norm clipping before Adam (the norm's parts
    cross the two meshes, so the update is several programs with moves between them)."""
    model = GPT(num_stages=2, num_layers=2)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3, eps=1e-5))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
    return supervised_step(gpt_loss), state, batch


def test_the_update_compiles_while_the_stages_are_traced(monkeypatch):
    step, state, batch = _clipped_adam_step()
    want_state, want_loss = jax.jit(step)(state, batch)

    # The pass tracing the stages' replicas waits (boundedly) until an update program has
    # compiled: that happens only if the update started compiling before this pass.
    real = pipeline_driver.plan_data_replicas
    compiled_before: list[list[str]] = []

    def after_an_update_compiled(*args, **kwargs):
        start = time.monotonic()
        while "jit(run)" not in names and time.monotonic() - start < 120:
            time.sleep(0.01)
        compiled_before.append(list(names))
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline_driver, "plan_data_replicas", after_an_update_compiled)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4]))
    with compiled() as names:
        executable = parallel.compile(state, batch)
    assert compiled_before and "jit(run)" in compiled_before[0], \
        f"no update program compiled before the stages were traced: {compiled_before}"

    # Each of the step's computations around the pipeline compiled once: the executable's own
    # walk found the programs started early instead of compiling them again.
    computations = [ins for ins in executable.step_program if isinstance(ins, RunCompute)]
    assert len(computations) >= 3
    assert names.count("jit(run)") == len(computations), names

    with compiled() as late:
        got_state, got_loss = parallel(state, batch)
        jax.block_until_ready(got_state)
    assert not late, f"compiled during the first step: {late}"
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
