"""``frozen_heap``: while a step compiles, the heap that was there before is out of the garbage
collector's reach, and given back afterwards; a heap the program froze itself stays frozen."""

import gc
import sys

import jax
import numpy as np
import pytest

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.runtime import frozen_heap as frozen_heap_module
from meshpar.runtime import pipeline_executor
from meshpar.runtime.frozen_heap import frozen_heap
from pipeline_models import assert_trees_close, make_state, mse, run_both


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_the_heap_is_frozen_within_and_given_back_by_the_outermost():
    assert gc.get_freeze_count() == 0
    with frozen_heap():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        made = [object() for _ in range(1000)]
        with frozen_heap():  # nested: still frozen, and nothing more
            assert gc.get_freeze_count() == frozen
        assert gc.get_freeze_count() == frozen
        # What compiling makes is still collected: a cycle made within it goes.
        cycle = [made]
        cycle.append(cycle)
        del cycle
        assert gc.collect() > 0
    assert gc.get_freeze_count() == 0


def test_a_heap_the_program_froze_itself_stays_frozen():
    gc.freeze()
    frozen = gc.get_freeze_count()
    with frozen_heap():
        assert gc.get_freeze_count() == frozen
    assert gc.get_freeze_count() == frozen


def test_compiling_a_step_runs_with_the_heap_frozen_and_gives_it_back(monkeypatch):
    seen = {}

    def noting(name, fn):
        def call(*args, **kwargs):
            seen[name] = gc.get_freeze_count()
            return fn(*args, **kwargs)
        return call

    # ``meshpar.parallelize`` is the function; its module is in sys.modules.
    parallelize_module = sys.modules["meshpar.parallelize"]
    monkeypatch.setattr(parallelize_module, "compile_step", noting("trace", parallelize_module.compile_step))
    monkeypatch.setattr(pipeline_executor, "compile_step_ahead",
                        noting("compile_ahead", pipeline_executor.compile_step_ahead))
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((8, 6)).astype(np.float32),
             "y": rng.standard_normal((8, 4)).astype(np.float32)}
    state = make_state(MLP(features=(8, 4), num_stages=2), batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(1, 1), devices=jax.devices()[:2])
    ref_state, par_state, _ = run_both(supervised_step(mse), state, batch, method, steps=2)
    assert_trees_close(par_state, ref_state)
    assert seen["trace"] > 0 and seen["compile_ahead"] > 0
    assert gc.get_freeze_count() == 0 and not frozen_heap_module._depth
