"""``PipeshardParallel``'s options: ``stages_per_mesh`` (virtual stages) checked before tracing,
each error naming the argument; the groups the compiler reads (``pipeline_options``) covering
every option exactly once; ``ParallelismPlan.method_with`` keeping the user's options."""

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

import meshpar
from examples.train_step import supervised_step
from meshpar.passes.pipeline.pipeline_options import (GradientOptions, GradientReduction, PipelineOptions,
                                                      PlacementOptions, ScheduleOptions, TransferOptions)
from meshpar.passes.pipeline.placing.edge_transfer import Executor
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, schedule_kind
from meshpar.passes.resharding.balancers import get_balancer
from meshpar.passes.resharding.strategies import STRATEGIES, get_strategy
from meshpar.passes.planning.layer_profile import LayerProfile, ModelProfile
from meshpar.passes.planning.planner_meshpar import PipelinePlan, StagePlan
from meshpar.planning import ParallelismPlan
from pipeline_models import make_state, mse

GROUPS = (ScheduleOptions, PlacementOptions, TransferOptions, GradientOptions)
# Options the API reads itself (where to run, how to trace and check): in no group.
API_ONLY = {"devices", "batch_argnums", "single_program", "logical_axis_rules"}
# Group fields named differently from the option they come from.
RENAMED = {"kind": "schedule", "strategy": "resharding"}
# Group fields holding the option resolved (a name becomes its object), as the API resolves it.
RESOLVED = {"kind": schedule_kind, "strategy": get_strategy, "balancer": get_balancer,
            "executor": lambda v: Executor.of(v, "executor"),
            "gradient_reduction": lambda v: GradientReduction.of(v, "gradient_reduction")}
# Group fields the cluster (or its default) decides.
FROM_CLUSTER = {"inter_host_bandwidth", "intra_host_bandwidth"}


def _raises(start, *fragments):
    """A ValueError whose message starts with ``start`` (the argument) and holds ``fragments``."""
    return pytest.raises(ValueError, match="(?s)^" + re.escape(start) + "".join(
        f"(?=.*{re.escape(f)})" for f in fragments))


def _mesh(first, n, axes=("data", "model")):
    return jax.sharding.Mesh(np.array(jax.devices()[first:first + n]).reshape(n, 1), axes)


def _user_fields():
    return {f.name for f in dataclasses.fields(meshpar.PipeshardParallel)}


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_stages_per_mesh_must_be_a_positive_int(value):
    with _raises("stages_per_mesh: expected a positive integer", repr(value)):
        meshpar.PipeshardParallel(stages_per_mesh=value)


@pytest.mark.parametrize("value", ["per_microbatch", "once", None, 1])
def test_gradient_reduction_must_be_known(value):
    with _raises("gradient_reduction: expected one of ('per_step', 'per_micro_batch')", repr(value)):
        meshpar.PipeshardParallel(gradient_reduction=value)


@pytest.mark.parametrize("value", [jnp.int32, "int8", "bool", "not_a_dtype", 3, None])
def test_accumulation_dtype_must_be_floating(value):
    with _raises("accumulation_dtype: expected a floating dtype", repr(value)):
        meshpar.PipeshardParallel(accumulation_dtype=value)


@pytest.mark.parametrize("value", [jnp.float32, "float32", jnp.bfloat16, np.float64])
def test_floating_accumulation_dtypes_are_taken(value):
    options = meshpar.PipeshardParallel(accumulation_dtype=value).pipeline_options(8)
    assert options.gradients == GradientOptions(GradientReduction.PER_STEP, jnp.dtype(value))


def test_stages_per_mesh_is_rejected_with_auto():
    with _raises("stages_per_mesh: 'auto'", "do not pass stages_per_mesh"):
        meshpar.PipeshardParallel(num_stages="auto", stages_per_mesh=2)


def test_fewer_meshes_than_stages_are_virtual_stages():
    meshes = [_mesh(0, 4), _mesh(4, 4)]
    method = meshpar.PipeshardParallel(stage_meshes=meshes, num_stages=4, schedule="interleaved_1f1b",
                                       num_micro_batches=2)
    assert method.num_meshes(4) == 2
    # Given, the count must agree with the meshes.
    meshpar.PipeshardParallel(stage_meshes=meshes, num_stages=4, stages_per_mesh=2, schedule="interleaved_1f1b",
                              num_micro_batches=2)
    with _raises("stages_per_mesh: 3, but 4 stages (num_stages=4) on 2 stage_meshes", "stages_per_mesh=2"):
        meshpar.PipeshardParallel(stage_meshes=meshes, num_stages=4, stages_per_mesh=3,
                                  schedule="interleaved_1f1b", num_micro_batches=2)


def test_meshes_that_do_not_divide_the_stages_are_rejected():
    with _raises("stage_meshes: 2 meshes, but num_stages=3", "pass one mesh per stage", "dividing num_stages"):
        meshpar.PipeshardParallel(stage_meshes=[_mesh(0, 4), _mesh(4, 4)], num_stages=3)


def test_virtual_stages_need_a_schedule_that_runs_them():
    with _raises("schedule: '1f1b' runs one stage per mesh", "interleaved_1f1b"):
        meshpar.PipeshardParallel(stage_meshes=[_mesh(0, 4), _mesh(4, 4)], num_stages=4, schedule="1f1b")
    with _raises("schedule: 'gpipe' runs one stage per mesh"):
        meshpar.PipeshardParallel(num_stages=4, stages_per_mesh=2, schedule="gpipe")


def test_virtual_stages_need_micro_batches_the_schedule_fits():
    with _raises("num_micro_batches: interleaved_1f1b with virtual stages needs a multiple of 2", "got 3"):
        meshpar.PipeshardParallel(num_stages=4, stages_per_mesh=2, schedule="interleaved_1f1b",
                                  num_micro_batches=3)


def test_cut_meshes_hold_whole_groups_of_stages():
    with _raises("stages_per_mesh: 3 does not divide the 4 stages (num_stages=4)"):
        meshpar.PipeshardParallel(num_stages=4, stages_per_mesh=3, schedule="interleaved_1f1b")
    # One stage per mesh, the meshes are the stages.
    one = meshpar.PipeshardParallel(num_stages=4, stages_per_mesh=1)
    assert one.num_meshes(4) == 4


def test_devices_are_cut_into_stages_over_stages_per_mesh_meshes():
    devices = jax.devices()
    # 4 stages two per mesh: 2 meshes of 4 devices, so (2, 2) fits; one per mesh it would not.
    meshpar.PipeshardParallel(num_stages=4, stages_per_mesh=2, schedule="interleaved_1f1b", num_micro_batches=2,
                              stage_mesh_shape=(2, 2), devices=devices)
    with _raises("stage_mesh_shape: (2, 2) does not hold the 2 devices"):
        meshpar.PipeshardParallel(num_stages=4, stage_mesh_shape=(2, 2), devices=devices)
    with pytest.raises(ValueError, match=re.escape("2 stages (num_stages=4 over stages_per_mesh=2: 2 meshes) "
                                                   "do not divide 3 devices")):
        meshpar.PipeshardParallel(num_stages=4, stages_per_mesh=2, schedule="interleaved_1f1b",
                                  num_micro_batches=2, devices=devices[:3])


class _Stages(nn.Module):
    num_stages: int

    @nn.compact
    def __call__(self, x):
        for _ in range(self.num_stages - 1):
            x = jnp.tanh(nn.Dense(6)(x))
            meshpar.mark_stage_boundary()
        return nn.Dense(6)(x)


def _step_error(num_stages, method):
    batch = {"x": np.ones((8, 6), np.float32), "y": np.ones((8, 6), np.float32)}
    state = make_state(_Stages(num_stages), batch["x"][:1])
    with pytest.raises(ValueError) as error:
        meshpar.parallelize(supervised_step(mse), method=method)(state, batch)
    return str(error.value)


def test_the_models_stage_count_is_checked_against_the_placement():
    # num_stages not given: the model's markers decide, checked once traced.
    message = _step_error(3, meshpar.PipeshardParallel(stages_per_mesh=2, schedule="interleaved_1f1b"))
    assert message.startswith("stages_per_mesh: 2 does not divide the 3 stages (stage markers + 1)"), message
    message = _step_error(4, meshpar.PipeshardParallel(stage_meshes=[_mesh(0, 4), _mesh(4, 4)]))
    assert message.startswith("schedule: '1f1b' runs one stage per mesh"), message


def test_every_option_is_in_exactly_one_group_or_api_only():
    sources = collections.Counter(RENAMED.get(f.name, f.name) for group in GROUPS
                                  for f in dataclasses.fields(group) if f.name not in FROM_CLUSTER)
    assert [n for n, count in sources.items() if count > 1] == []
    assert set(sources) <= _user_fields(), "a group field no PipeshardParallel option sets"
    assert not set(sources) & API_ONLY
    # A new option must join a group (or API_ONLY here): none is forgotten.
    assert set(sources) | API_ONLY == _user_fields()
    assert [f.name for f in dataclasses.fields(PipelineOptions)] == [
        "schedule", "placement", "transfers", "micro_batch_size", "gradients"]


def test_groups_carry_the_options():
    devices = jax.devices()
    cluster = meshpar.Cluster.from_devices(devices, inter_host_bandwidth=3e9, intra_host_bandwidth=7e9)
    meshes = [_mesh(0, 4, ("dp", "tp")), _mesh(4, 4, ("dp", "tp"))]
    method = meshpar.PipeshardParallel(
        num_micro_batches=4, stage_meshes=meshes, num_stages=4, stages_per_mesh=2, schedule="interleaved_1f1b",
        resharding="send_recv", balancer="greedy_random", cluster=cluster, executor="p2p", timeout_s=7.5,
        weight_delay=True, data_axis="dp", model_axis="tp", cut_points=(0, 1, 2), auto_layers=9)
    options = method.pipeline_options(5)
    assert options.micro_batch_size == 5
    for group in (options.schedule, options.placement, options.transfers):
        for f in dataclasses.fields(group):
            got = getattr(group, f.name)
            if f.name in FROM_CLUSTER:
                assert got == getattr(cluster, f.name), f.name
            else:
                want = getattr(method, RENAMED.get(f.name, f.name))
                assert got == RESOLVED.get(f.name, lambda v: v)(want), f.name
    assert options.schedule.kind is SCHEDULES["interleaved_1f1b"] and options.placement.stages_per_mesh == 2
    assert options.transfers.strategy is STRATEGIES["send_recv"] and options.transfers.executor is Executor.P2P


def test_signal_is_an_executor():
    for method in (meshpar.PipeshardParallel(executor="signal"), meshpar.PipeshardParallel(resharding="signal"),
                   meshpar.PipeshardParallel(resharding="signal", executor="signal")):
        transfers = method.pipeline_options(1).transfers
        assert transfers.executor is Executor.SIGNAL and transfers.strategy is STRATEGIES["broadcast"]
    with _raises("resharding: 'signal' sends one byte per transfer (executor='signal')", "executor='collective'"):
        meshpar.PipeshardParallel(resharding="signal", executor="collective")
    with _raises("resharding: unknown 'ring'", "broadcast"):
        meshpar.PipeshardParallel(resharding="ring")
    with _raises("executor: expected one of ('auto', 'p2p', 'collective', 'signal')", "'nccl'"):
        meshpar.PipeshardParallel(executor="nccl")


def test_default_bandwidths_are_the_default_clusters():
    options = meshpar.PipeshardParallel().pipeline_options(1)
    default = meshpar.Cluster.from_devices(jax.devices())
    assert options.transfers.inter_host_bandwidth == default.inter_host_bandwidth
    assert options.transfers.intra_host_bandwidth == default.intra_host_bandwidth


def _plan():
    devices = tuple(jax.devices()[:4])
    layer = LayerProfile(1.0, 1.0, 1.0, 1.0, 1.0)
    best = PipelinePlan((StagePlan(0, 1, (2, 1)), StagePlan(1, 2, (2, 1))), 2, "1f1b", 1.0, (1.0, 1.0))
    return ParallelismPlan(best, (), ModelProfile((layer, layer), 8), devices,
                           meshpar.Cluster.from_devices(list(devices)), 0.0)


# What a plan chooses or fixes; method_with keeps every other option of its base.
PLANNED = {"num_micro_batches", "stage_meshes", "num_stages", "stage_mesh_shape", "stages_per_mesh", "schedule",
           "cut_points", "cluster", "devices", "auto_layers", "batch_argnums"}


def test_method_with_keeps_the_users_options():
    plan = _plan()
    base = meshpar.PipeshardParallel(
        num_stages="auto", resharding="send_recv", balancer="naive", executor="p2p", timeout_s=7.5,
        weight_delay=True, data_axis="dp", model_axis="tp", single_program=False, logical_axis_rules=[("mlp", "tp")])
    method = plan.method_with(base)
    assert not method.planned
    for name in _user_fields() - PLANNED:
        assert getattr(method, name) == getattr(base, name), name
    assert method.num_micro_batches == 2 and method.cut_points == (0,) and method.num_stages is None
    assert [m.axis_names for m in method.stage_meshes] == [("dp", "tp")] * 2
    assert plan.method_with(base, executor="collective").executor == "collective"
    assert plan.method == plan.method_with(meshpar.PipeshardParallel())
