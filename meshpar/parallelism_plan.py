"""``ParallelismPlan``: a planner's choice for one step, and the ``PipeshardParallel`` that runs it."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from meshpar.cluster import Cluster
from meshpar.passes.planning.layer_profile import ModelProfile
from meshpar.passes.planning.protocol import PipelinePlan, stage_meshes
from meshpar.pipeshard_parallel import PipeshardParallel

__all__ = ["ParallelismPlan"]

# Runners-up ``describe`` lists after the chosen plan.
DESCRIBED_ALTERNATIVES = 4


@dataclasses.dataclass(frozen=True)
class ParallelismPlan:
    """A planner's choice for one step.

    Attributes:
      best: the chosen plan (stages and their layers, each mesh's (data, model) shape, stages
        per mesh, micro-batches, schedule, predicted step time and peak memory per mesh).
      alternatives: the other plans the planner ranked, fastest first.
      profile: the layers the planner partitioned.
      devices: the devices planned on, in the order their meshes are cut; a plan runs on the
        first ``best.num_devices`` of them (``method``).
      cluster: the hosts and links it was priced on.
      planning_s: wall seconds of the whole planning call: tracing and profiling the step,
        calibrating on the devices (measuring candidate steps) and ranking the plans.
      batch_argnums: the step's batch arguments, as planned; ``method`` keeps them.
    """

    best: PipelinePlan
    alternatives: tuple[PipelinePlan, ...]
    profile: ModelProfile
    devices: tuple[Any, ...]
    cluster: Cluster
    planning_s: float
    batch_argnums: tuple[int, ...] = (1,)

    @property
    def method(self) -> PipeshardParallel:
        """A ``PipeshardParallel`` that runs this plan under ``meshpar.parallelize``."""
        return self.method_with()

    def method_with(self, base: PipeshardParallel = PipeshardParallel(), **options: Any) -> PipeshardParallel:
        """``base`` running this plan: what planning chose (stage meshes, named by ``base``'s
        axes, stages per mesh, cut points, micro-batches, schedule, the devices it uses) and
        fixed (cluster, batch_argnums) replace ``base``'s, every other option of ``base`` is
        kept, and ``options`` (any ``PipeshardParallel`` field) override both. An ``"auto"``
        ``base`` comes out planned. A plan of one stage and one micro-batch on one device runs
        the step as one program there: what ``jax.jit`` runs."""
        meshes = stage_meshes(self.cluster, self.best.mesh_shapes)
        by_id = {d.id: d for d in self.devices}
        axes = (base.data_axis, base.model_axis)
        jax_meshes = [jax.sharding.Mesh(np.vectorize(by_id.get, otypes=[object])(m.device_ids), axes)
                      for m in meshes]
        used = tuple(by_id[int(i)] for m in meshes for i in m.device_ids.flat)
        # The stage count and mesh shape are the meshes' now: base's "auto" would be planned
        # again, its counts checked against a plan that replaced them.
        planned = dict(num_micro_batches=self.best.num_micro_batches, stage_meshes=jax_meshes, num_stages=None,
                       stage_mesh_shape=None, stages_per_mesh=self.best.stages_per_mesh, schedule=self.best.schedule,
                       cut_points=self.best.cut_points, cluster=self.cluster, devices=used,
                       auto_layers=self.profile.auto_layers, batch_argnums=self.batch_argnums)
        return dataclasses.replace(base, **{**planned, **options})

    def describe(self) -> str:
        """The chosen plan and the runners-up, one line each: their stages' layers and meshes,
        stages per mesh, micro-batches, schedule, devices, predicted step and memory."""
        lines = [f"planned {self.profile.name}: {self.profile.num_layers} layers, batch {self.profile.batch_size}, "
                 f"{len(self.devices)} devices, in {self.planning_s:.2f} s", "  chosen: " + self.best.summary()]
        lines += ["  then:   " + p.summary() for p in self.alternatives[:DESCRIBED_ALTERNATIVES]]
        return "\n".join(lines)
