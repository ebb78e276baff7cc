"""What exact micro-batching's analysis adds to the main job's compile time.

    python -m benchmarks.micro_batching_analysis [--rounds N] [--json PATH]

Each round compiles the main job (``examples.train_gpt``'s step: 2 stages on two (2, 2)
meshes, 4 micro-batches) from a fresh ``meshpar.parallelize`` with ``step.compile`` and times
the whole compile and, inside it, the pass that decides how micro-batches combine
(``exact_micro_batching.micro_batch_step``: the row analysis, the loss rewrite and the hoisting
into the step). JAX's caches are cleared between rounds, so every round compiles every
program. Prints a progress line per round and a markdown table of p50 / p90 / max.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.planner import progress_emitter, save_records
from benchmarks.step_timing import spread_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None, help="write every round's record here")
    args = parser.parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import meshpar
    import meshpar.step_compiler as step_compiler
    from examples.train_gpt import job_devices, main_job, parse_args

    analysis_s: list[float] = []
    timed = step_compiler.micro_batch_step

    def measured(*a, **k):
        start = time.perf_counter()
        try:
            return timed(*a, **k)
        finally:
            analysis_s.append(time.perf_counter() - start)

    # The compiler calls the pass by this module's name for it.
    step_compiler.micro_batch_step = measured
    train_step, method, state, batch = main_job(parse_args([]), job_devices(8))
    records: list[dict] = []
    emit = progress_emitter(records)
    for r in range(args.rounds):
        jax.clear_caches()
        analysis_s.clear()
        start = time.perf_counter()
        meshpar.parallelize(train_step, method=method).compile(state, batch)
        total = time.perf_counter() - start
        emit({"part": "round", "round": r, "compile_s": total, "analysis_s": sum(analysis_s),
              "share": sum(analysis_s) / total})
    compile_ms = spread_ms([rec["compile_s"] for rec in records])
    analysis_ms = spread_ms([rec["analysis_s"] for rec in records])
    # spread_ms scales by 1e3: a share of 1 reads 1000, so / 10 gives per cent.
    share = spread_ms([rec["share"] for rec in records])
    print("\n| | p50 | p90 | max |\n|---|---|---|---|")
    print(f"| main job's compile (ms) | {compile_ms['p50_ms']:.0f} | {compile_ms['p90_ms']:.0f} | "
          f"{compile_ms['max_ms']:.0f} |")
    print(f"| micro-batching analysis (ms) | {analysis_ms['p50_ms']:.1f} | {analysis_ms['p90_ms']:.1f} | "
          f"{analysis_ms['max_ms']:.1f} |")
    print(f"| analysis / compile (%) | {share['p50_ms'] / 10:.2f} | {share['p90_ms'] / 10:.2f} | "
          f"{share['max_ms'] / 10:.2f} |")
    save_records(args.json, records)


if __name__ == "__main__":
    main()
