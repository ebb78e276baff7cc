"""Simulated microbenchmark: every strategy x balancer on the paper's cases, under the cost model."""

from __future__ import annotations

import time
from collections.abc import Sequence

from meshpar.passes import ALPA_BASELINE, BALANCERS, STRATEGIES, ReshardingTask, plan_resharding
from meshpar.cluster import Cluster

from .cases import Case, n_to_m_cases, one_to_m_cases

__all__ = ["run_sim", "scale_case"]


def run_sim(cases: Sequence[Case], strategies: Sequence[str] = tuple(STRATEGIES), balancers: Sequence[str] = tuple(BALANCERS)) -> list[dict]:
    """One record per (case, strategy, balancer)."""
    records = []
    for case in cases:
        for strategy in strategies:
            for balancer in balancers:
                start = time.perf_counter()
                plan = plan_resharding(case.task, case.cluster, strategy=strategy, balancer=balancer)
                records.append(
                    {
                        "suite": case.suite,
                        "case": case.name,
                        "strategy": strategy,
                        "balancer": balancer,
                        "estimated_s": plan.estimated_time,
                        "lower_bound_s": plan.lower_bound,
                        "planner_s": time.perf_counter() - start,
                        "unit_tasks": len(plan.tasks),
                        "rounds": plan.num_rounds,
                    }
                )
    return records


def scale_case() -> Case:
    """A 1,024-device resharding (128 hosts of 8) with 32,768 unit tasks.

    Source ``S01R`` on a (64, 8) mesh cuts rows into 512 blocks, one per
    device; destination ``RS0`` on the other 64 hosts cuts columns into 64
    blocks, one per host: every (row block, column block) pair is a unit task.
    """
    cluster = Cluster.dgx_h100(128)
    src = cluster.mesh(list(range(64)), 8)
    dst = cluster.mesh(list(range(64, 128)), 8)
    task = ReshardingTask((131072, 65536), 2, src, "S01R", dst, "RS0")
    return Case("scale", "1024dev", task, cluster)


def default_cases() -> list[Case]:
    return n_to_m_cases() + one_to_m_cases()


HEADLINE = (
    ("send_recv", "ensemble"),
    ALPA_BASELINE,
    ("global_allgather", "ensemble"),
    ("broadcast", "naive"),
    ("broadcast", "load_balance"),
    ("broadcast", "ensemble"),
)


def _by_case(records: Sequence[dict]) -> dict[tuple[str, str], dict[tuple[str, str], dict]]:
    out: dict[tuple[str, str], dict[tuple[str, str], dict]] = {}
    for r in records:
        out.setdefault((r["suite"], r["case"]), {})[(r["strategy"], r["balancer"])] = r
    return out


def headline_table(records: Sequence[dict]) -> str:
    """Per case: estimated time / lower bound of the headline methods, and Alpa's time over ours."""
    names = {ALPA_BASELINE: "Alpa (local_allgather/load_balance)"}
    head = "| suite | case | unit tasks | lower bound (ms) | " + " | ".join(
        names.get(c, f"{c[0]}/{c[1]}") for c in HEADLINE
    ) + " | Alpa / ours |"
    lines = [head, "|" + "---|" * (len(HEADLINE) + 5)]
    for (suite, case), row in _by_case(records).items():
        any_row = next(iter(row.values()))
        lb = any_row["lower_bound_s"]
        cells = [f"{row[c]['estimated_s'] / lb:.2f}x" if c in row else "-" for c in HEADLINE]
        alpa, ours = row.get(ALPA_BASELINE), row.get(("broadcast", "ensemble"))
        speedup = f"{alpa['estimated_s'] / ours['estimated_s']:.2f}x" if alpa and ours else "-"
        lines.append(f"| {suite} | {case} | {any_row['unit_tasks']} | {lb * 1e3:.1f} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)


def full_table(records: Sequence[dict]) -> str:
    """Every (case, strategy) row, one column per balancer: estimated time / lower bound."""
    balancers = [b for b in BALANCERS if any(r["balancer"] == b for r in records)]
    lines = ["| case | strategy | " + " | ".join(balancers) + " |", "|" + "---|" * (len(balancers) + 2)]
    for (suite, case), row in _by_case(records).items():
        for strategy in STRATEGIES:
            cells = [row.get((strategy, b)) for b in balancers]
            if any(cells):
                lines.append(
                    f"| {case} | {strategy} | "
                    + " | ".join(f"{c['estimated_s'] / c['lower_bound_s']:.2f}x" if c else "-" for c in cells)
                    + " |"
                )
    return "\n".join(lines)
