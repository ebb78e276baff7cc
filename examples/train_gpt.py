"""Main job: train a small GPT with (data, model, pipeline) = (2, 2, 2) on 8 devices.

    python -m examples.train_gpt [--steps N] [--schedule NAME] [--stages-per-mesh V]
        [--weight-delay false|true|auto] [--micro-batches M] [--scan-layers]

``--schedule`` is any of ``meshpar.SCHEDULES``; ``--stages-per-mesh 2 --schedule
interleaved_1f1b`` cuts the GPT into 4 stages on the same two meshes (virtual stages).
``--scan-layers`` stacks the 8 blocks in one ``nn.scan``, as large models are written: the
model calls no marker, ``num_stages`` cuts the scan evenly, and each stage holds only its
slice of every stacked parameter and its Adam moments.

It runs on 8 accelerators when JAX's default backend has 8 or more, and otherwise on 8
virtual CPU devices, saying so (a workstation with one GPU); ``JAX_PLATFORMS`` chooses the
backends as usual (``JAX_PLATFORMS=cpu`` always runs on the CPU).

Each of the two stage meshes is a (data=2, model=2) mesh on its own emulated
host; activations and their gradients cross between the meshes through
meshpar's cross-mesh resharding. The step is the usual transformer recipe:
global-norm clipping before Adam, token accuracy returned as aux, the gradient
norm logged. Prints the stages, their meshes and shardings, each resharding
task's plan (as it runs across processes; one process moves by jax.device_put),
the schedule, the loss, accuracy and gradient norm per step, and how far the
result is from the same steps under plain jax.jit on one device.
"""

from __future__ import annotations

import argparse
import os
import time


def job_devices(count: int) -> list:
    """``count`` devices of JAX's default backend when it has that many, else ``count`` virtual
    CPU devices (``jax_num_cpu_devices`` set before the backend started), said in one line."""
    import jax

    default = jax.devices()
    if len(default) >= count:
        return default[:count]
    try:
        cpus = jax.devices("cpu")
    except RuntimeError:
        cpus = []
    if len(cpus) < count:
        raise SystemExit(f"the main job needs {count} devices: JAX's {default[0].platform} backend has "
                         f"{len(default)} and no {count} CPU devices are allowed (JAX_PLATFORMS="
                         f"{os.environ.get('JAX_PLATFORMS', '')!r}); add cpu to JAX_PLATFORMS, e.g. "
                         f"JAX_PLATFORMS={default[0].platform},cpu")
    print(f"{len(default)} {default[0].platform} device{'s' * (len(default) > 1)}, fewer than {count}: "
          f"running on {count} virtual CPU devices")
    return cpus[:count]


def main_job(args: argparse.Namespace, devices: list) -> tuple:
    """The main job's ``(train_step, method, state, batch)`` for the command line's ``args`` on
    ``devices`` (benchmarks time the same job)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    import meshpar
    from examples.gpt import GPT, gpt_batch, gpt_loss

    # Two emulated hosts of 4 devices, linked at 10 Gbit/s: the planner sees
    # every stage-to-stage transfer cross hosts, as on a real cluster.
    cluster = meshpar.Cluster.from_devices(devices, host_of=lambda d: d.id // 4, inter_host_bandwidth=1.25e9)
    model = GPT(num_stages=2 * args.stages_per_mesh, scan_layers=args.scan_layers)
    batch = gpt_batch(0, args.batch_size, model.seq_len, model.vocab_size)
    params = model.init(jax.random.PRNGKey(0), batch["x"][:1])
    # The usual transformer recipe: global-norm clipping before Adam. The norm spans both stage
    # meshes; meshpar reduces each mesh's part and moves only scalars between them.
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    def train_step(state, batch):
        def loss_fn(params):
            # GPT calls meshpar.mark_stage_boundary(); with --scan-layers meshpar cuts its nn.scan.
            logits = state.apply_fn(params, batch["x"])
            accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["y"])
            return gpt_loss(logits, batch["y"]), accuracy

        (loss, accuracy), grads = meshpar.value_and_grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads), (loss, accuracy, optax.tree.norm(grads))

    method = meshpar.PipeshardParallel(
        num_micro_batches=args.micro_batches, num_stages=2 * args.stages_per_mesh,
        stages_per_mesh=args.stages_per_mesh, stage_mesh_shape=(2, 2),
        schedule=args.schedule, resharding="broadcast", balancer="ensemble", cluster=cluster, devices=devices,
        weight_delay=(False if meshpar.SCHEDULES[args.schedule].places_weight_passes
                      else {"false": False, "true": True, "auto": "auto"}[args.weight_delay]),
    )
    return train_step, method, state, batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The main job's command line (``argv``; ``None``: the process's own)."""
    import meshpar

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--schedule", default="eager_1f1b", choices=sorted(meshpar.SCHEDULES))
    parser.add_argument("--stages-per-mesh", type=int, default=1,
                        help="stages each of the two meshes runs (above 1: a schedule taking virtual stages)")
    parser.add_argument("--weight-delay", default="auto", choices=["false", "true", "auto"],
                        help="split backwards and delay the weight-gradient passes (ignored by schedules "
                             "placing weight passes themselves, zb_h1)")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--scan-layers", action="store_true",
                        help="stack the blocks in one nn.scan (no markers): meshpar cuts the scan into the stages, "
                             "each holding only its slice of the stacked parameters")
    return parser.parse_args(argv)


def main() -> None:
    # Importing JAX starts no backend: the device count below still takes effect.
    import meshpar

    args = parse_args()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    devices = job_devices(8)
    if devices[0].platform != jax.default_backend():
        # The model, its batch and the jax.jit reference live on the job's devices too.
        jax.config.update("jax_default_device", devices[0])
    import jax.numpy as jnp
    import numpy as np

    train_step, method, state, batch = main_job(args, devices)
    step = meshpar.parallelize(train_step, method=method)
    params, model_seq_len = state.params, batch["x"].shape[1]
    n_params = sum(x.size for x in jax.tree.leaves(params))
    print(f"GPT: {n_params} parameters, batch {args.batch_size} x {model_seq_len} tokens, "
          f"(data, model, pipeline) = (2, 2, 2) on {len(devices)} {devices[0].platform} devices")
    print(step.get_executable(state, batch).describe())

    reference = jax.jit(train_step)
    ref_state = state
    for i in range(args.steps):
        start = time.perf_counter()
        state, (loss, accuracy, norm) = step(state, batch)
        loss = float(loss)
        elapsed = time.perf_counter() - start
        ref_state, (ref_loss, _, ref_norm) = reference(ref_state, batch)
        note = "  (includes compiling every stage and transfer)" if i == 0 else ""
        print(f"step {i}: loss {loss:.5f}  (jax.jit on one device: {float(ref_loss):.5f})  "
              f"accuracy {float(accuracy):.3f}  grad norm {float(norm):.4f} (jax.jit: {float(ref_norm):.4f})  "
              f"{elapsed * 1e3:.0f} ms{note}")
    diff = max(float(jnp.max(jnp.abs(np.asarray(a) - np.asarray(b))))
               for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)))
    print(f"after {args.steps} steps: max |parameter difference| vs jax.jit = {diff:.2e} "
          f"(Adam moves parameters whose gradient is rounding noise by up to its 1e-3 learning rate)")
    homes = sorted({tuple(sorted(d.id for d in x.sharding.device_set)) for x in jax.tree.leaves(state.params)})
    print(f"parameters live on stage meshes {homes}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
