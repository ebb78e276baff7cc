"""Latency of one cross-process move, 4 B to 64 MiB: meshpar's p2p executor vs ``jax.device_put``.

    python -m benchmarks.move_latency [--where localhost|cluster ...] [--link-gbit G]
                                      [--sizes SIZE ...] [--methods p2p|device_put ...]
                                      [--repeat N] [--json PATH]

Two JAX processes with one CPU device each; an array that lives whole on
process 0's device moves to process 1's device, same layout (a mesh of one
device, ``P()``), by

- ``p2p``: ``meshpar.reshard(x, dst, executor="p2p")``;
- ``device_put``: a plain same-layout ``jax.device_put(x, dst)``,

``--where`` (default both):

- ``localhost``: two plain processes on 127.0.0.1, joined by
  ``meshpar.distributed.initialize`` (gloo and JAX's cross-host transfer
  server);
- ``cluster``: a 2-host :class:`benchmarks.emulated_cluster.EmulatedCluster`
  (root; one device per host) with links shaped to ``--link-gbit``.

Sizes (``--sizes``, bytes with an optional K/M/G suffix for KiB/MiB/GiB;
default 4 1K 64K 1M 16M 64M) are float32 vectors (uint8 where the size is
not a multiple of 4). Timing (see ``benchmarks/move_latency_worker.py``): one
warm-up call, then ``--repeat`` timed calls (default 20), each from a fresh
source and after a barrier of both processes, each process timing until
its own result is ready; a repeat's time is the slower process's (the
receiver's, but for a sender slow to dispatch). Before the workers start,
the parent measures the link's round trip: the p50 of 50 one-byte TCP
ping-pongs (``TCP_NODELAY``) from process 0's host to process 1's, after 5
untimed ones; on the cluster also the link rate
(:meth:`EmulatedCluster.measure_link_rate`). The cluster's link bound is

    link_bound_s = rtt_s + bytes / link_rate_Bps

since JAX's transfer server has the receiver pull: a request crosses the
link one way and the data comes back the other. Moves that fit in the
shaper's burst (``tbf``: 1 ms at line rate, at least 256 KiB) can beat it.

Prints a progress line per size and method, then a markdown table (size,
method, p50, p90, max in ms, p90 / p50, p50 against ``jax.device_put``'s,
the round trip and, on the cluster, the link bound) and the targets, met or
missed, for the p2p move (``jax.device_put``'s for information):

- 4 B: p50 <= 1 ms on localhost; p50 <= round trip + 1 ms on the cluster;
- 16 MiB on localhost: p90 <= 1.5x p50.

Records (``--json``), one per (where, size, method)::

    {"where", "bytes", "dtype", "method", "times_s", "p50_s", "p90_s", "median_s", "min_s", "max_s",
     "warmup_s", "verified", "checked", "rtt_s", "link_gbit", "link_rate_Bps", "link_bound_s"}

``times_s`` holds every timed repeat (the slower process's time); the
percentiles are nearest rank (:func:`benchmarks.resharding.real.percentile`);
``link_gbit``, ``link_rate_Bps`` and ``link_bound_s`` are ``None`` on
localhost.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from benchmarks.move_latency_worker import DEFAULT_SIZES, METHODS
from benchmarks.resharding.real import distribution, machine_busy_cores, percentile
from benchmarks.worker_records import ProgressPrinter, read_records, worker_env, write_json

__all__ = [
    "TARGET_LOCAL_P50_S", "TARGET_RTT_SLACK_S", "TARGET_TAIL_RATIO", "aggregate", "format_size", "main",
    "measure_rtt", "parse_size", "run", "run_local", "table", "targets",
]

WHERE = ("localhost", "cluster")
LABELS = {"p2p": "meshpar p2p", "device_put": "jax.device_put"}
SMALL = 4  # bytes: the latency targets' move
TAIL_BYTES = 16 << 20
TARGET_LOCAL_P50_S = 1e-3
TARGET_RTT_SLACK_S = 1e-3
TARGET_TAIL_RATIO = 1.5
_PINGS, _UNTIMED_PINGS = 50, 5
# Once one worker fails the other usually waits at a barrier until its timeout.
_FAILURE_GRACE_S = 5.0

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"4"``, ``"64K"``, ``"16MiB"``, ``"1G"``: bytes (suffixes are binary), at least 1."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m or int(m.group(1)) < 1:
        raise ValueError(f"size: expected a positive number of bytes with an optional K/M/G suffix, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(nbytes: int) -> str:
    """``4 B``, ``64 KiB``, ``16 MiB``: the largest binary unit that divides ``nbytes``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


# -- the link's round trip ----------------------------------------------------

_ECHO = r"""
import socket, sys
with socket.create_server((sys.argv[1], 0)) as srv:
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while b := conn.recv(1):
            conn.sendall(b)
"""

_PING = r"""
import json, socket, sys, time
addr, port, n, skip = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
with socket.create_connection((addr, port), timeout=10) as s:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(skip + n):
        t0 = time.perf_counter()
        s.sendall(b"x")
        s.recv(1)
        rtts.append(time.perf_counter() - t0)
print(json.dumps(rtts[skip:]))
"""


def measure_rtt(address: str, server_prefix: Sequence[str] = (), client_prefix: Sequence[str] = (),
                timeout_s: float = 30.0) -> list[float]:
    """Round trips (s) of one-byte TCP ping-pongs to an echo server on ``address``.

    The server runs under ``server_prefix`` and the client under
    ``client_prefix`` (e.g. ``ip netns exec NS``); the client is bounded by
    ``timeout_s``, and the server killed at most 5 s after it.
    """
    server = subprocess.Popen([*server_prefix, sys.executable, "-c", _ECHO, address], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)
    try:
        port = server.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"measure_rtt: the echo server on {address} failed: {server.communicate()[1][-500:]}")
        r = subprocess.run([*client_prefix, sys.executable, "-c", _PING, address, port, str(_PINGS),
                            str(_UNTIMED_PINGS)], capture_output=True, text=True, timeout=timeout_s)
        if r.returncode != 0:
            raise RuntimeError(f"measure_rtt: the client failed: {r.stderr[-500:]}")
        return json.loads(r.stdout)
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=5)
        server.kill()
        server.wait()


# -- running ------------------------------------------------------------------


def aggregate(lines: Sequence[dict], num_processes: int = 2) -> list[dict]:
    """Per (size, method) that every process reported: one record (see the module docstring),
    without the placement's fields. A repeat's time is the slowest process's."""
    groups: dict[tuple[int, str], list[dict]] = {}
    for r in lines:
        if r.get("kind") == "move":
            groups.setdefault((r["bytes"], r["method"]), []).append(r)
    records = []
    for (nbytes, method), group in groups.items():
        n = min(len(g["times"]) for g in group)
        if len(group) < num_processes or n == 0:
            continue
        per_repeat = [max(g["times"][i] for g in group) for i in range(n)]
        records.append({
            "bytes": nbytes, "dtype": group[0]["dtype"], "method": method, "times_s": per_repeat,
            **distribution(per_repeat), "warmup_s": max(g["warmup_s"] for g in group),
            # The receiver matched numpy on every call, and someone checked.
            "verified": all(g["verified"] is not False for g in group) and any(g["verified"] for g in group),
            "checked": sum(g["checked"] for g in group),
        })
    return records


def _progress(where: str):
    printed: set[tuple[int, str]] = set()

    def report(lines: list[dict], elapsed: float) -> list[str]:
        out = []
        for r in aggregate(lines):
            key = (r["bytes"], r["method"])
            if key not in printed:
                printed.add(key)
                bad = "" if r["verified"] else " UNVERIFIED"
                out.append(f"[{elapsed:6.0f}s] {where} {format_size(r['bytes'])} {LABELS[r['method']]}: "
                           f"p50 {r['p50_s'] * 1e3:.3f} ms, p90 {r['p90_s'] * 1e3:.3f}, max {r['max_s'] * 1e3:.3f} "
                           f"({len(r['times_s'])} repeats){bad}")
        return out

    return report


def _worker_argv(args: argparse.Namespace, out: str) -> list[str]:
    return ["-m", "benchmarks.move_latency_worker", "--out", out, "--sizes", *map(str, args.sizes),
            "--methods", *args.methods, "--repeat", str(args.repeat), "--timeout", repr(args.step_timeout)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> str | None:
    """Waits for ``procs`` until they exit, the deadline passes, or a grace period after one
    failed; returns why it stopped waiting early, or ``None``."""
    deadline, give_up_at = time.monotonic() + timeout_s, float("inf")
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        if all(c is not None for c in codes):
            return None
        if now >= give_up_at:
            return f"killed {_FAILURE_GRACE_S:g} s after a worker failed"
        if now >= deadline:
            return f"killed: did not finish within {timeout_s:g} s"
        if give_up_at == float("inf") and any(c not in (None, 0) for c in codes):
            give_up_at = now + _FAILURE_GRACE_S
        time.sleep(0.05)


def run_local(cmds: Sequence[Sequence[str]], env: dict[str, str], timeout_s: float,
              progress: ProgressPrinter) -> list[str]:
    """Runs ``cmds`` at once while ``progress`` (an unstarted ``ProgressPrinter``) reports; kills
    them all on the deadline or once one failed (see :func:`_wait_all`). Returns one error, with
    the output's tail, per process that failed or was killed."""
    errors: list[str] = []
    procs: list[subprocess.Popen] = []
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(tempfile.TemporaryFile()) for _ in cmds]
        progress.start()
        try:
            for cmd, log in zip(cmds, logs):
                procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log))
            killed = _wait_all(procs, timeout_s)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            progress.stop.set()
            progress.join()
        progress.poll()
        for i, (p, log) in enumerate(zip(procs, logs)):
            if killed or p.returncode != 0:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                errors.append(f"process {i}: exit {p.returncode}{f' ({killed})' if killed else ''}\n{tail}")
    return errors


def _run_localhost(args: argparse.Namespace, out: str, start: float) -> tuple[dict, list[str]]:
    """Runs both workers on 127.0.0.1; returns the placement's fields and any errors."""
    rtt = percentile(measure_rtt("127.0.0.1"), 50)
    print(f"localhost: 2 processes x 1 CPU device, gloo + cross-host transfer server on 127.0.0.1; "
          f"TCP round trip p50 {rtt * 1e3:.3f} ms", flush=True)
    coordinator = f"127.0.0.1:{_free_port()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env.update(worker_env())
    cmds = [[sys.executable, *_worker_argv(args, out), "--coordinator", coordinator, "--process-id", str(i)]
            for i in range(2)]
    errors = run_local(cmds, env, args.timeout, ProgressPrinter(out, _progress("localhost"), start))
    fields = {"where": "localhost", "rtt_s": rtt, "link_gbit": None, "link_rate_Bps": None}
    return fields, [f"localhost {e}" for e in errors]


def _run_cluster(args: argparse.Namespace, out: str, start: float) -> tuple[dict, list[str]]:
    """Runs both workers on a 2-host emulated cluster; returns the placement's fields and any errors."""
    from benchmarks.emulated_cluster import EmulatedCluster

    ok, why = EmulatedCluster.available()
    if not ok:
        return {}, [f"emulated cluster unavailable: {why}"]
    with EmulatedCluster(2, 1, args.link_gbit, timeout_s=args.timeout) as cluster:
        rate = cluster.measure_link_rate(0, 1)
        netns = [["ip", "netns", "exec", ns] for ns in cluster.namespaces]
        rtt = percentile(measure_rtt(cluster.host_addresses[1], netns[1], netns[0]), 50)
        print(f"emulated cluster: 2 hosts x 1 CPU device, {args.link_gbit:g} Gbit/s tbf-shaped links; measured "
              f"{rate / 1e6:.1f} MB/s of TCP payload host0 -> host1, round trip p50 {rtt * 1e3:.3f} ms", flush=True)
        errors = cluster.run_reporting(_worker_argv(args, out), env=worker_env(), timeout_s=args.timeout,
                                       progress=ProgressPrinter(out, _progress("cluster"), start),
                                       what=f"emulated run at {args.link_gbit:g} Gbit/s")
    return {"where": "cluster", "rtt_s": rtt, "link_gbit": args.link_gbit, "link_rate_Bps": rate}, errors


def run(args: argparse.Namespace) -> tuple[list[dict], list[str]]:
    """Runs every ``--where``; returns the records and any errors."""
    start = time.perf_counter()
    busy = machine_busy_cores()
    print(f"machine: {os.cpu_count()} cores, {busy:.2f} busy before the run"
          + (" -- NOT IDLE: other load inflates every time below" if busy > 0.25 else ""), flush=True)
    print(f"{len(args.sizes)} sizes x {len(args.methods)} methods x (1 warm-up + {args.repeat} timed)", flush=True)
    records: list[dict] = []
    errors: list[str] = []
    for where in args.where:
        with tempfile.TemporaryDirectory(prefix="meshpar-move-latency-") as out:
            fields, errs = (_run_localhost if where == "localhost" else _run_cluster)(args, out, start)
            lines = read_records(out)
        errs += [f"{where}, process {r['process']}: {r['error']}" for r in lines if r.get("kind") == "error"]
        for e in errs:
            print(f"ERROR: {e}", file=sys.stderr, flush=True)
        errors += errs
        for r in aggregate(lines):
            rate = fields["link_rate_Bps"]
            bound = fields["rtt_s"] + r["bytes"] / rate if rate else None
            records.append({"where": where, **r, **fields, "link_bound_s": bound})
    return records, errors


# -- reporting ----------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def table(records: Sequence[dict]) -> str:
    """Markdown, one row per record: where, size, method, repeats, p50 / p90 / max (ms),
    p90 / p50, p50 over ``jax.device_put``'s at the same size and place, the round
    trip and the link bound (ms; ``-`` on localhost), p50 / link bound.

    ``(!)``: the result did not match numpy.
    """
    put = {(r["where"], r["bytes"]): r for r in records if r["method"] == "device_put"}
    lines = ["| where | size | method | repeats | p50 (ms) | p90 (ms) | max (ms) | p90 / p50 | p50 / device_put's "
             "| round trip (ms) | link bound (ms) | p50 / bound |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        ref = put.get((r["where"], r["bytes"]))
        vs_put = f"{r['p50_s'] / ref['p50_s']:.2f}x" if ref and r["method"] != "device_put" else "-"
        bound = r.get("link_bound_s")
        over_bound = f"{r['p50_s'] / bound:.2f}x" if bound else "-"
        lines.append(
            f"| {r['where']} | {format_size(r['bytes'])} | {LABELS.get(r['method'], r['method'])}"
            f"{'' if r['verified'] else ' (!)'} | {len(r['times_s'])} | {_ms(r['p50_s'])} | {_ms(r['p90_s'])} | "
            f"{_ms(r['max_s'])} | {r['p90_s'] / r['p50_s']:.2f} | {vs_put} | {_ms(r['rtt_s'])} | {_ms(bound)} | "
            f"{over_bound} |")
    return "\n".join(lines)


def _verdicts(records: Sequence[dict], nbytes: int, what: str, measure, unit: str) -> list[str]:
    """One line per record of size ``nbytes``: ``measure(record)`` is ``(value, limit)``;
    ``met``/``MISSED`` for the p2p move, ``info`` for ``jax.device_put``."""
    fmt = (lambda v: f"{v * 1e3:.3f} ms") if unit == "ms" else (lambda v: f"{v:.2f}x")  # noqa: E731
    rows = [r for r in records if r["bytes"] == nbytes]
    out = []
    if rows and not any(r["method"] == "p2p" for r in rows):
        out.append(f"MISSED {rows[0]['where']} {format_size(nbytes)} {LABELS['p2p']}: no result (failed or not run)")
    for r in rows:
        value, limit = measure(r)
        verdict = ("met   " if value <= limit else "MISSED") if r["method"] == "p2p" else "info  "
        out.append(f"{verdict} {r['where']} {format_size(nbytes)} {LABELS.get(r['method'], r['method'])}: "
                   f"{what} {fmt(value)} (target <= {fmt(limit)})")
    return out


def targets(records: Sequence[dict]) -> list[str]:
    """The targets, one line each, for every placement in ``records`` (see the module
    docstring): ``met``/``MISSED`` for the p2p move, ``info`` for ``jax.device_put`` under
    the same bound; a size a placement ran whose p2p move has no record is ``MISSED``."""
    out = []
    for where in dict.fromkeys(r["where"] for r in records):
        here = [r for r in records if r["where"] == where]
        if where == "localhost":
            out += _verdicts(here, SMALL, "p50", lambda r: (r["p50_s"], TARGET_LOCAL_P50_S), "ms")
            out += _verdicts(here, TAIL_BYTES, "p90 / p50",
                             lambda r: (r["p90_s"] / r["p50_s"], TARGET_TAIL_RATIO), "x")
        else:
            out += _verdicts(here, SMALL, "p50", lambda r: (r["p50_s"], r["rtt_s"] + TARGET_RTT_SLACK_S), "ms")
    return out


# -- CLI ----------------------------------------------------------------------


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.move_latency", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--where", nargs="+", choices=WHERE, default=list(WHERE),
                   help="localhost (two plain processes) and/or cluster (emulated, root); default both")
    p.add_argument("--link-gbit", type=float, default=1.0, help="the emulated cluster's link rate (default 1)")
    p.add_argument("--sizes", nargs="+", type=_size, default=list(DEFAULT_SIZES),
                   help="bytes per move, K/M/G suffixes allowed (default 4 1K 64K 1M 16M 64M)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--repeat", type=int, default=20, help="timed moves per size and method (default 20)")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--timeout", type=float, default=900.0, help="bound on each placement's run, s")
    p.add_argument("--step-timeout", type=float, default=120.0, help="bound on each barrier and wait, s")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat: expected at least 1")
    start = time.perf_counter()
    records, errors = run(args)
    print("\nOne cross-process move, 1 CPU device per process: p50 / p90 / max (nearest rank) over repeats "
          "of the slower process's time; link bound = round trip + bytes / measured link rate.\n")
    print(table(records))
    lines = targets(records)
    if lines:
        print("\nTargets (meshpar p2p; jax.device_put for information):")
        print("\n".join(lines))
    unverified = [r for r in records if not r["verified"]]
    for r in unverified:
        print(f"ERROR: {r['where']} {format_size(r['bytes'])} {r['method']}: result did not match numpy",
              file=sys.stderr)
    write_json(args.json, records)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 1 if errors or unverified or not records else 0


if __name__ == "__main__":
    sys.exit(main())
