"""Cross-mesh resharding benchmarks.

    python -m benchmarks.resharding sim [--json PATH] [--scale]
    python -m benchmarks.resharding real [--link-gbit G [G ...]] [--mib M] [--devices-per-host D] [--repeat N]
                                         [--cases C ...] [--grid [collective|p2p]] [--json PATH]

``real`` compares, per link rate, meshpar.reshard's p2p executor (eager and
rounds order), its collective executor, Alpa's baseline and stock JAX (jit
to the destination layout, then a cross-host jax.device_put); ``--grid``
runs the old 9 strategy x balancer grid instead. It prints medians, then
each case x method's p50 / p90 / max over the repeats. The overlap
benchmark (reshard alongside compute) is ``python -m benchmarks.overlap``;
one move's latency (4 B to 64 MiB, p2p vs jax.device_put) is
``python -m benchmarks.move_latency``.
"""

from __future__ import annotations

import argparse
import sys
import time

from benchmarks.worker_records import write_json
from meshpar.passes import BALANCERS, STRATEGIES

from . import real, sim


def _sim(args: argparse.Namespace) -> int:
    cases = sim.default_cases()
    print(f"simulating {len(cases)} cases x {len(args.strategies)} strategies x {len(args.balancers)} balancers "
          f"(cost model: host NIC bottleneck, aws_p3_8xlarge: 10 Gbit/s between hosts)", flush=True)
    records = sim.run_sim(cases, args.strategies, args.balancers)
    if args.scale:
        case = sim.scale_case()
        print(f"scale case: {case.task.src_spec}{case.task.src_mesh.shape} -> {case.task.dst_spec}{case.task.dst_mesh.shape}, "
              f"{case.cluster.num_devices} devices", flush=True)
        scale = sim.run_sim([case], ["broadcast"], ["greedy_random", "load_balance"])
        for r in scale:
            print(f"  {r['strategy']}/{r['balancer']}: planned {r['unit_tasks']} unit tasks in {r['planner_s']:.2f} s, "
                  f"{r['rounds']} rounds, estimated {r['estimated_s'] * 1e3:.1f} ms (lower bound {r['lower_bound_s'] * 1e3:.1f} ms)",
                  flush=True)
        records += scale
    print("\nEstimated time / lower bound (1.00x = optimal); last column: Alpa's time over broadcast+ensemble's.\n")
    print(sim.headline_table([r for r in records if r["suite"] != "scale"]))
    if args.full:
        print("\nAll strategies x balancers, estimated time / lower bound:\n")
        print(sim.full_table(records))
    slowest = max(records, key=lambda r: r["planner_s"])
    print(f"\nslowest plan: {slowest['case']} {slowest['strategy']}/{slowest['balancer']}: "
          f"{slowest['planner_s']:.2f} s for {slowest['unit_tasks']} unit tasks")
    write_json(args.json, records)
    return 0


def _real(args: argparse.Namespace) -> int:
    records, errors = real.run_real(args)
    emulated = [r for r in records if r["suite"] != "single_host"]
    comparison = not (args.grid or args.methods)
    for rate in real._rates(emulated):
        rows = [r for r in emulated if r.get("link_gbit") == rate]
        if comparison:
            print(f"\nEmulated cluster at {rate:g} Gbit/s, {args.mib:g} MiB, {args.devices_per_host} devices per host: "
                  "median ms over repeats of the slowest process; n/a: no single same-layout cross-host "
                  "jax.device_put does this move (different device counts, or a source host facing several "
                  "destination hosts).\n")
            print(real.comparison_table(rows))
        else:
            print(f"\nEmulated cluster at {rate:g} Gbit/s: median time / link lower bound (1.00x = the measured "
                  "link's best); last columns: broadcast/ensemble's (ours) and Alpa's times.\n")
            print(real.table(rows))
        print(f"\nEmulated cluster at {rate:g} Gbit/s, spread over repeats: p50 / p90 / max (nearest rank) "
              "of the slowest process's time, as multiples of the link lower bound.\n")
        print(real.distribution_table(rows))
    traces = real.hop_trace_report(emulated)
    if traces:
        print("\nHop traces: per repeat, each plan round's first dispatch to last arrival (ms from the move's "
              "first dispatch, all processes on one clock) and the hops in flight per host; then every hop of "
              "the slowest and the median repeat ('alone': its bytes at the measured link rate).\n")
        print(traces)
    single = [r for r in records if r["suite"] == "single_host"]
    if single:
        print("\nSingle host, 8 virtual CPU devices in one process (median):\n")
        print(real.single_host_table(records))
        print("\nSingle host, spread over repeats: p50 / p90 / max (nearest rank), ms.\n")
        print(real.distribution_table(single))
    if comparison:
        lines = real.targets(records)
        if lines:
            print(f"\nTargets (stated for {real.TARGET_GBIT:g} Gbit/s links; other rates for information):")
            print("\n".join(lines))
    unverified = [r for r in records if not r["verified"]]
    for r in unverified:
        print(f"ERROR: {r['suite']} {r['case']} {real.method_label(real._method_of(r))}: result did not match numpy",
              file=sys.stderr)
    write_json(args.json, records)
    return 1 if errors or unverified or not records else 0


def _method(text: str) -> str:
    try:
        m = real.Method.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if m.strategy != "stock_jax" and (m.strategy not in STRATEGIES or m.balancer not in BALANCERS
                                      or m.executor not in real.EXECUTORS):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected strategy in {list(STRATEGIES)}, balancer in {list(BALANCERS)}, "
            f"executor in {list(real.EXECUTORS)} (or stock_jax/-)")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.resharding", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("sim", help="plan every case under the cost model (no devices needed)")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    p.add_argument("--balancers", nargs="+", default=list(BALANCERS), choices=list(BALANCERS))
    p.add_argument("--scale", action="store_true", help="also plan a 1,024-device, 32,768-unit-task resharding")
    p.add_argument("--full", action="store_true", help="also print the full strategy x balancer table")
    p.set_defaults(func=_sim)
    p = sub.add_parser("real", help="time reshard on an emulated multi-host cluster (root; network namespaces)",
                       description=real.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--link-gbit", type=float, nargs="+", default=[1.0],
                   help="shaped link rate(s) per host NIC; one emulated cluster and one table per rate (default 1)")
    p.add_argument("--devices-per-host", type=int, default=4, help="CPU devices per emulated host (default 4)")
    p.add_argument("--repeat", type=int, default=15,
                   help="timed calls per case x method (default 15: enough for a p90)")
    p.add_argument("--json", help="write the records here")
    p.add_argument("--cases", nargs="+", help="case names, e.g. case1 case3 2x2 (default: all)")
    p.add_argument("--suites", nargs="+", choices=[*real.SUITES, "single_host"],
                   help="default: n_to_m one_to_m single_host")
    p.add_argument("--grid", nargs="?", const="collective", choices=list(real.EXECUTORS),
                   help="run the old grid (broadcast, send_recv, local_allgather x naive, load_balance, ensemble) "
                        "on this executor (default collective) instead of the comparison set")
    p.add_argument("--methods", nargs="+", metavar="STRATEGY/BALANCER[/EXECUTOR[/ORDER]]", type=_method,
                   help="run these instead (executor p2p|collective, default p2p; order eager|rounds); "
                        "stock_jax/- is stock JAX")
    p.add_argument("--mib", type=float, default=None,
                   help=f"tensor size in MiB (default {real.COMPARISON_MIB:g}; with --grid {real._BASE_MIB:g})")
    p.add_argument("--chunks", type=int, help="force the broadcast chunk count (default: the planner's)")
    p.add_argument("--hop-trace", action="store_true",
                   help="p2p methods: record when each hop arrived and print the slowest and median repeats' hops")
    p.add_argument("--plan-gbit", type=float,
                   help="plan for links of this rate instead of --link-gbit (same payload efficiency as measured)")
    p.add_argument("--latency", type=float, default=1e-3, help="planner's per-message latency, s (default 1e-3)")
    p.add_argument("--intra-rate", type=float, default=2e9, help="planner's intra-host bytes/s (default 2e9)")
    p.add_argument("--timeout", type=float, default=3600.0, help="bound on each run of the workers, s")
    p.add_argument("--step-timeout", type=float, default=300.0, help="bound on each barrier / plan agreement, s")
    p.set_defaults(func=_real)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    code = args.func(args)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
