"""What ``python -m benchmarks.pipeline`` runs: models scaled to CPU, and the methods it compares.

Models (the paper's §5.2, scaled so a step takes about a second on two CPU
cores and a micro-batch's activation is megabytes, well above the emulated
links' token-bucket burst):

- ``gpt`` at ``(data, model, pipeline) = (2, 2, 2)`` and ``(4, 1, 2)``: a
  GPT of short, wide-batch micro-batches (``d_model`` 64), two blocks per
  stage (one under ``interleaved``), so its boundary activations are large
  next to its compute, as in the paper's setting where cross-mesh
  communication matters;
- ``u_transformer`` at ``(4, 1, 2)``: a U-Net Transformer cut in two (four
  under ``interleaved``), so the bottleneck path and all three long skips
  cross the stage boundary.

A case's ``pipeline`` is its number of meshes, each of ``data x model``
devices; every method but ``interleaved`` runs one stage per mesh.

Methods (the paper's Fig. 7 and Fig. 9), each a ``PipeshardParallel``
configuration:

============  ================  ================  ==============  ==========
method        resharding        schedule          weight delay    executor
============  ================  ================  ==============  ==========
send_recv     send_recv         1f1b              no              collective
alpa          local_allgather   1f1b              no              collective
broadcast     broadcast         1f1b              no              collective
overlap       broadcast         1f1b              no              auto
ours          broadcast         eager_1f1b        auto            auto
zb_h1         broadcast         zb_h1             (its own)       auto
interleaved   broadcast         interleaved_1f1b  no              auto
upper_bound   signal            eager_1f1b        auto            auto
============  ================  ================  ==============  ==========

``collective`` runs each transfer as one program over both meshes, so it
holds both meshes' devices until it ends (the paper's baselines do not
overlap communication with compute); ``auto`` is asynchronous
point-to-point moves across processes and ``jax.device_put`` inside one.
``upper_bound`` sends one byte per transfer with the same dependencies:
what the schedule would take if communication were free.
``interleaved`` is Megatron-LM's interleaved 1F1B (``interleaved_1f1b``)
with virtual stages: the case's pipeline number is the meshes, each running
two stages (stage ``k`` on mesh ``k mod pipeline``), so its model is cut in
twice as many stages, each half as deep, as in the other rows (GPT_SIZE has 4
layers and the U-Transformer 8 blocks, so both cut in 4); the cases'
micro-batches are a multiple of the meshes, as the schedule needs. It has no
target of its own: ``benchmarks.pipeline.targets`` prints its speed next to
``upper_bound``'s for information.

Importing this module touches neither JAX nor the network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

__all__ = ["Case", "CASES", "Method", "METHODS", "SINGLE_PROCESS_METHODS", "build_step"]


@dataclasses.dataclass(frozen=True)
class Case:
    """A model at one ``(data, model, pipeline)`` configuration; ``batch`` examples per step in
    ``micro_batches`` micro-batches."""

    model: str
    config: tuple[int, int, int]
    batch: int
    micro_batches: int

    @property
    def name(self) -> str:
        return f"{self.model} {self.config}"


@dataclasses.dataclass(frozen=True)
class Method:
    """A ``PipeshardParallel`` configuration; ``stages_per_mesh`` stages run on each of the case's
    ``pipeline`` meshes (virtual stages above 1)."""

    name: str
    resharding: str
    schedule: str
    weight_delay: bool | str
    executor: str
    stages_per_mesh: int = 1


CASES = (
    Case("gpt", (2, 2, 2), batch=256, micro_batches=4),
    Case("gpt", (4, 1, 2), batch=256, micro_batches=4),
    Case("u_transformer", (4, 1, 2), batch=32, micro_batches=4),
)

METHODS = (
    Method("send_recv", "send_recv", "1f1b", False, "collective"),
    Method("alpa", "local_allgather", "1f1b", False, "collective"),
    Method("broadcast", "broadcast", "1f1b", False, "collective"),
    Method("overlap", "broadcast", "1f1b", False, "auto"),
    Method("ours", "broadcast", "eager_1f1b", "auto", "auto"),
    Method("zb_h1", "broadcast", "zb_h1", False, "auto"),
    Method("interleaved", "broadcast", "interleaved_1f1b", False, "auto", stages_per_mesh=2),
    Method("upper_bound", "signal", "eager_1f1b", "auto", "auto"),
)

# In one process every "auto" transfer is a jax.device_put, so the resharding
# strategy no longer matters: send_recv and alpa would repeat overlap.
SINGLE_PROCESS_METHODS = tuple(m for m in METHODS if m.name not in ("send_recv", "alpa"))

GPT_SIZE = dict(vocab_size=128, seq_len=64, d_model=64, num_heads=4, num_layers=4)
UT_SIZE = dict(channels=(32, 64, 128, 128), num_heads=4, bottleneck_depth=2)
UT_HW = 32


def build_step(case: Case, method: Method, cluster: Any, timeout_s: float) -> tuple[Callable, Any, Any]:
    """``(step, state, batch)``: the parallelized train step (Adam), its initial state and a batch.

    The model is cut in ``pipeline * method.stages_per_mesh`` stages, placed on ``pipeline``
    meshes of ``(data, model)`` devices.
    """
    import jax
    import optax
    from flax.training import train_state

    import meshpar
    from examples.train_step import supervised_step

    data, model_axis, meshes = case.config
    stages = meshes * method.stages_per_mesh
    if case.model == "gpt":
        from examples.gpt import GPT, gpt_batch, gpt_loss

        net = GPT(num_stages=stages, **GPT_SIZE)
        batch = gpt_batch(0, case.batch, net.seq_len, net.vocab_size)
        loss_of = gpt_loss
    elif case.model == "u_transformer":
        from examples.u_transformer import UTransformer, ut_batch, ut_loss

        net = UTransformer(num_stages=stages, **UT_SIZE)
        batch = ut_batch(0, case.batch, UT_HW)
        loss_of = ut_loss
    else:
        raise ValueError(f"case.model: expected 'gpt' or 'u_transformer', got {case.model!r}")
    params = net.init(jax.random.PRNGKey(0), batch["x"][:1])
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))

    parallel = meshpar.PipeshardParallel(
        num_micro_batches=case.micro_batches, num_stages=stages, stages_per_mesh=method.stages_per_mesh,
        stage_mesh_shape=(data, model_axis),
        schedule=method.schedule, weight_delay=method.weight_delay, resharding=method.resharding,
        balancer="ensemble", executor=method.executor, cluster=cluster, timeout_s=timeout_s,
    )
    return meshpar.parallelize(supervised_step(loss_of), method=parallel), state, batch
