"""How a value travels between meshes and sits in pipeline buffers: typed PRNG keys as their
key data (``uint32``, the key shape appended), every other value as it is.

Transfers plan and move plain arrays only; stage programs convert keys at their edges, so a
key made on one stage (a derived dropout key) reaches the next one intact.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from .. import jax_ir

__all__ = ["from_wire", "is_key", "leaf_dtype", "to_wire", "wire_aval"]


def leaf_dtype(x: Any) -> Any:
    """The dtype JAX gives ``x`` (Python scalars and int64 numpy data canonicalised; typed PRNG
    keys keep their key dtype)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


def wire_aval(aval: jax_ir.AbstractValue) -> jax_ir.ShapedArray:
    """The aval ``aval``'s values travel as."""
    if is_key(aval):
        return jax_ir.ShapedArray((*aval.shape, *aval.dtype._impl.key_shape), np.dtype(np.uint32))
    return jax_ir.ShapedArray(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def to_wire(x: Any) -> Any:
    """``x`` as it travels (inside a traced function or eagerly)."""
    return jax.random.key_data(x) if is_key(x) else x


def from_wire(x: Any, aval: jax_ir.AbstractValue) -> Any:
    """A travelled value back as ``aval``'s type."""
    return jax.random.wrap_key_data(x, impl=aval.dtype._impl) if is_key(aval) else x


def is_key(aval: jax_ir.AbstractValue) -> bool:
    """Whether ``aval`` is a typed PRNG key array (``jax.random.key``)."""
    return jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended)
