"""meshpar: MPMD pipelines over device meshes with fast cross-mesh resharding."""

from meshpar.cluster import Cluster
from meshpar.mesh import DeviceMesh
from meshpar.sharding_spec import ShardingSpec
from meshpar.tiles import Tile, tiles
from meshpar.reshard import plan_for, reshard
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
    "BALANCERS",
    "BalancerOptions",
    "Cluster",
    "DeviceMesh",
    "ReshardingPlan",
    "ReshardingTask",
    "STRATEGIES",
    "ShardingSpec",
    "Tile",
    "plan_for",
    "plan_resharding",
    "reshard",
    "tiles",
]
