"""What a pipelined step costs the host: meshpar against ``jax.jit`` running the same micro-batches.

    python -m benchmarks.host_overhead [--json PATH] [--steps N] [--models tiny medium]
        [--micro-batches 2 4 8 32] [--layouts one_mesh_interleaved ...]

One process, each stage mesh one device, so every difference from ``jax.jit`` is host work
(dispatch, slicing, accumulators), not parallelism:

- ``jit_accum``: ``jax.jit`` of the step with the batch cut into M micro-batches whose
  gradients a ``lax.scan`` accumulates, then one update: the same arithmetic as a pipeline
  of M micro-batches, launched as one program;
- ``one_mesh_interleaved``: meshpar ``interleaved_1f1b``, the GPT's 2 stages on one mesh of one
  device (nothing to pipeline: pure host overhead);
- ``one_mesh_zb_v``: meshpar ``zb_v``, the same 2 stages on one mesh, split backwards (I and W
  passes: more launches per micro-batch);
- ``two_meshes_1f1b``: meshpar ``1f1b``, one stage on each of two devices;
- ``one_mesh_interleaved_fused``, ``two_meshes_1f1b_fused``: the same with ``fuse_compute=None``
  (``passes.pipeline.lowering.fused_runs``): a mesh's back-to-back passes one program, the one mesh's
  whole pipeline one program.

Models: ``tiny`` is ``examples/gpt.py``'s GPT with its defaults (8 layers, d_model 32, seq 8,
vocab 64), batch 64; ``medium`` has d_model 256, 8 heads, 4 layers, seq 64, vocab 512, batch
32; ``large`` (118M parameters, for a GPU) d_model 1024, 16 heads, 8 layers, seq 512, vocab
8192, batch 32. All use Adam.

Per row: p50 / p90 / max of ``--steps`` timed steps (after two untimed ones), each step timed
to its outputs being ready; every configuration of a model is compiled first, then all are
timed in 4 rounds in rotated order (the machine's speed drifts over minutes). Per model and
layout, a least-squares line of p50 over M gives the host cost per micro-batch (its slope),
the fixed cost per step (its intercept), and the cost per launch: the slope divided by the
stage programs the pipeline launches per micro-batch (its F, B, I and W instructions, a fused
run of them once). Ratios are to ``jit_accum`` at the same M, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import numpy as np

from benchmarks.step_timing import spread_ms, time_steps
from benchmarks.worker_records import write_json

LAYOUTS = {
    # name: (schedule, meshes, stages per mesh, fuse_compute)
    "one_mesh_interleaved": ("interleaved_1f1b", 1, 2, 1),
    "one_mesh_zb_v": ("zb_v", 1, 2, 1),
    "two_meshes_1f1b": ("1f1b", 2, 1, 1),
    "one_mesh_interleaved_fused": ("interleaved_1f1b", 1, 2, None),
    "two_meshes_1f1b_fused": ("1f1b", 2, 1, None),
}
MODELS = {
    # name: (GPT keyword arguments, batch size)
    "tiny": ({}, 64),
    "medium": ({"vocab_size": 512, "seq_len": 64, "d_model": 256, "num_heads": 8, "num_layers": 4}, 32),
    # 118M parameters: issue 33's GPU model (too large for the CPU rows)
    "large": ({"vocab_size": 8192, "seq_len": 512, "d_model": 1024, "num_heads": 16, "num_layers": 8}, 32),
}


def _model(name: str) -> tuple[Any, dict, Any]:
    import jax
    import optax
    from flax.training import train_state

    from examples.gpt import GPT, gpt_batch

    kwargs, batch_size = MODELS[name]
    model = GPT(num_stages=2, **kwargs)
    batch = gpt_batch(0, batch_size, model.seq_len, model.vocab_size)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))
    return model, batch, state


def _jit_accum(num_micro_batches: int):
    """``jax.jit`` of the step over ``num_micro_batches`` micro-batches accumulated by a scan."""
    import jax
    import jax.numpy as jnp

    from examples.gpt import gpt_loss

    def step(state, batch):
        def grads_of(micro):
            def loss_fn(params):
                return gpt_loss(state.apply_fn(params, micro["x"]), micro["y"])
            return jax.value_and_grad(loss_fn)(state.params)

        micro = jax.tree.map(lambda x: x.reshape(num_micro_batches, -1, *x.shape[1:]), batch)

        def body(total, mb):
            loss, grads = grads_of(mb)
            return jax.tree.map(jnp.add, total, (loss, grads)), None

        zero = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
        (loss, grads), _ = jax.lax.scan(body, zero, micro)
        loss, grads = jax.tree.map(lambda x: x / num_micro_batches, (loss, grads))
        return state.apply_gradients(grads=grads), loss

    return jax.jit(step)


def _meshpar_step(layout: str, num_micro_batches: int):
    import jax

    import meshpar
    from examples.gpt import gpt_loss
    from examples.train_step import supervised_step

    schedule, meshes, per_mesh, fuse = LAYOUTS[layout]
    method = meshpar.PipeshardParallel(
        num_micro_batches=num_micro_batches, num_stages=meshes * per_mesh, stages_per_mesh=per_mesh,
        stage_mesh_shape=(1, 1), schedule=schedule, devices=jax.devices()[:meshes], fuse_compute=fuse)
    return meshpar.parallelize(supervised_step(gpt_loss), method=method)


def _launches_per_micro_batch(step: Any, state: Any, batch: dict, num_micro_batches: int) -> float:
    """Stage programs the pipeline launches per micro-batch: its F, B, I and W instructions, a
    fused run of them counting once."""
    program = step.get_executable(state, batch).program
    launches = sum(any(t.kind.is_compute for t in i.tasks) for ins in program.instructions for i in ins)
    return launches / num_micro_batches


def _fit(ms: list[int], p50s: list[float]) -> tuple[float, float]:
    """Least-squares ``p50 = fixed + slope * M``: ``(slope, fixed)`` in ms."""
    slope, fixed = np.polyfit(np.asarray(ms, float), np.asarray(p50s, float), 1)
    return float(slope), float(fixed)


def run(models: list[str], layouts: list[str], micro_batches: list[int], steps: int,
        rounds: int = 4) -> dict[str, Any]:
    """Every configuration of a model built and warmed first, then timed in ``rounds`` rounds,
    each configuration ``steps / rounds`` steps a round in rotated order, so that the machine's
    drift over minutes falls on all of them alike."""
    rows, fits = [], []
    for name in models:
        _, batch, state = _model(name)
        configs = [(layout, m) for layout in ["jit_accum", *layouts] for m in micro_batches]
        made = {}
        for layout, m in configs:
            step = _jit_accum(m) if layout == "jit_accum" else _meshpar_step(layout, m)
            time_steps(step, state, batch, 0, untimed=2)
            made[(layout, m)] = step
            print(f"{name} {layout} M={m}: compiled", flush=True)
        times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
        per_round = max(1, steps // rounds)
        for r in range(rounds):
            for c in configs[r % len(configs):] + configs[:r % len(configs)]:
                times[c] += time_steps(made[c], state, batch, per_round, untimed=0)
        p50 = {}
        for layout, m in configs:
            row = {"kind": "step", "model": name, "layout": layout, "num_micro_batches": m,
                   "steps": len(times[(layout, m)]), **spread_ms(times[(layout, m)])}
            p50[(layout, m)] = row["p50_ms"]
            if layout != "jit_accum":
                row["launches_per_micro_batch"] = _launches_per_micro_batch(made[(layout, m)], state, batch, m)
                row["vs_jit_accum"] = row["p50_ms"] / p50[("jit_accum", m)]
            rows.append(row)
            ratio = f"  {row['vs_jit_accum']:.2f}x jit_accum" if "vs_jit_accum" in row else ""
            print(f"{name} {layout} M={m}: p50 {row['p50_ms']:.1f} ms, p90 {row['p90_ms']:.1f}, "
                  f"max {row['max_ms']:.1f}{ratio}", flush=True)
        for layout in ["jit_accum", *layouts]:
            slope, fixed = _fit(micro_batches, [p50[(layout, m)] for m in micro_batches])
            fit = {"kind": "fit", "model": name, "layout": layout, "per_micro_batch_ms": slope, "fixed_ms": fixed}
            if layout != "jit_accum":
                launches = next(r["launches_per_micro_batch"] for r in rows
                                if r["model"] == name and r["layout"] == layout)
                accum = next(f for f in fits if f["model"] == name and f["layout"] == "jit_accum")
                fit.update(launches_per_micro_batch=launches, per_launch_us=1e3 * slope / launches,
                           per_micro_batch_vs_jit_accum=slope / accum["per_micro_batch_ms"])
            fits.append(fit)
    return {"rows": rows, "fits": fits}


def markdown(result: dict[str, Any]) -> str:
    lines = ["| model | layout | M | p50 ms | p90 ms | max ms | vs jit_accum |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ratio = f"{r['vs_jit_accum']:.2f}x" if "vs_jit_accum" in r else ""
        lines.append(f"| {r['model']} | {r['layout']} | {r['num_micro_batches']} | {r['p50_ms']:.1f} | "
                     f"{r['p90_ms']:.1f} | {r['max_ms']:.1f} | {ratio} |")
    lines += ["", "| model | layout | per micro-batch ms | vs jit_accum | fixed ms per step | launches per "
              "micro-batch | per launch µs |", "|---|---|---|---|---|---|---|"]
    for f in result["fits"]:
        ratio = f"{f['per_micro_batch_vs_jit_accum']:.2f}x" if "per_micro_batch_vs_jit_accum" in f else ""
        launches = f"{f['launches_per_micro_batch']:.3g}" if "launches_per_micro_batch" in f else ""
        per_launch = f"{f['per_launch_us']:.0f}" if "per_launch_us" in f else ""
        lines.append(f"| {f['model']} | {f['layout']} | {f['per_micro_batch_ms']:.2f} | {ratio} | "
                     f"{f['fixed_ms']:.1f} | {launches} | {per_launch} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write rows and fits here")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per row (default 20)")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["tiny", "medium"])
    parser.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--micro-batches", nargs="+", type=int, default=[2, 4, 8, 32])
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: expected a positive number of steps, got {args.steps}")
    if len(set(args.micro_batches)) < 2 or min(args.micro_batches) < 2:
        parser.error(f"--micro-batches: expected at least two distinct counts of 2 or more (a line is fitted "
                     f"through them), got {args.micro_batches}")
    import jax

    jax.config.update("jax_num_cpu_devices", 2)
    short = [layout for layout in args.layouts if LAYOUTS[layout][1] > len(jax.devices())]
    if short:
        parser.error(f"--layouts: {short} need {max(LAYOUTS[x][1] for x in short)} devices; "
                     f"this machine's backend has {len(jax.devices())}")
    for name in args.models:
        batch_size = MODELS[name][1]
        bad = [m for m in args.micro_batches if batch_size % m]
        if bad:
            parser.error(f"--micro-batches: {bad} do not divide the {name} GPT's batch of {batch_size}")
    result = run(args.models, args.layouts, args.micro_batches, args.steps)
    print(markdown(result))
    if args.json:
        write_json(args.json, result["rows"] + result["fits"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
