"""A padded-sequence language model trained as flax's ``examples/lm1b`` writes its train step,
changed only to ``meshpar.value_and_grad`` and stage markers.

    python -m examples.flax_lm [--steps N] [--schedule NAME]

The pattern followed (written anew here, not copied): the parameters carry flax *logical*
partitioning (``nn.with_logical_partitioning``) mapped to mesh axes by
``nn.logical_axis_rules``; padding positions (token 0) get weight 0; the loss function
returns the weighted cross-entropy (with label smoothing) **divided by the batch's token
count inside the loss function**, with the logits as aux; the metrics (loss and accuracy sums
and the token count) are computed **outside** the loss function from the logits and the
batch; an ``eval_step`` computes the same metrics without a gradient.

meshpar cuts the step into 2 stages on two ``(data=2, model=2)`` meshes, and the same steps
run under plain ``jax.jit`` on one device beside it: the losses and metrics printed per
step agree to float tolerance, because meshpar computes the token count once on the whole
batch and sums each micro-batch's share of the loss (docs/micro_batching.md).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state

import meshpar

__all__ = ["LOGICAL_AXIS_RULES", "PaddedLM", "compute_metrics", "eval_step", "lm_batch", "make_state", "train_step"]

# Logical axis names as flax's examples and MaxText name them, mapped to the stage meshes' axes.
LOGICAL_AXIS_RULES = (("batch", "data"), ("vocab", None), ("embed", None), ("mlp", "model"), ("length", None))

LABEL_SMOOTHING = 0.1


class Block(nn.Module):
    """A residual MLP block over tokens, its kernels partitioned ``(embed, mlp)`` and
    ``(mlp, embed)``; a stage marker after it."""

    hidden: int

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        init = nn.initializers.lecun_normal()
        h = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(nn.LayerNorm()(x))
        x = x + nn.Dense(x.shape[-1], kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.gelu(h))
        meshpar.mark_stage_boundary()
        return x


class PaddedLM(nn.Module):
    """Token embedding, ``num_blocks`` blocks (a marker after all but the last), logits over
    the vocabulary: ``int32 [B, T] -> float32 [B, T, vocab]``."""

    vocab_size: int = 32
    width: int = 16
    hidden: int = 32
    num_blocks: int = 2

    @nn.compact
    def __call__(self, tokens: jnp.ndarray) -> jnp.ndarray:
        embed = nn.Embed(self.vocab_size, self.width,
                         embedding_init=nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")))
        x = embed(tokens)
        for _ in range(self.num_blocks - 1):
            x = Block(self.hidden)(x)
        h = nn.Dense(self.hidden, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                           ("embed", "mlp")))(nn.LayerNorm()(x))
        return nn.Dense(self.vocab_size, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(),
                                                                                  ("mlp", "vocab")))(nn.gelu(h))


def weighted_cross_entropy(logits: jnp.ndarray, targets: jnp.ndarray, weights: jnp.ndarray,
                           label_smoothing: float = 0.0) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Sum over tokens of the label-smoothed cross-entropy times ``weights``, and the sum of the
    weights: ``[B, T, V]``, ``[B, T]``, ``[B, T]`` -> two scalars."""
    vocab = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    soft = optax.smooth_labels(jax.nn.one_hot(targets, vocab), label_smoothing) if label_smoothing else \
        jax.nn.one_hot(targets, vocab)
    # The loss of a perfect prediction, so a solved batch reads 0 (as flax's example does).
    floor = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20)) if label_smoothing else 0.0
    loss = optax.softmax_cross_entropy(logits, soft) - floor
    return (loss * weights).sum(), weights.sum()


def weighted_accuracy(logits: jnp.ndarray, targets: jnp.ndarray, weights: jnp.ndarray
                      ) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Correct predictions counted by ``weights``, and the sum of the weights."""
    return ((jnp.argmax(logits, -1) == targets) * weights).sum(), weights.sum()


def compute_metrics(logits: jnp.ndarray, targets: jnp.ndarray, weights: jnp.ndarray) -> dict[str, jnp.ndarray]:
    """Loss and accuracy sums and the token count of a batch (summed across hosts by the caller
    in flax's example; here the batch is one global array)."""
    loss, count = weighted_cross_entropy(logits, targets, weights, LABEL_SMOOTHING)
    correct, _ = weighted_accuracy(logits, targets, weights)
    return {"loss": loss, "accuracy": correct, "denominator": count}


def train_step(state: train_state.TrainState, batch: dict[str, jnp.ndarray]) -> tuple[train_state.TrainState, dict]:
    """One step as flax's lm1b example writes it: weights from the padding, the loss divided by
    the token count inside ``loss_fn``, the metrics computed outside it from the logits."""
    inputs, targets = batch["inputs"], batch["targets"]
    weights = jnp.where(targets > 0, 1.0, 0.0).astype(jnp.float32)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, inputs)
        loss, weight_sum = weighted_cross_entropy(logits, targets, weights, LABEL_SMOOTHING)
        return loss / weight_sum, logits

    (_, logits), grads = meshpar.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    return new_state, compute_metrics(logits, targets, weights)


def eval_step(params: Any, batch: dict[str, jnp.ndarray], apply_fn: Any = None) -> dict[str, jnp.ndarray]:
    """The metrics of ``batch`` without a gradient (flax's ``eval_step``)."""
    weights = jnp.where(batch["targets"] > 0, 1.0, 0.0).astype(jnp.float32)
    logits = (apply_fn or PaddedLM().apply)({"params": params}, batch["inputs"])
    return compute_metrics(logits, batch["targets"], weights)


def lm_batch(seed: int, batch_size: int = 16, length: int = 8, vocab: int = 32) -> dict[str, np.ndarray]:
    """Padded next-token sequences: ``{"inputs", "targets"}``, int32 ``[B, T]``, each row an
    arithmetic progression over ``1 .. vocab - 1`` cut to a random length, the rest 0
    (padding); the first quarter of the rows is empty: a quarter of the batch's micro-batches
    holds padding only."""
    rng = np.random.default_rng(seed)
    start = rng.integers(1, vocab, batch_size)[:, None]
    stride = rng.integers(1, 4, batch_size)[:, None]
    seq = (start + stride * np.arange(length + 1)[None, :]) % (vocab - 1) + 1
    lengths = rng.integers(2, length + 1, batch_size)
    lengths[:batch_size // 4] = 0
    mask = np.arange(length + 1)[None, :] < lengths[:, None] + 1
    seq = np.where(mask, seq, 0).astype(np.int32)
    return {"inputs": seq[:, :-1], "targets": seq[:, 1:]}


def make_state(model: PaddedLM, example: np.ndarray, learning_rate: float = 3e-3) -> train_state.TrainState:
    """A ``TrainState`` whose parameters keep their ``LogicallyPartitioned`` boxes."""
    params = model.init(jax.random.key(0), example)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(learning_rate))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b")
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 8)
    V = 2 if args.schedule in ("zb_v", "dualpipev") else 1
    model = PaddedLM(num_blocks=2 * V)
    state = make_state(model, lm_batch(0)["inputs"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2 * V, stage_mesh_shape=(2, 2),
                                       schedule=args.schedule, stages_per_mesh=V,
                                       logical_axis_rules=LOGICAL_AXIS_RULES, devices=jax.devices()[:8])
    parallel = meshpar.parallelize(train_step, method=method)
    reference = jax.jit(train_step)
    ref = par = state
    for step in range(args.steps):
        batch = lm_batch(step)
        ref, ref_metrics = reference(ref, batch)
        par, metrics = parallel(par, batch)
        print(f"step {step}: loss {float(metrics['loss'] / metrics['denominator']):.6f} "
              f"(jax.jit {float(ref_metrics['loss'] / ref_metrics['denominator']):.6f}), accuracy "
              f"{float(metrics['accuracy'] / metrics['denominator']):.4f}, tokens {int(metrics['denominator'])}")
    print(parallel.get_executable(par, lm_batch(0)).describe())


if __name__ == "__main__":
    main()
