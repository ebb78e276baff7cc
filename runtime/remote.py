"""What a process holds of a value that lives on other processes' devices.

In a multi-controller run every process names every value, including those
whose shards all live elsewhere: it passes them to moves it takes part in
(or that number transfers on every process) and returns them from steps.
Such an array has the value's global shape, dtype and sharding and no local
shards; it holds no memory, so one can stand for every call.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Sharding

__all__ = ["absent"]


def absent(shape: tuple[int, ...], dtype: Any, sharding: Sharding) -> jax.Array:
    """An array of ``shape``/``dtype`` sharded as ``sharding`` with no shards in this process."""
    return jax.make_array_from_single_device_arrays(tuple(shape), sharding, [], dtype=dtype)
