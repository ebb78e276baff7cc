"""A cross-mesh move that carries one byte instead of the value (``executor="signal"``).

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
from jax.sharding import NamedSharding

from meshpar.passes.program.devices import device_key
from meshpar.passes.program.shardings import device_sharding
from meshpar.runtime.p2p_executor import token_of
from meshpar.runtime.remote import absent

__all__ = ["SignalMove"]


class SignalMove:
    """Moves a byte derived from ``x`` (sharded as ``src``) and yields zeros sharded as ``dst``.

    The byte is read from the shard on the source mesh's first device, by a program of that
    device alone: a program over the whole source mesh would make its devices meet in a
    collective (the byte is in one shard), a rendezvous the real move never has.

    Args:
      shape, dtype: the value's.
      src, dst: its shardings on the two meshes.
      carry: moves a 0-d ``uint8`` on the source mesh's first device to every device of
        ``dst``'s mesh (``jax.device_put`` inside a process, a p2p move across processes);
        every process calls it, as p2p moves require.
    """

    def __init__(self, shape: tuple[int, ...], dtype: Any, src: NamedSharding, dst: NamedSharding,
                 carry: Callable[[jax.Array], jax.Array]) -> None:
        self.shape, self.dtype, self.src, self.dst = tuple(shape), np.dtype(dtype), src, dst
        first = src.mesh.devices.flat[0]
        self._first = device_key(first)
        self._carry = carry
        self._fill = jax.jit(lambda t: jnp.zeros(self.shape, self.dtype) + t.astype(self.dtype), out_shardings=dst)
        me = jax.process_index()
        self._sends = first.process_index == me
        self._receives = any(d.process_index == me for d in dst.mesh.devices.flat)
        # What this process names in place of a value it owns no shard of.
        self._no_token = None if self._sends else absent((), np.uint8, device_sharding(first))
        self._no_value = None if self._receives else absent(self.shape, self.dtype, dst)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self._sends:
            shard = next(s.data for s in x.addressable_shards if device_key(s.device) == self._first)
            token = token_of(shard)
        else:
            token = self._no_token
        arrived = self._carry(token)
        return self._fill(arrived) if self._receives else self._no_value
