"""Every program a step launches is compiled before its first step (``step.compile(*args)``, or
the first call itself), side by side on a pool of threads (``runtime.compile_ahead``): the first
step then compiles none of the stages' passes, fused runs or gradient reductions, nor the
programs around the pipeline, and still equals jax.jit; the second step, fed the first's state,
compiles nothing; a second process running the same step reads every program from JAX's
persistent compilation cache. (Across processes, where the processes then meet once:
tests/multiprocess/mp_pipeline_worker.py and mp_four_worker.py run every step through it.)"""

import jax
import numpy as np
import pytest

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.train_step import supervised_step
from compile_events import compiled
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


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_first_step_compiles_none_of_the_pipelines_programs(layout):
    model = GPT(num_stages=2, num_layers=2)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    state = make_state(model, batch["x"][:1])
    step = supervised_step(gpt_loss)
    want_state, want_loss = jax.jit(step)(state, batch)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(num_micro_batches=2, **LAYOUTS[layout]))

    with compiled() as ahead:
        executable = parallel.compile(state, batch)
    with compiled() as late:
        got_state, got_loss = parallel(state, batch)
        jax.block_until_ready(got_state)
    assert executable.compiled_ahead > 0
    assert parallel.compile(state, batch) is executable  # compiled once
    assert set(PIPELINE_PROGRAMS) & set(ahead), f"no pipeline program was logged compiling ahead: {ahead}"
    # The programs around the pipeline (the update, the micro-batches' slicing, the gradient
    # accumulators, the losses' combining) compile ahead too: the first step compiles only what
    # jax.device_put compiles to place the state on the stage meshes.
    late = [n for n in late if n != "jit(_multi_slice)"]
    assert not late, f"compiled during the first step: {late}"
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    for got, want in zip(jax.tree.leaves(got_state.params), jax.tree.leaves(want_state.params)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    # The second step, fed the state the first returned (its shardings spelled as the compiled
    # programs give them, not as the compiler did), compiles nothing either.
    with compiled() as second:
        jax.block_until_ready(parallel(got_state, batch))
    assert not second, f"compiled during the second step: {second}"


def test_programs_compile_side_by_side_once_each():
    """``AheadOfTime``: a program reading another's result compiles once that one has (its
    operands' shardings are the compiled program's), the same program for the same operand types
    compiles once, and the real call finds the program compiled on the pool's thread."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from meshpar.runtime.compile_ahead import AheadOfTime, Pending

    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    sharded = NamedSharding(mesh, P("data"))
    first = jax.jit(lambda x: (x * 2, x.sum()))
    second = jax.jit(lambda y, s: y + s)
    x = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=sharded)
    compiler = AheadOfTime()
    doubled, total = compiler.program(first, x, mesh=mesh)
    assert isinstance(doubled, Pending) and doubled.shape == (8, 4)
    out = compiler.program(second, doubled, total, mesh=mesh)
    assert compiler.program(first, x, mesh=mesh)[0] is doubled  # queued once
    again = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("data")))
    compiler.program(first, again, mesh=mesh)  # equal operand types: the same program
    assert compiler.finish() == 2
    assert compiler.resolve(doubled).sharding.is_equivalent_to(sharded, 2)
    assert compiler.resolve(out).shape == (8, 4)

    with compiled() as late:
        with jax.set_mesh(mesh):
            value = jax.device_put(np.ones((8, 4), np.float32), sharded)
            y, s = first(value)
            np.testing.assert_allclose(np.asarray(second(y, s)), 2 + 32)
    assert not [n for n in late if n != "jit(_multi_slice)"], late


def test_a_program_reading_declared_results_compiles_before_its_producer_has(monkeypatch):
    """A result whose sharding its program declares (``out_shardings``: what the compiler fixed)
    is known once that program is traced, so a program reading only such results starts
    compiling while its producer still compiles; one reading a result XLA lays out waits for
    the producer's compile. Compiles are held on futures this test completes by hand."""
    import concurrent.futures

    from jax.sharding import NamedSharding, PartitionSpec as P

    from meshpar.runtime import compile_ahead

    held: list[tuple[concurrent.futures.Future, object]] = []

    def hold(lowered, pool=None):
        future = concurrent.futures.Future()
        held.append((future, lowered))
        return future

    submit = compile_ahead._submit_compile
    monkeypatch.setattr(compile_ahead, "_submit_compile", hold)
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    sharded, replicated = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
    producer = jax.jit(lambda x: (x * 2, x.sum()), out_shardings=(sharded, None))
    reader = jax.jit(lambda y: y + 1)
    x = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=replicated)
    compiler = compile_ahead.AheadOfTime()
    doubled, total = compiler.program(producer, x, mesh=mesh)
    compiler.program(reader, doubled, mesh=mesh)
    compiler.program(reader, total, mesh=mesh)
    assert len(held) == 2, "the reader of the declared result waited for its producer's compile"
    assert compiler.resolve(doubled).sharding == sharded
    monkeypatch.setattr(compile_ahead, "_submit_compile", submit)  # what starts from here compiles
    for future, lowered in held:
        future.set_result(lowered.compile())
    assert compiler.finish() == 3  # the reader of the undeclared sum compiled once the producer had
    assert compiler.resolve(total).sharding.is_fully_replicated


def test_a_call_typed_alike_but_spelled_otherwise_finds_the_program_compiled_ahead():
    """The pool compiles a program under the JAX context it was lowered in (the mesh
    ``jax.set_mesh`` entered): a later call whose operands' shardings are equal but spelled
    otherwise (``P()`` for ``P(None, None)``, as the state a step returns is) misses the
    lowering JAX cached for the operands compiled ahead, lowers again to the same module and
    finds it compiled. Compiled on the pool without the mesh, it compiled again (the two-process
    lm1b test's second step: tests/multiprocess/test_multiprocess.py)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from meshpar.runtime.compile_ahead import AheadOfTime

    mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    update = jax.jit(lambda w, b: (w * 2 + b, b))
    compiler = AheadOfTime()
    compiler.program(update, jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P(None, None))),
                     jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(mesh, P("model", None))),
                     mesh=mesh)
    with compiled() as ahead:
        assert compiler.finish() == 1
    assert ahead == ["jit(<lambda>)"], ahead

    w = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P()))
    b = jax.device_put(np.ones((8, 4), np.float32), NamedSharding(mesh, P("model")))
    with compiled() as late:
        with jax.set_mesh(mesh):
            out, _ = update(w, b)
    np.testing.assert_allclose(np.asarray(out), 3)
    assert not late, late


def test_a_second_run_reads_every_program_from_the_persistent_cache(tmp_path):
    """With ``jax_compilation_cache_dir`` set, a second process running the same step compiles
    nothing: every program of its first step (the pipeline's, and those around it) is read from
    JAX's persistent cache, as jax.jit's are."""
    import json
    import os
    import subprocess
    import sys

    from repo_paths import ROOT_DIR, TESTS_DIR

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compile_cache_worker.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([TESTS_DIR, ROOT_DIR, os.environ.get("PYTHONPATH", "")])}

    def run() -> dict:
        done = subprocess.run([sys.executable, worker, str(tmp_path)], capture_output=True, text=True, timeout=300,
                              env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    cold, warm = run(), run()
    assert cold["cache_misses"] > 0 and set(PIPELINE_PROGRAMS) & set(cold["programs"]), cold
    assert warm["cache_misses"] == 0, warm
    assert warm["cache_hits"] == cold["cache_misses"], (cold, warm)
    assert warm["loss"] == cold["loss"]
