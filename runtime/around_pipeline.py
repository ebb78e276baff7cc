"""The handlers of ``RunCompute``, ``RunMove`` and ``FreeValues``: the computations around the
pipeline, each on its mesh, the moves of their values between meshes (several values of one dtype
packed into one vector), and the dropping of each value after its last use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from meshpar.passes import jax_ir
from meshpar.passes.program.flat_values import flatten, unflatten
from meshpar.passes.program.step_instructions import FreeValues, RunCompute, RunMove
from meshpar.runtime.coordination import Arrival, owns_a_device_of, senders, wait_arrivals, wait_pending
from meshpar.runtime.remote import absent
from meshpar.runtime.stage_executables import on_mesh
from meshpar.runtime.step_state import AheadWalk, StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS", "compute_program", "moved_shape"]


def compute_program(ins: RunCompute, mesh: Mesh, timeout_s: float) -> Callable:
    """The program computing ``ins`` on ``mesh`` (``on_mesh``: waits bounded by ``timeout_s``)."""
    fn = jax_ir.staged_fun(ins.jaxpr)
    targets = ins.output_shardings

    def run(*args):
        outs = fn(*args)
        return [o if t is None else jax.lax.with_sharding_constraint(o, t) for o, t in zip(outs, targets)]

    # Declared (``None``: as XLA lays it out) so that what reads them compiles ahead at once.
    return on_mesh(jax.jit(run, out_shardings=list(targets)), mesh, timeout_s)


def prepare_compute(ex: StepExecutable, ins: RunCompute) -> Callable:
    return compute_program(ins, ex.meshes[ins.mesh], ex.timeout_s)


def moved_shape(ins: RunMove, value: Any) -> jax.ShapeDtypeStruct:
    """The type of the one value ``ins`` moves, typed ``value`` on its source, on arrival."""
    weak = bool(getattr(value, "weak_type", False))
    return jax.ShapeDtypeStruct(ins.via.shape, ins.via.dtype, sharding=ins.via.dst, weak_type=weak)


def run_compute(ex: StepExecutable, ins: RunCompute, program: Callable, state: StepState) -> None:
    mesh = ins.mesh
    if ex.mesh_local[mesh]:
        wait_pending(state.remote, [(r, mesh) for r in ins.inputs], ex.timeout_s, "moves around the pipeline",
                     lambda: f"launching the program on mesh {mesh} that computes {', '.join(map(str, ins.outputs))}")
        outs = program(*[state.value(r, mesh) for r in ins.inputs])
        state.values.update({(ref, mesh): o for ref, o in zip(ins.outputs, outs)})


def prepare_move(ex: StepExecutable, ins: RunMove) -> tuple[Callable, Callable | None, Callable | None]:
    """The move, and (several values) the programs packing them on the source mesh and unpacking
    them on the destination (relaying values out over a mesh: collectives where it spans
    processes)."""
    move = ex.move(ins.via.move_key)
    if not ins.unpacked:
        return move, None, None
    avals = [ex.step_program.avals[r] for r in ins.values]
    return (move, on_mesh(_packer(ins.via.src), ins.via.src.mesh, ex.timeout_s),
            on_mesh(_unpacker(avals, ins.unpacked), ins.unpacked[0].mesh, ex.timeout_s))


def run_move(ex: StepExecutable, ins: RunMove, ready: tuple[Callable, Callable | None, Callable | None],
             state: StepState) -> None:
    # Every process joins the move, whether or not it holds either end.
    via = ins.via
    move, pack, unpack = ready
    if pack is None:
        moved = state.values[(ins.values[0], ins.dst)] = move(state.value(ins.values[0], ins.src, via.src))
        arrival = _note_arrival(ins, moved, state.arrivals)
        if arrival is not None:
            state.remote[(ins.values[0], ins.dst)] = arrival
        return
    if ex.mesh_local[ins.src]:
        vector = pack(*[state.value(r, ins.src) for r in ins.values])
    else:
        vector = absent(via.shape, via.dtype, via.src)
    moved = move(vector)
    arrival = _note_arrival(ins, moved, state.arrivals)
    if ex.mesh_local[ins.dst]:
        if arrival is not None:  # unpacking launches a program reading it
            wait_arrivals([arrival], ex.timeout_s, "moves around the pipeline", f"unpacking {arrival.what}")
        state.values.update({(r, ins.dst): v for r, v in zip(ins.values, unpack(moved))})


def _note_arrival(ins: RunMove, moved: jax.Array, arrivals: list[Arrival]) -> Arrival | None:
    """Adds ``moved`` to ``arrivals`` when other processes send it here, and returns it."""
    sending = senders(ins.via.src)
    if owns_a_device_of(ins.via.dst.mesh) and sending:
        names = ", ".join(map(str, ins.values))
        arrivals.append(Arrival(moved, f"{names} moved from mesh {ins.src} to mesh {ins.dst}", sending))
        return arrivals[-1]
    return None


def _packer(sharding: NamedSharding) -> Callable:
    """Values of one dtype, flattened into one vector with ``sharding`` (on their mesh)."""
    return jax.jit(lambda *xs: flatten(xs), out_shardings=sharding)


def _unpacker(avals: Sequence[Any], shardings: Sequence[NamedSharding]) -> Callable:
    """A packed vector back into values shaped ``avals``, each with its sharding."""
    return jax.jit(lambda v: unflatten(v, avals), out_shardings=list(shardings))


def compute_ahead(walk: AheadWalk, ins: RunCompute, program: Callable) -> None:
    if not walk.ex.mesh_local[ins.mesh]:
        return
    outs = walk.program(program, *[walk.value(r, ins.mesh) for r in ins.inputs])
    if outs is not None:
        walk.values.update({(ref, ins.mesh): o for ref, o in zip(ins.outputs, outs)})


def move_ahead(walk: AheadWalk, ins: RunMove, ready: tuple[Callable, Callable | None, Callable | None]) -> None:
    via = ins.via
    move, pack, unpack = ready
    if pack is None:
        value = walk.value(ins.values[0], ins.src)
        if value is not None and getattr(move, "jitted", None) is not None:
            walk.program(move, value)
        walk.values[(ins.values[0], ins.dst)] = moved_shape(ins, value)
        return
    if walk.ex.mesh_local[ins.src]:
        walk.program(pack, *[walk.value(r, ins.src) for r in ins.values])
    if walk.ex.mesh_local[ins.dst]:
        outs = walk.program(unpack, jax.ShapeDtypeStruct(via.shape, via.dtype, sharding=via.dst))
        if outs is not None:
            walk.values.update({(r, ins.dst): v for r, v in zip(ins.values, outs)})


def free_values(ex: StepExecutable, ins: FreeValues, ready: None, state: StepState) -> None:
    for located in ins.values:
        state.values.pop(located, None)
        state.remote.pop(located, None)


HANDLERS = {RunCompute: StepHandler(run_compute, prepare_compute, compute_ahead),
            RunMove: StepHandler(run_move, prepare_move, move_ahead),
            FreeValues: StepHandler(free_values)}
