"""The live-byte meter's peak against the device allocator's own, one process per configuration.

    python -m benchmarks.allocator_peak [--json PATH] [--models large] [--micro-batches 4 8]
        [--layouts one_mesh_interleaved one_mesh_zb_v]

``StepTrace.live_bytes`` (``runtime.live_bytes_meter``) counts the buffers the runtime holds a
reference to after every instruction, plus the running program's temporaries from XLA's memory
analysis. A GPU's allocator counts what it really hands out: ``Device.memory_stats()
["peak_bytes_in_use"]``. JAX cannot reset that peak, so each configuration runs in a process of
its own, which builds the model (``benchmarks.host_overhead``'s), commits its state to the
device, compiles the step, runs one step, drops every other reference to the state, then traces
one step. The allocator's peak spans both steps. Per row:

- ``allocator_after_compile_bytes``: the allocator's peak before any step (the state, the batch,
  and what compiling allocated, e.g. autotuning's scratch);
- ``allocator_peak_bytes``: its peak after the traced step;
- ``meter_peak_bytes``: the meter's peak over the traced step, and its error against the
  allocator's.

``jit_accum`` rows give the allocator's peak of ``jax.jit`` with the same micro-batches (no
meter). CPU devices report no allocator statistics: there the benchmark says so and stops.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from benchmarks.host_overhead import LAYOUTS, MODELS, _jit_accum, _meshpar_step, _model
from benchmarks.worker_records import write_json

_ROW_PREFIX = "allocator_peak row: "


def _peak_in_use() -> int:
    import jax

    return int(jax.devices()[0].memory_stats()["peak_bytes_in_use"])


def measure(model: str, layout: str, num_micro_batches: int) -> dict[str, Any]:
    """One configuration's row, in this process (whose allocator peak must be its own)."""
    import jax

    _, batch, state = _model(model)
    # Committed to the device first: the step would otherwise commit the uncommitted initial state
    # by a copy, and the first step's peak (which the allocator's includes) would hold it twice.
    state = jax.device_put(state, jax.devices()[0])
    step = _jit_accum(num_micro_batches) if layout == "jit_accum" else _meshpar_step(layout, num_micro_batches)
    if layout == "jit_accum":
        step.lower(state, batch).compile()
    else:
        step.compile(state, batch)
    after_compile = _peak_in_use()
    state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
    row = {"model": model, "layout": layout, "num_micro_batches": num_micro_batches,
           "allocator_after_compile_bytes": after_compile}
    if layout == "jit_accum":
        jax.block_until_ready(step(state, batch))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            _, trace = step.trace(os.path.join(tmp, "step.json"), state, batch)
        row["meter_peak_bytes"] = trace.live_bytes.peak_bytes
    row["allocator_peak_bytes"] = _peak_in_use()
    if "meter_peak_bytes" in row:
        row["meter_error"] = row["meter_peak_bytes"] / row["allocator_peak_bytes"] - 1
    return row


def _gb(n: int | None) -> str:
    return "" if n is None else f"{n / 1e9:.2f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | layout | M | allocator after compile GB | allocator peak GB | meter peak GB | meter error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        error = f"{100 * r['meter_error']:+.1f}%" if "meter_error" in r else ""
        lines.append(f"| {r['model']} | {r['layout']} | {r['num_micro_batches']} | "
                     f"{_gb(r['allocator_after_compile_bytes'])} | {_gb(r['allocator_peak_bytes'])} | "
                     f"{_gb(r.get('meter_peak_bytes'))} | {error} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["large"])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["one_mesh_interleaved",
                                                                                  "one_mesh_zb_v"])
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "LAYOUT", "M"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        model, layout, m = args.one
        print(_ROW_PREFIX + json.dumps(measure(model, layout, int(m))), flush=True)
        return 0
    import jax

    if jax.devices()[0].memory_stats() is None:
        print(f"allocator_peak: {jax.devices()[0].platform} devices report no allocator statistics; "
              f"run this on a GPU", flush=True)
        return 0
    for name in args.models:
        bad = [m for m in args.micro_batches if MODELS[name][1] % m]
        if bad:
            parser.error(f"--micro-batches: {bad} do not divide the {name} GPT's batch of {MODELS[name][1]}")
    rows = []
    for name in args.models:
        for layout in ["jit_accum", *args.layouts]:
            for m in args.micro_batches:
                done = subprocess.run([sys.executable, "-m", "benchmarks.allocator_peak", "--one", name, layout,
                                       str(m)], capture_output=True, text=True)
                found = [line for line in done.stdout.splitlines() if line.startswith(_ROW_PREFIX)]
                if done.returncode or not found:
                    print(f"{name} {layout} M={m}: failed (exit {done.returncode})\n{done.stderr[-3000:]}",
                          flush=True)
                    continue
                rows.append(json.loads(found[0][len(_ROW_PREFIX):]))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown(rows))
    if args.json:
        write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
