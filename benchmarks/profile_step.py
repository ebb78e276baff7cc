"""Where a pipelined step's host time goes: cProfile over steps of one ``benchmarks.host_overhead``
configuration.

    python -m benchmarks.profile_step [--model tiny] [--layout one_mesh_interleaved]
        [--micro-batches 8] [--steps 20] [--top 30] [--dispatch | --handlers | --launches]

Builds the step as ``benchmarks.host_overhead`` does, runs two untimed steps (compiles), then
profiles ``--steps`` steps, each to its outputs being ready. Prints the wall ms per step, then
the ``--top`` functions by their own time and by cumulative time, per step. JAX's compiled
calls are C++ (``PjitFunction``): their own time is JAX's dispatch, including, on a GPU, the
launch of the program's kernels; what sits around them is meshpar's.

``--dispatch``: instead, per stage program (the first launch of each of its jitted functions,
kept with its operands), the µs a call costs through meshpar's launch wrapper
(``runtime.stage_executables.on_mesh``) against JAX's own call of the same compiled function
with the same operands, both in one loop of ``--calls`` calls waited for at its end. Programs
whose operands a launch donates are skipped (a second call would read deleted buffers).

``--handlers``: instead, no profiler: per step-instruction kind, the wall µs per step its handler
takes and the CPU µs the Python thread spends in it (``time.thread_time``: on a CPU backend the
programs the step launched run on the same cores meanwhile, and the wall time also counts the
time the thread waits for a core; ``runtime.step_handlers``: each kind's ``run`` timed as
registered), the executable's whole call, the argument cache key (``meshpar.parallelize._signatures`` and the lookup), and the rest
of the call outside the executable (flattening the arguments and unflattening the outputs, as
``jax.jit`` does too). The host work the issue names (placing inputs, assembling and sharing
outputs, combining micro-batches, the cache key) is summed on its own line; ``RunPipeline``
holds the pipeline's programs and waits, and the feeds and moves their launches.

``--launches``: instead, per stage program (by its jitted function's name), the wall and CPU
µs one launch takes inside real steps (``--steps`` of them, after two untimed), in alternating
rounds: as the step launches it, its operands possibly still being computed, and with every
operand made ready first (the wait not counted). Tells JAX's dispatch in a step (one program
after another) from waiting on the device: ``--dispatch`` times one program in a tight loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import cProfile
import io
import pstats
import sys
import time

from benchmarks.host_overhead import LAYOUTS, MODELS, _jit_accum, _meshpar_step, _model
from benchmarks.step_timing import spread_ms


def _wrap_launches(launch_with) -> None:
    """Wraps ``on_mesh`` so that every stage program's launch runs as ``launch_with(run, fn,
    operands)``: ``run`` is meshpar's launch of the jitted ``fn``."""
    from meshpar.runtime import stage_executables

    wrap = stage_executables.on_mesh

    def wrapping(fn, mesh, timeout_s):
        run = wrap(fn, mesh, timeout_s)

        def launch(*operands):
            return launch_with(run, fn, operands)

        launch.jitted, launch.mesh, launch.temp_bytes = run.jitted, run.mesh, run.temp_bytes
        return launch

    stage_executables.on_mesh = wrapping


def _record_launches() -> dict[str, tuple]:
    """Keeps each stage program's first launch: name -> (meshpar's launch, the jitted function,
    its mesh, the operands)."""
    launches: dict[str, tuple] = {}
    seen: set[int] = set()

    def recording(run, fn, operands):
        if id(fn) not in seen:
            seen.add(id(fn))
            launches[f"{getattr(fn, '__name__', fn)} #{len(launches)}"] = (run, fn, run.mesh, operands)
        return run(*operands)

    _wrap_launches(recording)
    return launches


def _time_dispatch(launches: dict[str, tuple], calls: int) -> None:
    import jax

    def per_call_us(call) -> float:
        jax.block_until_ready(call())
        start = time.perf_counter()
        for _ in range(calls - 1):
            call()
        jax.block_until_ready(call())
        return 1e6 * (time.perf_counter() - start) / calls

    print("| program | operands | meshpar's launch µs | JAX's call µs | ratio |\n|---|---|---|---|---|")
    for name, (run, fn, mesh, operands) in launches.items():
        leaves = jax.tree.leaves(operands)
        if any(isinstance(a, jax.Array) and a.is_deleted() for a in leaves):
            continue
        try:
            ours = per_call_us(lambda: run(*operands))
            with jax.set_mesh(mesh):
                theirs = per_call_us(lambda: fn(*operands))
        except (ValueError, RuntimeError) as e:  # donated by the first timed call
            print(f"| {name} | {len(leaves)} | skipped: {str(e).splitlines()[0][:80]} | | |")
            continue
        print(f"| {name} | {len(leaves)} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f} |", flush=True)


def _time_launches() -> tuple[dict, list[tuple[bool, str, float, float]]]:
    """Times each launch of a stage program (wall and the thread's CPU seconds): returns the
    switch (``["ready"]``: make the operands ready first) and the samples ``(ready, program name,
    wall s, CPU s)``."""
    import jax

    mode = {"ready": False}
    samples: list[tuple[bool, str, float, float]] = []

    def timing(run, fn, operands):
        if mode["ready"]:
            jax.block_until_ready(operands)
        start, cpu = time.perf_counter(), time.thread_time()
        out = run(*operands)
        samples.append((mode["ready"], getattr(fn, "__name__", "program"), time.perf_counter() - start,
                        time.thread_time() - cpu))
        return out

    _wrap_launches(timing)
    return mode, samples


def _report_launches(samples: list[tuple[bool, str, float, float]]) -> None:
    print("| program | operands | launches | wall µs p50 / p90 | CPU µs p50 / p90 |\n|---|---|---|---|---|")
    for name in dict.fromkeys(n for _, n, _, _ in samples):
        for ready in (False, True):
            mine = [(w, c) for r, n, w, c in samples if n == name and r == ready]
            if not mine:
                continue
            wall, cpu = (spread_ms([m[k] for m in mine]) for k in (0, 1))
            print(f"| {name} | {'ready' if ready else 'as launched'} | {len(mine)} | "
                  f"{1e3 * wall['p50_ms']:.0f} / {1e3 * wall['p90_ms']:.0f} | "
                  f"{1e3 * cpu['p50_ms']:.0f} / {1e3 * cpu['p90_ms']:.0f} |")


# The kinds whose handlers are the step's fixed host work outside the programs (issue 43).
FIXED_HOST_WORK = ("PlaceInputs", "AssembleOutputs", "ShareOutputs", "CombineMicroBatches")


def _time_handlers() -> tuple[dict[str, list[tuple[float, float]]], list[float]]:
    """Wraps every registered step handler, the argument cache key and the executable's call with
    timers: kind name (and ``cache key``) -> per call, its wall seconds and the calling thread's
    CPU seconds (``time.thread_time``); and the executable's wall seconds per call."""
    import importlib

    from meshpar.runtime import pipeline_executor
    from meshpar.runtime.step_handlers import STEP_HANDLERS
    spent: dict[str, list[tuple[float, float]]] = {}
    for kind, handler in list(STEP_HANDLERS.items()):
        def timed(ex, ins, ready, state, run=handler.run, name=kind.__name__):
            start, cpu = time.perf_counter(), time.thread_time()
            run(ex, ins, ready, state)
            spent.setdefault(name, []).append((time.perf_counter() - start, time.thread_time() - cpu))

        STEP_HANDLERS[kind] = dataclasses.replace(handler, run=timed)
    parallelize = importlib.import_module("meshpar.parallelize")  # the module, not the function
    signatures = parallelize._signatures

    def timed_key(*args):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return signatures(*args)
        finally:
            spent.setdefault("cache key", []).append((time.perf_counter() - start, time.thread_time() - cpu))

    parallelize._signatures = timed_key
    calls: list[float] = []
    call = pipeline_executor.PipelineExecutable.__call__

    def timed_call(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(self, *args, **kwargs)
        finally:
            calls.append(time.perf_counter() - start)

    pipeline_executor.PipelineExecutable.__call__ = timed_call
    return spent, calls


def _report_handlers(spent: dict[str, list[tuple[float, float]]], calls: list[float], totals: list[float],
                     steps: int) -> None:
    """Per kind, wall and CPU µs per step over the last ``steps`` steps (each kind may run several
    times a step)."""
    def per_step(samples: list[tuple[float, float]], per: int, which: int) -> float:
        return 1e6 * sum(s[which] for s in samples[-per * steps:]) / steps

    runs = len(calls)
    key_samples = spent.pop("cache key")
    key = [per_step(key_samples, 1, w) for w in (0, 1)]
    print("| handler | calls per step | wall µs per step | CPU µs per step |\n|---|---|---|---|")
    for name in sorted(spent, key=lambda n: -per_step(spent[n], len(spent[n]) // runs, 0)):
        per = len(spent[name]) // runs
        print(f"| {name} | {per} | {per_step(spent[name], per, 0):.0f} | {per_step(spent[name], per, 1):.0f} |")
    fixed = [sum(per_step(spent[n], len(spent[n]) // runs, w) for n in FIXED_HOST_WORK if n in spent) + key[w]
             for w in (0, 1)]
    outside = 1e6 * (sum(totals[-steps:]) - sum(calls[-steps:])) / steps - key[0]
    print(f"| the executable's call | 1 | {1e6 * sum(calls[-steps:]) / steps:.0f} | |")
    print(f"| the argument cache key (signatures of the leaves) | 1 | {key[0]:.0f} | {key[1]:.0f} |")
    print(f"| the rest outside the executable (flatten, lookup, unflatten) | 1 | {outside:.0f} | |")
    print(f"| fixed host work: {', '.join(FIXED_HOST_WORK)}, the cache key | | {fixed[0]:.0f} | {fixed[1]:.0f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--layout", choices=["jit_accum", *sorted(LAYOUTS)], default="one_mesh_interleaved")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--dispatch", action="store_true", help="time launches against JAX's own calls")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--handlers", action="store_true", help="time each step handler, no profiler")
    parser.add_argument("--launches", action="store_true",
                        help="time each stage program's launches in real steps, operands as launched and ready")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected a positive number of steps, got {args.steps}")
    if args.calls < 2:
        parser.error(f"--calls: expected at least 2 calls per program (a loop is timed), got {args.calls}")
    if MODELS[args.model][1] % args.micro_batches:
        parser.error(f"--micro-batches: {args.micro_batches} does not divide the {args.model} GPT's batch "
                     f"of {MODELS[args.model][1]}")
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    if args.handlers and args.layout == "jit_accum":
        parser.error("--handlers: jit_accum runs no step handler; pick a meshpar layout")
    if args.launches and args.layout == "jit_accum":
        parser.error("--launches: jit_accum launches one program of its own; pick a meshpar layout")
    launches = _record_launches() if args.dispatch else None
    launch_timer = _time_launches() if args.launches else None
    timers = _time_handlers() if args.handlers else None
    _, batch, state = _model(args.model)
    step = _jit_accum(args.micro_batches) if args.layout == "jit_accum" \
        else _meshpar_step(args.layout, args.micro_batches)
    for _ in range(2):
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
    if launches is not None:
        _time_dispatch(launches, args.calls)
        return 0
    if launch_timer is not None:
        mode, samples = launch_timer
        samples.clear()
        for round_ in range(4):  # alternating, so that both see the same machine
            mode["ready"] = bool(round_ % 2)
            for _ in range(max(1, args.steps // 2)):
                state, loss = step(state, batch)
                jax.block_until_ready((state, loss))
        print(f"{args.model} {args.layout} M={args.micro_batches} on {jax.devices()[0].platform}: "
              f"per launch, {2 * max(1, args.steps // 2)} steps each way")
        _report_launches(samples)
        return 0
    if timers is not None:
        totals = []
        for _ in range(args.steps):
            start = time.perf_counter()
            state, loss = step(state, batch)
            totals.append(time.perf_counter() - start)
            jax.block_until_ready((state, loss))
        print(f"{args.model} {args.layout} M={args.micro_batches} on {jax.devices()[0].platform}: "
              f"{1e3 * sum(totals) / args.steps:.1f} ms a call, not waiting for the outputs ({args.steps} steps)")
        _report_handlers(*timers, totals, args.steps)
        return 0
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for _ in range(args.steps):
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
    profile.disable()
    wall = time.perf_counter() - start
    print(f"{args.model} {args.layout} M={args.micro_batches} on {jax.devices()[0].platform}: "
          f"{1e3 * wall / args.steps:.1f} ms a step under the profiler ({args.steps} steps)")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(order).print_stats(args.top)
        print(f"--- by {order} (seconds over {args.steps} steps)\n" + text.getvalue().split("\n\n", 1)[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
