"""An image classifier with BatchNorm trained as flax's ``examples/imagenet`` writes its train
step, changed only to ``meshpar.value_and_grad`` and a stage marker.

    python -m examples.flax_image_classifier [--steps N]

The pattern followed (written anew here, not copied): a small convolutional network with
``nn.BatchNorm``; the loss function applies the model with ``mutable=["batch_stats"]``, adds
an L2 weight penalty to the mean cross-entropy and returns the new batch statistics and the
logits as aux; the metrics (loss and accuracy) are computed outside the loss function; the
new statistics go into the state with ``apply_gradients(..., batch_stats=...)``.

BatchNorm normalises each example with statistics of the whole batch it runs in, so no
combination of micro-batches reproduces the whole batch: meshpar warns when the step
compiles (naming the BatchNorm call's line) and runs each micro-batch as a batch of its own
(docs/micro_batching.md); ``exact=True`` makes that an error. The printed loss
is set beside ``jax.jit`` run per micro-batch and averaged, which it equals.
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

__all__ = ["ConvNet", "TrainState", "compute_metrics", "image_batch", "make_state", "train_step"]

NUM_CLASSES = 4
WEIGHT_DECAY = 1e-4


class ConvNet(nn.Module):
    """Conv, BatchNorm, ReLU, a stage marker, Conv, BatchNorm, ReLU, global average pool, Dense:
    ``float32 [B, H, W, C] -> [B, NUM_CLASSES]``."""

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool = True) -> jnp.ndarray:
        norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
        x = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        meshpar.mark_stage_boundary()
        x = nn.relu(norm()(nn.Conv(8, (3, 3), use_bias=False)(x)))
        return nn.Dense(NUM_CLASSES)(x.mean(axis=(1, 2)))


class TrainState(train_state.TrainState):
    """flax's ``TrainState`` with the model's BatchNorm statistics."""

    batch_stats: Any


def cross_entropy_loss(logits: jnp.ndarray, labels: jnp.ndarray) -> jnp.ndarray:
    """Mean softmax cross-entropy over the batch."""
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, NUM_CLASSES)).mean()


def compute_metrics(logits: jnp.ndarray, labels: jnp.ndarray) -> dict[str, jnp.ndarray]:
    """The batch's mean loss and accuracy."""
    return {"loss": cross_entropy_loss(logits, labels), "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def make_train_step(exact: bool = False) -> Any:
    """``train_step(state, batch) -> (state, metrics)`` as flax's imagenet example writes it;
    ``exact``: ``meshpar.value_and_grad``'s (refuse per-micro-batch semantics)."""

    def train_step(state: TrainState, batch: dict[str, jnp.ndarray]) -> tuple[TrainState, dict]:
        def loss_fn(params):
            logits, new_model_state = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                                     batch["image"], mutable=["batch_stats"])
            loss = cross_entropy_loss(logits, batch["label"])
            weight_l2 = sum(jnp.sum(x ** 2) for x in jax.tree.leaves(params) if x.ndim > 1)
            return loss + WEIGHT_DECAY * 0.5 * weight_l2, (new_model_state, logits)

        (_, (new_model_state, logits)), grads = meshpar.value_and_grad(loss_fn, has_aux=True, exact=exact)(
            state.params)
        metrics = compute_metrics(logits, batch["label"])
        return state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"]), metrics

    return train_step


train_step = make_train_step()


def image_batch(seed: int, batch_size: int = 16, size: int = 6) -> dict[str, np.ndarray]:
    """Random images ``float32 [B, size, size, 3]`` whose label is the brightest channel."""
    rng = np.random.default_rng(seed)
    image = rng.standard_normal((batch_size, size, size, 3)).astype(np.float32)
    label = np.argmax(image.mean(axis=(1, 2)), axis=-1).astype(np.int32) % NUM_CLASSES
    return {"image": image, "label": label}


def make_state(example: np.ndarray, learning_rate: float = 0.05) -> TrainState:
    model = ConvNet()
    variables = model.init(jax.random.key(0), example)
    return TrainState.create(apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                             tx=optax.sgd(learning_rate, momentum=0.9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    jax.config.update("jax_num_cpu_devices", 4)
    M = 4
    state = make_state(image_batch(0)["image"][:1])
    method = meshpar.PipeshardParallel(num_micro_batches=M, num_stages=2, stage_mesh_shape=(2, 1),
                                       devices=jax.devices()[:4])
    parallel = meshpar.parallelize(train_step, method=method)
    for step in range(args.steps):
        batch = image_batch(step)
        size, host = len(batch["label"]) // M, jax.device_get(state)
        reference = [jax.jit(train_step)(host, jax.tree.map(lambda v: v[m * size:(m + 1) * size], batch))[1]
                     for m in range(M)]
        state, metrics = parallel(state, batch)
        print(f"step {step}: loss {float(metrics['loss']):.6f} (jax.jit per micro-batch, averaged: "
              f"{np.mean([float(r['loss']) for r in reference]):.6f})")
    print(parallel.get_executable(state, image_batch(0)).describe())


if __name__ == "__main__":
    main()
