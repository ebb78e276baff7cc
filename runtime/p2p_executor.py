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

Dispatch order: ``"gated"`` (default) enqueues every hop at once, step by
step, and keeps the planner's rounds apart on the wire on the devices: a
sender's cross-host piece of a later round depends on a one-byte token made
of the earlier rounds' arrivals it would share a NIC with
(``passes.round_gates``), so it leaves only once those arrived; ``"eager"`` enqueues every hop at once
with no gates (later rounds' flows then share NICs with earlier ones);
``"rounds"`` waits on the host, before each plan round, for this process's
arrivals of the previous round, and therefore blocks the calling thread.
``"eager"`` and ``"rounds"`` exist to be measured against ``"gated"``.

Multi-process rule (JAX's): cross-process transfers are numbered by a
per-process counter that every process advances on every cross-process
``device_put``, so every process of the job calls the executable, in the
same order, including processes that own no device of either mesh (they
name the hops with arrays that have no local shards).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshpar.passes import jax_ir
from meshpar.passes.program.devices import device_key
from meshpar.passes.program.moves import TransferOrder, move_device_ids
from meshpar.passes.program.resharding_programs import Gate, HopProgram
from meshpar.passes.program.shardings import device_sharding
from meshpar.runtime.compile_ahead import deferred_compile
from meshpar.runtime.coordination import wait_ready
from meshpar.runtime.remote import absent

__all__ = ["HopArrival", "P2PReshardExecutable", "require_cross_host_transfers",
           "token_of"]



@dataclasses.dataclass(frozen=True)
class HopArrival:
    """A cross-process hop into this process, as dispatched: step ``step`` of plan round
    ``round`` moves piece ``piece`` (``nbytes``) from device ``src_device`` to ``dst_device``;
    ``dispatched_s`` is ``time.time()`` at its ``jax.device_put`` and ``array`` the arriving
    value (ready once it has arrived). For tracing where a move's time goes."""

    step: int
    round: int
    src_device: int
    dst_device: int
    piece: int
    nbytes: int
    dispatched_s: float
    array: jax.Array


@functools.lru_cache(maxsize=None)
def require_cross_host_transfers(what: str) -> None:
    """Raises a ``RuntimeError`` naming ``meshpar.distributed.initialize`` when this
    process cannot move arrays to other processes with ``jax.device_put``."""
    native, forced_over_network, server_address = jax_ir.cross_host_transfer_settings()
    if native and not forced_over_network:
        return
    if not server_address:
        joined = jax_ir.distributed_params()
        line = ("meshpar.distributed.initialize()" if joined is None else
                f"meshpar.distributed.initialize(coordinator_address={joined[0]!r}, num_processes={joined[1]}, "
                f"process_id={joined[2]})")
        raise RuntimeError(
            f"{what} moves data between processes with jax.device_put, which on {jax.default_backend()} needs "
            f"a cross-host transfer server, and this process's backend started without one. Start every "
            f"process with {line} instead of jax.distributed.initialize (under srun, mpirun or another "
            f"launcher JAX detects, meshpar.distributed.initialize() with no arguments); or call "
            f"meshpar.distributed.initialize() right after jax.distributed.initialize; or set "
            f"jax.config.update('jax_cpu_collectives_implementation', 'gloo'), "
            f"jax.config.update('jax_cross_host_transfer_socket_address', '<this host's IP>:<a free port>') and "
            f"jax.config.update('jax_cross_host_transport_addresses', '<this host's IP>:0'). Each of these "
            f"before anything touches JAX's backend (jax.devices(), creating an array); or use "
            f"executor='collective'"
        )


def _cut_fn(slices: tuple[tuple[slice, ...], ...]):
    def cut(tile: jax.Array) -> tuple[jax.Array, ...]:
        return tuple(tile[s] for s in slices)

    return cut


def _token(piece: jax.Array) -> jax.Array:
    """A 0-d ``uint8`` zero that exists only once ``piece`` does (``x * 0`` is not folded:
    it is NaN for a NaN ``x``)."""
    return (jax.numpy.ravel(piece)[:1].sum() * 0).astype(jax.numpy.uint8)


def _combine(*tokens: jax.Array) -> jax.Array:
    return functools.reduce(jax.numpy.maximum, tokens)


def _gate(piece: jax.Array, token: jax.Array) -> jax.Array:
    """``piece``, as a value that exists only once ``token`` does too."""
    return jax.lax.optimization_barrier((piece, token))[0]


token_of, _combine_jit, _gate_jit = jax.jit(_token), jax.jit(_combine), jax.jit(_gate)


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
      order: a ``TransferOrder``: gated, eager or rounds (see the module docstring).
      gates: ``"gated"``'s gates (``passes.round_gates``), hosts being processes.
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
        order: TransferOrder = TransferOrder.GATED,
        timeout_s: float = 120.0,
        gates: tuple[Gate, ...] = (),
    ) -> None:
        if not isinstance(order, TransferOrder):
            raise TypeError(f"order: expected a TransferOrder (resolve a name with TransferOrder.of), got {order!r}")
        self.program = program
        self.shape = tuple(program.shape)
        self.dtype = np.dtype(dtype)
        self.src, self.dst = src, dst
        self.order, self.timeout_s = order, timeout_s
        # The hop program names devices by the planner's ids, distinct across platforms.
        ids = move_device_ids(src, dst)
        devices = {ids[device_key(d)]: d for d in [*src.mesh.devices.flat, *dst.mesh.devices.flat]}
        me = jax.process_index()
        local = {i for i, d in devices.items() if d.process_index == me}
        self._devices = devices
        self._ids = ids
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
        self.gates = gates if order.gated else ()
        self._gates_at: dict[int, list[Gate]] = {}
        for g in self.gates:
            self._gates_at.setdefault(program.rounds[g.round][0], []).append(g)
        self._assembles = self._compile_assembles(local)
        self._dst_order = [ids[device_key(d)] for d in dst.mesh.devices.flat if ids[device_key(d)] in local]
        self.participates = bool(local)

    def _apply(self, gate: Gate, have: dict[tuple[int, int], jax.Array], tokens: dict) -> None:
        """Makes ``gate.src_device``'s pieces wait for ``gate``'s token. ``tokens`` caches, for
        one call, each arrival's token, each gathered token and each token moved to a sender
        (later rounds' gates often await the same arrivals); every process fills it alike, so
        every process calls the tokens' cross-process ``device_put``s in one order, as hops."""
        gathered_key = (gate.collector, gate.arrivals)
        if gathered_key not in tokens:
            collector = device_sharding(self._devices[gate.collector])
            if gate.collector in self._local:
                for a in gate.arrivals:
                    if a not in tokens:
                        tokens[a] = token_of(have[a])
                gathered = _combine_jit(*[tokens[a] if a[0] == gate.collector else jax.device_put(tokens[a], collector)
                                          for a in gate.arrivals])
            else:
                gathered = absent((), np.uint8, collector)
            tokens[gathered_key] = gathered
        moved_key = (gathered_key, gate.src_device)
        if moved_key not in tokens:
            tokens[moved_key] = jax.device_put(tokens[gathered_key], device_sharding(self._devices[gate.src_device]))
        if gate.src_device in self._local:
            for piece in gate.pieces:
                have[(gate.src_device, piece)] = _gate_jit(have[(gate.src_device, piece)], tokens[moved_key])

    def _arrival(self, step: int, src: tuple[int, int], dst: tuple[int, int], array: jax.Array) -> HopArrival:
        round_of = next(i for i, (first, end) in enumerate(self.program.rounds) if first <= step < end)
        nbytes = int(np.prod(self.program.piece_shapes[src[1]], dtype=np.int64)) * self.dtype.itemsize
        return HopArrival(step, round_of, src[0], dst[0], src[1], nbytes, time.time(), array)

    def _on(self, device: int, shape: tuple[int, ...]) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, self.dtype, sharding=device_sharding(self._devices[device]))

    def _compile_cuts(self, local: set[int]):
        """Per local source device, one program cutting its pieces (compiling on the pool:
        ``compile_ahead.deferred_compile``); a piece that is the whole tile is the tile itself
        (listed in ``whole``)."""
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
                fn = deferred_compile(jax.jit(_cut_fn(slices)).lower(self._on(d, tiles[d])))
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
        """Per local destination device, one program placing its pieces into its tile
        (compiling on the pool); a device receiving one piece that is its whole tile keeps it
        as is."""
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
            fn = deferred_compile(jax.jit(_assemble_fn(tiles[d], tuple(p.offset for p in places), self.dtype)).lower(
                *[self._on(d, program.piece_shapes[p.piece]) for p in places]))
            out.append((d, fn, tuple(p.piece for p in places)))
        return out

    def __call__(self, x: jax.Array, *, timeout_s: float | None = None,
                 on_arrival: Callable[[HopArrival], None] | None = None) -> jax.Array:
        """``x`` (sharded as ``src``) moved onto ``dst``; returns without waiting (but with ``"rounds"``).
        ``on_arrival`` is told of every cross-process hop into this process as it is dispatched."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        # Keyed by (device, piece); pieces on other processes' devices are shard-less.
        have: dict[tuple[int, int], jax.Array] = dict(self._absent)
        if self._whole or self._cuts:
            shards = {self._ids[device_key(s.device)]: s.data for s in x.addressable_shards}
            for d, piece in self._whole:
                have[(d, piece)] = shards[d]
            for d, fn, pieces in self._cuts:
                for piece, value in zip(pieces, fn.get()(shards[d])):
                    have[(d, piece)] = value
        arrivals: list[jax.Array] = []
        tokens: dict = {}
        for k, (local_hops, cross_hops) in enumerate(self._steps):
            if self.order.waits_for_rounds and k in self._round_starts:
                wait_ready(arrivals, timeout_s, f"a round of a p2p resharding (before step {k})")
                arrivals = []
            for gate in self._gates_at.get(k, ()):
                self._apply(gate, have, tokens)
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
                    if on_arrival is not None:
                        on_arrival(self._arrival(k, s, r, moved))
        tiles = {}
        for d, fn, pieces in self._assembles:
            tiles[d] = have[(d, pieces[0])] if fn is None else fn.get()(*[have[(d, p)] for p in pieces])
        return jax.make_array_from_single_device_arrays(
            self.shape, self.dst, [tiles[d] for d in self._dst_order], dtype=self.dtype
        )
