"""Several arrays as one flat vector and back: a program's outputs each cost the host a fixed
price, one vector costs it once (packed residuals, moves of many small values)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["flatten", "unflatten"]


def flatten(values: Sequence[jax.Array]) -> jax.Array:
    """``values`` (of one dtype) raveled and concatenated, in order."""
    return jnp.concatenate([jnp.ravel(x) for x in values])


def unflatten(flat: jax.Array, avals: Sequence[Any]) -> list[jax.Array]:
    """``flatten``'s inverse: ``flat`` cut into values shaped as ``avals``, in order."""
    values, start = [], 0
    for aval in avals:
        size = math.prod(aval.shape)
        values.append(flat[start:start + size].reshape(aval.shape))
        start += size
    return values
