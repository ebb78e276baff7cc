"""A multilayer perceptron split into pipeline stages.

Also home of :func:`stage_ends`, the even block-to-stage split that every
example model uses to decide where to call ``mark_stage_boundary()``.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from meshpar.stage_boundary import mark_stage_boundary

__all__ = ["MLP", "mlp_batch", "mlp_loss", "stage_ends"]


def stage_ends(num_blocks: int, num_stages: int) -> frozenset[int]:
    """Indices of the blocks after which a stage boundary goes.

    ``num_blocks`` blocks are cut into ``num_stages`` contiguous runs whose
    sizes differ by at most one; the earlier stages take the extra blocks.
    The last block never ends a stage with a marker (nothing follows it), so
    the result has ``num_stages - 1`` entries.

    Raises:
      ValueError: if ``num_stages`` is < 1 or exceeds ``num_blocks``.
    """
    if not 1 <= num_stages <= num_blocks:
        raise ValueError(
            f"num_stages={num_stages} must be between 1 and the number of "
            f"markable blocks ({num_blocks})"
        )
    base, extra = divmod(num_blocks, num_stages)
    ends, last = [], -1
    for stage in range(num_stages - 1):
        last += base + (1 if stage < extra else 0)
        ends.append(last)
    return frozenset(ends)


class MLP(nn.Module):
    """Dense + gelu layers; the last layer is linear.

    Each Dense layer is one markable block, so ``num_stages`` may be at most
    ``len(features)``.

    Input ``[..., d_in]`` -> output ``[..., features[-1]]``.
    """

    features: tuple[int, ...]
    num_stages: int = 1

    @nn.compact
    def __call__(self, x: jnp.ndarray) -> jnp.ndarray:
        ends = stage_ends(len(self.features), self.num_stages)
        for i, width in enumerate(self.features):
            x = nn.Dense(width, name=f"dense_{i}")(x)
            if i < len(self.features) - 1:
                x = nn.gelu(x)
            if i in ends:
                mark_stage_boundary()
        return x


def mlp_loss(pred: jnp.ndarray, target: jnp.ndarray) -> jnp.ndarray:
    """Mean squared error (a scalar)."""
    return jnp.mean((pred - target) ** 2)


def mlp_batch(seed: int, batch_size: int, d_in: int, d_out: int) -> dict[str, np.ndarray]:
    """A regression batch: ``{"x": [B, d_in], "y": [B, d_out]}``, float32.

    The target is a fixed smooth function of ``x`` (the projection does not
    depend on ``seed``), so batches from different seeds share one task.
    """
    x = np.random.default_rng(seed).standard_normal((batch_size, d_in))
    w = np.random.default_rng(12345).standard_normal((d_in, d_out)) / np.sqrt(d_in)
    return {"x": x.astype(np.float32), "y": np.tanh(x @ w).astype(np.float32)}
