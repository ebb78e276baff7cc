"""Time to the first step, against ``jax.jit``'s first call of the same step, and where it goes.

    python -m benchmarks.first_step [--rounds N] [--jobs main,stages8] [--caches off,cold,warm]
        [--trees NAME=DIR,...] [--json PATH]

Each measurement runs in a fresh Python process (so nothing is cached in memory), 8 CPU devices:

- ``main``: the main job (``examples.train_gpt``'s ``main_job``: a 105k-parameter GPT, 2 stages
  on two (2, 2) meshes, 4 micro-batches, Adam with global-norm clipping);
- ``stages8``: the same step on a 16-layer GPT cut into 8 stages, one device each, 8
  micro-batches;

and, for each, ``jax.jit`` of the same step on one device. Time to first step: from
``meshpar.parallelize(...)`` (``jax.jit(...)``) to the first call's outputs being ready
(tracing, planning, every compile, placing the state, running the step).

With JAX's persistent compilation cache (``jax_compilation_cache_dir``) ``off``, ``cold`` (a
fresh empty directory) and ``warm`` (the cold run's directory again, in a new process). With the
cache on, ``jax_persistent_cache_min_compile_time_secs`` is set to 0 (``--min-compile-time``):
JAX's default (1 s) writes no program compiling faster than that, which is every stage program
of these jobs.

Where the time goes (meshpar, wall clock, each phase timed by wrapping the function that does
it; XLA compile seconds, summed over compiles as ``jax.monitoring`` reports them, attributed to
the phase they ran in, so they exceed the wall clock where compiles run side by side):
``trace``: tracing the step and the pass pipeline (``compile_step`` less the executable);
``transfers``: preparing the moves (``prepare_move``: transfer programs compile there, unless the
executable compiles them ahead); ``executable``: the rest of building ``PipelineExecutable``;
``compile_ahead``: the programs compiled before anything runs; ``first_run``: the first
call's own work (placing the state, programs not compiled ahead, running the step).

``--trees`` measures meshpar from several copies of the repository (a before and an after),
interleaved within each round so that each sees the same load. Each record also has ``cpu_s``,
every thread's CPU seconds over the measurement (over ``total_s``: the cores kept busy).

Prints a progress line per measurement and markdown tables of p50 / p90 / max.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks.planner import progress_emitter, save_records
from benchmarks.step_timing import spread_ms

JOBS = ("main", "stages8")
CACHES = ("off", "cold", "warm")
PHASES = ("trace", "transfers", "executable", "compile_ahead", "first_run")


def _job(name: str):
    """``(train_step, method, state, batch)`` of job ``name`` on 8 devices."""
    from examples.train_gpt import job_devices, main_job, parse_args

    devices = job_devices(8)
    if name == "main":
        return main_job(parse_args([]), devices)
    import meshpar
    from examples import gpt as gpt_module

    # The main job's step and recipe on a 16-layer GPT, 8 stages of one device each.
    real_gpt = gpt_module.GPT
    gpt_module.GPT = lambda num_stages, scan_layers: real_gpt(num_stages=8, num_layers=16, scan_layers=scan_layers)
    try:
        train_step, method, state, batch = main_job(parse_args(["--micro-batches", "8"]), devices)
    finally:
        gpt_module.GPT = real_gpt
    method = meshpar.PipeshardParallel(num_micro_batches=8, num_stages=8, stage_mesh_shape=(1, 1),
                                       schedule="1f1b", devices=devices)
    return train_step, method, state, batch


def _child(job: str, runner: str, cache: str | None, min_compile_time: float) -> dict:
    """One measurement in this (fresh) process."""
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    if cache is not None:
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_time)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    from jax import monitoring

    import meshpar
    import meshpar.runtime.pipeline_executor as executor_module

    # ``meshpar.parallelize`` is the function; its module is in sys.modules.
    parallelize_module = sys.modules["meshpar.parallelize"]

    phase = ["outside"]
    wall: dict[str, float] = {}
    compile_s: dict[str, float] = {}
    compiles: dict[str, int] = {}
    events: dict[str, int] = {}
    programs: list[tuple[str, str, float]] = []

    def on_duration(event: str, duration: float, fun_name: str = "?", **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and phase[0] != "outside":
            programs.append((phase[0], fun_name, round(duration, 4)))
            compile_s[phase[0]] = compile_s.get(phase[0], 0.0) + duration
            compiles[phase[0]] = compiles.get(phase[0], 0) + 1

    def on_event(event: str, **_: object) -> None:
        if event.startswith("/jax/compilation_cache/") and phase[0] != "outside":
            key = event.rsplit("/", 1)[1]
            events[key] = events.get(key, 0) + 1

    monitoring.register_event_duration_secs_listener(on_duration)
    monitoring.register_event_listener(on_event)

    def timed(name: str, fn):
        def call(*a, **k):
            outer, phase[0] = phase[0], name
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                wall[name] = wall.get(name, 0.0) + time.perf_counter() - start
                phase[0] = outer

        return call

    if runner == "meshpar":
        parallelize_module.compile_step = timed("compile_step", parallelize_module.compile_step)
        executor_module.prepare_move = timed("transfers", executor_module.prepare_move)
        cls = executor_module.PipelineExecutable
        cls.__init__ = timed("executable_all", cls.__init__)
        cls.compile_ahead = timed("compile_ahead", cls.compile_ahead)

    train_step, method, state, batch = _job(job)
    n_params = sum(x.size for x in jax.tree.leaves(state.params))
    phase[0] = "first_run"
    cpu = os.times()
    start = time.perf_counter()
    if runner == "meshpar":
        step = meshpar.parallelize(train_step, method=method)
    else:
        step = jax.jit(train_step)
    out = step(state, batch)
    jax.block_until_ready(out)
    total = time.perf_counter() - start
    cpu_end = os.times()
    record = {"job": job, "runner": runner, "cache": "off" if cache is None else "?", "total_s": total,
              "params": int(n_params), "compiles": sum(compiles.values()),
              # Every thread's CPU time over the measurement: / total_s, the cores it kept busy.
              "cpu_s": cpu_end.user + cpu_end.system - cpu.user - cpu.system,
              "compile_sum_s": sum(compile_s.values()), "programs": programs,
              **{f"cache_{k}": v for k, v in events.items()}}
    if runner == "meshpar":
        # Exclusive wall times: the executable is built inside compile_step, transfers inside it.
        executable = wall.get("executable_all", 0.0)
        phases = {"trace": wall.get("compile_step", 0.0) - executable,
                  "transfers": wall.get("transfers", 0.0),
                  "executable": executable - wall.get("transfers", 0.0),
                  "compile_ahead": wall.get("compile_ahead", 0.0)}
        phases["first_run"] = total - sum(phases.values())
        # Compile seconds per phase (the executable's own and its transfers' under their names).
        by_phase = {"trace": compile_s.get("compile_step", 0.0), "transfers": compile_s.get("transfers", 0.0),
                    "executable": compile_s.get("executable_all", 0.0),
                    "compile_ahead": compile_s.get("compile_ahead", 0.0),
                    "first_run": compile_s.get("first_run", 0.0)}
        counts = {"trace": compiles.get("compile_step", 0), "transfers": compiles.get("transfers", 0),
                  "executable": compiles.get("executable_all", 0),
                  "compile_ahead": compiles.get("compile_ahead", 0), "first_run": compiles.get("first_run", 0)}
        for p in PHASES:
            record[f"{p}_s"] = phases[p]
            record[f"{p}_compile_s"] = by_phase[p]
            record[f"{p}_compiles"] = counts[p]
        executable_obj = step.get_executable(state, batch)
        record["compiled_ahead"] = getattr(executable_obj, "compiled_ahead", None)
    return record


def _measure(job: str, runner: str, cache: str | None, min_compile_time: float, tree: str | None = None,
             env: dict[str, str] | None = None) -> dict:
    """``_child`` in a fresh Python process; with ``tree``, run from that copy of the repository
    (laid out as installed: ``meshpar/passes``, ``meshpar/runtime``), under ``env``'s additions."""
    command = [sys.executable, "-m", "benchmarks.first_step", "--child", f"{job}:{runner}",
               "--min-compile-time", str(min_compile_time)]
    if cache is not None:
        command += ["--cache-dir", cache]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env or {})}
    if tree is not None:
        env["PYTHONPATH"] = tree
    done = subprocess.run(command, capture_output=True, text=True, env=env, check=False, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                           f"{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, of {JOBS}")
    parser.add_argument("--caches", default=",".join(CACHES),
                        help=f"comma-separated, of {CACHES} (warm runs after cold, on its directory)")
    parser.add_argument("--runners", default="meshpar,jit")
    parser.add_argument("--min-compile-time", type=float, default=0.0,
                        help="jax_persistent_cache_min_compile_time_secs with the cache on")
    parser.add_argument("--trees", default=None,
                        help="NAME=DIR,...: measure meshpar from each copy of the repository (laid out as installed: "
                             "passes/ and runtime/ moved into meshpar/), interleaved within each round, so a "
                             "before and an after see the same load; NAME=DIR:VAR=VALUE sets an environment "
                             "variable for that one (e.g. MESHPAR_COMPILE_THREADS=1)")
    parser.add_argument("--json", default=None, help="write every measurement's record here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        job, runner = args.child.split(":")
        print("RESULT " + json.dumps(_child(job, runner, args.cache_dir, args.min_compile_time)), flush=True)
        return

    jobs, caches, runners = args.jobs.split(","), args.caches.split(","), args.runners.split(",")
    # (name, directory or None for this one, environment additions)
    trees: list[tuple[str, str | None, dict[str, str]]] = [("this", None, {})]
    if args.trees:
        trees = []
        for spec in args.trees.split(","):
            name, rest = spec.split("=", 1)
            directory, *assignments = rest.split(":")
            trees.append((name, os.path.abspath(directory), dict(a.split("=", 1) for a in assignments)))
    records: list[dict] = []
    emit = progress_emitter(records)
    for r in range(args.rounds):
        for job in jobs:
            for runner in runners:
                # jax.jit runs the same from any copy: once, from the first.
                for name, tree, env in (trees if runner == "meshpar" else trees[:1]):
                    directory = tempfile.mkdtemp(prefix="meshpar-first-step-")
                    try:
                        for cache in caches:
                            if cache == "cold":
                                shutil.rmtree(directory)
                                os.mkdir(directory)
                            record = _measure(job, runner, None if cache == "off" else directory,
                                              args.min_compile_time, tree, env)
                            record.update(part="first_step", round=r, cache=cache, load=_load(),
                                          tree=name if runner == "meshpar" else "-")
                            if cache != "off":
                                record["cache_files"] = len(os.listdir(directory))
                            emit(record)
                    finally:
                        shutil.rmtree(directory, ignore_errors=True)
    print(summary(records))
    save_records(args.json, records)


def summary(records: list[dict]) -> str:
    """Markdown: per job, cache and copy of meshpar, meshpar's and jax.jit's time to first step
    and their ratio (p50 / p90 / max over rounds, each round's meshpar over that round's jax.jit);
    then where meshpar's time went (p50 per phase)."""
    lines = ["| job | cache | meshpar | meshpar s (p50 / p90 / max) | jax.jit s (p50 / p90 / max) "
             "| ratio (p50 / p90 / max) |", "|---|---|---|---|---|---|"]
    trees = list(dict.fromkeys(r.get("tree", "this") for r in records if r["runner"] == "meshpar"))
    keys = sorted({(r["job"], r["cache"]) for r in records}, key=lambda k: (k[0], CACHES.index(k[1])))

    def spread(values: list[float], fmt: str = "{:.1f}") -> str:
        s = spread_ms(values)
        return " / ".join(fmt.format(s[k] / 1e3) for k in ("p50_ms", "p90_ms", "max_ms"))

    for job, cache in keys:
        jit = {r["round"]: r["total_s"] for r in records
               if r["job"] == job and r["cache"] == cache and r["runner"] == "jit"}
        for tree in trees:
            ours = {r["round"]: r["total_s"] for r in records if r["job"] == job and r["cache"] == cache
                    and r["runner"] == "meshpar" and r.get("tree", "this") == tree}
            ratios = [ours[k] / jit[k] for k in ours if k in jit]
            lines.append(f"| {job} | {cache} | {tree} | {spread(list(ours.values())) if ours else '-'} | "
                         f"{spread(list(jit.values())) if jit else '-'} | "
                         f"{spread(ratios, '{:.2f}') if ratios else '-'} |")
    lines += ["", "meshpar's phases, p50 s wall (XLA compile s summed, compiles):", "",
              "| job | cache | meshpar | " + " | ".join(PHASES) + " | total | compiles | cache hits |",
              "|---|---|---|" + "---|" * (len(PHASES) + 3)]
    for job, cache in keys:
        for tree in trees:
            rows = [r for r in records if r["job"] == job and r["cache"] == cache and r["runner"] == "meshpar"
                    and r.get("tree", "this") == tree]
            if not rows:
                continue

            def p50(key: str) -> float:
                return spread_ms([r.get(key, 0) for r in rows])["p50_ms"] / 1e3

            cells = [f"{p50(f'{p}_s'):.2f} ({p50(f'{p}_compile_s'):.2f}, {p50(f'{p}_compiles'):.0f})"
                     for p in PHASES]
            lines.append(f"| {job} | {cache} | {tree} | " + " | ".join(cells) +
                         f" | {p50('total_s'):.2f} | {p50('compiles'):.0f} | {p50('cache_cache_hits'):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
