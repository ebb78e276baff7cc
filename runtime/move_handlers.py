"""One runtime handler per executor: a ``PlannedMove`` (``passes.program.moves``, lowered by ``passes.pipeline.placing.plan_moves``) becomes the
callable that moves a value.

Every process calls every move in the same order (p2p moves number their transfers by a
counter each process advances); a process that owns no device of the destination gets a
stand-in with no shards (``runtime.remote.absent``). Handlers compile what they run when
built, so a call plans, lowers and compiles nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from meshpar.passes.program.moves import PlannedMove, TransferKind
from meshpar.runtime.coordination import owns_a_device_of
from meshpar.runtime.p2p_executor import P2PReshardExecutable
from meshpar.runtime.remote import absent
from meshpar.runtime.resharding_executor import ReshardingExecutable
from meshpar.runtime.signal_move import SignalMove
from meshpar.runtime.stage_executables import on_mesh

__all__ = ["MOVE_HANDLERS", "Move", "prepare_move"]

Move = Callable[[jax.Array], jax.Array]


def _nothing(move: PlannedMove) -> Move:
    stand_in = absent(move.key.shape, move.key.dtype, move.key.dst)
    return lambda x: stand_in


def _local(move: PlannedMove, timeout_s: float) -> Move:
    key = move.key
    if not owns_a_device_of(key.dst.mesh):
        return _nothing(move)
    # Two stages on one mesh: the value stays on its devices, relaid out there if need be (a
    # program launched as every program on the mesh is: collectives where it spans processes).
    return (lambda x: x) if key.src == key.dst else on_mesh(jax.jit(lambda x: x, out_shardings=key.dst),
                                                            key.dst.mesh, timeout_s)


def _device_put(move: PlannedMove, timeout_s: float) -> Move:
    if not owns_a_device_of(move.key.dst.mesh):
        # Both meshes are another process's: it moves the value, this one only names it.
        return _nothing(move)
    return functools.partial(jax.device_put, device=move.key.dst)


def _p2p(move: PlannedMove, timeout_s: float) -> Move:
    key = move.key
    return P2PReshardExecutable(move.program, key.dtype, key.src, key.dst, order=move.order, gates=move.gates,
                                timeout_s=timeout_s)


def _collective(move: PlannedMove, timeout_s: float) -> Move:
    key = move.key
    executable = ReshardingExecutable(move.program, key.shape, key.dtype, key.src, key.dst)
    if not executable.participates:
        return _nothing(move)
    # Collectives in flight at once could start in different orders on different devices
    # (processes, or a process's device threads) and deadlock: each completes before the next.
    return functools.partial(executable, complete_within=timeout_s)


def _signal(move: PlannedMove, timeout_s: float) -> Move:
    key = move.key
    return SignalMove(key.shape, key.dtype, key.src, key.dst, prepare_move(move.carry, timeout_s))


# Kind -> handler; a new executor is one entry here and one in passes' MOVE_EXECUTORS.
MOVE_HANDLERS: dict[TransferKind, Callable[[PlannedMove, float], Move]] = {
    TransferKind.LOCAL: _local,
    TransferKind.DEVICE_PUT: _device_put,
    TransferKind.P2P: _p2p,
    TransferKind.COLLECTIVE: _collective,
    TransferKind.SIGNAL: _signal,
}


def prepare_move(move: PlannedMove, timeout_s: float) -> Move:
    """The callable running ``move``; ``timeout_s`` bounds its waits (p2p rounds, collectives)."""
    return MOVE_HANDLERS[move.key.kind](move, timeout_s)
