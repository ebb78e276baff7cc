"""Random resharding tasks for property tests: small shapes, meshes, specs, shared or disjoint hosts."""

from __future__ import annotations

import math
import random

from meshpar import Cluster, ShardingSpec
from meshpar.passes import ReshardingTask


def random_spec(rng: random.Random, rank: int, mesh_ndim: int) -> ShardingSpec:
    axes = list(range(mesh_ndim))
    rng.shuffle(axes)
    dims: list[list[int]] = [[] for _ in range(rank)]
    for a in axes:
        r = rng.randrange(rank + 1)
        if r < rank:
            dims[r].append(a)
    return ShardingSpec(tuple(tuple(d) for d in dims))


def random_task(seed: int, *, max_hosts: int = 5, pad: bool | None = None) -> tuple[ReshardingTask, Cluster]:
    """A random task on a random uniform cluster; meshes may share hosts but never devices."""
    rng = random.Random(seed)
    per_host = rng.randrange(2, 5)
    num_hosts = rng.randrange(2, max_hosts + 1)
    cluster = Cluster.uniform(
        num_hosts, per_host, inter_host_bandwidth=1e9, intra_host_bandwidth=rng.choice([math.inf, 5e10]),
        latency=rng.choice([0.0, 1e-5]),
    )
    hosts = list(range(num_hosts))
    if rng.random() < 0.3:
        # Both meshes on the same hosts, different devices of each.
        src_d = rng.randrange(1, per_host)
        dst_d = rng.randrange(1, per_host - src_d + 1)
        shared = rng.sample(hosts, rng.randrange(1, num_hosts + 1))
        src = cluster.mesh(shared, src_d)
        dst = cluster.mesh(rng.sample(shared, rng.randrange(1, len(shared) + 1)), dst_d, first_device=src_d)
    else:
        rng.shuffle(hosts)
        cut = rng.randrange(1, num_hosts)
        src = cluster.mesh(sorted(hosts[:cut]), rng.randrange(1, per_host + 1))
        dst = cluster.mesh(sorted(hosts[cut:]), rng.randrange(1, per_host + 1))
    rank = rng.randrange(1, 4)
    src_spec = random_spec(rng, rank, 2)
    dst_spec = random_spec(rng, rank, 2)
    use_pad = rng.random() < 0.25 if pad is None else pad
    sp, dp = src_spec.num_shards(src.shape), dst_spec.num_shards(dst.shape)
    if use_pad:
        shape = tuple(rng.randrange(1, 2 * max(a, b) + 2) for a, b in zip(sp, dp))
    else:
        shape = tuple(math.lcm(a, b) * rng.randrange(1, 3) for a, b in zip(sp, dp))
    itemsize = rng.choice([1, 2, 4])
    return ReshardingTask(shape, itemsize, src, src_spec, dst, dst_spec, pad=use_pad), cluster
