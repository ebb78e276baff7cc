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
  cross the stage boundary;
- ``gpt_tied`` at ``(2, 2, 2)`` on 4 emulated hosts x 2 devices: a GPT with
  tied input/output embeddings (the embedding on stage 0, the head reading
  it on stage 1), one wide block per stage (``d_model`` 256, vocabulary
  512), so each device holds about 2 MB of parameter gradients and a
  micro-batch (8 sequences of 64 tokens) computes little: reducing them
  over a 0.25 Gbit/s link in every micro-batch is about half the step.

- ``gpt`` at ``(2, 1, 2)`` on 2 hosts x 2 devices and ``(4, 1, 2)`` on 2 x 4,
  each with ``M`` in ``{S, 2S, 4S}`` = 2, 4 and 8 micro-batches (issue 24):
  our schedules (``overlap``, ``ours``, ``zb_h1``, ``interleaved``) beside
  the stock-JAX circular SPMD pipeline with ``R`` = 1 and 2 repeats
  (``spmd_circular``, ``spmd_circular_r2``: ``SpmdBaseline``, one ``jax.jit``
  over a ``(stage, data)`` mesh of the case's devices, stage ``s`` on host
  ``s``; ``benchmarks.spmd_pipeline``).

A case's ``pipeline`` is its number of meshes, each of ``data x model``
devices; every method but ``interleaved`` runs one stage per mesh. Meshes
are cut host-major (``PipeshardParallel(stage_mesh_shape=(data, model))``
orders devices by process, then id), so on ``hosts = (4, 2)`` mesh 0 is
hosts 0 and 1 and mesh 1 hosts 2 and 3, each mesh's data axis running
across its two hosts and its model axis inside one: every byte of a data
axis reduction crosses a link. On ``(2, 4)`` each mesh is one host.
A case compares its own ``methods``: the paper's cases the paper's methods,
``gpt_tied`` the two gradient reductions.

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

and the gradient reductions (issue 22), ``overlap``'s configuration but for
``gradient_reduction``, which the others leave at the library's default
(``"per_step"``):

===============  ===============================================
method           gradient reduction over each mesh's data axis
===============  ===============================================
per_step         once per step, of the accumulated partial sums
per_micro_batch  in every micro-batch's backward
===============  ===============================================

``zb_v`` and ``dualpipev`` (issue 25) run the model in twice as many stages
as the meshes too, placed in a V (stages ``r`` and ``2P - 1 - r`` on mesh
``r``): ZB-V's and DualPipeV's orders, backwards split, at least ``2P``
micro-batches (the paper cases' 4 on 2 meshes).

``ours_remat`` (the SPMD comparison only) is ``ours`` on the same GPT with
its blocks in one ``nn.scan`` under ``nn.remat``, as the SPMD baseline
recomputes its blocks: each stage keeps only its blocks' inputs for the
backward, so activation bytes compare like for like.

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

__all__ = ["Case", "CASES", "GRADIENT_METHODS", "Method", "METHODS", "PAPER_HOSTS", "PAPER_METHODS",
           "SINGLE_PROCESS_METHODS", "SPMD_COMPARISON", "SPMD_METHODS", "SpmdBaseline", "build_spmd_step",
           "build_step"]


# The emulated cluster of the paper's cases: (hosts, CPU devices per host).
PAPER_HOSTS = (2, 4)
PAPER_METHODS = ("send_recv", "alpa", "broadcast", "overlap", "ours", "zb_h1", "interleaved", "zb_v", "dualpipev",
                 "upper_bound")
GRADIENT_METHODS = ("per_step", "per_micro_batch")
# Issue 24: our schedules beside the stock-JAX circular SPMD pipeline (R = 1 and 2).
SPMD_METHODS = ("spmd_circular", "spmd_circular_r2")
SPMD_COMPARISON = ("overlap", "ours", "ours_remat", "zb_h1", "interleaved", *SPMD_METHODS)


@dataclasses.dataclass(frozen=True)
class Case:
    """A model at one ``(data, model, pipeline)`` configuration; ``batch`` examples per step in
    ``micro_batches`` micro-batches, on an emulated cluster of ``hosts = (hosts, devices per
    host)``, run with each of ``methods`` (``Method`` names)."""

    model: str
    config: tuple[int, int, int]
    batch: int
    micro_batches: int
    hosts: tuple[int, int] = PAPER_HOSTS
    methods: tuple[str, ...] = PAPER_METHODS

    @property
    def name(self) -> str:
        """``gpt (2, 2, 2)``; on other than the paper's hosts ``gpt_tied (2, 2, 2) 4x2 hosts``; a
        case of the SPMD comparison ends in its micro-batches, ``gpt (2, 1, 2) 2x2 hosts M=4``."""
        base = f"{self.model} {self.config}"
        if self.hosts != PAPER_HOSTS:
            base = f"{base} {self.hosts[0]}x{self.hosts[1]} hosts"
        return f"{base} M={self.micro_batches}" if set(self.methods) & set(SPMD_METHODS) else base


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
    gradient_reduction: str = "per_step"
    remat: bool = False


@dataclasses.dataclass(frozen=True)
class SpmdBaseline:
    """The stock-JAX circular SPMD pipeline (``benchmarks.spmd_pipeline``) with ``repeats`` R:
    one ``jax.jit`` over a ``(stage, data)`` mesh of the case's devices, the GPT's blocks
    stacked ``[R, S, k, ...]``."""

    name: str
    repeats: int
    stages_per_mesh: int = 1


CASES = (
    Case("gpt", (2, 2, 2), batch=256, micro_batches=4),
    Case("gpt", (4, 1, 2), batch=256, micro_batches=4),
    Case("u_transformer", (4, 1, 2), batch=32, micro_batches=4),
    Case("gpt_tied", (2, 2, 2), batch=64, micro_batches=8, hosts=(4, 2), methods=GRADIENT_METHODS),
    *(Case("gpt", config, batch=256, micro_batches=M, hosts=hosts, methods=SPMD_COMPARISON)
      for config, hosts in (((2, 1, 2), (2, 2)), ((4, 1, 2), PAPER_HOSTS)) for M in (2, 4, 8)),
)

METHODS = (
    Method("send_recv", "send_recv", "1f1b", False, "collective"),
    Method("alpa", "local_allgather", "1f1b", False, "collective"),
    Method("broadcast", "broadcast", "1f1b", False, "collective"),
    Method("overlap", "broadcast", "1f1b", False, "auto"),
    Method("ours", "broadcast", "eager_1f1b", "auto", "auto"),
    Method("zb_h1", "broadcast", "zb_h1", False, "auto"),
    Method("interleaved", "broadcast", "interleaved_1f1b", False, "auto", stages_per_mesh=2),
    Method("zb_v", "broadcast", "zb_v", False, "auto", stages_per_mesh=2),
    Method("dualpipev", "broadcast", "dualpipev", False, "auto", stages_per_mesh=2),
    Method("upper_bound", "signal", "eager_1f1b", "auto", "auto"),
    Method("ours_remat", "broadcast", "eager_1f1b", "auto", "auto", remat=True),
    Method("per_step", "broadcast", "1f1b", False, "auto", gradient_reduction="per_step"),
    Method("per_micro_batch", "broadcast", "1f1b", False, "auto", gradient_reduction="per_micro_batch"),
    SpmdBaseline("spmd_circular", repeats=1),
    SpmdBaseline("spmd_circular_r2", repeats=2),
)

# In one process every "auto" transfer is a jax.device_put, so the resharding
# strategy no longer matters: send_recv and alpa would repeat overlap.
SINGLE_PROCESS_METHODS = tuple(m for m in METHODS if m.name not in ("send_recv", "alpa"))

GPT_SIZE = dict(vocab_size=128, seq_len=64, d_model=64, num_heads=4, num_layers=4)
GPT_TIED_SIZE = dict(vocab_size=512, seq_len=64, d_model=256, num_heads=4, num_layers=2, tie_embeddings=True)
UT_SIZE = dict(channels=(32, 64, 128, 128), num_heads=4, bottleneck_depth=2)
UT_HW = 32


def build_spmd_step(case: Case, method: SpmdBaseline, devices: Any) -> tuple[Callable, Any, Any, Any]:
    """``(step, state, batch, config)``: the circular SPMD pipeline's jitted train step (Adam) on
    the case's ``devices``, its initial state and batch (``benchmarks.spmd_pipeline``)."""
    from benchmarks.spmd_pipeline import SpmdPipelineConfig, build_train_step, spmd_mesh

    data, model_axis, stages = case.config
    config = SpmdPipelineConfig(data=data, stages=stages, micro_batches=case.micro_batches, repeats=method.repeats,
                                batch=case.batch, model_size=GPT_SIZE, model_parallel=model_axis)
    step, state, batch = build_train_step(config, spmd_mesh(devices, data, stages))
    return step, state, batch, config


def build_step(case: Case, method: Method, cluster: Any, timeout_s: float,
               devices: Any = None) -> tuple[Callable, Any, Any]:
    """``(step, state, batch)``: the parallelized train step (Adam), its initial state and a batch.

    The model is cut in ``pipeline * method.stages_per_mesh`` stages, placed on ``pipeline``
    meshes of ``(data, model)`` devices cut from ``devices`` (default all).
    """
    import jax
    import optax
    from flax.training import train_state

    import meshpar
    from examples.train_step import supervised_step

    data, model_axis, meshes = case.config
    stages = meshes * method.stages_per_mesh
    if case.model in ("gpt", "gpt_tied"):
        from examples.gpt import GPT, gpt_batch, gpt_loss

        size = GPT_SIZE if case.model == "gpt" else GPT_TIED_SIZE
        # With remat, as the SPMD baseline runs its blocks: one nn.scan with nn.remat inside,
        # which meshpar cuts into the stages itself.
        net = (GPT(**size, scan_layers=True, remat_blocks=True) if method.remat
               else GPT(num_stages=stages, **size))
        batch = gpt_batch(0, case.batch, net.seq_len, net.vocab_size)
        loss_of = gpt_loss
    elif case.model == "u_transformer":
        from examples.u_transformer import UTransformer, ut_batch, ut_loss

        net = UTransformer(num_stages=stages, **UT_SIZE)
        batch = ut_batch(0, case.batch, UT_HW)
        loss_of = ut_loss
    else:
        raise ValueError(f"case.model: expected 'gpt', 'gpt_tied' or 'u_transformer', got {case.model!r}")
    params = net.init(jax.random.PRNGKey(0), batch["x"][:1])
    state = train_state.TrainState.create(apply_fn=net.apply, params=params, tx=optax.adam(1e-3))

    parallel = meshpar.PipeshardParallel(
        num_micro_batches=case.micro_batches, num_stages=stages, stages_per_mesh=method.stages_per_mesh,
        stage_mesh_shape=(data, model_axis),
        schedule=method.schedule, weight_delay=method.weight_delay, resharding=method.resharding,
        balancer="ensemble", executor=method.executor, cluster=cluster, timeout_s=timeout_s,
        devices=None if devices is None else tuple(devices),
        gradient_reduction=method.gradient_reduction,
    )
    return meshpar.parallelize(supervised_step(loss_of), method=parallel), state, batch
