"""``python -m benchmarks.resharding real``: case layouts, aggregation, and (slow) a tiny run end to end."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks.resharding.real import METHODS, aggregate, real_cases, single_host_cases, table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEYS = {"suite", "case", "strategy", "balancer", "median_s", "min_s", "max_s", "link_lower_bound_s", "bytes_moved"}


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
    assert r["verified"] and r["steps"] == 7 and r["warmup_s"] == 2.0
    assert "| n_to_m | case1 | S0RR(2, 4) -> S0RR(2, 4) |" in table([r])
    lines[2]["verified"] = False
    assert not aggregate(lines, num_processes=2)[0]["verified"]


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
    assert {(rec["case"], rec["strategy"], rec["balancer"]) for rec in emulated} == {
        (c, s, b) for c in ("case1", "case3") for s, b in METHODS
    }
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
    assert "| n_to_m | case1 |" in r.stdout and "| n_to_m | case3 |" in r.stdout
    assert "single_host case1" in r.stdout  # a progress line
