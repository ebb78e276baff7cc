"""Putting step inputs where the layout says, viewing micro-batches of a global batch where they
lie, and joining per-mesh copies of outputs."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshpar.passes.program.batch_rows import MicroBatchRows
from meshpar.passes.program.devices import device_key
from meshpar.passes.program.shardings import PlaceLeaf

__all__ = ["put", "place", "on_meshes", "join", "view", "micro_batch_view"]


def put(value: Any, sharding: NamedSharding, what: str = "a value") -> jax.Array:
    """``value`` (host data, or an array anywhere) placed with ``sharding``, in any process;
    ``what`` names it in errors.

    Raises:
      ValueError: naming ``what``, for an array spanning processes not laid out as ``sharding``:
        no process can fetch it to the host, and only a move the compiler plans places it
        (``batch_rows.global_batch_placements``, for a global batch).
    """
    # Specs spelt differently (P("model") and P("model", None)) place a value alike: no copy.
    # An uncommitted array (made without naming its device) is committed by a copy: JAX
    # compiles a program again for operands it may move (the first step's would not be the next's).
    if isinstance(value, jax.Array) and value.committed and (
            value.sharding is sharding or _places_alike(value.sharding, sharding, value.ndim)):
        return value
    if isinstance(value, jax.Array) and value.is_fully_addressable and jax.process_count() == 1:
        if not _on_one_cpu_device(value):
            return jax.device_put(value, sharding)
        # JAX cuts an array on one device into shards with a program it compiles per shape and
        # layout (40 ms each on XLA:CPU, every one on the first step); a CPU array's host view is
        # its own buffer, cut as numpy without compiling.
        value = np.asarray(value)
    if isinstance(value, jax.Array) and not value.is_fully_addressable:
        raise ValueError(
            f"{what}: a jax.Array spanning processes, laid out as {value.sharding}, is to be placed as {sharding} "
            f"with no move planned for it, and no process can fetch it to the host. Pass it laid out as the step "
            f"keeps it (meshpar.reshard(x, sharding), every process calling it) or as host data equal on every "
            f"process; a batch built with jax.make_array_from_process_local_data belongs in batch_argnums, whose "
            f"global arrays the compiler moves where the step reads them")
    host = np.asarray(value)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def _on_one_cpu_device(value: jax.Array) -> bool:
    """Whether ``value`` lies on one CPU device, with a host view (keys have none)."""
    devices = value.devices()
    return (len(devices) == 1 and next(iter(devices)).platform == "cpu"
            and not jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended))


@functools.lru_cache(maxsize=4096)
def _places_alike(a: jax.sharding.Sharding, b: NamedSharding, ndim: int) -> bool:
    """Whether ``a`` and ``b`` lay out an array of ``ndim`` dimensions alike. Cached: a step
    checks each of its leaves, and the shardings of a step's outputs recur every step (their
    hashes are cached; comparing specs is not)."""
    return a == b or a.is_equivalent_to(b, ndim)


def view(x: jax.Array, sharding: NamedSharding, shape: tuple[int, ...] | None = None) -> jax.Array:
    """The shards of ``x`` on ``sharding``'s devices as one array laid out by ``sharding``,
    without copies: of ``x``'s shape (a union-replicated array's part on one mesh), or of
    ``shape`` (a stacked array's piece on its mesh)."""
    wanted = {device_key(d) for d in sharding.mesh.devices.flat}
    shards = [s.data for s in x.addressable_shards if device_key(s.device) in wanted]
    return jax.make_array_from_single_device_arrays(x.shape if shape is None else shape, sharding, shards,
                                                    dtype=x.dtype)


def place(value: Any, placement: PlaceLeaf, what: str = "a value") -> dict[int, jax.Array]:
    """``value`` on each mesh of ``placement``: put once over their union and viewed per mesh, or
    put on each; ``what`` names it in errors (``put``)."""
    if placement.union is None:
        return {m: put(value, placement.on(m), what) for m in placement.meshes}
    return on_meshes(put(value, placement.union, what), placement)


def on_meshes(union: jax.Array, placement: PlaceLeaf) -> dict[int, jax.Array]:
    """``union``, a value laid out over every mesh of ``placement`` (its union sharding), as
    each mesh's view."""
    return {m: view(union, placement.on(m)) for m in placement.meshes}


def join(parts: Sequence[jax.Array], union: NamedSharding | None, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Per-mesh replicated copies of one value (possibly shard-less here) as one array laid out as
    ``union``, over all their devices; ``None`` (meshes of several platforms): the first copy."""
    if union is None:
        return parts[0]
    shards = [s.data for x in parts for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(shape, union, shards, dtype=dtype)


def micro_batch_view(leaf: jax.Array, rows: MicroBatchRows, size: int) -> jax.Array:
    """One micro-batch of a global batch ``leaf`` where its rows already lie (``rows``), as an
    array of ``size`` rows laid out by ``rows.sharding``: this process's shards of it (each a
    whole shard of ``leaf``, or rows of one), or none."""
    wanted = rows.sharding.addressable_devices
    pieces: dict[Any, jax.Array] = {}
    for shard in leaf.addressable_shards:
        if shard.device in wanted and shard.device not in pieces:
            pieces[shard.device] = shard.data if rows.whole else shard.data[rows.start: rows.start + size]
    shape = (size, *leaf.shape[1:])
    return jax.make_array_from_single_device_arrays(shape, rows.sharding, list(pieces.values()), dtype=leaf.dtype)
