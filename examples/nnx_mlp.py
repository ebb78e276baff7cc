"""A flax NNX model and train step under ``meshpar.parallelize``, written as under ``nnx.jit``.

The step takes the model and an ``nnx.Optimizer`` and updates both in place; meshpar returns
the updated Variables and writes them back after each call, as ``nnx.jit`` does. The loss is
differentiated with ``meshpar.value_and_grad`` (``nnx.value_and_grad``'s result: an
``nnx.State`` of the ``nnx.Param`` gradients). ``nnx.with_partitioning`` names the model axis
a kernel shards over on its stage mesh; ``nnx.Dropout`` draws from the model's ``nnx.Rngs``,
folded per micro-batch.

Run it: ``python -m examples.nnx_mlp`` (8 virtual CPU devices; prints each step's loss next to
``nnx.jit``'s).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import meshpar

__all__ = ["NnxMLP", "make_model", "nnx_batch", "train_step"]


class NnxMLP(nnx.Module):
    """Two stages: ``Linear(d, h)`` + tanh + dropout, a stage marker, then ``Linear(h, k)``.
    The first kernel shards its output features over ``"model"``."""

    def __init__(self, d: int, h: int, k: int, dropout: float, rngs: nnx.Rngs) -> None:
        sharded = nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model"))
        self.hidden = nnx.Linear(d, h, kernel_init=sharded, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(h, k, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.dropout(jnp.tanh(self.hidden(x)))
        meshpar.mark_stage_boundary()
        return self.out(h)


def make_model(d: int = 6, h: int = 16, k: int = 4, dropout: float = 0.0, seed: int = 0,
               learning_rate: float = 1e-2) -> tuple[NnxMLP, nnx.Optimizer]:
    """A fresh model and its Adam optimizer over the ``nnx.Param``s. Sharding annotations are
    kept as metadata (no mesh is needed to build it; meshpar places each Variable on its
    stage's mesh)."""
    with nnx.use_eager_sharding(False):
        model = NnxMLP(d, h, k, dropout, nnx.Rngs(seed, dropout=seed + 1))
    return model, nnx.Optimizer(model, optax.adam(learning_rate), wrt=nnx.Param)


def nnx_batch(n: int = 16, d: int = 6, k: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    """A regression batch: ``x`` of shape ``[n, d]``, ``y`` of shape ``[n, k]``."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((n, d)).astype(np.float32),
            "y": rng.standard_normal((n, k)).astype(np.float32)}


def train_step(model: NnxMLP, optimizer: nnx.Optimizer, batch: dict[str, Any]) -> jax.Array:
    """One step: mean squared error, its gradient, the optimizer's update in place."""

    def loss_fn(model: NnxMLP) -> jax.Array:
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshpar.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def main() -> None:
    jax.config.update("jax_num_cpu_devices", 8)
    method = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2),
                                       batch_argnums=(2,))
    step = meshpar.parallelize(train_step, method=method)
    reference = nnx.jit(train_step)
    model, optimizer = make_model()
    ref_model, ref_optimizer = make_model()
    batch = nnx_batch()
    for i in range(3):
        loss = step(model, optimizer, batch)
        ref_loss = reference(ref_model, ref_optimizer, batch)
        print(f"step {i}: loss {float(loss):.6f} (nnx.jit {float(ref_loss):.6f}), "
              f"optimizer.step {int(optimizer.step[...])}")
    print(step.get_executable(model, optimizer, batch).describe())


if __name__ == "__main__":
    main()
