"""Stacked layers cut into stages: parameter and optimizer bytes per device, and what holding
the stacks as per-stage pieces costs per step.

    python -m benchmarks.scanned_stages [--json PATH] [--steps N] [--layers L]

A GPT whose blocks are one ``nn.scan`` (Adam after global-norm clipping) on 8 virtual CPU
devices in one process, each stage mesh one device:

- ``uncut``: the step under ``jax.jit`` on one device, the reference for bytes per device;
- ``scan 4 stages`` / ``scan 4 + 4``: the scan cut evenly; the stacks come back as one array
  over the stage devices (no copy);
- ``scan 3 + 5``: cut unevenly; the stacks are gathered on the first mesh and cut again every
  step (moves);
- ``markers 4 + 4``: the same GPT with its blocks written one by one and a marker between
  them: no stacked leaves at all, the baseline for the step time.

Per row: the largest bytes of parameters and optimizer state on one device after a step
(``addressable_shards`` of the returned state), its ratio to the uncut step's, p50 / p90 /
max of ``--steps`` steps, and the seconds per step spent splitting the stacks into pieces
and joining them back (timed around ``StackedLeaves.split`` and ``join``, inside the step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np

from benchmarks.worker_records import write_json

DEVICES = 8


def _bytes_per_device(tree: Any) -> dict[int, int]:
    import jax

    per_device: dict[int, int] = {}
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per_device[shard.device.id] = per_device.get(shard.device.id, 0) + shard.data.nbytes
    return per_device


def _state(model: Any, batch: dict) -> Any:
    import jax
    import optax
    from flax.training import train_state

    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


class _Timed:
    """Wraps a ``StackedLeaves`` to add the seconds its split and join take."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def split(self, *args: Any) -> Any:
        start = time.perf_counter()
        out = self.inner.split(*args)
        self.seconds += time.perf_counter() - start
        return out

    def join(self, *args: Any) -> Any:
        import jax

        start = time.perf_counter()
        out = jax.block_until_ready(self.inner.join(*args))
        self.seconds += time.perf_counter() - start
        return out


def run(args: argparse.Namespace, emit: Any) -> None:
    import jax

    import meshpar
    from examples.gpt import GPT, gpt_batch, gpt_loss
    from examples.train_step import supervised_step

    step = supervised_step(gpt_loss)
    L = args.layers
    scanned = GPT(scan_layers=True, num_layers=L)
    batch = gpt_batch(0, 16, scanned.seq_len, scanned.vocab_size)
    state = _state(scanned, batch)
    uncut_state, _ = jax.jit(step)(jax.device_put(state, jax.devices()[0]), batch)
    jax.block_until_ready(jax.jit(step)(uncut_state, batch))  # the returned state's layout, compiled
    uncut = max(_bytes_per_device(uncut_state).values())
    rows: list[tuple[str, Any, Any, int]] = [
        ("scan 4 stages", scanned, dict(num_stages=4), 4),
        ("scan 4 + 4", scanned, dict(num_stages=2), 2),
        ("scan 3 + 5", scanned, dict(auto_layers=L, cut_points=(2,)), 2),
        ("markers 4 + 4", GPT(num_layers=L, num_stages=2), dict(num_stages=2), 2),
    ]
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        jax.block_until_ready(jax.jit(step)(uncut_state, batch))
        times.append(time.perf_counter() - start)
    emit({"config": "uncut (jax.jit, one device)", "stages": 1, "bytes_per_device": uncut, "ratio_to_uncut": 1.0,
          **_spread(times), "split_join_s": 0.0})
    for name, model, options, stages in rows:
        par_state = _state(model, batch)
        method = meshpar.PipeshardParallel(num_micro_batches=2, stage_mesh_shape=(1, 1),
                                           devices=jax.devices()[:stages], **options)
        parallel = meshpar.parallelize(step, method=method)
        # Two untimed steps: the first takes the host state, the second the state the first
        # returned, laid out on the stage meshes (a new input layout: compiled once more).
        for _ in range(2):
            par_state, _ = parallel(par_state, batch)
        executable = parallel.get_executable(par_state, batch)
        timed = None
        if executable.stacked_leaves is not None:
            timed = executable.stacked_leaves = _Timed(executable.stacked_leaves)
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            par_state, loss = parallel(par_state, batch)
            jax.block_until_ready((par_state, loss))
            times.append(time.perf_counter() - start)
        worst = max(_bytes_per_device(par_state).values())
        emit({"config": name, "stages": stages, "bytes_per_device": worst, "ratio_to_uncut": worst / uncut,
              **_spread(times),
              "split_join_s": (timed.seconds / args.steps) if timed is not None else 0.0})


def _spread(times: list[float]) -> dict[str, float]:
    """p50 (``step_s``), p90 and max of the timed steps."""
    return {"step_s": statistics.median(times), "step_p90_s": float(np.percentile(times, 90)),
            "step_max_s": max(times)}


def table(records: list[dict]) -> str:
    lines = ["| config | stages | params + optimizer bytes per device (max) | / uncut | step ms p50 / p90 / max | "
             "split + join ms per step |", "|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['config']} | {r['stages']} | {r['bytes_per_device']:,} | {r['ratio_to_uncut']:.3f} | "
                     f"{r['step_s'] * 1e3:.1f} / {r['step_p90_s'] * 1e3:.1f} / {r['step_max_s'] * 1e3:.1f} | "
                     f"{r['split_join_s'] * 1e3:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scanned_stages", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per configuration (default 15)")
    parser.add_argument("--layers", type=int, default=8, help="blocks in the scan (default 8)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps: expected a positive number of steps")
    if args.layers < 8:
        parser.error("--layers: expected at least 8 (the 3 + 5 and 4-stage cuts)")
    import jax

    jax.config.update("jax_num_cpu_devices", DEVICES)
    records: list[dict] = []
    start = time.perf_counter()

    def emit(record: dict) -> None:
        records.append(record)
        shown = {k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in record.items()}
        print(f"[{time.perf_counter() - start:6.1f} s] {shown}", flush=True)

    run(args, emit)
    write_json(args.json, records)
    print(table(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
