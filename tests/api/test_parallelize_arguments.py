"""meshpar.PipeshardParallel's arguments: errors name the argument and a fix, before the step is
traced; meshes whose axes have other names; describe() on size-1 axes. 8 CPU devices."""

import re

import jax
import numpy as np
import pytest
from flax import linen as nn
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from pipeline_models import assert_trees_close, make_state, mse


def _mesh(start: int, shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
    n = int(np.prod(shape))
    return Mesh(np.array(jax.devices()[start:start + n]).reshape(shape), names)


def _batch(n: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, 6)).astype(np.float32), "y": rng.standard_normal((n, 4)).astype(np.float32)}


def _raises(*fragments: str):
    """Expects a ValueError whose message holds every fragment (the argument and the fix)."""
    return pytest.raises(ValueError, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


class _TensorParallel(nn.Module):
    """Two stages whose kernels flax partitions over ``axis`` (the second one only its input
    dimension, so both stages shard something)."""

    axis: str = "model"

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(16, kernel_init=nn.with_partitioning(init, (None, self.axis)))(x)
        meshpar.mark_stage_boundary()
        return nn.Dense(4, kernel_init=nn.with_partitioning(init, (self.axis, None)))(nn.gelu(h))


# -- checked when PipeshardParallel is made ------------------------------------------------


CONSTRUCTION_ERRORS = [
    (dict(stage_mesh_shape=(4,)), ["stage_mesh_shape: expected (data, model), two positive integers",
                                   "e.g. stage_mesh_shape=(2, 2)"]),
    (dict(stage_mesh_shape=(0, 2)), ["stage_mesh_shape:", "two positive integers"]),
    (dict(stage_mesh_shape="2x2"), ["stage_mesh_shape:", "two positive integers"]),
    (dict(num_stages=0), ["num_stages: expected a positive integer"]),
    (dict(num_stages="2"), ["num_stages: expected a positive integer"]),
    (dict(batch_argnums=1), ["batch_argnums: expected a non-empty tuple of non-negative integers",
                             "batch_argnums=(1,)"]),
    (dict(batch_argnums=(-1,)), ["batch_argnums:", "non-negative", "batch_argnums=(1,)"]),
    (dict(batch_argnums=()), ["batch_argnums:", "non-empty"]),
    (dict(cluster="p3"), ["cluster: expected a meshpar.Cluster", "meshpar.Cluster.aws_p3_8xlarge"]),
    (dict(data_axis=""), ["data_axis: expected a mesh axis name"]),
    (dict(model_axis=None), ["model_axis: expected a mesh axis name"]),
    (dict(data_axis="x", model_axis="x"), ["data_axis, model_axis: both are 'x'", "two different"]),
    (dict(devices=[]), ["devices: expected a non-empty list of jax devices", "jax.devices()[:4]"]),
    (dict(devices="cpu"), ["devices: expected a non-empty list of jax devices"]),
    (dict(devices=[0, 1]), ["devices: expected a non-empty list of jax devices"]),
    (dict(fuse_compute=0), ["fuse_compute: expected a positive number of stage passes per program or None"]),
    (dict(fuse_compute=True), ["fuse_compute:", "got True"]),
    (dict(fuse_compute="2"), ["fuse_compute:", "got '2'"]),
]


@pytest.mark.parametrize("kwargs, fragments", CONSTRUCTION_ERRORS, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_malformed_arguments_are_rejected_when_made(kwargs, fragments):
    with _raises(*fragments):
        meshpar.PipeshardParallel(**kwargs)


def test_devices_given_are_checked_against_the_mesh_arguments_when_made():
    devices = jax.devices()
    with _raises("devices:", "repeat; pass each device once"):
        meshpar.PipeshardParallel(devices=[devices[0], devices[0]])
    with _raises("3 stages (num_stages=3) do not divide 8 devices evenly", "pass stage_meshes=[...]",
                 "uneven split"):
        meshpar.PipeshardParallel(num_stages=3, devices=devices)
    with _raises("stage_mesh_shape: (4, 4) does not hold the 4 devices of each stage",
                 "pass stage_mesh_shape=(4, 1), (2, 2) or (1, 4)"):
        meshpar.PipeshardParallel(num_stages=2, stage_mesh_shape=(4, 4), devices=devices)
    with _raises("stage_meshes: mesh 0 uses device cpu:4, which is not among the devices "
                 "['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']",
                 "pass devices= including it"):
        meshpar.PipeshardParallel(stage_meshes=[_mesh(4, (2, 2), ("data", "model"))], devices=devices[:4])
    method = meshpar.PipeshardParallel(devices=np.array(devices[:4]).reshape(2, 2), stage_mesh_shape=(2, 1))
    assert method.devices == tuple(devices[:4])


def test_stage_meshes_are_checked_when_made():
    a, b = _mesh(0, (2, 2), ("data", "model")), _mesh(4, (2, 2), ("data", "model"))
    with _raises("stage_meshes: expected a non-empty list of jax.sharding.Mesh", "stage_meshes=[mesh0, mesh1]"):
        meshpar.PipeshardParallel(stage_meshes=a)
    with _raises("stage_meshes: expected a non-empty list of jax.sharding.Mesh"):
        meshpar.PipeshardParallel(stage_meshes=[])
    with _raises("stage_mesh_shape:", "pass one of stage_meshes or stage_mesh_shape"):
        meshpar.PipeshardParallel(stage_meshes=[a, b], stage_mesh_shape=(2, 2))
    with _raises("stage_meshes: 2 meshes, but num_stages=3", "pass one mesh per stage"):
        meshpar.PipeshardParallel(stage_meshes=[a, b], num_stages=3)
    with _raises("stage_meshes: meshes 0 and 1 overlap on device cpu:2", "pass disjoint meshes"):
        meshpar.PipeshardParallel(stage_meshes=[a, _mesh(2, (2, 2), ("data", "model"))])


def test_stage_meshes_without_the_named_axes_are_rejected():
    """A mesh axis of size > 1 that is neither the data nor the model axis would only repeat work:
    rejected while one of the two roles has no axis, naming the axes and the arguments to pass."""
    tp = [_mesh(0, (2, 2), ("dp", "tp")), _mesh(4, (2, 2), ("dp", "tp"))]
    with _raises("stage_meshes: mesh 0 has axes ('dp', 'tp')", "no data_axis='data' or model_axis='model'",
                 "pass data_axis='dp', model_axis='tp'"):
        meshpar.PipeshardParallel(stage_meshes=tp)
    with _raises("stage_meshes: mesh 1 has axes ('data', 'tp')", "no model_axis='model'", "pass model_axis='tp'"):
        meshpar.PipeshardParallel(stage_meshes=[_mesh(0, (2, 2), ("data", "model")), _mesh(4, (2, 2), ("data", "tp"))])
    with _raises("stage_meshes: mesh 0 has axes ('x',)", "pass data_axis='x'"):
        meshpar.PipeshardParallel(stage_meshes=[_mesh(0, (4,), ("x",))])
    # One role's axis is enough; size-1 axes of other names hold nothing; extra axes beside both
    # roles are the step's own (its sharding constraints).
    meshpar.PipeshardParallel(stage_meshes=[_mesh(0, (4,), ("data",)), _mesh(4, (4,), ("data",))])
    meshpar.PipeshardParallel(stage_meshes=[_mesh(0, (4,), ("tp",))], model_axis="tp")
    meshpar.PipeshardParallel(stage_meshes=[_mesh(0, (4, 1), ("data", "x"))])
    meshpar.PipeshardParallel(stage_meshes=[_mesh(0, (2, 2, 2), ("data", "model", "seq"))])
    meshpar.PipeshardParallel(stage_meshes=tp, data_axis="dp", model_axis="tp")


# -- checked against jax.devices() when the step first compiles, before tracing --------------


@pytest.mark.parametrize("kwargs, fragments", [
    (dict(stage_mesh_shape=(4, 4)), ["stage_mesh_shape: (4, 4) holds 16 devices per stage",
                                     "(for 2 stages: (4, 1), (2, 2) or (1, 4))", "stage_meshes=[...]"]),
    (dict(stage_mesh_shape=(3, 1)), ["stage_mesh_shape: (3, 1) holds 3 devices per stage"]),
    (dict(num_stages=2, stage_mesh_shape=(4, 4)), ["stage_mesh_shape: (4, 4) does not hold the 4 devices",
                                                   "pass stage_mesh_shape=(4, 1), (2, 2) or (1, 4)"]),
    (dict(num_stages=3), ["3 stages (num_stages=3) do not divide 8 devices evenly",
                          "pass stage_meshes=[...] (one jax.sharding.Mesh per stage) for an uneven split"]),
], ids=["shape-too-big", "shape-not-dividing", "shape-with-num-stages", "uneven-stages"])
def test_device_errors_come_before_tracing(kwargs, fragments):
    traced = []

    def step(state, batch):
        traced.append(True)
        return supervised_step(mse)(state, batch)

    batch = _batch()
    state = make_state(MLP(features=(16, 4), num_stages=2), batch["x"][:1])
    with _raises(*fragments):
        meshpar.parallelize(step, method=meshpar.PipeshardParallel(**kwargs))(state, batch)
    assert not traced


# -- checked against the stage count, right after the stage graph is built -----------------


def test_stage_count_errors_from_markers_name_the_argument_and_fix():
    batch = _batch()
    three = make_state(MLP(features=(16, 16, 4), num_stages=3), batch["x"][:1])
    step = meshpar.parallelize(supervised_step(mse))
    with _raises("3 stages (stage markers + 1) do not divide 8 devices evenly", "pass stage_meshes=[...]"):
        step(three, batch)
    two = make_state(MLP(features=(16, 4), num_stages=2), batch["x"][:1])
    step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(stage_mesh_shape=(1, 2)))
    with _raises("stage_mesh_shape: (1, 2) does not hold the 4 devices of each stage (8 devices / 2 stages",
                 "pass stage_mesh_shape=(4, 1), (2, 2) or (1, 4), or devices=jax.devices()[:4] to run on 4 of "
                 "the 8 devices"):
        step(two, batch)
    step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(num_stages=4))
    with _raises("num_stages: 4 stages asked for", "make 2 stages; pass num_stages=2 (or None)"):
        step(two, batch)


# -- meshes with other axis names; describe() ----------------------------------------------


@pytest.mark.parametrize("annotation, shapes", [("tp", ((2, 2), (2, 2))), ("model", ((2, 2), (1, 4)))],
                         ids=["tp-named-params", "model-named-params"])
def test_meshes_with_other_axis_names_shard_over_them_and_match_jit(annotation, shapes):
    """Meshes with axes ("dp", "tp"): the batch and boundary activations shard over dp, flax-partitioned
    parameter dimensions over tp, whether flax names the mesh axis or 'model'. (flax constrains
    parameters by their names while the step is traced under a stage mesh, which happens when all
    stage meshes are alike: there the names must be the mesh's.)"""
    batch = _batch()
    state = make_state(_TensorParallel(annotation), batch["x"][:1])
    meshes = [_mesh(0, shapes[0], ("dp", "tp")), _mesh(4, shapes[1], ("dp", "tp"))]
    step = supervised_step(mse)
    parallel = meshpar.parallelize(step, method=meshpar.PipeshardParallel(
        num_micro_batches=2, num_stages=2, stage_meshes=meshes, data_axis="dp", model_axis="tp"))
    ref_state, par_state = state, state
    for _ in range(2):
        ref_state, ref_loss = jax.jit(step)(ref_state, batch)
        par_state, par_loss = parallel(par_state, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(par_state.params, ref_state.params)
    kernels = [leaf for leaf in jax.tree.leaves(par_state.params) if leaf.ndim == 2]
    for kernel, mesh, spec in zip(kernels, meshes, (P(None, "tp"), P("tp", None)), strict=True):
        assert kernel.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), kernel.sharding
    executable = parallel.get_executable(par_state, batch)
    compiled = parallel.get_compiled(par_state, batch)
    per_micro_batch = [op for ops in compiled.layout.stage_operands for op in ops if op.per_micro_batch]
    assert per_micro_batch and all(op.sharding.spec == P("dp") for op in per_micro_batch)
    assert {t.src.spec for t in executable.program.transfers} == {P("dp")}
    assert "(1 sharded over 'tp', the rest replicated)" in executable.describe()


def test_describe_does_not_count_size_one_axes_as_sharding():
    batch = _batch()
    state = make_state(_TensorParallel(), batch["x"][:1])
    texts = {}
    for shape in ((4, 1), (2, 2)):
        parallel = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
            num_micro_batches=2, num_stages=2, stage_mesh_shape=shape))
        texts[shape] = parallel.get_executable(state, batch).describe()
    assert "sharded over" not in texts[(4, 1)] and texts[(4, 1)].count("(all replicated)") == 2
    assert texts[(2, 2)].count("(1 sharded over 'model', the rest replicated)") == 2


def test_more_stages_than_scanned_layers_names_the_most_it_can_make():
    from examples.gpt import GPT, gpt_batch, gpt_loss

    model = GPT(scan_layers=True, num_layers=4)
    batch = gpt_batch(0, 8, model.seq_len, model.vocab_size)
    state = make_state(model, batch["x"][:1])
    step = meshpar.parallelize(supervised_step(gpt_loss), method=meshpar.PipeshardParallel(
        num_micro_batches=2, num_stages=8, stage_mesh_shape=(1, 1)))
    with _raises("num_stages: 8 stages asked for, but the loss's layer scans have 4 iterations in all",
                 "pass num_stages=4 or fewer"):
        step(state, batch)
