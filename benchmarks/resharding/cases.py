"""The paper's microbenchmark cases (§5.1, Table 2 and Fig. 5) on an abstract cluster."""

from __future__ import annotations

import dataclasses

from meshpar.cluster import Cluster
from meshpar.passes import ReshardingTask

__all__ = ["Case", "n_to_m_cases", "one_to_m_cases"]

# Table 2: (name, src spec, dst spec, src mesh (hosts, devices/host), dst mesh).
TABLE2 = (
    ("case1", "S0RR", "S0RR", (2, 4), (2, 4)),
    ("case2", "RRR", "S0RR", (2, 4), (2, 4)),
    ("case3", "RS0R", "S0RR", (2, 4), (2, 4)),
    ("case4", "RS01R", "S01RR", (2, 4), (2, 4)),
    ("case5", "S1RR", "S0RR", (2, 4), (2, 4)),
    ("case6", "S0RR", "S0RR", (2, 4), (3, 4)),
    ("case7", "S1RR", "RRR", (1, 4), (2, 4)),
    ("case8", "RRR", "RRR", (2, 3), (3, 2)),
    ("case9", "RS0R", "RRS0", (2, 4), (2, 4)),
)

# Fig. 5: receiver meshes (hosts, devices/host) for one sender device.
FIG5 = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 2), (3, 2), (4, 2))


@dataclasses.dataclass(frozen=True)
class Case:
    suite: str
    name: str
    task: ReshardingTask
    cluster: Cluster


def n_to_m_cases(
    shape: tuple[int, int, int] = (1024, 1024, 512),
    itemsize: int = 4,
    cluster_of=Cluster.aws_p3_8xlarge,
    devices_per_host: int = 4,
) -> list[Case]:
    """Table 2 with source and destination meshes on disjoint hosts.

    Case 6 pads dimension 0 up to a multiple of 6 (1024 -> 1026 in the paper)
    so both the 2-host and the 3-host mesh divide it.
    """
    cases = []
    for name, src_spec, dst_spec, (sh, sd), (dh, dd) in TABLE2:
        case_shape = shape
        if name == "case6":
            case_shape = (-(-shape[0] // 6) * 6, *shape[1:])
        cluster = cluster_of(sh + dh)
        assert cluster.devices_per_host >= max(sd, dd) and devices_per_host >= max(sd, dd)
        src = cluster.mesh(list(range(sh)), sd)
        dst = cluster.mesh(list(range(sh, sh + dh)), dd)
        cases.append(Case("n_to_m", name, ReshardingTask(case_shape, itemsize, src, src_spec, dst, dst_spec), cluster))
    return cases


def one_to_m_cases(num_elements: int = 2**28, itemsize: int = 4, cluster_of=Cluster.aws_p3_8xlarge) -> list[Case]:
    """Fig. 5: one sender device on its own host, a replicated vector to each receiver mesh."""
    cases = []
    for hosts, per_host in FIG5:
        cluster = cluster_of(1 + hosts)
        src = cluster.mesh([0], 1)
        dst = cluster.mesh(list(range(1, 1 + hosts)), per_host)
        task = ReshardingTask((num_elements,), itemsize, src, "R", dst, "R")
        cases.append(Case("one_to_m", f"{hosts}x{per_host}", task, cluster))
    return cases
