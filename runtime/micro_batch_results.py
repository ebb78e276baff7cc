"""The handlers of what the pipeline leaves: ``CombineMicroBatches`` (the loss or an aux value, its
micro-batches combined on its mesh as the compiler resolved) and ``ReduceGradient`` (one stage's
accumulated gradient of one parameter, moved to its owner's mesh and summed there)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from meshpar.passes.program.step_instructions import CombineMicroBatches, ReduceGradient
from meshpar.passes.program.step_values import AuxReduction, OuterKind, OuterRef
from meshpar.passes.program.wire_format import from_wire, is_key
from meshpar.runtime.coordination import Arrival, senders, wait_arrivals
from meshpar.runtime.move_handlers import Move
from meshpar.runtime.remote import absent
from meshpar.runtime.stage_executables import on_mesh
from meshpar.runtime.step_state import AheadWalk, StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS"]


def prepare_combine(ex: StepExecutable, ins: CombineMicroBatches) -> tuple[Callable, Callable | None]:
    """The program combining the micro-batches' values of ``ins`` on its mesh, and the one relaying
    the result out over it (``None``: none). Relaying is a program of its own (collectives where
    the mesh spans processes), launched as every program on the mesh is."""
    mesh = ex.meshes[ins.mesh]
    relay = None if ins.sharding is None else on_mesh(jax.jit(lambda x: x, out_shardings=ins.sharding), mesh,
                                                      ex.timeout_s)
    return on_mesh(_combiner(ins.how, len(ins.buffers), ins.per_replica), mesh, ex.timeout_s), relay


def combine_micro_batches(ex: StepExecutable, ins: CombineMicroBatches, ready: tuple[Callable, Callable | None],
                          state: StepState) -> None:
    if not ex.mesh_local[ins.mesh]:
        return
    combine, relay = ready
    combined = from_wire(combine([state.run.results[b] for b in ins.buffers]), ins.aval)
    state.values[(ins.value, ins.mesh)] = combined if relay is None else relay(combined)


def prepare_gradient(ex: StepExecutable, ins: ReduceGradient) -> Move | None:
    return None if ins.move is None else ex.move(ins.move.move_key)


def reduce_gradient(ex: StepExecutable, ins: ReduceGradient, move: Move | None, state: StepState) -> None:
    grads = state.run.grads[ins.stage]
    if grads is not None:
        g, grads[ins.position] = grads[ins.position], None  # consumed: each accumulator is reduced once
    else:
        g = absent(ins.aval.shape, ins.aval.dtype, ins.sharding)
    key = (OuterRef(OuterKind.GRAD, ins.param), ins.mesh)
    if move is not None:
        g = move(g)
        sending = senders(ins.sharding)
        if sending and ex.mesh_local[ins.mesh]:
            arrival = Arrival(g, f"{ins}", sending)
            state.arrivals.append(arrival)
            if ins.adds:  # the sum launches a program reading it
                wait_arrivals([arrival], ex.timeout_s, "gradients moved home", f"adding {ins}")
            else:
                state.remote[key] = arrival
    state.values[key] = state.values[key] + g if ins.adds and ex.mesh_local[ins.mesh] else g


@functools.lru_cache(maxsize=None)
def _combiner(how: AuxReduction, count: int, per_replica: bool) -> Callable[[list[jax.Array]], jax.Array]:
    """One program combining ``count`` micro-batches' values as ``how`` says (each first over its
    replicas, with ``per_replica``)."""

    def combine(parts: list[jax.Array]) -> jax.Array:
        if per_replica:
            parts = [_combine_leading(part, how) for part in parts]
        return _combine(parts, how)

    return jax.jit(combine)


def _combine(parts: Sequence[jax.Array], how: AuxReduction) -> jax.Array:
    """Per-micro-batch values of one result combined as ``how`` says, on their mesh."""
    if how is AuxReduction.LAST:
        return parts[-1]
    if how is AuxReduction.CONCAT:
        return jnp.concatenate(parts, axis=0)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total / len(parts) if how is AuxReduction.MEAN else total


def _combine_leading(values: jax.Array, how: AuxReduction) -> jax.Array:
    """One value per replica (the leading dimension) combined as ``how`` combines micro-batches'."""
    if how is AuxReduction.LAST:
        return values[-1]
    return values.mean(0) if how is AuxReduction.MEAN else values.sum(0)


def combine_ahead(walk: AheadWalk, ins: CombineMicroBatches, ready: tuple[Callable, Callable | None]) -> None:
    if not walk.ex.mesh_local[ins.mesh] or walk.run is None:
        return
    combine, relay = ready
    combined = walk.program(combine, [walk.run.results.get(b) for b in ins.buffers])
    if combined is None or is_key(ins.aval):
        return
    walk.values[(ins.value, ins.mesh)] = combined if relay is None else walk.program(relay, combined)


def gradient_ahead(walk: AheadWalk, ins: ReduceGradient, move: Move | None) -> None:
    grads = walk.run.grads[ins.stage] if walk.run is not None else None
    g = grads[ins.position] if grads is not None else None
    key = (OuterRef(OuterKind.GRAD, ins.param), ins.mesh)
    if g is not None and move is not None:
        if getattr(move, "jitted", None) is not None:
            walk.program(move, g)
        g = jax.ShapeDtypeStruct(ins.move.shape, ins.move.dtype, sharding=ins.move.dst)
    # A second stage's gradient adds into the first's (laid out alike).
    if not ins.adds:
        walk.values[key] = g
    elif g is None:
        walk.values[key] = None


HANDLERS = {CombineMicroBatches: StepHandler(combine_micro_batches, prepare_combine, combine_ahead),
            ReduceGradient: StepHandler(reduce_gradient, prepare_gradient, gradient_ahead)}
