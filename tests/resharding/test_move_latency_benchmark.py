"""``python -m benchmarks.move_latency``: sizes, aggregation, table, targets, and a 2-process run on localhost."""

import json
import os
import signal
import subprocess
import sys
import threading

import pytest

from repo_paths import ROOT_DIR

import benchmarks.move_latency as move_latency
from benchmarks.move_latency import (
    aggregate, format_size, measure_rtt, parse_size, run_local, table, targets,
)

ROOT = ROOT_DIR
KEYS = {"where", "bytes", "dtype", "method", "times_s", "p50_s", "p90_s", "median_s", "min_s", "max_s",
        "warmup_s", "verified", "checked", "rtt_s", "link_gbit", "link_rate_Bps", "link_bound_s"}


def test_sizes_parse_and_print_in_binary_units():
    assert [parse_size(s) for s in ("4", "1K", "64k", "1MiB", "16M", "64MB", "1G")] == [
        4, 1024, 65536, 1 << 20, 16 << 20, 64 << 20, 1 << 30]
    for bad in ("0", "-4", "1T", "K", "1.5M"):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert [format_size(n) for n in (4, 1024, 1536, 16 << 20, 1 << 30)] == ["4 B", "1 KiB", "1536 B", "16 MiB", "1 GiB"]


def _line(process, nbytes, method, times, verified):
    return {"kind": "move", "bytes": nbytes, "dtype": "float32", "method": method, "process": process,
            "role": "src" if process == 0 else "dst", "warmup_s": 0.5 + process, "times": times,
            "verified": verified, "checked": len(times) + 1 if verified is not None else 0}


def _records(where="localhost", rtt=1e-4, rate=None):
    lines = [
        _line(0, 4, "p2p", [0.0002, 0.0009, 0.0002, 0.0002], None),
        _line(1, 4, "p2p", [0.0005, 0.0006, 0.0007, 0.0020], True),
        _line(0, 4, "device_put", [0.0001] * 4, None),
        _line(1, 4, "device_put", [0.0004, 0.0004, 0.0005, 0.0009], True),
        _line(0, 16 << 20, "p2p", [0.001] * 4, None),
        _line(1, 16 << 20, "p2p", [0.010, 0.011, 0.012, 0.020], True),
        _line(0, 1024, "p2p", [0.001], None),  # one process only: left out
    ]
    records = aggregate(lines)
    for r in records:
        r.update(where=where, rtt_s=rtt, link_gbit=None if rate is None else 1.0, link_rate_Bps=rate,
                 link_bound_s=None if rate is None else rtt + r["bytes"] / rate)
    return records


def test_aggregate_takes_the_slower_process_per_repeat():
    records = _records()
    assert [(r["bytes"], r["method"]) for r in records] == [(4, "p2p"), (4, "device_put"), (16 << 20, "p2p")]
    p2p = records[0]
    assert KEYS <= p2p.keys()
    assert p2p["times_s"] == [0.0005, 0.0009, 0.0007, 0.0020]
    assert (p2p["p50_s"], p2p["p90_s"], p2p["max_s"], p2p["min_s"]) == (0.0007, 0.0020, 0.0020, 0.0005)
    assert p2p["warmup_s"] == 1.5 and p2p["verified"] and p2p["checked"] == 5
    lines = [_line(0, 4, "p2p", [0.1], None), _line(1, 4, "p2p", [0.1], False)]
    assert not aggregate(lines)[0]["verified"]
    assert not aggregate([_line(0, 4, "p2p", [0.1], None), _line(1, 4, "p2p", [0.1], None)])[0]["verified"]


def test_table_and_targets_on_localhost():
    records = _records()
    text = table(records)
    assert "| localhost | 4 B | meshpar p2p | 4 | 0.700 | 2.000 | 2.000 | 2.86 | 1.75x | 0.100 | - | - |" in text
    assert "| localhost | 4 B | jax.device_put | 4 | 0.400 | 0.900 | 0.900 | 2.25 | - | 0.100 | - | - |" in text
    assert "| localhost | 16 MiB | meshpar p2p | 4 | 11.000 | 20.000 | 20.000 | 1.82 | - |" in text
    assert targets(records) == [
        "met    localhost 4 B meshpar p2p: p50 0.700 ms (target <= 1.000 ms)",
        "info   localhost 4 B jax.device_put: p50 0.400 ms (target <= 1.000 ms)",
        "MISSED localhost 16 MiB meshpar p2p: p90 / p50 1.82x (target <= 1.50x)",
    ]
    records[0]["verified"] = False
    assert "| meshpar p2p (!) |" in table(records)
    # A size that ran without a p2p result misses its target.
    no_p2p = targets([r for r in records if r["method"] != "p2p"])
    assert no_p2p[0].startswith("MISSED localhost 4 B meshpar p2p: no result")


def test_table_and_targets_on_the_cluster_use_the_round_trip_and_link_bound():
    records = _records("cluster", rtt=2e-4, rate=125e6)
    text = table(records)
    # bound = 0.2 ms + 16 MiB / 125 MB/s = 134.4 ms
    assert "| cluster | 16 MiB | meshpar p2p | 4 | 11.000 | 20.000 | 20.000 | 1.82 | - | 0.200 | 134.418 | 0.08x |" \
        in text
    assert targets(records) == [
        "met    cluster 4 B meshpar p2p: p50 0.700 ms (target <= 1.200 ms)",
        "info   cluster 4 B jax.device_put: p50 0.400 ms (target <= 1.200 ms)",
    ]


def test_measure_rtt_on_loopback():
    rtts = measure_rtt("127.0.0.1", timeout_s=20)
    assert len(rtts) == 50 and all(0 < t < 1.0 for t in rtts)


class _Progress:
    """A stand-in for ``ProgressPrinter``: counts its polls."""

    def __init__(self):
        self.stop, self.polls, self.started = threading.Event(), 0, False

    def start(self):
        self.started = True

    def join(self):
        pass

    def poll(self):
        self.polls += 1


def test_run_local_kills_the_others_once_one_fails(monkeypatch):
    monkeypatch.setattr(move_latency, "_FAILURE_GRACE_S", 0.2)
    progress = _Progress()
    fail = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    hang = [sys.executable, "-c", "import time; time.sleep(60)"]
    errors = run_local([fail, hang], dict(os.environ), timeout_s=30, progress=progress)
    assert len(errors) == 2 and errors[0].startswith("process 0: exit 3 (killed 0.2 s after a worker failed)")
    assert "boom" in errors[0] and errors[1].startswith("process 1: exit -9")
    assert progress.started and progress.stop.is_set() and progress.polls == 1
    assert run_local([hang], dict(os.environ), timeout_s=0.3, progress=_Progress())[0].startswith(
        "process 0: exit -9 (killed: did not finish within 0.3 s)")
    assert run_local([[sys.executable, "-c", "pass"]], dict(os.environ), timeout_s=30, progress=_Progress()) == []


def _run_cli(args, timeout_s):
    """Runs ``python -m benchmarks.move_latency *args``; in its own session, so that on a
    timeout the benchmark and all its workers die together."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.move_latency", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"move_latency did not finish within {timeout_s} s:\n{out[-3000:]}\n{err[-3000:]}")
    assert proc.returncode == 0, f"stdout:\n{out[-4000:]}\nstderr:\n{err[-4000:]}"
    return out


@pytest.mark.multiprocess
def test_move_latency_cli_on_localhost(tmp_path):
    path = tmp_path / "latency.json"
    out = _run_cli(["--where", "localhost", "--sizes", "4", "64K", "--repeat", "3", "--json", str(path),
                    "--timeout", "100", "--step-timeout", "30"], timeout_s=150)
    records = json.loads(path.read_text())
    assert {(r["bytes"], r["method"]) for r in records} == {(n, m) for n in (4, 65536) for m in ("p2p", "device_put")}
    for r in records:
        assert KEYS <= r.keys() and r["where"] == "localhost" and r["link_bound_s"] is None
        assert r["verified"] and r["checked"] == 4  # the receiver checked the warm-up and 3 timed moves
        assert len(r["times_s"]) == 3 and 0 < r["min_s"] <= r["p50_s"] <= r["p90_s"] <= r["max_s"]
        assert r["rtt_s"] > 0
    assert "localhost 64 KiB meshpar p2p: p50" in out  # a progress line
    assert "| localhost | 4 B | meshpar p2p | 3 |" in out and "| localhost | 64 KiB | jax.device_put | 3 |" in out
    assert "localhost 4 B meshpar p2p: p50" in out.split("Targets")[1]


@pytest.mark.slow
def test_move_latency_cli_on_the_emulated_cluster(tmp_path):
    from benchmarks.emulated_cluster import EmulatedCluster

    ok, why = EmulatedCluster.available()
    if not ok:
        pytest.skip(f"needs an emulated cluster (root, network namespaces, tc): {why}")
    path = tmp_path / "latency.json"
    out = _run_cli(["--where", "cluster", "--sizes", "4", "1M", "--repeat", "3", "--json", str(path),
                    "--timeout", "200", "--step-timeout", "60"], timeout_s=300)
    records = json.loads(path.read_text())
    assert {(r["bytes"], r["method"]) for r in records} == {(n, m) for n in (4, 1 << 20) for m in ("p2p", "device_put")}
    for r in records:
        assert r["where"] == "cluster" and r["verified"] and r["link_gbit"] == 1.0
        assert r["link_bound_s"] == pytest.approx(r["rtt_s"] + r["bytes"] / r["link_rate_Bps"])
    assert "| cluster | 1 MiB | meshpar p2p | 3 |" in out
    assert "cluster 4 B meshpar p2p: p50" in out.split("Targets")[1]
