"""Baseline: the stock-JAX circular SPMD pipeline (the MaxText / praxis style), on the repo's GPT.

    python -m benchmarks.spmd_pipeline --config D 1 S --micro-batches M --repeats R --steps N
        [--batch B] [--warmup W] [--json PATH]

One SPMD program, a single ``jax.jit`` over a mesh ``("stage", "data")`` of ``S x D`` devices:

- the ``L`` transformer blocks' parameters are stacked ``[R, S, k, ...]`` (``L = R S k``, layer
  ``l = r S k + s k + j``: the C-order reshape of GPT(scan_layers=True)'s ``[L, ...]`` stack),
  axis ``S`` sharded over ``"stage"``, so stage ``s`` holds layers ``r S k + s k + j`` of every
  repeat ``r``;
- one ``lax.scan`` of ``M R + S - 1`` iterations (``M`` micro-batches); in each, every stage
  applies its ``k`` blocks to its input (``jax.vmap(..., spmd_axis_name="stage")`` over a state
  buffer ``[S, mb, T, d]`` sharded ``P("stage", "data")``), each with the weights of the repeat
  it is on, then the outputs move one stage on (``jnp.roll`` over the stage-sharded axis, which
  XLA partitions into a collective-permute);
- stage ``s`` works at iteration ``n`` on item ``i = n - s`` (valid for ``0 <= i < M R``),
  item ``i = r M + m`` being micro-batch ``m``'s repeat ``r``: stage 0 takes micro-batch ``n``
  while ``n < M``, and afterwards the last stage's output of item ``n - M``, which left it
  ``M - S`` iterations earlier (so ``M >= S``) and waited in a circular buffer of ``M - S``
  slots (none when ``M == S`` or ``R == 1``), sharded over ``"stage"`` like the state, only
  stage 0's copy being read;
- the iteration body is ``jax.checkpoint``-ed: the backward keeps only each iteration's carry
  (the state buffer and the circular buffer) and recomputes the blocks (GPipe with full remat);
  the loop also stacks every iteration's stage outputs (``[M R + S - 1, S, mb, T, d]``), from
  which the last stage's final-repeat outputs are taken after it;
- the backward is ``jax.grad`` of the whole loss. As XLA partitions it (jax 0.10, CPU), the
  blocks' gradients are all-reduced over ``"data"`` inside the backward loop, once per
  iteration and layer, not once per step;
- token/position embeddings, the final LayerNorm, the head and the loss run outside the loop
  on every device, the batch sharded over ``"data"`` (so each stage's devices repeat them: the
  baseline's price for being one program).

The fraction of stage-iterations idle is ``bubble(M, R, S) = (S - 1) / (R M + S - 1)``.

The reference is the same GPT(scan_layers=True) under plain ``jax.jit``: the pipeline's loss
and gradients equal it (``tests/pipeline/test_spmd_pipeline.py``), its parameters converting both ways
with :func:`pipeline_params` / :func:`gpt_params_from_pipeline`.

Arrays are placed with ``jax.make_array_from_callback`` from full host copies that every process
holds, so the same code runs as one SPMD program over the processes of an emulated cluster
(call :func:`run` after joining it; ``main`` sets the CPU device count for a run alone).

The CLI prints progress lines and one result line; ``--json`` writes a one-record list::

    {"method": "spmd_pipeline", "model", "config", "micro_batches", "repeats", "batch",
     "step_times_s", "measured_step_s", "samples_per_s", "peak_bytes_per_device",
     "temp_bytes_per_device", "memory", "bubble", "losses", "compile_s", "processes"}

Importing this module starts no JAX backend (JAX, Flax and the model are imported inside the
functions).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "SpmdPipelineConfig",
    "batch_shardings",
    "bubble",
    "build_train_step",
    "gpt_params_from_pipeline",
    "init_gpt_params",
    "loss_and_grads",
    "main",
    "memory_bytes_per_device",
    "pipeline_loss",
    "pipeline_params",
    "place",
    "run",
    "spmd_mesh",
    "state_shardings",
]

STAGE_AXIS = "stage"
DATA_AXIS = "data"
# Key of the stacked block parameters ([R, S, k, ...]) in the pipeline's parameter tree.
STAGES_KEY = "stages"
_SIZE_KEYS = ("vocab_size", "seq_len", "d_model", "num_heads", "num_layers")


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class SpmdPipelineConfig:
    """What one SPMD pipeline run is: mesh ``(data, model_parallel, stages)``, schedule, model.

    Attributes:
      data: ``D``, devices per stage; the batch is sharded over them.
      stages: ``S``, pipeline stages (one block of ``D`` devices each).
      micro_batches: ``M >= S``; each of ``batch / M`` sequences.
      repeats: ``R``, circular repeats: each stage holds ``R`` non-adjacent chunks of
        ``k = num_layers / (R S)`` layers.
      batch: global batch ``B``, divisible by ``M D`` (a micro-batch splits evenly over ``data``).
      model_size: GPT keyword arguments ``vocab_size, seq_len, d_model, num_heads, num_layers``
        (exactly those: the baseline has no tied embeddings).
      model_parallel: the config's model axis; must be 1 (this baseline has no tensor
        parallelism).

    Every invariant is checked here, so a bad configuration raises ``ValueError`` naming the
    argument before anything is traced. ``model_size`` is left out of the hash (a dict), not out
    of equality.
    """

    data: int
    stages: int
    micro_batches: int
    repeats: int
    batch: int
    model_size: Mapping[str, int] = dataclasses.field(hash=False)
    model_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("data", "stages", "micro_batches", "repeats", "batch", "model_parallel"):
            _positive_int(name, getattr(self, name))
        if self.model_parallel != 1:
            raise ValueError(f"model_parallel must be 1 (the SPMD pipeline baseline has no tensor "
                             f"parallelism), got {self.model_parallel}")
        if self.micro_batches < self.stages:
            raise ValueError(f"micro_batches ({self.micro_batches}) must be >= stages ({self.stages}): "
                             f"a repeat's output must leave the last stage before stage 0 needs it")
        if not isinstance(self.model_size, Mapping):
            raise ValueError(f"model_size must be a mapping, got {type(self.model_size).__name__}")
        keys = set(self.model_size)
        if keys != set(_SIZE_KEYS):
            raise ValueError(f"model_size must have exactly the keys {_SIZE_KEYS}; missing "
                             f"{sorted(set(_SIZE_KEYS) - keys)}, unsupported {sorted(keys - set(_SIZE_KEYS))}")
        for key in _SIZE_KEYS:
            _positive_int(f"model_size[{key!r}]", self.model_size[key])
        object.__setattr__(self, "model_size", {k: int(self.model_size[k]) for k in _SIZE_KEYS})
        size = self.model_size
        if size["d_model"] % size["num_heads"]:
            raise ValueError(f"model_size: d_model ({size['d_model']}) must be divisible by "
                             f"num_heads ({size['num_heads']})")
        if size["num_layers"] % (self.repeats * self.stages):
            raise ValueError(f"model_size['num_layers'] ({size['num_layers']}) must be divisible by "
                             f"repeats * stages ({self.repeats} * {self.stages})")
        if self.batch % (self.micro_batches * self.data):
            raise ValueError(f"batch ({self.batch}) must be divisible by micro_batches * data "
                             f"({self.micro_batches} * {self.data})")

    @property
    def layers_per_stage(self) -> int:
        """``k``: consecutive layers a stage applies per repeat."""
        return self.model_size["num_layers"] // (self.repeats * self.stages)

    @property
    def iterations(self) -> int:
        """``M R + S - 1``: iterations of the pipelined loop."""
        return self.micro_batches * self.repeats + self.stages - 1

    @property
    def micro_batch(self) -> int:
        """``mb = B / M``: sequences per micro-batch (over all ``data`` devices)."""
        return self.batch // self.micro_batches


def bubble(M: int, R: int, S: int) -> float:
    """Idle fraction of stage-iterations: ``(S - 1) / (R M + S - 1)``."""
    return (S - 1) / (R * M + S - 1)


def spmd_mesh(devices: Sequence[Any], data: int, stages: int) -> Any:
    """The ``("stage", "data")`` mesh of shape ``(stages, data)`` over exactly ``stages * data`` devices.

    Devices are ordered process-major (by ``(process_index, id)``) before the reshape, so stage
    ``s`` is a contiguous block of ``data`` devices: one host per stage on an emulated cluster of
    ``data`` devices per host, the data-axis reductions staying inside a host.
    """
    import jax

    _positive_int("data", data)
    _positive_int("stages", stages)
    devices = list(devices)
    if len(devices) != data * stages:
        raise ValueError(f"devices: need exactly data * stages = {data * stages}, got {len(devices)}")
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return jax.sharding.Mesh(np.array(ordered, dtype=object).reshape(stages, data), (STAGE_AXIS, DATA_AXIS))


def init_gpt_params(model_size: Mapping[str, int], seed: int = 0) -> dict:
    """GPT(scan_layers=True, **model_size)'s ``params`` collection as host numpy arrays, unboxed.

    Tree: ``tok_embed``, ``pos_embed``, ``blocks/stack/block/...`` (leaves ``[L, ...]``),
    ``ln_f``, ``head``. Deterministic in ``seed``, so every process computes the same values.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from examples.gpt import GPT

    net = GPT(scan_layers=True, **model_size)
    variables = jax.jit(net.init)(jax.random.PRNGKey(seed), jnp.zeros((1, net.seq_len), jnp.int32))
    return jax.tree.map(np.asarray, nn.meta.unbox(variables["params"]))


def pipeline_params(gpt_params: Mapping[str, Any], repeats: int, stages: int) -> dict:
    """GPT(scan_layers=True) params -> the pipeline's: block leaves ``[L, ...] -> [R, S, k, ...]``.

    ``gpt_params`` is the ``params`` collection (boxed or not). The result has the non-block
    entries unchanged and ``"stages"``: the ``GPTBlock`` parameter tree with every leaf
    reshaped in C order, so ``out[r, s, j] = in[r S k + s k + j]``. Works on numpy and JAX
    arrays alike; inverse: :func:`gpt_params_from_pipeline`.
    """
    import flax.linen as nn
    import jax

    _positive_int("repeats", repeats)
    _positive_int("stages", stages)
    params = dict(nn.meta.unbox(gpt_params))
    blocks = params.pop("blocks")["stack"]["block"]
    layers = {x.shape[0] for x in jax.tree.leaves(blocks)}
    if len(layers) != 1:
        raise ValueError(f"gpt_params: block leaves disagree on the layer count: {sorted(layers)}")
    (num_layers,) = layers
    if num_layers % (repeats * stages):
        raise ValueError(f"gpt_params: {num_layers} layers are not divisible by repeats * stages "
                         f"({repeats} * {stages})")
    k = num_layers // (repeats * stages)
    params[STAGES_KEY] = jax.tree.map(lambda x: x.reshape(repeats, stages, k, *x.shape[1:]), blocks)
    return params


def gpt_params_from_pipeline(params: Mapping[str, Any]) -> dict:
    """Inverse of :func:`pipeline_params`: ``"stages"`` leaves ``[R, S, k, ...] -> [L, ...]`` under
    ``blocks/stack/block``, the rest unchanged (also maps gradients and Adam moments)."""
    import jax

    out = dict(params)
    stacked = out.pop(STAGES_KEY)
    out["blocks"] = {"stack": {"block": jax.tree.map(lambda x: x.reshape(-1, *x.shape[3:]), stacked)}}
    return out


def _check_mesh(config: SpmdPipelineConfig, mesh: Any) -> None:
    want = {STAGE_AXIS: config.stages, DATA_AXIS: config.data}
    if dict(mesh.shape) != want:
        raise ValueError(f"mesh: expected axes {want} (spmd_mesh(devices, {config.data}, {config.stages})), "
                         f"got {dict(mesh.shape)}")


def _stage_apply(weights: Any, repeat: Any, x: Any, num_heads: int) -> Any:
    """One stage, one iteration: its ``k`` blocks of repeat ``repeat`` on ``x`` ``[mb, T, d]``.

    ``weights``: this stage's slice, leaves ``[R, k, ...]``; ``repeat``: int32 scalar.
    """
    import jax
    from jax import lax

    from examples.gpt import GPTBlock

    # Stages sit on different repeats in one iteration, so the repeat index is per stage (a
    # gather under the vmap), not a static slice.
    chunk = jax.tree.map(lambda w: lax.dynamic_index_in_dim(w, repeat, 0, keepdims=False), weights)
    block = GPTBlock(num_heads)

    def layer(h: Any, p: Any) -> tuple[Any, None]:
        return block.apply({"params": p}, h), None

    out, _ = lax.scan(layer, x, chunk)
    return out


def _pipelined_blocks(stacked: Any, x: Any, config: SpmdPipelineConfig, mesh: Any) -> Any:
    """All ``L`` blocks on ``x`` ``[B, T, d]`` (sharded ``P("data")``) through the circular pipeline.

    ``stacked``: leaves ``[R, S, k, ...]``, sharded ``P(None, "stage")``. Returns ``[B, T, d]``
    sharded like ``x``, equal to the blocks applied in layer order.
    """
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    S, M, R = config.stages, config.micro_batches, config.repeats
    B, T, d = x.shape
    mb = B // M

    def constrain(a: Any, *spec: Any) -> Any:
        return lax.with_sharding_constraint(a, NamedSharding(mesh, P(*spec)))

    # Micro-batch m is rows j M + m: each data shard's contiguous rows then hold its part of
    # every micro-batch, so the split moves nothing (the loss is a mean, order-free).
    inputs = x.reshape(mb, M, T, d).swapaxes(0, 1)  # [M, mb, T, d]
    # A copy per stage, sharded like the state: stage 0 reads its own, so the backward
    # accumulates the inputs' cotangent locally and sums it over stages once, after the loop,
    # not in every iteration.
    inputs = constrain(jnp.broadcast_to(inputs, (S, M, mb, T, d)), STAGE_AXIS, None, DATA_AXIS)
    slots = M - S if R > 1 else 0
    state = constrain(jnp.zeros((S, mb, T, d), x.dtype), STAGE_AXIS, DATA_AXIS)
    # Sharded over "stage" like the state, though only stage 0's copy is read: the writes
    # (the rolled state) and reads (stage 0's input) then stay on stage 0's devices.
    circ = constrain(jnp.zeros((S, slots, mb, T, d), x.dtype), STAGE_AXIS, None, DATA_AXIS)
    stage_ids = jnp.arange(S)
    stages = jax.vmap(lambda w, r, h: _stage_apply(w, r, h, config.model_size["num_heads"]),
                      in_axes=(1, 0, 0), spmd_axis_name=STAGE_AXIS)

    def iteration(carry: tuple[Any, Any], n: Any) -> tuple[tuple[Any, Any], Any]:
        state, circ = carry
        first = lax.dynamic_index_in_dim(inputs, jnp.minimum(n, M - 1), 1, keepdims=False)  # [S, mb, T, d]
        if slots:
            # state[0] holds item n - S (the last stage's output of the previous iteration);
            # stage 0 needs item n - M; both live in slot (n - M) mod (M - S): read, then write.
            slot = jnp.remainder(n - M, slots)
            back = lax.dynamic_index_in_dim(circ, slot, 1, keepdims=False)
            circ = lax.dynamic_update_index_in_dim(circ, state, slot, 1)
        else:
            back = state
        stage0 = jnp.where(n < M, first, back)
        h = jnp.where((stage_ids == 0)[:, None, None, None], stage0, state)
        h = constrain(h, STAGE_AXIS, DATA_AXIS)
        repeat = jnp.clip((n - stage_ids) // M, 0, R - 1)
        y = constrain(stages(stacked, repeat, h), STAGE_AXIS, DATA_AXIS)
        return (constrain(jnp.roll(y, 1, axis=0), STAGE_AXIS, DATA_AXIS), circ), y

    body = jax.checkpoint(iteration, prevent_cse=False)
    _, ys = lax.scan(body, (state, circ), jnp.arange(config.iterations))  # ys [iterations, S, mb, T, d]
    # Micro-batch m's last repeat is item (R - 1) M + m, on the last stage at iteration + S - 1.
    start = (R - 1) * M + S - 1
    # Iterations first (unsharded: no communication), then the last stage's slice, broadcast
    # to every stage once.
    last = constrain(ys[start:start + M], None, STAGE_AXIS, DATA_AXIS)
    out = constrain(last[:, S - 1], None, DATA_AXIS)  # [M, mb, T, d]
    return constrain(out.swapaxes(0, 1).reshape(B, T, d), DATA_AXIS)


def pipeline_loss(params: Mapping[str, Any], batch: Mapping[str, Any], config: SpmdPipelineConfig,
                  mesh: Any) -> Any:
    """The GPT's mean next-token loss with the blocks pipelined (traceable, not jitted).

    ``params``: :func:`pipeline_params`'s tree; ``batch``: ``{"x", "y"}`` int32 ``[B, T]``.
    Embeddings, final LayerNorm, head and loss run on every device, the batch over ``"data"``.
    """
    import flax.linen as nn
    import jax.numpy as jnp

    from examples.gpt import gpt_loss

    size = config.model_size
    tokens = batch["x"]
    t = tokens.shape[-1]
    x = nn.Embed(size["vocab_size"], size["d_model"]).apply({"params": params["tok_embed"]}, tokens)
    x = x + nn.Embed(size["seq_len"], size["d_model"]).apply({"params": params["pos_embed"]}, jnp.arange(t))
    h = _pipelined_blocks(params[STAGES_KEY], x, config, mesh)
    h = nn.LayerNorm().apply({"params": params["ln_f"]}, h)
    logits = nn.Dense(size["vocab_size"]).apply({"params": params["head"]}, h)
    return gpt_loss(logits, batch["y"])


def _spec_tree(tree: Any) -> Any:
    """PartitionSpec per leaf: ``P(None, "stage")`` under a ``"stages"`` key, else replicated."""
    import jax
    from jax.sharding import PartitionSpec as P

    def spec(path: Any, _: Any) -> Any:
        stacked = any(getattr(k, "key", None) == STAGES_KEY for k in path)
        return P(None, STAGE_AXIS) if stacked else P()

    return jax.tree_util.tree_map_with_path(spec, tree)


def state_shardings(tree: Any, mesh: Any) -> Any:
    """NamedSharding per leaf of a params-like tree (params, grads, Adam state, or a dict of them):
    the ``[R, S, k, ...]`` leaves under ``"stages"`` sharded over ``"stage"`` on axis 1, the rest
    replicated."""
    import jax
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda s: NamedSharding(mesh, s), _spec_tree(tree))


def batch_shardings(mesh: Any) -> dict:
    """``{"x", "y"}``: the ``[B, T]`` token arrays sharded over ``"data"``, replicated over ``"stage"``."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    s = NamedSharding(mesh, P(DATA_AXIS))
    return {"x": s, "y": s}


def place(tree: Any, shardings: Any) -> Any:
    """Global arrays from full host arrays (every process holds all of ``tree``): each device's
    shard is cut from the host copy, so no process-local data is assumed."""
    import jax

    def one(host: Any, sharding: Any) -> Any:
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    return jax.tree.map(one, tree, shardings)


def loss_and_grads(config: SpmdPipelineConfig, mesh: Any) -> Callable[[Any, Any], tuple[Any, Any]]:
    """Jitted ``(params, batch) -> (loss, grads)`` of :func:`pipeline_loss`.

    ``params``/``grads``: :func:`pipeline_params` trees, placed with :func:`state_shardings`;
    ``batch``: ``{"x", "y"}`` ``[B, T]`` sharded ``P("data")``; ``loss`` replicated. Arguments
    may also be host arrays (then jit places them).
    """
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _check_mesh(config, mesh)
    params_shape = jax.eval_shape(lambda p: pipeline_params(p, config.repeats, config.stages),
                                  _abstract_gpt_params(config))
    shardings = state_shardings(params_shape, mesh)
    fn = jax.value_and_grad(lambda p, b: pipeline_loss(p, b, config, mesh))
    return jax.jit(fn, in_shardings=(shardings, batch_shardings(mesh)),
                   out_shardings=(NamedSharding(mesh, P()), shardings))


def _abstract_gpt_params(config: SpmdPipelineConfig) -> Any:
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from examples.gpt import GPT

    net = GPT(scan_layers=True, **config.model_size)
    shapes = jax.eval_shape(net.init, jax.random.PRNGKey(0), jnp.zeros((1, net.seq_len), jnp.int32))
    return nn.meta.unbox(shapes["params"])


def build_train_step(config: SpmdPipelineConfig, mesh: Any, seed: int = 0,
                     learning_rate: float = 1e-3) -> tuple[Callable[[Any, Any], tuple[Any, Any]], dict, dict]:
    """``(step, state, batch)`` on ``mesh``: ``step(state, batch) -> (state, loss)``.

    ``state = {"params": pipeline params, "opt_state": optax.adam(learning_rate) state}``, from
    :func:`init_gpt_params` (``seed``); ``batch = gpt_batch(seed, B, T, vocab)`` sharded
    ``P("data")``. ``step`` is one jit with explicit in/out shardings (the stacked leaves and
    their moments over ``"stage"``, the rest replicated) and donates ``state``.
    """
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from examples.gpt import gpt_batch

    _check_mesh(config, mesh)
    size = config.model_size
    tx = optax.adam(learning_rate)
    host_params = pipeline_params(init_gpt_params(size, seed), config.repeats, config.stages)
    params = place(host_params, state_shardings(host_params, mesh))
    opt_shape = jax.eval_shape(tx.init, params)
    opt_state = jax.jit(tx.init, out_shardings=state_shardings(opt_shape, mesh))(params)
    state = {"params": params, "opt_state": opt_state}
    shardings = state_shardings(state, mesh)
    batch_specs = batch_shardings(mesh)
    batch = place(gpt_batch(seed, config.batch, size["seq_len"], size["vocab_size"]), batch_specs)

    def step(state: dict, batch: dict) -> tuple[dict, Any]:
        loss, grads = jax.value_and_grad(pipeline_loss)(state["params"], batch, config, mesh)
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}, loss

    jitted = jax.jit(step, in_shardings=(shardings, batch_specs),
                     out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)
    return jitted, state, batch


def memory_bytes_per_device(compiled: Any) -> dict[str, int]:
    """Bytes one device needs for ``compiled``, from XLA's ``compiled.memory_analysis()``.

    On CPU (jax 0.10) that returns a ``CompiledMemoryStats`` with ``argument_size_in_bytes``,
    ``output_size_in_bytes``, ``alias_size_in_bytes``, ``temp_size_in_bytes``,
    ``generated_code_size_in_bytes`` (0 on CPU), the ``host_*`` variants (0 on CPU) and
    ``peak_memory_in_bytes``, which on CPU is about argument + output bytes, temporaries not
    included, so not a peak. They describe the SPMD-partitioned module, i.e. one device: the
    argument bytes equal the per-device shard bytes of the inputs, not their global size (the
    test checks this against ``addressable_shards``). Every device of this pipeline runs the
    same module, so one figure holds for all.

    Returns ``argument_bytes``, ``output_bytes``, ``alias_bytes`` (outputs reusing donated
    arguments), ``temp_bytes``, ``generated_code_bytes``, ``peak_bytes`` = argument + output
    - alias + temp, and ``xla_peak_bytes`` (XLA's own ``peak_memory_in_bytes``, when the object
    has it).

    Raises:
      ValueError: ``memory_analysis()`` returned None (a backend that does not report it).
    """
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError("compiled.memory_analysis() returned None on this backend")
    out = {
        "argument_bytes": int(stats.argument_size_in_bytes),
        "output_bytes": int(stats.output_size_in_bytes),
        "alias_bytes": int(stats.alias_size_in_bytes),
        "temp_bytes": int(stats.temp_size_in_bytes),
        "generated_code_bytes": int(stats.generated_code_size_in_bytes),
    }
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    if getattr(stats, "peak_memory_in_bytes", None) is not None:
        out["xla_peak_bytes"] = int(stats.peak_memory_in_bytes)
    return out


def _mb(n: float) -> str:
    return f"{n / 2**20:.2f} MB"


def run(args: argparse.Namespace) -> dict:
    """Builds, compiles and times the train step on ``jax.devices()`` (all processes' devices,
    which must number ``D S``); returns the record. Call after the backend is set up."""
    import jax

    from benchmarks.pipeline_cases import GPT_SIZE

    data, model_parallel, stages = args.config
    config = SpmdPipelineConfig(data=data, stages=stages, micro_batches=args.micro_batches, repeats=args.repeats,
                                batch=args.batch, model_size=GPT_SIZE, model_parallel=model_parallel)
    prefix = f"[p{jax.process_index()}] " if jax.process_count() > 1 else ""

    def say(line: str) -> None:
        print(prefix + line, flush=True)

    mesh = spmd_mesh(jax.devices(), data, stages)
    name = (f"spmd_pipeline ({data},{model_parallel},{stages}) M={config.micro_batches} R={config.repeats} "
            f"B={config.batch}")
    say(f"{name}: {config.iterations} iterations, {config.layers_per_stage} layer(s) per stage per repeat, "
        f"{jax.process_count()} process(es), {len(jax.devices())} devices")
    step, state, batch = build_train_step(config, mesh)
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    compile_s = time.perf_counter() - start
    memory = memory_bytes_per_device(compiled)
    say(f"{name}: compiled in {compile_s:.1f} s; per device: peak {_mb(memory['peak_bytes'])}, "
        f"temp {_mb(memory['temp_bytes'])}, arguments {_mb(memory['argument_bytes'])}")
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        state, loss = compiled(state, batch)
        loss = float(jax.block_until_ready(loss))
        jax.block_until_ready(state)
        elapsed = time.perf_counter() - start
        losses.append(loss)
        timed = i >= args.warmup
        if timed:
            times.append(elapsed)
        say(f"{name}: {'step' if timed else 'warm-up'} {i - args.warmup if timed else i} "
            f"{elapsed:.3f} s loss {loss:.4f}")
    median = statistics.median(times)
    b = bubble(config.micro_batches, config.repeats, config.stages)
    say(f"{name}: RESULT step {median:.3f} s (median of {len(times)}), {config.batch / median:.1f} samples/s, "
        f"peak {_mb(memory['peak_bytes'])}/device, temp {_mb(memory['temp_bytes'])}/device, bubble {b:.3f}")
    return {
        "method": "spmd_pipeline", "model": "gpt", "config": [data, model_parallel, stages],
        "micro_batches": config.micro_batches, "repeats": config.repeats, "batch": config.batch,
        "step_times_s": times, "measured_step_s": median, "samples_per_s": config.batch / median,
        "peak_bytes_per_device": memory["peak_bytes"], "temp_bytes_per_device": memory["temp_bytes"],
        "memory": memory, "bubble": b, "losses": losses, "compile_s": compile_s,
        "processes": jax.process_count(),
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.spmd_pipeline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=int, nargs=3, metavar=("DATA", "MODEL", "PIPELINE"), default=(2, 1, 2),
                   help="mesh (data, model, pipeline); model must be 1")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--json", default=None, help="write the record here (a one-element list)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Runs alone in one process: ``D S`` virtual CPU devices, set before the backend starts."""
    args = _parse(argv)
    import jax

    from benchmarks.worker_records import write_json

    data, model_parallel, stages = args.config
    # Validated before the backend starts, so a bad argument fails fast and by name.
    from benchmarks.pipeline_cases import GPT_SIZE

    try:
        SpmdPipelineConfig(data=data, stages=stages, micro_batches=args.micro_batches, repeats=args.repeats,
                           batch=args.batch, model_size=GPT_SIZE, model_parallel=model_parallel)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    jax.config.update("jax_num_cpu_devices", data * stages)
    record = run(args)
    write_json(args.json, [record])
    return 0


if __name__ == "__main__":
    sys.exit(main())
