"""Pipeline boundary transfers in one process against plain ``jax.device_put``.

    python -m benchmarks.boundary_transfers [--repeat N] [--json PATH]

One process, 8 virtual CPU devices. Compiles the main job's GPT pipeline
((data, model, pipeline) = (2, 2, 2), 4 micro-batches) and, for every
boundary value in both directions, times, in one run and interleaved:

- ``boundary``: the move the pipeline prepared at compile time (what a step
  runs per micro-batch),
- ``device_put``: ``jax.device_put`` of the same value onto the same sharding,
- ``p2p``: the same move forced through the p2p executor (for reference).

Each sample is one move plus ``block_until_ready`` of a freshly computed
source (so no call can alias a previous result), the methods' order rotating
from sample to sample; medians over ``--repeat`` samples. Target: ``boundary / device_put <= 1.1``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.boundary_transfers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=200, help="samples per method and value")
    p.add_argument("--batch", type=int, default=64, help="global batch size (activations scale with it)")
    p.add_argument("--json", default=None, help="write the records here")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> list[dict]:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    import numpy as np
    import optax
    from flax.training import train_state

    import meshpar
    from examples.gpt import GPT, gpt_batch, gpt_loss
    from examples.train_step import supervised_step
    from meshpar.reshard import prepare_reshard

    model = GPT(num_stages=2)
    batch = gpt_batch(0, args.batch, 8, 64)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

    parallel = meshpar.parallelize(supervised_step(gpt_loss), method=meshpar.PipeshardParallel(
        num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2)))
    executable = parallel.get_executable(state, batch)
    records = []
    for transfer, move in zip(executable.program.transfers, executable.transfer_moves):
        aval, direction = jax.ShapeDtypeStruct(transfer.shape, transfer.dtype), transfer.direction.value
        src, dst = transfer.src, transfer.dst
        p2p, _ = prepare_reshard(aval.shape, aval.dtype, src, dst, executor="p2p")
        fresh = jax.jit(lambda v: v + 1.0, out_shardings=src)
        value = jax.device_put(np.ones(aval.shape, aval.dtype), src)
        methods = {"boundary": move, "device_put": lambda v, d=dst: jax.device_put(v, d), "p2p": p2p}
        for fn in methods.values():
            jax.block_until_ready(fn(fresh(value)))
        times: dict[str, list[float]] = {m: [] for m in methods}
        names = list(methods)
        for k in range(args.repeat):
            # Rotate who goes first: no method always runs on a cold cache.
            for name in names[k % 3:] + names[:k % 3]:
                fn = methods[name]
                x = fresh(value).block_until_ready()
                t0 = time.perf_counter()
                fn(x).block_until_ready()
                times[name].append(time.perf_counter() - t0)
        record = {"value": f"{direction} of edge {transfer.edge} {transfer.dtype.name}{list(transfer.shape)}", "bytes": int(np.prod(aval.shape)) * aval.dtype.itemsize,
                  **{f"{m}_median_s": statistics.median(t) for m, t in times.items()}}
        record["boundary_over_device_put"] = record["boundary_median_s"] / record["device_put_median_s"]
        records.append(record)
        print(f"[boundary_transfers] {record['value']}: boundary {record['boundary_median_s'] * 1e6:.0f} us, "
              f"device_put {record['device_put_median_s'] * 1e6:.0f} us, p2p {record['p2p_median_s'] * 1e6:.0f} us "
              f"(boundary/device_put {record['boundary_over_device_put']:.2f})", flush=True)
    return records


def table(records: list[dict]) -> str:
    lines = ["| value | bytes | boundary (us) | jax.device_put (us) | p2p executor (us) | boundary / device_put |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['value']} | {r['bytes']} | {r['boundary_median_s'] * 1e6:.0f} | "
                     f"{r['device_put_median_s'] * 1e6:.0f} | {r['p2p_median_s'] * 1e6:.0f} | "
                     f"{r['boundary_over_device_put']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    records = run(args)
    print(table(records))
    worst = max(r["boundary_over_device_put"] for r in records)
    print(f"target boundary/device_put <= 1.1: {'met' if worst <= 1.1 else 'missed'} (worst {worst:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
