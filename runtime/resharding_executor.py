"""Executes a ``TransferProgram``: one compiled SPMD program over the union of
the source and destination devices.

The program runs under ``jax.shard_map`` on a 1-d mesh of source devices then
destination devices. Each device holds two buffers: its source tile ``x``
(source devices pass their shard of the input array, without a copy;
destination devices pass a placeholder that is never written) and its
destination tile ``out``. Every step of the program is one
``jax.lax.ppermute`` per box shape: each sender cuts its box out of ``x`` (or,
relaying, out of ``out``) at an offset looked up by ``axis_index``, and each
receiver writes what arrives into ``out``. XLA lowers the ppermutes to NCCL
send/recv on GPUs and to gloo across processes on CPUs. Destination devices'
shards of the output are their final tiles and are re-wrapped onto the
destination sharding without copies.

Memory per device: the source tile (input) and the destination tile
(output); XLA's temporaries stay within one destination tile plus four boxes
(the payload cut out, the one arriving, and their selects), whatever the
tensor size (``tests/resharding/test_reshard.py`` checks this against
``memory_analysis``). A destination device also maps a source-tile-sized
placeholder whose pages are never touched; a source device also produces a
destination-tile-sized output shard that is dropped. No device ever holds
more than its own tiles.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.passes.program.resharding_programs import TransferProgram
from meshpar.runtime.compile_ahead import deferred_compile
from meshpar.runtime.coordination import wait_ready

__all__ = ["ReshardingExecutable"]

_AXIS = "union"


@dataclasses.dataclass(frozen=True)
class _Op:
    """One ``ppermute``: payload shape, pairs in union positions, per-position tables."""

    shape: tuple[int, ...]
    pairs: tuple[tuple[int, int], ...]
    send_offset: np.ndarray  # [n, rank]
    relay: np.ndarray  # [n] bool: sender reads ``out`` instead of ``x``
    recv_offset: np.ndarray  # [n, rank]
    receives: np.ndarray  # [n] bool
    reads_source: bool
    reads_relay: bool
    guarded: bool  # a non-receiver's zero write would clobber data it holds


def _ops(program: TransferProgram, position: dict[int, int]) -> list[list[_Op]]:
    """Per step, its ppermutes."""
    n, rank = len(position), len(program.dst_tile_shape)
    written: dict[int, list[tuple[int, ...]]] = {d: [] for d in program.dst_devices}
    out = []
    for step in program.steps:
        ops = []
        for shape in step.shapes:
            transfers = [t for t in step.transfers if t.shape == shape]
            send, recv = np.zeros((n, rank), np.int32), np.zeros((n, rank), np.int32)
            relay, receives = np.zeros(n, bool), np.zeros(n, bool)
            for t in transfers:
                send[position[t.src_device]] = t.src_offset
                relay[position[t.src_device]] = not t.from_source
                recv[position[t.dst_device]] = t.dst_offset
                receives[position[t.dst_device]] = True
            # ppermute hands non-receivers zeros, which they write at offset 0:
            # harmless unless that box overlaps data the device already holds.
            targets = {t.dst_device for t in transfers}
            guarded = any(
                all(s < e for s, e in zip(start, shape))
                for d, starts in written.items()
                if d not in targets
                for start in starts
            )
            for t in transfers:
                written[t.dst_device].append(t.dst_offset)
            ops.append(
                _Op(
                    shape=shape,
                    pairs=tuple((position[t.src_device], position[t.dst_device]) for t in transfers),
                    send_offset=send,
                    relay=relay,
                    recv_offset=recv,
                    receives=receives,
                    reads_source=any(t.from_source for t in transfers),
                    reads_relay=any(not t.from_source for t in transfers),
                    guarded=guarded,
                )
            )
        out.append(ops)
    return out


def _kernel(steps: list[list[_Op]], round_ends: frozenset[int], out_shape: tuple[int, ...], dtype: Any):
    def kernel(x: jax.Array) -> jax.Array:
        i = jax.lax.axis_index(_AXIS)
        out = jnp.zeros(out_shape, dtype)
        for k, ops in enumerate(steps):
            # One op at a time: read, permute, write. Reading all of a step's
            # payloads first kept them live across the other ops' writes and
            # made XLA copy the whole destination tile per extra op. Sequential
            # is safe: in a step a device sends at most one box and receives at
            # most one, a relay sends a box received in an earlier step, and a
            # non-receiver's zero write is guarded wherever it could clobber.
            for op in ops:
                offset = tuple(jnp.asarray(op.send_offset)[i])
                if op.reads_source and op.reads_relay:
                    payload = jnp.where(
                        jnp.asarray(op.relay)[i],
                        jax.lax.dynamic_slice(out, offset, op.shape),
                        jax.lax.dynamic_slice(x, offset, op.shape),
                    )
                else:
                    payload = jax.lax.dynamic_slice(out if op.reads_relay else x, offset, op.shape)
                got = jax.lax.ppermute(payload, _AXIS, op.pairs)
                offset = tuple(jnp.asarray(op.recv_offset)[i])
                if op.guarded:
                    got = jnp.where(jnp.asarray(op.receives)[i], got, jax.lax.dynamic_slice(out, offset, op.shape))
                out = jax.lax.dynamic_update_slice(out, got, offset)
            if k in round_ends:
                # Keep rounds apart: the next round's sends may not be hoisted
                # above this round's, or tasks the planner kept off each
                # other's NICs would overlap.
                x, out = jax.lax.optimization_barrier((x, out))
        return out

    return kernel


def _placeholder(device: Any, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """A buffer on ``device`` that the program reads only at offsets nobody receives.

    On CPU ``device_put`` of an aligned numpy array aliases it, and pages of
    ``np.empty`` that are never written cost no memory; elsewhere it is a
    plain allocation of one source tile.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 64, np.uint8)
    start = (-raw.ctypes.data) % 64
    host = raw[start : start + nbytes].view(dtype).reshape(shape)
    return jax.device_put(host, device, may_alias=True)


class ReshardingExecutable:
    """A compiled ``TransferProgram`` for one dtype and pair of shardings.

    Args:
      program: the lowered plan.
      shape, dtype: the global array's.
      src, dst: the source and destination ``NamedSharding``.

    Calling it with an array sharded as ``src`` returns the same array
    sharded as ``dst``. In multi-process runs every process owning a device
    of either mesh must call it, in the same order.
    """

    def __init__(
        self,
        program: TransferProgram,
        shape: tuple[int, ...],
        dtype: Any,
        src: NamedSharding,
        dst: NamedSharding,
    ) -> None:
        self.program = program
        self.shape = tuple(shape)
        self.dtype = jnp.dtype(dtype)
        self.src, self.dst = src, dst
        pool = {d.id: d for d in list(src.mesh.devices.flat) + list(dst.mesh.devices.flat)}
        union_ids = list(program.src_devices) + list(program.dst_devices)
        self.union = [pool[d] for d in union_ids]
        position = {d: k for k, d in enumerate(union_ids)}
        mesh = Mesh(np.array(self.union), (_AXIS,))
        self._union_sharding = NamedSharding(mesh, P(_AXIS))
        n = len(self.union)
        self._in_shape = (n * program.src_tile_shape[0], *program.src_tile_shape[1:])
        out_shape = (n * program.dst_tile_shape[0], *program.dst_tile_shape[1:])
        steps = _ops(program, position)
        kernel = _kernel(steps, frozenset(program.round_ends), program.dst_tile_shape, self.dtype)
        fn = jax.jit(jax.shard_map(kernel, mesh=mesh, in_specs=P(_AXIS), out_specs=P(_AXIS), check_vma=False))
        # Compiling on the pool, beside the pipeline's other programs (``compile_ahead``).
        self._deferred = deferred_compile(fn.lower(
            jax.ShapeDtypeStruct(self._in_shape, self.dtype, sharding=self._union_sharding)))
        self.num_collectives = sum(len(ops) for ops in steps)
        me = jax.process_index()
        self._local = [d for d in self.union if d.process_index == me]
        self._src_ids = set(program.src_devices)
        self._dst_ids = set(program.dst_devices)
        self._out_shape = out_shape
        self._placeholders: dict[int, jax.Array] = {}

    @property
    def _compiled(self) -> Any:
        """The compiled program (waiting for its compile)."""
        return self._deferred.get()

    @property
    def participates(self) -> bool:
        """Whether this process owns a device of either mesh."""
        return bool(self._local)

    def __call__(self, x: jax.Array, *, complete_within: float | None = None) -> jax.Array:
        """Moves ``x``; with ``complete_within`` (seconds), returns only once this process's part
        of the collective has finished.

        Several processes must run their collectives in one order. Each launches them in the
        same order, but a device runs a launched program once its inputs are ready, so two in
        flight at once can start in different orders on different processes and wait on each
        other forever (across processes, or between the device threads of one); a pipeline with
        several collective moves waits for each.

        Raises:
          CoordinationError: the collective did not finish within ``complete_within``.
        """
        shards = {s.device.id: s.data for s in x.addressable_shards}
        buffers = []
        for d in self._local:
            if d.id in self._src_ids:
                buffers.append(shards[d.id])
            else:
                if d.id not in self._placeholders:
                    self._placeholders[d.id] = _placeholder(d, self.program.src_tile_shape, self.dtype)
                buffers.append(self._placeholders[d.id])
        union_in = jax.make_array_from_single_device_arrays(
            self._in_shape, self._union_sharding, buffers, dtype=self.dtype
        )
        union_out = self._compiled(union_in)
        if complete_within is not None:
            wait_ready([union_out], complete_within, f"a collective resharding of {self.shape} {self.dtype}")
        mine = [s.data for s in union_out.addressable_shards if s.device.id in self._dst_ids]
        return jax.make_array_from_single_device_arrays(self.shape, self.dst, mine, dtype=self.dtype)
