"""Every program a pipeline launches is compiled before its first step (``step.compile(*args)``, or
the first call itself): the first step then compiles none of the stages' passes, fused runs or
gradient reductions, and still equals jax.jit. (Across processes, where the processes then meet
once: tests/multiprocess/mp_pipeline_worker.py and mp_four_worker.py run every step through it.)"""

import logging

import jax
import numpy as np
import pytest

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from pipeline_models import make_state

# The pipeline's own programs, as JAX names them when it compiles one.
PIPELINE_PROGRAMS = ("jit(forward)", "jit(backward)", "jit(backward_input)", "jit(backward_weight)", "jit(fused)",
                     "jit(reduce_gradients)")

LAYOUTS = {
    "1f1b on two meshes": dict(num_stages=2, stage_mesh_shape=(1, 1), devices=jax.devices()[:2]),
    "zb_v, both stages on one mesh": dict(num_stages=2, stages_per_mesh=2, schedule="zb_v",
                                          stage_mesh_shape=(1, 1), devices=jax.devices()[:1]),
    "fused runs": dict(num_stages=2, stages_per_mesh=2, schedule="interleaved_1f1b", stage_mesh_shape=(1, 1),
                       devices=jax.devices()[:1], fuse_compute=None),
    "data replicas reduced once per step": dict(num_stages=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4]),
}


class _Compiles(logging.Handler):
    def __init__(self):
        super().__init__()
        self.names = []

    def emit(self, record):
        message = record.getMessage()
        if message.startswith("Finished XLA compilation of"):
            self.names.append(message.split(" of ")[1].split(" in ")[0])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_first_step_compiles_none_of_the_pipelines_programs(layout, monkeypatch):
    model = GPT(num_stages=2, num_layers=2)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    state = make_state(model, batch["x"][:1])
    step = supervised_step(gpt_loss)
    want_state, want_loss = jax.jit(step)(state, batch)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(num_micro_batches=2, **LAYOUTS[layout]))
    executable = parallel.compile(state, batch)
    assert executable.compiled_ahead > 0
    assert parallel.compile(state, batch) is executable  # compiled once

    compiles = _Compiles()
    logger = logging.getLogger("jax")
    logger.addHandler(compiles)
    monkeypatch.setattr(logger, "level", logging.DEBUG)
    with jax.log_compiles(True):
        got_state, got_loss = parallel(state, batch)
        jax.block_until_ready(got_state)
    logger.removeHandler(compiles)
    assert compiles.names, "no compilation was logged at all (the check would pass vacuously)"
    late = [n for n in compiles.names if n in PIPELINE_PROGRAMS]
    assert not late, f"compiled during the first step: {late}"
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
