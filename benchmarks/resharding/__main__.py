"""Cross-mesh resharding benchmarks.

    python -m benchmarks.resharding sim [--json PATH] [--scale]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from meshpar.passes import BALANCERS, STRATEGIES

from . import sim


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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {len(records)} records to {args.json}")
    return 0


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
    args = parser.parse_args(argv)
    start = time.perf_counter()
    code = args.func(args)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
