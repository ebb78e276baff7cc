"""Executes a ``HopProgram`` with asynchronous point-to-point ``jax.device_put`` moves.

Nothing here spans both meshes, so no device waits for another to reach a
common program: a source device runs one small compiled *cut* program (its
pieces out of its tile), each hop is a ``jax.device_put`` of one
single-device array onto another single-device sharding (a local copy inside
a process; JAX's cross-host transfer path across processes: NCCL-backed in
the GPU client, the DCN transfer server on CPU), and each destination device
runs one small compiled *assemble* program (its pieces into its tile). A
relay forwards the array it received. All of it is dispatched
asynchronously: calling the executable returns as soon as the work is
enqueued, each hop starts when its source piece exists, and only a caller
that reads the result waits for it. So the moves overlap with whatever else
the devices run.

Dispatch order: ``"eager"`` (default) enqueues every hop at once, step by
step; ``"rounds"`` waits, before each plan round, for this process's
arrivals of the previous round (receivers pull across processes, so that
keeps the planner's rounds apart on the wire), and therefore blocks the
calling thread; it exists to be measured against ``"eager"``.

Multi-process rule (JAX's): cross-process transfers are numbered by a
per-process counter that every process advances on every cross-process
``device_put``, so every process of the job calls the executable, in the
same order, including processes that own no device of either mesh (they
name the hops with arrays that have no local shards).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.hop_program import HopProgram
from meshpar.runtime.coordination import wait_ready
from meshpar.runtime.remote import absent

__all__ = ["ORDERS", "P2PReshardExecutable", "device_sharding", "require_cross_host_transfers"]

ORDERS = ("eager", "rounds")


@functools.lru_cache(maxsize=None)
def device_sharding(device: Any) -> NamedSharding:
    """The sharding of an array that lives whole on ``device``, in any process
    (a ``NamedSharding``: ``SingleDeviceSharding`` cannot name a remote device
    for the cross-host path)."""
    return NamedSharding(Mesh(np.array([device]), ("device",)), P())


def require_cross_host_transfers(what: str) -> None:
    """Raises a ``RuntimeError`` naming ``meshpar.distributed.initialize`` when this
    process cannot move arrays to other processes with ``jax.device_put``."""
    from jax._src import xla_bridge

    native = getattr(xla_bridge.get_backend(), "supports_cross_host_transfers", False)
    if native and not xla_bridge.FORCE_DCN_CROSS_HOST_TRANSFERS.value:
        return
    if not xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value:
        raise RuntimeError(
            f"{what} moves data between processes with jax.device_put, which on "
            f"{jax.default_backend()} needs a cross-host transfer server: start every process with "
            f"meshpar.distributed.initialize(coordinator_address, num_processes, process_id) instead of "
            f"jax.distributed.initialize (or use executor='collective')"
        )


def _cut_fn(slices: tuple[tuple[slice, ...], ...]):
    def cut(tile: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(tile[s] for s in slices)

    return cut


def _assemble_fn(tile: tuple[int, ...], offsets: tuple[tuple[int, ...], ...], dtype: Any):
    def assemble(*pieces: jax.Array) -> jax.Array:
        out = jax.numpy.zeros(tile, dtype)
        for offset, piece in zip(offsets, pieces):
            out = jax.lax.dynamic_update_slice(out, piece, offset)
        return out

    return assemble


class P2PReshardExecutable:
    """A ``HopProgram`` prepared for one dtype and pair of shardings.

    Args:
      program: the lowered plan (``lower_to_hops`` or ``replicate_scalar``).
      dtype: the array's dtype.
      src, dst: source and destination ``NamedSharding``.
      order: ``"eager"`` or ``"rounds"`` (see the module docstring).
      timeout_s: how long ``"rounds"`` waits for one round's arrivals (a call
        may say otherwise).

    Compiles this process's cut and assemble programs when constructed, so
    calls do no tracing, planning or compiling.
    """

    def __init__(
        self,
        program: HopProgram,
        dtype: Any,
        src: NamedSharding,
        dst: NamedSharding,
        *,
        order: str = "eager",
        timeout_s: float = 120.0,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"order: expected one of {ORDERS}, got {order!r}")
        self.program = program
        self.shape = tuple(program.shape)
        self.dtype = np.dtype(dtype)
        self.src, self.dst = src, dst
        self.order, self.timeout_s = order, timeout_s
        devices = {d.id: d for d in [*src.mesh.devices.flat, *dst.mesh.devices.flat]}
        me = jax.process_index()
        local = {i for i, d in devices.items() if d.process_index == me}
        self._devices = devices
        self._local = local
        self.cross_process = any(
            devices[h.src_device].process_index != devices[h.dst_device].process_index
            for step in program.steps for h in step
        )
        if self.cross_process:
            require_cross_host_transfers("this resharding")
        self._whole, self._cuts = self._compile_cuts(local)
        self._steps, self._absent = self._split_hops(local, me)
        self._round_starts = {first for first, _ in program.rounds[1:]}
        self._assembles = self._compile_assembles(local)
        self._dst_order = [d.id for d in dst.mesh.devices.flat if d.id in local]
        self.participates = bool(local)

    def _on(self, device: int, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=device_sharding(self._devices[device]))

    def _compile_cuts(self, local: set[int]):
        """Per local source device, one compiled program cutting its pieces; a piece
        that is the whole tile is the tile itself (listed in ``whole``)."""
        program, tiles = self.program, dict(self.program.src_tiles)
        by_device: dict[int, list] = {}
        for c in program.cuts:
            if c.device in local:
                by_device.setdefault(c.device, []).append(c)
        whole: list[tuple[int, int]] = []
        cuts: list[tuple[int, Any, tuple[int, ...]]] = []
        for d, mine in sorted(by_device.items()):
            whole += [(d, c.piece) for c in mine if program.piece_shapes[c.piece] == tiles[d]]
            sliced = [c for c in mine if program.piece_shapes[c.piece] != tiles[d]]
            if sliced:
                slices = tuple(tuple(slice(o, o + n) for o, n in zip(c.offset, program.piece_shapes[c.piece]))
                               for c in sliced)
                fn = jax.jit(_cut_fn(slices)).lower(self._on(d, tiles[d])).compile()
                cuts.append((d, fn, tuple(c.piece for c in sliced)))
        return whole, cuts

    def _split_hops(self, local: set[int], me: int):
        """Per step, the hops this process calls: its own local copies (one batched
        ``device_put``) and every cross-process hop (every process numbers those),
        each in a ``device_put`` of its own: JAX groups a batch by device pair in a
        hash map whose order differs between processes, so two cross-process groups
        in one call would take their transfer numbers in different orders on the
        two sides. Also, for cross-process hops from other processes' devices, the
        shard-less arrays that name their sources here. Each hop is ``(source key,
        destination key, destination sharding)``, a key being ``(device, piece)``."""
        devices = self._devices
        Move = tuple[tuple[int, int], tuple[int, int], NamedSharding]
        steps: list[tuple[list[Move], list[Move]]] = []
        remote: dict[tuple[int, int], jax.Array] = {}
        for step in self.program.steps:
            local_hops, cross_hops = [], []
            for h in step:
                s, r = devices[h.src_device], devices[h.dst_device]
                hop = ((h.src_device, h.piece), (h.dst_device, h.piece), device_sharding(r))
                if s.process_index != r.process_index:
                    cross_hops.append(hop)
                    if h.src_device not in local:
                        remote[hop[0]] = absent(self.program.piece_shapes[h.piece], self.dtype, device_sharding(s))
                elif s.process_index == me:
                    local_hops.append(hop)
            steps.append((local_hops, cross_hops))
        return steps, remote

    def _compile_assembles(self, local: set[int]) -> list[tuple[int, Any, tuple[int, ...]]]:
        """Per local destination device, one compiled program placing its pieces into
        its tile; a device receiving one piece that is its whole tile keeps it as is."""
        program, tiles = self.program, dict(self.program.dst_tiles)
        pieces_at: dict[int, list] = {}
        for p in program.places:
            if p.device in local:
                pieces_at.setdefault(p.device, []).append(p)
        out: list[tuple[int, Any, tuple[int, ...]]] = []
        for d, places in sorted(pieces_at.items()):
            if len(places) == 1 and program.piece_shapes[places[0].piece] == tiles[d]:
                out.append((d, None, (places[0].piece,)))
                continue
            fn = jax.jit(_assemble_fn(tiles[d], tuple(p.offset for p in places), self.dtype)).lower(
                *[self._on(d, program.piece_shapes[p.piece]) for p in places]).compile()
            out.append((d, fn, tuple(p.piece for p in places)))
        return out

    def __call__(self, x: jax.Array, *, timeout_s: float | None = None) -> jax.Array:
        """``x`` (sharded as ``src``) moved onto ``dst``; returns without waiting (``"eager"``)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        # Keyed by (device, piece); pieces on other processes' devices are shard-less.
        have: dict[tuple[int, int], jax.Array] = dict(self._absent)
        if self._whole or self._cuts:
            shards = {s.device.id: s.data for s in x.addressable_shards}
            for d, piece in self._whole:
                have[(d, piece)] = shards[d]
            for d, fn, pieces in self._cuts:
                for piece, value in zip(pieces, fn(shards[d])):
                    have[(d, piece)] = value
        arrivals: list[jax.Array] = []
        for k, (local_hops, cross_hops) in enumerate(self._steps):
            if self.order == "rounds" and k in self._round_starts:
                wait_ready(arrivals, timeout_s, f"a round of a p2p resharding (before step {k})")
                arrivals = []
            if local_hops:
                moved = jax.device_put([have[s] for s, _, _ in local_hops], [to for _, _, to in local_hops])
                for (_, r, _), value in zip(local_hops, moved):
                    have[r] = value
                arrivals += moved
            for s, r, to in cross_hops:
                moved = jax.device_put(have[s], to)
                if r[0] in self._local:
                    have[r] = moved
                    arrivals.append(moved)
        tiles = {}
        for d, fn, pieces in self._assembles:
            tiles[d] = have[(d, pieces[0])] if fn is None else fn(*[have[(d, p)] for p in pieces])
        return jax.make_array_from_single_device_arrays(
            self.shape, self.dst, [tiles[d] for d in self._dst_order], dtype=self.dtype
        )
