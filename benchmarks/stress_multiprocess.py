"""Runs a multi-process test worker many times in a row and counts hangs: the stress run of issue 42.

    python -m benchmarks.stress_multiprocess [--runs 50] [--worker mp_four_worker.py] [--processes 4]
        [--limit-s 600] [--keep DIR] [--json PATH]

Each run starts ``tests/<worker> PID NPROC PORT`` in ``--processes`` local processes, as
``tests/multiprocess/test_multiprocess.py`` does, and waits at most ``--limit-s``. A run *passed* when every
process exited 0 having printed ``ALL OK``; *failed* when one exited otherwise (the workers' own
timeouts end a deadlock with a named error, so a deadlock shows here as a failure); *hung* when a
process was still running at the limit: then every live process's threads are dumped with
``gdb`` (when installed) before the run is killed. Every run's output is kept under ``--keep``
(default: a fresh temporary directory, printed). Prints a progress line per run and a markdown
table: runs, passed, failed, hung, and each run's wall time (p50, p90, max).
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from benchmarks.planner import progress_emitter, save_records
from benchmarks.step_timing import spread_ms

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TESTS = os.path.join(_REPO, "tests")
_WORKERS = os.path.join(_TESTS, "multiprocess")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dump_threads(pid: int, path: str) -> None:
    """Every thread's native stack of process ``pid`` into ``path``, with gdb if it is installed."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return
    with open(path, "w") as out:
        subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt"], stdout=out,
                       stderr=subprocess.STDOUT, timeout=120, check=False)


def run_once(worker: str, processes: int, limit_s: float, directory: str) -> dict:
    """One run of ``worker`` in ``processes`` processes, its outputs in ``directory``.

    Returns:
      ``{"outcome": "passed" | "failed" | "hung", "wall_s": float, "returncodes": [int | None]}``.
    """
    os.makedirs(directory, exist_ok=True)
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([_TESTS, _REPO, env.get("PYTHONPATH", "")])
    logs = [os.path.join(directory, f"process{i}.log") for i in range(processes)]
    start = time.monotonic()
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen([sys.executable, os.path.join(_WORKERS, worker), str(i), str(processes),
                                           port], stdout=out, stderr=subprocess.STDOUT, env=env))
    hung = False
    try:
        for p in procs:
            p.wait(timeout=max(0.0, limit_s - (time.monotonic() - start)))
    except subprocess.TimeoutExpired:
        hung = True
        for i, p in enumerate(procs):
            if p.poll() is None:
                _dump_threads(p.pid, os.path.join(directory, f"process{i}.threads.txt"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    wall = time.monotonic() - start
    codes = [None if hung and p.returncode < 0 else p.returncode for p in procs]
    passed = not hung and all(
        p.returncode == 0 and f"process {i}: ALL OK" in open(log).read() for i, (p, log) in enumerate(zip(procs, logs)))
    return {"outcome": "hung" if hung else "passed" if passed else "failed", "wall_s": wall, "returncodes": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--worker", default="mp_four_worker.py", help="a worker script in tests/")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--limit-s", type=float, default=600.0, help="a run still going after this is a hang")
    parser.add_argument("--keep", default=None, help="directory for every run's output")
    parser.add_argument("--json", default=None, help="write every run's record here")
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(_WORKERS, args.worker)):
        parser.error(f"--worker: no {args.worker} in {_WORKERS}")
    keep = args.keep or tempfile.mkdtemp(prefix="meshpar-stress-")
    print(f"keeping every run's output under {keep}", flush=True)
    records: list[dict] = []
    emit = progress_emitter(records)
    for r in range(args.runs):
        result = run_once(args.worker, args.processes, args.limit_s, os.path.join(keep, f"run{r:03d}"))
        emit({"part": "run", "run": r, **result})
    outcomes = [rec["outcome"] for rec in records]
    wall = spread_ms([rec["wall_s"] for rec in records])
    print(f"\n| worker | processes | runs | passed | failed | hung | wall p50 (s) | p90 | max |\n"
          f"|---|---|---|---|---|---|---|---|---|\n"
          f"| {args.worker} | {args.processes} | {len(records)} | {outcomes.count('passed')} | "
          f"{outcomes.count('failed')} | {outcomes.count('hung')} | {wall['p50_ms'] / 1e3:.1f} | "
          f"{wall['p90_ms'] / 1e3:.1f} | {wall['max_ms'] / 1e3:.1f} |")
    save_records(args.json, records)


if __name__ == "__main__":
    main()
