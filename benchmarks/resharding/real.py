"""Real-network resharding benchmark: the paper's cases on an emulated cluster.

    python -m benchmarks.resharding real [--link-gbit G] [--devices-per-host D] [--repeat N] [--json PATH]

Parent side. Builds one :class:`benchmarks.emulated_cluster.EmulatedCluster`
with as many hosts as the largest case needs (5) and ``D`` CPU devices per
host, measures the shaped link with ``measure_link_rate()``, and runs
``python -m benchmarks.resharding.real_worker`` once on every host: every
process runs every case x method in the same order (see the worker's
docstring for the timing protocol). Then runs the same cases in one plain
process on 8 virtual devices against ``jax.device_put`` (suite
``single_host``). Records, one per (suite, case, strategy, balancer)::

    {"suite", "case", "strategy", "balancer", "median_s", "min_s", "max_s",
     "link_lower_bound_s", "bytes_moved", ...}

``median_s``/``min_s``/``max_s`` are over repeats of the slowest process's
time (receivers finish last). ``link_lower_bound_s`` is the planner's lower
bound of the executed task on a cluster whose inter-host bandwidth is the
measured rate and whose latency is 0. ``bytes_moved`` is the least number of
bytes that must cross host NICs: per unit slice, its size times the number
of destination hosts that need it and do not already hold it.

Importing this module touches no JAX backend (``cases`` imports meshpar,
hence JAX, but nothing here creates devices), so the worker can import its
case definitions before it configures JAX.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence

from .cases import FIG5, TABLE2

__all__ = [
    "METHODS",
    "RealCase",
    "aggregate",
    "machine_busy_cores",
    "real_cases",
    "run_real",
    "single_host_cases",
    "single_host_table",
    "table",
    "targets",
]

STRATEGIES = ("broadcast", "send_recv", "local_allgather")
BALANCERS = ("naive", "load_balance", "ensemble")
METHODS = tuple((s, b) for s in STRATEGIES for b in BALANCERS)
OURS = ("broadcast", "ensemble")
ALPA = ("local_allgather", "load_balance")
SUITES = ("n_to_m", "one_to_m")
# Table 2 at 32 MiB: float32 (256, 256, 128); Fig. 5: 2**23 float32 elements.
_BASE_MIB = 32.0
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class RealCase:
    """One case laid out on concrete devices.

    ``src_rows``/``dst_rows``: the mesh, one row per mesh row, each device as
    ``(process, local device index)``. On the emulated cluster a row is one
    host (process); on a single host every device is ``(0, i)`` and rows
    stand for hosts.
    """

    suite: str
    name: str
    shape: tuple[int, ...]
    src_spec: str
    dst_spec: str
    src_rows: tuple[tuple[tuple[int, int], ...], ...]
    dst_rows: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_processes(self) -> int:
        return 1 + max(p for rows in (self.src_rows, self.dst_rows) for row in rows for p, _ in row)


def _table2_shape(mib: float) -> tuple[int, int, int]:
    # Scale the last dimension; it stays even (case 9 shards it over 2 hosts).
    last = max(2, 2 * round(128 * mib / _BASE_MIB / 2))
    return (256, 256, last)


def _fig5_elements(mib: float) -> int:
    return max(64, round(mib / _BASE_MIB * 2**23))


def _on_hosts(hosts: Iterable[int], per_host: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    return tuple(tuple((h, k) for k in range(per_host)) for h in hosts)


def _select(cases: list[RealCase], names: Sequence[str] | None, suites: Sequence[str] | None) -> list[RealCase]:
    if suites:
        cases = [c for c in cases if c.suite in suites]
    if names:
        unknown = set(names) - {c.name for c in cases}
        if unknown:
            raise ValueError(f"cases: unknown {sorted(unknown)}; expected some of {[c.name for c in cases]}")
        cases = [c for c in cases if c.name in names]
    return cases


def real_cases(
    mib: float = _BASE_MIB,
    devices_per_host: int = 4,
    names: Sequence[str] | None = None,
    suites: Sequence[str] | None = None,
) -> list[RealCase]:
    """Table 2 and Fig. 5 on emulated hosts: source on hosts 0.., destination on the next ones.

    A mesh ``(hosts, d)`` takes the first ``min(d, devices_per_host)`` devices
    of each of its hosts (case 8's (2, 3) -> (3, 2) uses 3 and 2 of 4).
    Case 6 pads dimension 0 to a multiple of 6.
    """
    D = devices_per_host
    shape = _table2_shape(mib)
    cases = []
    for name, src_spec, dst_spec, (sh, sd), (dh, dd) in TABLE2:
        case_shape = shape
        if name == "case6":
            case_shape = (-(-shape[0] // 6) * 6, *shape[1:])
        cases.append(RealCase("n_to_m", name, case_shape, src_spec, dst_spec,
                              _on_hosts(range(sh), min(sd, D)), _on_hosts(range(sh, sh + dh), min(dd, D))))
    n = _fig5_elements(mib)
    for hosts, per_host in FIG5:
        cases.append(RealCase("one_to_m", f"{hosts}x{per_host}", (n,), "R", "R",
                              (((0, 0),),), _on_hosts(range(1, 1 + hosts), min(per_host, D))))
    return _select(cases, names, suites)


def single_host_cases(
    mib: float = _BASE_MIB, names: Sequence[str] | None = None, suites: Sequence[str] | None = None
) -> list[RealCase]:
    """The same cases scaled down to 8 devices of one process, as tests/test_reshard.py does.

    Table 2 meshes shrink to fit 4 + 4 devices (source on devices 0-3,
    destination on 4-7); Fig. 5's sender is device 0 and ``4x2`` becomes
    ``3x2``. Rows still stand for hosts (for the planner).
    """
    fit = {(2, 4): (2, 2), (3, 4): (2, 2), (1, 4): (1, 4), (2, 3): (2, 2), (3, 2): (2, 2)}

    def rows(first: int, shape: tuple[int, int]) -> tuple[tuple[tuple[int, int], ...], ...]:
        h, d = shape
        return tuple(tuple((0, first + i * d + k) for k in range(d)) for i in range(h))

    shape = _table2_shape(mib)
    cases = []
    for name, src_spec, dst_spec, sm, dm in TABLE2:
        case_shape = shape
        if name == "case6":
            case_shape = (-(-shape[0] // 6) * 6, *shape[1:])
        cases.append(RealCase("single_host", name, case_shape, src_spec, dst_spec, rows(0, fit[sm]), rows(4, fit[dm])))
    n = _fig5_elements(mib)
    for hosts, per_host in FIG5:
        fitted = (hosts, per_host) if hosts * per_host <= 7 else (3, 2)
        cases.append(RealCase("single_host", f"{hosts}x{per_host}", (n,), "R", "R", rows(0, (1, 1)), rows(1, fitted)))
    if suites:  # n_to_m / one_to_m select Table 2 / Fig. 5 cases
        table2 = {name for name, *_ in TABLE2}
        cases = [c for c in cases if ("n_to_m" if c.name in table2 else "one_to_m") in suites]
    return _select(cases, names, None)


# -- running ------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    # The worker runs as `python -m benchmarks.resharding.real_worker`, whatever
    # the caller's working directory.
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join([_REPO, path]) if path else _REPO}


def _read_lines(directory: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".jsonl"):
            continue
        with open(os.path.join(directory, name)) as f:
            for line in f:
                if line.endswith("\n"):  # a line still being written is skipped
                    out.append(json.loads(line))
    return out


class _Progress(threading.Thread):
    """Prints one line per case as soon as every process has reported all its methods."""

    def __init__(self, directory: str, cases: Sequence[RealCase], methods: Sequence[tuple[str, str]],
                 num_processes: int, start: float) -> None:
        super().__init__(daemon=True)
        self.directory, self.cases, self.methods = directory, list(cases), list(methods)
        self.num_processes, self.start_time = num_processes, start
        self.stop = threading.Event()
        self._printed: set[tuple[str, str]] = set()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            self.poll()

    def poll(self) -> None:
        try:
            records = aggregate(_read_lines(self.directory), self.num_processes)
        except (OSError, ValueError):
            return
        by_case: dict[tuple[str, str], dict[tuple[str, str], dict]] = {}
        for r in records:
            by_case.setdefault((r["suite"], r["case"]), {})[(r["strategy"], r["balancer"])] = r
        for c in self.cases:
            key = (c.suite, c.name)
            row = by_case.get(key, {})
            if key in self._printed or len(row) < len(self.methods):
                continue
            self._printed.add(key)
            print(_progress_line(c, row, time.perf_counter() - self.start_time), flush=True)


def _progress_line(case: RealCase, row: dict[tuple[str, str], dict], elapsed: float) -> str:
    any_r = next(iter(row.values()))
    lb = any_r.get("link_lower_bound_s")
    parts = []
    for (s, b), r in row.items():
        ratio = f" {r['median_s'] / lb:.2f}x" if lb else ""
        bad = "" if r["verified"] else " UNVERIFIED"
        parts.append(f"{s}/{b} {r['median_s'] * 1e3:.0f}{ratio}{bad}")
    head = f"[{elapsed:6.0f}s] {case.suite} {case.name} {any_r.get('src', '')} -> {any_r.get('dst', '')}"
    if lb:
        head += f", {any_r['bytes_moved'] / 2**20:.0f} MiB over the links, lower bound {lb * 1e3:.0f} ms"
    line = head + ": " + ", ".join(parts) + " (median ms)"
    ours = row.get(OURS)
    if ours and "cpu_cores" in ours:
        line += f"; {OURS[0]}/{OURS[1]} kept {ours['cpu_cores']:.1f} cores busy (machine {ours['machine_cores']:.1f})"
    return line


def aggregate(lines: Sequence[dict], num_processes: int) -> list[dict]:
    """Per (suite, case, strategy, balancer) with every process's report: one record.

    A repeat's time is the slowest process's; median/min/max are over repeats.
    """
    info = {(r["suite"], r["case"]): r for r in lines if r.get("kind") == "case"}
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for r in lines:
        if r.get("kind") == "method":
            groups.setdefault((r["suite"], r["case"], r["strategy"], r["balancer"]), []).append(r)
    records = []
    for (suite, case, strategy, balancer), group in groups.items():
        if len(group) < num_processes or (suite, case) not in info:
            continue
        n = min(len(g["times"]) for g in group)
        per_repeat = [max(g["times"][i] for g in group) for i in range(n)]
        if not per_repeat:
            continue
        c = info[(suite, case)]
        plan = next((g["plan"] for g in group if g.get("plan")), {})
        records.append({
            "suite": suite,
            "case": case,
            "strategy": strategy,
            "balancer": balancer,
            "median_s": statistics.median(per_repeat),
            "min_s": min(per_repeat),
            "max_s": max(per_repeat),
            "link_lower_bound_s": c.get("link_lower_bound_s"),
            "bytes_moved": c.get("bytes_moved"),
            "tensor_bytes": c.get("tensor_bytes"),
            "src": c.get("src"),
            "dst": c.get("dst"),
            "times_s": per_repeat,
            "warmup_s": max(g["warmup_s"] for g in group),
            # CPU seconds all processes spent in the timed calls (including
            # waiting at the barrier), over their wall time: cores kept busy.
            "cpu_cores": sum(g.get("cpu_s", 0.0) for g in group) / sum(per_repeat),
            # The whole machine's busy cores over the same span (process 0's
            # view): the excess over cpu_cores is kernel network work
            # (softirq: bridge, tbf, TCP) plus any other load on the machine.
            "machine_cores": max(g.get("machine_cores", 0.0) for g in group),
            # Every process that received something matched numpy, and someone did.
            "verified": all(g["verified"] is not False for g in group) and any(g["verified"] for g in group),
            "checked_shards": sum(g["checked_shards"] for g in group),
            "link_rate_Bps": c.get("link_rate"),
            **{k: plan[k] for k in ("estimated_s", "unit_tasks", "rounds", "chunks", "steps", "ppermutes") if k in plan},
        })
    return records


def _run_emulated(args, cases: list[RealCase], methods: list[tuple[str, str]], start: float) -> tuple[list[dict], list[str]]:
    from benchmarks.emulated_cluster import ClusterRunError, EmulatedCluster

    errors: list[str] = []
    hosts = max(c.num_processes for c in cases)
    print(f"emulated cluster: {hosts} hosts x {args.devices_per_host} CPU devices, {args.link_gbit:g} Gbit/s "
          f"tbf-shaped links, gloo; {len(cases)} cases x {len(methods)} methods x (1 warm-up + {args.repeat} timed)",
          flush=True)
    with EmulatedCluster(hosts, args.devices_per_host, args.link_gbit, timeout_s=args.timeout) as cluster:
        rate = cluster.measure_link_rate(0, 1)
        print(f"measured link rate host0 -> host1: {rate / 1e6:.1f} MB/s ({rate * 8 / 1e9:.3f} Gbit/s of TCP payload)",
              flush=True)
        with tempfile.TemporaryDirectory(prefix="meshpar-real-") as out:
            argv = ["-m", "benchmarks.resharding.real_worker", "--out", out, "--link-rate", repr(rate),
                    "--intra-rate", repr(args.intra_rate), "--latency", repr(args.latency),
                    "--mib", repr(args.mib), "--devices-per-host", str(args.devices_per_host),
                    "--repeat", str(args.repeat), "--timeout", repr(args.step_timeout),
                    "--cases", *[c.name for c in cases], "--methods", *[f"{s}/{b}" for s, b in methods]]
            if args.chunks:
                argv += ["--chunks", str(args.chunks)]
            if args.plan_gbit:
                argv += ["--plan-rate", repr(args.plan_gbit * 1e9 / 8 * rate / (args.link_gbit * 1e9 / 8))]
            progress = _Progress(out, cases, methods, hosts, start)
            progress.start()
            try:
                cluster.run(argv, env=_child_env(), timeout_s=args.timeout)
            except ClusterRunError as e:
                errors.append(f"emulated run failed: {e}")
                print(f"ERROR: {e}", file=sys.stderr, flush=True)
            finally:
                progress.stop.set()
                progress.join()
            progress.poll()
            lines = _read_lines(out)
    errors += [f"process {r['process']}: {r['error']}" for r in lines if r.get("kind") == "error"]
    records = aggregate(lines, hosts)
    for r in records:
        r["devices_per_host"] = args.devices_per_host
        r["link_gbit"] = args.link_gbit
    return records, errors


def _run_single_host(args, cases: list[RealCase], start: float) -> tuple[list[dict], list[str]]:
    methods = [("device_put", "-"), OURS]
    print(f"single host: {len(cases)} cases in one process on 8 virtual CPU devices, "
          f"jax.device_put vs meshpar.reshard broadcast/ensemble", flush=True)
    errors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="meshpar-real-") as out:
        cmd = [sys.executable, "-m", "benchmarks.resharding.real_worker", "--single-host", "--out", out,
               "--link-rate", repr(args.intra_rate), "--intra-rate", repr(args.intra_rate),
               "--latency", repr(args.latency), "--mib", repr(args.mib), "--repeat", str(args.repeat),
               "--cases", *[c.name for c in cases]]
        env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
        env.update(_child_env())
        progress = _Progress(out, cases, methods, 1, start)
        progress.start()
        try:
            r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=args.timeout)
            if r.returncode != 0:
                errors.append(f"single-host run failed ({r.returncode}): {r.stderr[-2000:]}")
        except subprocess.TimeoutExpired:
            errors.append(f"single-host run did not finish within {args.timeout:.0f} s")
        finally:
            progress.stop.set()
            progress.join()
        progress.poll()
        lines = _read_lines(out)
    errors += [f"single host: {r['error']}" for r in lines if r.get("kind") == "error"]
    for e in errors:
        print(f"ERROR: {e}", file=sys.stderr, flush=True)
    return aggregate(lines, 1), errors


def machine_busy_cores(seconds: float = 1.0) -> float:
    """Cores the whole machine keeps busy over ``seconds`` (from /proc/stat)."""
    def busy() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        return sum(ticks) - ticks[3] - ticks[4], time.perf_counter()

    try:
        (b0, t0), _ = busy(), time.sleep(seconds)
        b1, t1 = busy()
    except (OSError, ValueError):
        return float("nan")
    return (b1 - b0) / os.sysconf("SC_CLK_TCK") / (t1 - t0)


def run_real(args) -> tuple[list[dict], list[str]]:
    """Runs the selected suites; returns the records and any errors."""
    start = time.perf_counter()
    idle = machine_busy_cores()
    print(f"machine: {os.cpu_count()} cores, {idle:.2f} busy before the run"
          + (" -- NOT IDLE: other load inflates every time below" if idle > 0.25 else ""), flush=True)
    methods = [tuple(m.split("/")) for m in args.methods] if args.methods else list(METHODS)
    suites = args.suites or [*SUITES, "single_host"]
    records: list[dict] = []
    errors: list[str] = []
    emulated = real_cases(args.mib, args.devices_per_host, names=args.cases, suites=[s for s in suites if s in SUITES])
    emulated = emulated if any(s in SUITES for s in suites) else []
    if emulated:
        from benchmarks.emulated_cluster import EmulatedCluster

        ok, why = EmulatedCluster.available()
        if not ok:
            errors.append(f"emulated cluster unavailable: {why}")
            print(f"ERROR: {why}", file=sys.stderr, flush=True)
        else:
            got, errs = _run_emulated(args, emulated, methods, start)
            records += got
            errors += errs
    if "single_host" in suites:
        # Every case name given must exist in some suite; single host has them all.
        single = single_host_cases(args.mib, names=args.cases)
        if single:
            got, errs = _run_single_host(args, single, start)
            records += got
            errors += errs
    return records, errors


# -- reporting ----------------------------------------------------------------


def _by_case(records: Sequence[dict]) -> dict[tuple[str, str], dict[tuple[str, str], dict]]:
    out: dict[tuple[str, str], dict[tuple[str, str], dict]] = {}
    for r in records:
        out.setdefault((r["suite"], r["case"]), {})[(r["strategy"], r["balancer"])] = r
    return out


def table(records: Sequence[dict]) -> str:
    """Markdown: per emulated case, the link lower bound, every method's median / bound, Alpa / ours."""
    methods = [m for m in METHODS if any((r["strategy"], r["balancer"]) == m for r in records)]
    lines = ["| suite | case | meshes | MiB over links | link lower bound (ms) | "
             + " | ".join(f"{s}/{b}" for s, b in methods)
             + " | ours (ms) | Alpa (ms) | Alpa / ours | ours: cores busy (JAX / machine) |",
             "|" + "---|" * (len(methods) + 9)]
    for (suite, case), row in _by_case(records).items():
        if suite == "single_host":
            continue
        any_r = next(iter(row.values()))
        lb = any_r["link_lower_bound_s"]
        cells = []
        for m in methods:
            r = row.get(m)
            cells.append("-" if r is None else f"{r['median_s'] / lb:.2f}x" + ("" if r["verified"] else " (!)"))
        ours, alpa = row.get(OURS), row.get(ALPA)
        fmt = lambda r: f"{r['median_s'] * 1e3:.0f}" if r else "-"  # noqa: E731
        speedup = f"{alpa['median_s'] / ours['median_s']:.2f}x" if ours and alpa else "-"
        cores = f"{ours['cpu_cores']:.1f} / {ours['machine_cores']:.1f}" if ours and "cpu_cores" in ours else "-"
        lines.append(f"| {suite} | {case} | {any_r['src']} -> {any_r['dst']} | {any_r['bytes_moved'] / 2**20:.0f} | "
                     f"{lb * 1e3:.0f} | " + " | ".join(cells) + f" | {fmt(ours)} | {fmt(alpa)} | {speedup} | {cores} |")
    return "\n".join(lines)


def single_host_table(records: Sequence[dict]) -> str:
    lines = ["| case | meshes | MiB | jax.device_put (ms) | reshard broadcast/ensemble (ms) | reshard / device_put |",
             "|---|---|---|---|---|---|"]
    for (suite, case), row in _by_case(records).items():
        if suite != "single_host":
            continue
        put, ours = row.get(("device_put", "-")), row.get(OURS)
        any_r = next(iter(row.values()))
        meshes = f"{any_r['src']} -> {any_r['dst']}" if any_r.get("src") else "-"
        fmt = lambda r: (f"{r['median_s'] * 1e3:.1f}" + ("" if r["verified"] else " (!)")) if r else "-"  # noqa: E731
        ratio = f"{ours['median_s'] / put['median_s']:.2f}x" if put and ours else "-"
        lines.append(f"| {case} | {meshes} | {any_r['tensor_bytes'] / 2**20:.0f} | {fmt(put)} | {fmt(ours)} | {ratio} |")
    return "\n".join(lines)


# Cases where the paper's method should beat Alpa's by at least 1.5x.
_BIG_WIN = ("case3", "case4", "case7", "case8", "case9")


def targets(records: Sequence[dict]) -> list[str]:
    """The benchmark's targets, one line each, met or missed."""
    out = []
    for (suite, case), row in _by_case(records).items():
        ours, alpa = row.get(OURS), row.get(ALPA)
        if suite == "single_host" or ours is None:
            continue
        lb = ours["link_lower_bound_s"]
        ratio = ours["median_s"] / lb
        out.append(f"{'met   ' if ratio <= 1.5 else 'MISSED'} {suite} {case}: broadcast/ensemble {ratio:.2f}x "
                   f"the link lower bound (target <= 1.5x)")
        if alpa is not None:
            speedup = alpa["median_s"] / ours["median_s"]
            want = 1.5 if case in _BIG_WIN else 1.0
            out.append(f"{'met   ' if speedup >= want else 'MISSED'} {suite} {case}: Alpa / ours {speedup:.2f}x "
                       f"(target >= {want:.1f}x)")
    return out
