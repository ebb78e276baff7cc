"""A new resharding strategy, or a new schedule, is one module plus one registry entry (issue 43,
item 3): this file alone defines a toy of each, registers it, and the planner, both lowerings,
``meshpar.reshard`` and a pipeline take it by name, with no other change."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from examples.train_step import supervised_step
from meshpar.passes.model.cluster import Cluster
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, ScheduleKind, make_schedule
from meshpar.passes.program.moves import TransferKind
from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.resharding.chains import Chain
from meshpar.passes.resharding.hop_program import lower_to_hops, verify_hop_program
from meshpar.passes.resharding.strategies import STRATEGIES, Multicast, Strategy
from meshpar.passes.resharding.transfer_program import lower_plan, verify_program
from pipeline_models import TwoStages, assert_trees_close, make_state, mse
from random_tasks import random_task
from test_hop_program import run_in_numpy as run_hops
from test_transfer_program import run_in_numpy as run_transfers


@dataclasses.dataclass(frozen=True)
class TwoRings(Strategy):
    """The whole slice down two rings from the sender, each through half of the receivers (in
    ring order). Priced as ``send_recv`` (one copy per receiver from the sender), which bounds
    it; every remote receiver host may pass data on."""

    name: str = "two_rings"

    def seconds(self, multicast: Multicast, cluster: Cluster, chunks: int) -> float:
        return STRATEGIES["send_recv"].seconds(multicast, cluster, chunks)

    def chains(self, task, host_of, split) -> list[Chain]:
        half = (len(task.route) + 1) // 2
        return [Chain(task.unit.bounds, (task.sender, *ring)) for ring in (task.route[:half], task.route[half:])
                if ring]

    def forwarding_hosts(self, remote):
        return remote


@pytest.fixture
def two_rings(monkeypatch):
    strategy = TwoRings()
    monkeypatch.setitem(STRATEGIES, strategy.name, strategy)
    return strategy


def _tiles(task, x):
    return {d: x[tuple(slice(a, b) for a, b in t.bounds)] for t in task.dst_tiles for d in t.devices}


@pytest.mark.parametrize("seed", range(12))
def test_a_registered_strategy_is_planned_and_lowered_by_name(two_rings, seed):
    task, cluster = random_task(seed, pad=False)
    plan = meshpar.plan_resharding(task, cluster, strategy="two_rings")
    assert plan.strategy is two_rings and "two_rings/" in plan.summary()
    x = np.random.default_rng(seed).standard_normal(task.shape)
    program = lower_plan(plan)
    verify_program(program)
    delivered = run_transfers(program, task, x)
    hops = lower_to_hops(plan)
    verify_hop_program(hops)
    arrived = run_hops(hops, task, x)
    for d, want in _tiles(task, x).items():
        np.testing.assert_array_equal(delivered[d], want)
        np.testing.assert_array_equal(arrived[d], want)


@pytest.mark.parametrize("executor", ["p2p", "collective"])
def test_reshard_runs_a_registered_strategy(two_rings, executor):
    devices = jax.devices()
    src = NamedSharding(Mesh(np.array(devices[:4]).reshape(2, 2), ("x", "y")), P("x", None))
    dst = NamedSharding(Mesh(np.array(devices[4:8]).reshape(2, 2), ("x", "y")), P(None, "y"))
    expected = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    y = meshpar.reshard(jax.device_put(expected, src), dst, strategy="two_rings", executor=executor)
    assert y.sharding == dst
    np.testing.assert_array_equal(np.asarray(y), expected)
    assert meshpar.plan_for(jax.device_put(expected, src), dst, strategy="two_rings").strategy == two_rings


def _gpipe_in_reverse(num_meshes, stages_per_mesh, num_micro_batches):
    """One stage per mesh: every forward, then the backwards, last micro-batch first."""
    M = num_micro_batches
    return [[Task(TaskKind.FORWARD, s, m) for m in range(M)] + [Task(TaskKind.BACKWARD, s, m)
                                                               for m in reversed(range(M))]
            for s in range(num_meshes)]


@pytest.fixture
def reversed_gpipe(monkeypatch):
    kind = ScheduleKind("reversed_gpipe", _gpipe_in_reverse)
    monkeypatch.setitem(SCHEDULES, kind.name, kind)
    return kind


def test_a_registered_schedule_is_made_by_name(reversed_gpipe):
    schedule = make_schedule(reversed_gpipe, 3, 4, [(0, 1), (1, 2)])
    assert schedule.name == "reversed_gpipe" and schedule.sequences[0][-1] == Task(TaskKind.BACKWARD, 0, 0)
    options = meshpar.PipeshardParallel(num_stages=2, schedule="reversed_gpipe").pipeline_options(4)
    assert options.schedule.kind is reversed_gpipe


def test_a_pipeline_runs_a_registered_strategy_and_schedule_by_name(two_rings, reversed_gpipe):
    batch = {"x": np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32),
             "y": np.random.default_rng(1).standard_normal((8, 4)).astype(np.float32)}
    state = make_state(TwoStages(), batch["x"][:1])
    want_state, want_loss = jax.jit(supervised_step(mse))(state, batch)
    method = meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 1),
                                       schedule="reversed_gpipe", resharding="two_rings", executor="p2p",
                                       devices=jax.devices()[:4])
    step = meshpar.parallelize(supervised_step(mse), method=method)
    got_state, got_loss = step(state, batch)
    np.testing.assert_allclose(float(got_loss), float(want_loss), rtol=1e-5)
    assert_trees_close(got_state.params, want_state.params)
    compiled = step.get_compiled(state, batch)
    assert compiled.schedule.name == "reversed_gpipe"
    planned = [m.summary() for m in compiled.moves.moves
               if m.key.kind in (TransferKind.P2P, TransferKind.COLLECTIVE, TransferKind.DEVICE_PUT) and m.key.shape]
    assert planned and all("two_rings/" in s for s in planned)
