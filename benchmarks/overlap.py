"""Overlap benchmark: does a cross-host reshard run alongside a pipeline stage's compute?

    python -m benchmarks.overlap [--link-gbit G [G ...]] [--mib M] [--repeat N] [--executors E ...] [--json PATH]

Parent side (needs root: see :class:`benchmarks.emulated_cluster.EmulatedCluster`).
For each link rate ``G``: builds a 2-host emulated cluster (4 CPU devices
per host, one JAX process per host, links shaped to ``G`` Gbit/s), measures
the link, and runs ``python -m benchmarks.overlap_worker`` on both hosts.
Host 0 holds an ``M`` MiB float32 tensor sharded ``P("x")`` on its 4
devices and runs a stage-sized compute on the same devices (a chain of
matmuls, calibrated so that alone it takes about as long as the transfer
alone); host 1 receives the tensor as ``P(None, "y")`` on its 4 devices by
``meshpar.reshard`` broadcast/ensemble. Per executor (``p2p``,
``collective``) the worker times the compute alone, the transfer alone and
both launched together (reshard dispatched, then the compute; the receiver
waits for its result, host 0 for its compute); see the worker's docstring
for the protocol. A repeat's time is the slower process's; cells are
medians over repeats.

    ratio = time(both) / max(time(compute), time(transfer))

1.0 is full overlap, about 2.0 none (the two serialized). Target: ratio
<= 1.15 with p2p. Records (``--json``), one per (link rate, executor)::

    {"executor", "link_gbit", "compute_s", "transfer_s", "both_s", "ratio", "k", "mib",
     "link_rate_Bps", "compute_times_s", "transfer_times_s", "both_times_s", "verified", ...}

Importing this module touches neither JAX nor the network.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence

from benchmarks.worker_records import ProgressPrinter, read_records, worker_env, write_json

__all__ = ["TARGET_RATIO", "aggregate", "main", "table", "targets"]

EXECUTORS = ("p2p", "collective")
PHASES = ("compute", "transfer", "both")
TARGET_RATIO = 1.15


def aggregate(lines: Sequence[dict], num_processes: int = 2) -> list[dict]:
    """Per executor that every process reported: one record.

    Each repeat's phase time is the max over processes; ``compute_s``,
    ``transfer_s`` and ``both_s`` are medians over repeats, and
    ``ratio = both_s / max(compute_s, transfer_s)``.
    """
    calibration = {r["executor"]: r for r in lines if r.get("kind") == "calibration"}
    groups: dict[str, list[dict]] = {}
    for r in lines:
        if r.get("kind") == "executor":
            groups.setdefault(r["executor"], []).append(r)
    records = []
    for executor, group in groups.items():
        if len(group) < num_processes:
            continue
        record: dict = {"executor": executor}
        for phase in PHASES:
            n = min(len(g["times"][phase]) for g in group)
            per_repeat = [max(g["times"][phase][i] for g in group) for i in range(n)]
            record[f"{phase}_times_s"] = per_repeat
            record[f"{phase}_s"] = statistics.median(per_repeat) if per_repeat else None
        if any(record[f"{p}_s"] is None for p in PHASES):
            continue
        record["ratio"] = record["both_s"] / max(record["compute_s"], record["transfer_s"])
        # Which side the overlap slowed: host 0's compute and host 1's receive, each alone and together.
        for g in group:
            side = "src" if g.get("role") == "src" else "dst"
            for phase in PHASES:
                if g["times"][phase]:
                    record[f"{side}_{phase}_s"] = statistics.median(g["times"][phase])
        cal = calibration.get(executor, {})
        record.update({
            "k": group[0]["k"],
            "matmul_n": cal.get("matmul_n"),
            "calibration_transfer_s": cal.get("transfer_s"),
            "calibration_tries": cal.get("tries"),
            "tensor_bytes": cal.get("tensor_bytes"),
            "verified": all(g["verified"] is not False for g in group) and any(g["verified"] for g in group),
            "checked_shards": sum(g["checked_shards"] for g in group),
        })
        records.append(record)
    return records


def table(records: Sequence[dict]) -> str:
    """Markdown: one row per (link rate, executor)."""
    lines = ["| link (Gbit/s) | executor | MiB | matmul steps | compute alone (ms) | transfer alone (ms) | "
             "both (ms) | both / max(compute, transfer) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        mib = f"{r['tensor_bytes'] / 2**20:g}" if r.get("tensor_bytes") else "-"
        bad = "" if r.get("verified", True) else " (!)"
        link = f"{r['link_gbit']:g}" if r.get("link_gbit") is not None else "-"
        lines.append(f"| {link} | {r['executor']}{bad} | {mib} | {r['k']} | "
                     f"{r['compute_s'] * 1e3:.0f} | {r['transfer_s'] * 1e3:.0f} | {r['both_s'] * 1e3:.0f} | "
                     f"{r['ratio']:.2f} |")
    return "\n".join(lines)


def targets(records: Sequence[dict]) -> list[str]:
    """``ratio <= 1.15`` with p2p, one line per link rate; collective shown for reference."""
    out = []
    for r in records:
        at = f"{r['link_gbit']:g} Gbit/s " if r.get("link_gbit") is not None else ""
        if r["executor"] == "p2p":
            out.append(f"{'met   ' if r['ratio'] <= TARGET_RATIO else 'MISSED'} {at}p2p: both / max(compute, transfer) "
                       f"{r['ratio']:.2f} (target <= {TARGET_RATIO:.2f})")
        else:
            out.append(f"info   {at}{r['executor']}: both / max(compute, transfer) {r['ratio']:.2f} (no target)")
    return out


def _progress_lines(lines: Sequence[dict], done: set, prefix: str, elapsed: float) -> list[str]:
    out = []
    for r in lines:
        if r.get("kind") == "calibration" and ("cal", r["executor"]) not in done:
            done.add(("cal", r["executor"]))
            tries = ", ".join(f"k={t['k']}: {t['compute_s'] * 1e3:.0f} ms" for t in r["tries"])
            out.append(f"[{elapsed:6.0f}s] {prefix}{r['executor']}: transfer alone {r['transfer_s'] * 1e3:.0f} ms; "
                       f"compute calibrated to k={r['k']} matmul steps ({tries})")
    for rec in aggregate(lines):
        if ("rec", rec["executor"]) not in done:
            done.add(("rec", rec["executor"]))
            side = ""
            if "src_both_s" in rec and "dst_both_s" in rec:
                side = (f" (together: host 0's compute {rec['src_both_s'] * 1e3:.0f} ms, "
                        f"host 1's receive {rec['dst_both_s'] * 1e3:.0f} ms)")
            out.append(f"[{elapsed:6.0f}s] {prefix}{rec['executor']}: compute {rec['compute_s'] * 1e3:.0f} ms, "
                       f"transfer {rec['transfer_s'] * 1e3:.0f} ms, both {rec['both_s'] * 1e3:.0f} ms{side}: "
                       f"ratio {rec['ratio']:.2f}" + ("" if rec["verified"] else " UNVERIFIED"))
    return out


def _run_rate(args: argparse.Namespace, link_gbit: float, start: float) -> tuple[list[dict], list[str]]:
    from benchmarks.emulated_cluster import EmulatedCluster

    errors: list[str] = []
    print(f"emulated cluster: 2 hosts x 4 CPU devices, {link_gbit:g} Gbit/s tbf-shaped links; {args.mib:g} MiB "
          f"P('x') on host 0 -> P(None, 'y') on host 1, executors {', '.join(args.executors)}, "
          f"{args.repeat} repeats", flush=True)
    with EmulatedCluster(2, 4, link_gbit, timeout_s=args.timeout) as cluster:
        rate = cluster.measure_link_rate(0, 1)
        print(f"measured link rate host0 -> host1: {rate / 1e6:.1f} MB/s", flush=True)
        with tempfile.TemporaryDirectory(prefix="meshpar-overlap-") as out:
            argv = ["-m", "benchmarks.overlap_worker", "--out", out, "--link-rate", repr(rate),
                    "--mib", repr(args.mib), "--repeat", str(args.repeat), "--timeout", repr(args.step_timeout),
                    "--matmul-n", str(args.matmul_n), "--executors", *args.executors]
            done: set = set()
            progress = ProgressPrinter(
                out, lambda lines, elapsed: _progress_lines(lines, done, f"{link_gbit:g} Gbit/s ", elapsed), start)
            errors += cluster.run_reporting(argv, env=worker_env(), timeout_s=args.timeout, progress=progress,
                                            what=f"overlap run at {link_gbit:g} Gbit/s")
            lines = read_records(out)
    errors += [f"{link_gbit:g} Gbit/s, process {r['process']}: {r['error']}" for r in lines if r.get("kind") == "error"]
    records = aggregate(lines)
    for r in records:
        r.update(link_gbit=link_gbit, link_rate_Bps=rate, mib=args.mib)
    return records, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--link-gbit", type=float, nargs="+", default=[1.0, 0.25],
                        help="shaped link rate(s); one emulated cluster per rate (default 1 0.25)")
    parser.add_argument("--mib", type=float, default=8.0, help="tensor size in MiB (default 8)")
    parser.add_argument("--repeat", type=int, default=5, help="timed rounds per executor (default 5)")
    parser.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=EXECUTORS)
    parser.add_argument("--matmul-n", type=int, default=256, help="N of each device's N x N matmul (default 256)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--timeout", type=float, default=900.0, help="bound on each run of the workers, s")
    parser.add_argument("--step-timeout", type=float, default=120.0,
                        help="bound on each barrier, exchange and wait inside the workers, s")
    args = parser.parse_args(argv)
    start = time.perf_counter()

    from benchmarks.emulated_cluster import EmulatedCluster

    ok, why = EmulatedCluster.available()
    if not ok:
        print(f"ERROR: emulated cluster unavailable: {why}", file=sys.stderr)
        return 1
    records: list[dict] = []
    errors: list[str] = []
    for rate in args.link_gbit:
        got, errs = _run_rate(args, rate, start)
        records += got
        errors += errs
    if records:
        print("\nReshard alongside compute: median ms over repeats of the slower process; "
              "last column 1.00 = full overlap, ~2.00 = none.\n")
        print(table(records))
        print("\nTargets:")
        print("\n".join(targets(records)))
    unverified = [r for r in records if not r["verified"]]
    for r in unverified:
        print(f"ERROR: {r['link_gbit']:g} Gbit/s {r['executor']}: result did not match numpy", file=sys.stderr)
    write_json(args.json, records)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 1 if errors or unverified or not records else 0


if __name__ == "__main__":
    sys.exit(main())
