"""Gradients reduced once per step (``passes.pipeline.placing.data_replicas``): every schedule, micro-batch
count and data-axis size against jax.jit on one device; the compiled programs' collectives read
from XLA's own HLO dump; accumulation dtype; when a stage keeps the per-micro-batch reduction."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from repo_paths import ROOT_DIR, TESTS_DIR
from flax import linen as nn
from flax.training import train_state

import meshpar
from examples.gpt import GPT, gpt_batch, gpt_loss
from examples.mlp import MLP
from examples.train_step import supervised_step
from examples.u_transformer import UTransformer, ut_batch, ut_loss
from meshpar.passes.pipeline.placing.data_replicas import verify_data_replicas
from meshpar.passes.program.pipeline_instructions import ReduceGradients
from meshpar.passes.planning.hlo_collectives import CollectiveKind, collective_groups
from meshpar.passes.verification import PlanVerificationError
from pipeline_models import assert_trees_close, make_state, mse, run_both

ROOT = pathlib.Path(ROOT_DIR)

SCHEDULES = ("gpipe", "1f1b", "eager_1f1b", "zb_h1", "interleaved_1f1b")
# CI runs a spread in which every schedule, every micro-batch count and every data-axis size
# appears; the whole grid runs with -m slow.
CI_GRID = {("gpipe", 8, 4), ("1f1b", 2, 2), ("eager_1f1b", 1, 4), ("zb_h1", 8, 2), ("interleaved_1f1b", 2, 4),
           ("1f1b", 8, 1)}


def _grid():
    for schedule in SCHEDULES:
        for M in (1, 2, 8):
            if schedule == "interleaved_1f1b" and M == 1:
                continue  # its micro-batches come in rounds of the meshes (2)
            for data in (1, 2, 4):
                yield pytest.param(schedule, M, data, id=f"{schedule}-M{M}-data{data}",
                                   marks=() if (schedule, M, data) in CI_GRID else pytest.mark.slow)


def _replica_counts(compiled):
    return [g.copies for g in compiled.gradients.stages]


@pytest.mark.parametrize("schedule, M, data", list(_grid()))
def test_every_schedule_matches_single_device_jit(schedule, M, data):
    stages_per_mesh = 2 if schedule == "interleaved_1f1b" else 1
    num_stages = 2 * stages_per_mesh
    model = MLP(features=(16,) * num_stages + (4,), num_stages=num_stages)
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 6)).astype(np.float32),
             "y": rng.standard_normal((32, 4)).astype(np.float32)}
    state = make_state(model, batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=num_stages, stages_per_mesh=stages_per_mesh,
                                       stage_mesh_shape=(data, 1), devices=jax.devices()[:2 * data],
                                       schedule=schedule)
    ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=2)
    assert_trees_close(par_state, ref_state)
    executable = parallel.get_executable(par_state, batch)
    compiled = parallel.get_compiled(par_state, batch)
    # Every stage ran as replicas (none fell back to the per-micro-batch reduction).
    assert _replica_counts(compiled) == [data] * num_stages
    reductions = [ins for instructions in executable.program.instructions for ins in instructions
                  if isinstance(ins, ReduceGradients)]
    assert len(reductions) == (2 if data > 1 else 0)


@pytest.mark.parametrize("model_name, schedule, M", [
    pytest.param("gpt_tied", "1f1b", 8, id="gpt_tied-1f1b-M8"),
    pytest.param("gpt_tied", "zb_h1", 2, id="gpt_tied-zb_h1-M2", marks=pytest.mark.slow),
    pytest.param("u_transformer", "eager_1f1b", 2, id="u_transformer-eager_1f1b-M2", marks=pytest.mark.slow),
    pytest.param("u_transformer", "gpipe", 8, id="u_transformer-gpipe-M8", marks=pytest.mark.slow),
])
def test_tied_gpt_and_u_transformer_match_single_device_jit(model_name, schedule, M):
    """The tied embedding's gradients from stage 0 and the head's stage are each reduced once
    per step on their own meshes, then summed on the embedding's owner."""
    if model_name == "gpt_tied":
        model, batch, loss = GPT(num_stages=2, num_layers=2, tie_embeddings=True), gpt_batch(0, 16, 8, 64), gpt_loss
    else:
        model, batch, loss = UTransformer(num_stages=2), ut_batch(0, 16), ut_loss
    state = make_state(model, batch["x"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 2), schedule=schedule)
    ref_state, par_state, parallel = run_both(supervised_step(loss), state, batch, method, steps=2)
    assert_trees_close(par_state.params, ref_state.params)
    assert _replica_counts(parallel.get_compiled(par_state, batch)) == [2, 2]


_HLO_PROBE = textwrap.dedent("""
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import meshpar
    from examples.train_step import supervised_step
    from pipeline_models import TensorParallel, make_state, mse
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 8)).astype(np.float32),
             "y": rng.standard_normal((32, 4)).astype(np.float32)}
    state = make_state(TensorParallel(), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
        num_micro_batches=4, stage_mesh_shape=(2, 2), schedule=sys.argv[1], gradient_reduction=sys.argv[2]))
    jax.block_until_ready(parallel(state, batch))
""")


def _compiled_modules(tmp_path, schedule, reduction):
    """Per program name (``jit_backward``, ...), the HLO text XLA compiled for a step of the
    tensor-parallel two-stage model on (data 2, model 2) meshes."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text",
               PYTHONPATH=os.pathsep.join([ROOT_DIR, TESTS_DIR]))
    out = subprocess.run([sys.executable, "-c", _HLO_PROBE, schedule, reduction], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = {}
    for path in sorted(tmp_path.glob("*.cpu_after_optimizations.txt")):
        name = path.name.split(".")[1]
        modules.setdefault(name, []).append(path.read_text())
    return modules


def _spans_data(groups, model_size=2):
    """Whether a group holds devices of different data-axis rows (a mesh (data, model) numbers
    its devices data-major)."""
    return any(len({d // model_size for d in group}) > 1 for group in groups)


def _data_all_reduces(text):
    return [c for c, groups in collective_groups(text, 4) if c.kind is CollectiveKind.ALL_REDUCE
            and _spans_data(groups)]


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_backward_programs_reduce_nothing_over_the_data_axis_and_each_mesh_reduces_once(tmp_path, schedule):
    modules = _compiled_modules(tmp_path, schedule, "per_step")
    gradient_programs = [n for n in modules if n in ("jit_backward", "jit_backward_input", "jit_backward_weight")]
    assert sorted(gradient_programs) == (["jit_backward"] if schedule == "1f1b"
                                         else ["jit_backward_input", "jit_backward_weight"])
    # Forwards neither: the replicas' losses combine after the pipeline, so no stage program
    # waits on another replica's devices.
    for name in ["jit_forward", *gradient_programs]:
        assert len(modules[name]) == 2  # one per stage
        for text in modules[name]:
            assert _data_all_reduces(text) == [], name
    # One reduction program per stage mesh, run once per step, each one all-reduce over the
    # data axis (XLA combines the stage's parameters into it).
    reductions = modules["jit_reduce_gradients"]
    assert len(reductions) == 2
    assert [len(_data_all_reduces(text)) for text in reductions] == [1, 1]


def test_per_micro_batch_backwards_do_reduce_over_the_data_axis(tmp_path):
    """The same reading finds what per_step removes: the plain SPMD backward's all-reduce."""
    modules = _compiled_modules(tmp_path, "1f1b", "per_micro_batch")
    assert "jit_reduce_gradients" not in modules
    assert all(len(_data_all_reduces(text)) >= 1 for text in modules["jit_backward"])


class _Bfloat16Stages(nn.Module):
    """Two stages of bfloat16 parameters."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(16, param_dtype=jnp.bfloat16)(x))
        meshpar.mark_stage_boundary()
        return nn.Dense(4, param_dtype=jnp.bfloat16)(h)


def test_bfloat16_parameters_accumulate_in_float32():
    model = _Bfloat16Stages()
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 6)).astype(np.float32),
             "y": rng.standard_normal((32, 4)).astype(np.float32)}
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    grads_of = supervised_step(mse)
    runs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        parallel = meshpar.parallelize(grads_of, method=meshpar.PipeshardParallel(
            num_micro_batches=8, num_stages=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4],
            accumulation_dtype=dtype))
        runs[dtype] = parallel(state, batch)[0]
        executable = parallel.get_executable(state, batch)
        compiled = parallel.get_compiled(state, batch)
        assert {a.dtype for g in compiled.gradients.stages for a in g.accumulators} == {jnp.dtype(dtype)}
    assert {x.dtype for x in jax.tree.leaves(runs[jnp.float32].params)} == {jnp.dtype(jnp.bfloat16)}
    # The reference: the same step in float32 throughout (parameters upcast), on one device.
    f32 = state.replace(params=jax.tree.map(lambda x: x.astype(jnp.float32), state.params),
                        opt_state=state.tx.init(jax.tree.map(lambda x: x.astype(jnp.float32), state.params)))
    reference = jax.jit(grads_of)(f32, batch)[0].params
    error = {dtype: max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b)))
                        for a, b in zip(jax.tree.leaves(run.params), jax.tree.leaves(reference)))
             for dtype, run in runs.items()}
    # bfloat16 keeps 8 bits: a float32 accumulator leaves only the final rounding.
    assert error[jnp.float32] <= 2 ** -8
    assert error[jnp.float32] <= error[jnp.bfloat16]


class _Dropout(nn.Module):
    """Dropout drawn from a key the step is given, then a stage boundary."""

    @nn.compact
    def __call__(self, x, key):
        h = nn.Dense(16)(x)
        h = jnp.where(jax.random.bernoulli(key, 0.5, h.shape), 2 * h, 0.0)
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(jnp.tanh(h))


def _dropout_step(state, batch, key):
    def loss_fn(params):
        return mse(state.apply_fn(params, batch["x"], key), batch["y"])

    loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def test_replica_r_of_micro_batch_m_draws_from_the_key_folded_with_m_then_r():
    M, D, n = 2, 2, 16
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((n, 6)).astype(np.float32),
             "y": rng.standard_normal((n, 4)).astype(np.float32)}
    key = jax.random.key(7)
    model = _Dropout()
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1], key)
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1))
    parallel = meshpar.parallelize(_dropout_step, method=meshpar.PipeshardParallel(
        num_micro_batches=M, stage_mesh_shape=(D, 1), devices=jax.devices()[:2 * D]))
    got, loss = parallel(state, batch, key)
    assert _replica_counts(parallel.get_compiled(state, batch, key)) == [D, D]

    # Reference: every (micro-batch, replica) block on its own, with its own key; the step's
    # loss and gradients are the blocks' means (equal blocks).
    block = n // (M * D)

    def block_loss(p, m, r):
        rows = slice((m * D + r) * block, (m * D + r + 1) * block)
        k = jax.random.fold_in(jax.random.fold_in(key, m), r)
        return mse(model.apply(p, batch["x"][rows], k), batch["y"][rows])

    runs = [jax.jit(jax.value_and_grad(block_loss), static_argnums=(1, 2))(state.params, m, r)
            for m in range(M) for r in range(D)]
    want_loss = np.mean([float(v) for v, _ in runs])
    want = state.apply_gradients(grads=jax.tree.map(lambda *g: sum(g) / len(runs), *[g for _, g in runs]))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5)
    assert_trees_close(got.params, want.params)
    # Folding per micro-batch only (every replica the micro-batch's key) is another step.
    per_micro_batch = meshpar.parallelize(_dropout_step, method=meshpar.PipeshardParallel(
        num_micro_batches=M, stage_mesh_shape=(D, 1), devices=jax.devices()[:2 * D],
        gradient_reduction="per_micro_batch"))
    assert abs(float(per_micro_batch(state, batch, key)[1]) - want_loss) > 1e-4


class _BatchSizeBranch(nn.Module):
    """Computes differently below 8 examples: traced per replica (4 examples), its second stage
    is another program than per micro-batch (8)."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(2 * h if x.shape[0] % 8 == 0 else jnp.sin(h))


def _run_batch_size_branch():
    """``_BatchSizeBranch``'s step run against jax.jit (equal); its first stage runs as 2
    replicas, its second does not. Returns the parallelized step, its state and the batch."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 6)).astype(np.float32),
             "y": rng.standard_normal((16, 4)).astype(np.float32)}
    state = make_state(_BatchSizeBranch(), batch["x"][:8])
    method = meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4])
    ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=2)
    assert_trees_close(par_state, ref_state)
    assert _replica_counts(parallel.get_compiled(par_state, batch)) == [2, 1]
    return parallel, par_state, batch


def test_a_stage_that_does_not_split_keeps_the_per_micro_batch_reduction_and_says_why():
    parallel, par_state, batch = _run_batch_size_branch()
    executable = parallel.get_executable(par_state, batch)
    compiled = parallel.get_compiled(par_state, batch)
    why = "traced per replica, its equations differ from the micro-batch's"
    assert compiled.gradients.stages[1].per_micro_batch == why
    assert f"gradients of stage 1: reduced in every micro-batch's backward ({why})" in executable.describe()


def test_each_stage_is_linearized_once_at_the_size_it_runs(monkeypatch):
    """A stage run as replicas has its parts traced per replica only; one that does not split,
    at the micro-batch's size only. Both run as their parts say: results equal jax.jit's."""
    from meshpar.passes import pipeline_driver
    from meshpar.passes.pipeline.cutting import stage_parts as stage_parts_module
    from meshpar.passes.pipeline.placing import data_replicas

    traced = []

    def counted(stage, *args, **kwargs):
        traced.append((stage.index, stage.jaxpr.in_avals[0].shape[0]))
        return stage_parts_module.stage_parts(stage, *args, **kwargs)

    monkeypatch.setattr(pipeline_driver, "stage_parts", counted)
    monkeypatch.setattr(data_replicas, "stage_parts", counted)
    parallel, par_state, batch = _run_batch_size_branch()
    compiled = parallel.get_compiled(par_state, batch)
    # Stage 0 per replica (4 of a micro-batch's 8 examples), stage 1 per micro-batch; once each.
    assert sorted(traced) == [(0, 4), (1, 8)]
    assert compiled.parts[0] is compiled.gradients.stages[0].replicas.parts
    assert compiled.parts[1].forward.in_avals[0].shape[0] == 8


def test_the_verifier_names_the_stage_whose_plan_is_broken():
    batch = {"x": np.ones((16, 6), np.float32), "y": np.ones((16, 4), np.float32)}
    state = make_state(MLP(features=(8, 4), num_stages=2), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
        num_micro_batches=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4]))
    executable = parallel.get_executable(state, batch)
    compiled = parallel.get_compiled(state, batch)
    plan, graph, meshes, home = compiled.gradients, compiled.graph, executable.meshes, executable.home
    verify_data_replicas(plan, graph, meshes, home)
    stage = plan.stages[1]
    whole = dataclasses.replace(stage.accumulators[0], shape=stage.accumulators[0].shape[1:])
    broken = [
        (dataclasses.replace(plan, stages=plan.stages[:1]), "1 stages planned, the graph has 2"),
        (dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(
            stage, accumulators=(whole, *stage.accumulators[1:])))), "stage 1: an accumulator is not one per replica"),
        (dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(
            stage, replicas=dataclasses.replace(stage.replicas, count=4)))), "stage 1: 4 replicas on a mesh of"),
        (dataclasses.replace(plan, stages=(plan.stages[0], dataclasses.replace(stage, accumulators=()))),
         "stage 1: not one accumulator per parameter input"),
    ]
    for bad, message in broken:
        with pytest.raises(PlanVerificationError, match=re.escape(message)):
            verify_data_replicas(bad, graph, meshes, home)


def test_describe_says_how_each_stage_reduces():
    batch = {"x": np.ones((16, 6), np.float32), "y": np.ones((16, 4), np.float32)}
    state = make_state(MLP(features=(8, 4), num_stages=2), batch["x"][:1])
    lines = {}
    for reduction in ("per_step", "per_micro_batch"):
        parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
            num_micro_batches=2, stage_mesh_shape=(2, 1), devices=jax.devices()[:4], gradient_reduction=reduction))
        text = parallel.get_executable(state, batch).describe()
        lines[reduction] = [line for line in text.splitlines() if "gradients of stage" in line]
    assert lines["per_step"] == [
        f"  gradients of stage {s}: 2 data-parallel replicas over 'data', each accumulating its own examples' "
        f"partial sums; reduced once per step; accumulated in float32" for s in (0, 1)]
    assert lines["per_micro_batch"] == [
        f"  gradients of stage {s}: reduced in every micro-batch's backward (gradient_reduction='per_micro_batch'); "
        f"accumulated in float32" for s in (0, 1)]
