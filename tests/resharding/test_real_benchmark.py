"""``python -m benchmarks.resharding real``: case layouts, aggregation, and (slow) a tiny run end to end."""

import json
import os
import subprocess
import sys

import pytest

from repo_paths import ROOT_DIR

from benchmarks import overlap
from benchmarks.resharding.real import (
    ALPA, COMPARISON, OURS_P2P, OURS_ROUNDS, STOCK, Method, aggregate, comparison_table, distribution,
    distribution_table, grid_methods, not_applicable, percentile, real_cases, single_host_cases, stock_mesh_shape,
    table, targets,
)

ROOT = ROOT_DIR
KEYS = {"suite", "case", "strategy", "balancer", "times_s", "p50_s", "p90_s", "median_s", "min_s", "max_s",
        "link_lower_bound_s", "bytes_moved"}


def test_cases_sit_on_disjoint_emulated_hosts():
    cases = {c.name: c for c in real_cases()}
    assert len(cases) == 16
    for c in cases.values():
        src_hosts = {p for row in c.src_rows for p, _ in row}
        dst_hosts = {p for row in c.dst_rows for p, _ in row}
        assert not src_hosts & dst_hosts
        assert all(len({p for p, _ in row}) == 1 for row in c.src_rows + c.dst_rows)  # a row is one host
    assert cases["case6"].num_processes == 5 and cases["case6"].shape == (258, 256, 128)
    assert cases["4x2"].num_processes == 5 and cases["4x2"].shape == (2**23,)
    assert [len(r) for r in cases["case8"].src_rows] == [3, 3] and [len(r) for r in cases["case8"].dst_rows] == [2, 2, 2]
    assert cases["case1"].shape == (256, 256, 128)  # 32 MiB of float32
    # Fewer devices per host shrink the meshes' rows, not the hosts.
    small = {c.name: c for c in real_cases(mib=4, devices_per_host=2)}
    assert [len(r) for r in small["case8"].src_rows] == [2, 2] and small["case1"].shape == (256, 256, 16)
    assert [c.name for c in real_cases(names=["case3", "2x2"])] == ["case3", "2x2"]
    with pytest.raises(ValueError, match="unknown"):
        real_cases(names=["case10"])


def test_single_host_cases_fit_eight_devices():
    for c in single_host_cases():
        devices = [k for row in c.src_rows + c.dst_rows for _, k in row]
        assert len(set(devices)) == len(devices) and max(devices) < 8
    assert [c.name for c in single_host_cases(suites=["one_to_m"])][:2] == ["1x1", "1x2"]


def test_aggregate_takes_the_slowest_process_per_repeat():
    lines = [
        {"kind": "case", "suite": "n_to_m", "case": "case1", "link_lower_bound_s": 0.1, "bytes_moved": 8,
         "tensor_bytes": 8, "src": "S0RR(2, 4)", "dst": "S0RR(2, 4)"},
        {"kind": "method", "suite": "n_to_m", "case": "case1", "strategy": "broadcast", "balancer": "ensemble",
         "process": 0, "times": [0.05, 0.30, 0.10], "warmup_s": 1.0, "cpu_s": 0.1, "verified": None,
         "checked_shards": 0, "plan": {"steps": 7}},
        {"kind": "method", "suite": "n_to_m", "case": "case1", "strategy": "broadcast", "balancer": "ensemble",
         "process": 1, "times": [0.20, 0.10, 0.15], "warmup_s": 2.0, "cpu_s": 0.2, "verified": True,
         "checked_shards": 4},
        # A method only one process reported is incomplete and left out.
        {"kind": "method", "suite": "n_to_m", "case": "case1", "strategy": "send_recv", "balancer": "naive",
         "process": 0, "times": [0.1], "warmup_s": 1.0, "cpu_s": 0.1, "verified": None, "checked_shards": 0},
    ]
    (r,) = aggregate(lines, num_processes=2)
    assert KEYS <= r.keys()
    assert r["times_s"] == [0.20, 0.30, 0.15]
    assert (r["median_s"], r["min_s"], r["max_s"]) == (0.20, 0.15, 0.30)
    assert (r["p50_s"], r["p90_s"]) == (0.20, 0.30)
    assert r["verified"] and r["steps"] == 7 and r["warmup_s"] == 2.0
    assert "| n_to_m | case1 | S0RR(2, 4) -> S0RR(2, 4) |" in table([r])
    lines[2]["verified"] = False
    assert not aggregate(lines, num_processes=2)[0]["verified"]


def test_percentiles_are_nearest_rank():
    times = [float(t) for t in range(20, 0, -1)]  # 20 .. 1, unsorted
    assert percentile(times, 50) == 10.0 and percentile(times, 90) == 18.0 and percentile(times, 100) == 20.0
    assert percentile(times[:15], 90) == 19.0  # 20 .. 6: the 14th fastest
    assert percentile([1.0, 2.0, 3.0], 90) == 3.0 and percentile([5.0], 50) == 5.0
    assert percentile([float(t) for t in range(1, 11)], 70) == 7.0  # not 8: 70 * 10 / 100 is not quite 7
    for bad in (0, 101):
        with pytest.raises(ValueError):
            percentile(times, bad)
    with pytest.raises(ValueError):
        percentile([], 50)
    assert distribution([0.3, 0.1, 0.2, 0.4]) == {"p50_s": 0.2, "p90_s": 0.4, "median_s": 0.25, "min_s": 0.1,
                                                  "max_s": 0.4}


def test_distribution_table_shows_p50_p90_max_over_the_bound():
    lines = _comparison_lines("case3", {OURS_P2P: 110, ALPA: 165, STOCK: 120})
    lines += _comparison_lines("case8", {OURS_P2P: 100, ALPA: 300}, stock_na="several hosts")
    for line in lines:  # the receiver's times are the slower
        if line["kind"] == "method":
            line["times"] = [t / 1e3 for t in ((100, 110, 120, 130, 300) if line["process"] else (1,) * 5)]
    records = aggregate(lines, num_processes=2)
    text = distribution_table(records)
    assert "| case | meshes | link lower bound (ms) | repeats | ours p2p | Alpa | stock JAX |" in text
    assert "| case3 | RS0R(2, 4) -> S0RR(2, 4) | 100 | 5 | 1.20 / 3.00 / 3.00 | 1.20 / 3.00 / 3.00 |" in text
    assert "| case8 |" in text and text.endswith("| 1.20 / 3.00 / 3.00 | n/a |")
    for r in records:  # the single host's cases have no bound: milliseconds
        r["link_lower_bound_s"] = None
    assert "| 120.0 / 300.0 / 300.0 |" in distribution_table(records)


def test_methods_parse_and_stock_jax_applies_only_to_process_aligned_meshes():
    assert Method.parse("broadcast/ensemble") == OURS_P2P
    assert Method.parse("broadcast/ensemble/p2p/rounds") == OURS_ROUNDS
    assert Method.parse("local_allgather/load_balance/collective") == ALPA
    assert Method.parse("stock_jax/-") == STOCK
    for m in [*COMPARISON, *grid_methods("p2p"), *grid_methods("collective")]:
        assert Method.parse(m.key) == m
    for bad in ("broadcast", "broadcast/ensemble/collective/rounds", "broadcast/ensemble/p2p/sideways"):
        with pytest.raises(ValueError):
            Method.parse(bad)
    cases = {c.name: c for c in real_cases()}
    # Equal device counts, each source host facing one destination host.
    for name in ("case1", "case2", "case3", "case4", "case5", "case9", "1x1"):
        assert not_applicable(cases[name], STOCK) is None, name
    assert stock_mesh_shape(cases["case3"]) == (2, 4) and stock_mesh_shape(cases["1x1"]) == (1, 1)
    assert "8 -> 12 devices" in not_applicable(cases["case6"], STOCK)
    assert "4 -> 8 devices" in not_applicable(cases["case7"], STOCK)
    # (2, 3) -> (3, 2): 6 devices each, but host 0's 3 devices face 2 destination hosts.
    assert "several hosts" in not_applicable(cases["case8"], STOCK) and stock_mesh_shape(cases["case8"]) is None
    assert all(not_applicable(c, m) is None for c in cases.values() for m in COMPARISON if m != STOCK)


def _comparison_lines(case, times_ms, lb_s=0.1, stock_na=None):
    lines = [{"kind": "case", "suite": "n_to_m", "case": case, "link_lower_bound_s": lb_s, "bytes_moved": 2**20,
              "tensor_bytes": 2**20, "src": "RS0R(2, 4)", "dst": "S0RR(2, 4)", "src_devices": 8,
              "dst_devices": 8, "stock_na": stock_na}]
    for m, ms in times_ms.items():
        for process in (0, 1):
            lines.append({"kind": "method", "suite": "n_to_m", "case": case, "strategy": m.strategy,
                          "balancer": m.balancer, "executor": m.executor, "order": m.order, "process": process,
                          "times": [ms / 1e3 * (1 if process else 0.5)] * 3, "warmup_s": 1.0, "cpu_s": 0.1,
                          "verified": True if process else None, "checked_shards": 4 * process})
    return lines


def test_comparison_table_and_targets():
    from benchmarks.resharding.real import OURS_COLLECTIVE

    lines = _comparison_lines("case3", {OURS_P2P: 110, OURS_ROUNDS: 120, OURS_COLLECTIVE: 130, ALPA: 165, STOCK: 120})
    lines += _comparison_lines("case8", {OURS_P2P: 100, OURS_ROUNDS: 100, OURS_COLLECTIVE: 130, ALPA: 300},
                               stock_na="a source host's shards would land on several hosts")
    lines += _comparison_lines("case1", {OURS_P2P: 100, OURS_ROUNDS: 100, OURS_COLLECTIVE: 100, ALPA: 96,
                                         STOCK: 90})
    records = aggregate(lines, num_processes=2)
    assert len(records) == 14
    assert {(r["executor"], r["order"]) for r in records} == {("p2p", "gated"), ("p2p", "rounds"),
                                                             ("collective", "-"), ("device_put", "-")}
    p2p = next(r for r in records if r["case"] == "case3" and r["executor"] == "p2p" and r["order"] == "gated")
    assert p2p["median_s"] == pytest.approx(0.110) and p2p["verified"]
    text = comparison_table(records)
    assert "| case3 | RS0R(2, 4) -> S0RR(2, 4) | 1.0 | 100 | 110 | - | 120 | 130 | 165 | 120 | 1.10x | 1.50x | 1.09x |" in text
    assert "| case8 |" in text and "| n/a | 1.00x | 3.00x | n/a |" in text
    for r in records:
        r["link_gbit"] = 0.25
    got = targets(records)
    assert "met    0.25 Gbit/s n_to_m case3: ours p2p 1.10x the link lower bound (target <= 1.15x)" in got
    assert "met    0.25 Gbit/s n_to_m case3: Alpa / ours p2p 1.50x (target >= 1.40x)" in got
    assert "MISSED 0.25 Gbit/s n_to_m case3: stock / ours p2p 1.09x (target >= 1.30x)" in got
    assert any(line.startswith("n/a    0.25 Gbit/s n_to_m case8: stock") for line in got)
    assert "met    0.25 Gbit/s n_to_m case1: Alpa / ours p2p 0.96x (target >= 0.95x)" in got
    assert "MISSED 0.25 Gbit/s n_to_m case1: stock / ours p2p 0.90x (target >= 0.95x)" in got
    # The grid table still renders records of mixed executors.
    assert "| n_to_m | case3 |" in table(records)


def test_overlap_aggregation_table_and_targets():
    def line(executor, process, compute, transfer, both, verified):
        return {"kind": "executor", "executor": executor, "process": process, "role": "src" if process == 0 else "dst",
                "k": 40, "times": {"compute": compute, "transfer": transfer, "both": both},
                "verified": verified, "checked_shards": 4 if verified else 0}

    lines = [
        {"kind": "calibration", "executor": "p2p", "k": 40, "transfer_s": 0.3, "tries": [{"k": 40, "compute_s": 0.3}],
         "matmul_n": 256, "tensor_bytes": 8 * 2**20},
        line("p2p", 0, [0.30, 0.32, 0.31], [0.01, 0.01, 0.01], [0.31, 0.33, 0.30], None),
        line("p2p", 1, [0.00, 0.00, 0.00], [0.28, 0.30, 0.29], [0.30, 0.34, 0.33], True),
        line("collective", 0, [0.30, 0.30, 0.30], [0.29, 0.29, 0.29], [0.60, 0.58, 0.59], None),
        line("collective", 1, [0.00, 0.00, 0.00], [0.29, 0.30, 0.31], [0.60, 0.59, 0.59], True),
        line("rounds-never-finished", 0, [0.1], [0.1], [0.1], None),  # one process only: left out
    ]
    records = overlap.aggregate(lines, num_processes=2)
    assert [r["executor"] for r in records] == ["p2p", "collective"]
    p2p, coll = records
    assert p2p["compute_times_s"] == [0.30, 0.32, 0.31] and p2p["both_times_s"] == [0.31, 0.34, 0.33]
    assert (p2p["compute_s"], p2p["transfer_s"], p2p["both_s"]) == (0.31, 0.29, 0.33)
    assert p2p["ratio"] == pytest.approx(0.33 / 0.31) and p2p["verified"] and p2p["k"] == 40
    assert p2p["src_both_s"] == 0.31 and p2p["dst_both_s"] == 0.33
    assert coll["ratio"] == pytest.approx(0.59 / 0.30)
    for r in records:
        r["link_gbit"] = 0.25
    text = overlap.table(records)
    assert "| 0.25 | p2p | 8 | 40 | 310 | 290 | 330 | 1.06 |" in text
    assert "| 0.25 | collective | - | 40 | 300 | 300 | 590 | 1.97 |" in text
    got = overlap.targets(records)
    assert got[0] == "met    0.25 Gbit/s p2p: both / max(compute, transfer) 1.06 (target <= 1.15)"
    assert got[1].startswith("info   0.25 Gbit/s collective: both / max(compute, transfer) 1.97")
    records[0]["ratio"] = 1.2
    assert overlap.targets(records)[0].startswith("MISSED")


@pytest.mark.slow
def test_real_benchmark_cli_on_a_tiny_configuration(tmp_path):
    from benchmarks.emulated_cluster import EmulatedCluster

    ok, why = EmulatedCluster.available()
    if not ok:
        pytest.skip(f"needs an emulated cluster (root, network namespaces, tc): {why}")
    path = tmp_path / "real.json"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.resharding", "real", "--cases", "case1", "case3",
         "--repeat", "1", "--mib", "4", "--json", str(path)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert r.returncode == 0, f"stdout:\n{r.stdout[-4000:]}\nstderr:\n{r.stderr[-4000:]}"
    records = json.loads(path.read_text())
    assert all(KEYS <= rec.keys() for rec in records)
    emulated = [rec for rec in records if rec["suite"] == "n_to_m"]
    # The default comparison set, every method applicable to both cases.
    assert {(rec["case"], Method(rec["strategy"], rec["balancer"], rec["executor"], rec["order"]))
            for rec in emulated} == {(c, m) for c in ("case1", "case3") for m in COMPARISON}
    assert all(rec["link_gbit"] == 1.0 for rec in emulated)
    single = [rec for rec in records if rec["suite"] == "single_host"]
    assert {(rec["case"], rec["strategy"]) for rec in single} == {
        (c, s) for c in ("case1", "case3") for s in ("device_put", "broadcast")
    }
    assert len(records) == len(emulated) + len(single)
    # Every result matched numpy on every receiving process.
    assert all(rec["verified"] and rec["checked_shards"] > 0 for rec in records)
    for rec in emulated:
        assert rec["bytes_moved"] == 4 * 2**20 and rec["link_lower_bound_s"] > 0
        assert 0 < rec["min_s"] <= rec["median_s"] <= rec["max_s"]
    assert "| case1 | S0RR(2, 4) -> S0RR(2, 4) |" in r.stdout and "| case3 |" in r.stdout
    assert "single_host case1" in r.stdout  # a progress line
    assert "Targets" in r.stdout


def test_the_benchmark_spells_the_p2p_orders_as_the_compiler_does():
    from benchmarks.resharding import real
    from meshpar.passes.pipeline.placing.plan_moves import P2P_ORDERS

    assert real.P2P_ORDERS == P2P_ORDERS
