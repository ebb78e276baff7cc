"""A cross-mesh move that carries one byte instead of the value (``resharding="signal"``).

The receiver's value is zeros of the value's shape, made from the byte that
arrived, so it exists only after the sender's value did: the same
dependencies as the real move, almost none of the bytes. A schedule run this
way measures its communication upper bound; its numbers are not the step's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar.runtime.remote import absent

__all__ = ["SignalMove"]


def _owns(sharding: NamedSharding) -> bool:
    me = jax.process_index()
    return any(d.process_index == me for d in sharding.mesh.devices.flat)


class SignalMove:
    """Moves a byte derived from ``x`` (sharded as ``src``) and yields zeros sharded as ``dst``.

    Args:
      shape, dtype: the value's.
      src, dst: its shardings on the two meshes.
      carry: moves a replicated 0-d ``uint8`` from ``src``'s mesh to ``dst``'s
        (``jax.device_put`` inside a process, a p2p move across processes);
        every process calls it, as p2p moves require.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, src: NamedSharding, dst: NamedSharding,
                 carry: Callable[[jax.Array], jax.Array]) -> None:
        self.shape, self.dtype, self.src, self.dst = tuple(shape), np.dtype(dtype), src, dst
        self._token_sharding = NamedSharding(src.mesh, P())
        self._carry = carry
        self._token = jax.jit(lambda x: (jnp.ravel(x)[0] * 0).astype(jnp.uint8), out_shardings=self._token_sharding)
        self._fill = jax.jit(lambda t: jnp.zeros(self.shape, self.dtype) + t.astype(self.dtype), out_shardings=dst)
        self._sends, self._receives = _owns(src), _owns(dst)
        # What this process names in place of a value it owns no shard of.
        self._no_token = None if self._sends else absent((), np.uint8, self._token_sharding)
        self._no_value = None if self._receives else absent(self.shape, self.dtype, dst)

    def __call__(self, x: jax.Array) -> jax.Array:
        arrived = self._carry(self._token(x) if self._sends else self._no_token)
        return self._fill(arrived) if self._receives else self._no_value
