"""meshpar: MPMD pipelines over device meshes with fast cross-mesh resharding."""

from meshpar.cluster import Cluster
from meshpar.mesh import DeviceMesh
from meshpar.sharding_spec import ShardingSpec
from meshpar.tiles import Tile, tiles
from meshpar.autodiff import AuxReduction, grad, value_and_grad
from meshpar.passes.pipeline.cutting.exact_micro_batching import MicroBatchingWarning
from meshpar.pipeshard_parallel import PipeshardParallel
from meshpar.parallelize import ParallelizedStep, parallelize
from meshpar import checkpoint, distributed, planning
from meshpar.planning import plan_parallelism
from meshpar.reshard import plan_between, plan_for, reshard
from meshpar.stage_boundary import mark_stage_boundary
from meshpar.runtime.coordination import CoordinationError, PeerLostError
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, ScheduleKind
from meshpar.passes.pipeline.scheduling.schedule_csv import load_schedule_csv, save_schedule_csv
from meshpar.passes import (
    ALPA_BASELINE,
    BALANCERS,
    STRATEGIES,
    BalancerOptions,
    ReshardingPlan,
    ReshardingTask,
    plan_resharding,
)

__version__ = "0.1.0"

__all__ = [
    "ALPA_BASELINE",
    "AuxReduction",
    "BALANCERS",
    "BalancerOptions",
    "Cluster",
    "CoordinationError",
    "ParallelizedStep",
    "PeerLostError",
    "PipeshardParallel",
    "DeviceMesh",
    "MicroBatchingWarning",
    "ReshardingPlan",
    "ReshardingTask",
    "SCHEDULES",
    "STRATEGIES",
    "ScheduleKind",
    "ShardingSpec",
    "Tile",
    "checkpoint",
    "distributed",
    "planning",
    "plan_parallelism",
    "grad",
    "load_schedule_csv",
    "mark_stage_boundary",
    "parallelize",
    "plan_between",
    "plan_for",
    "plan_resharding",
    "reshard",
    "save_schedule_csv",
    "tiles",
    "value_and_grad",
]
