"""The handlers of the feeds (``FeedInstruction``s): each fills one stage operand for the pipeline,
``state.operands[(stage, position)]`` (one value, or a list of one per micro-batch). A feed that
moves values runs on every process (each joins every move); the others only where the stage is.
What other processes send a stage here is noted in ``state.feeding``: the pipeline starts once it
has arrived."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from meshpar.passes.program.step_instructions import (
    FeedConstant, FeedValue, FetchParameter, FoldKey, MoveMicroBatches, SliceMicroBatches,
)
from meshpar.runtime.coordination import Arrival, senders, wait_pending
from meshpar.runtime.move_handlers import Move
from meshpar.runtime.placement import micro_batch_view, put
from meshpar.runtime.step_state import AheadWalk, StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS"]


def _feeding(ex: StepExecutable, value: jax.Array, source: NamedSharding, stage: int, what: str,
             state: StepState) -> None:
    """Notes ``value``, an operand of ``stage`` moved from ``source``, when it is this process's
    and other processes send it."""
    sending = senders(source)
    if sending and ex.local[stage]:
        state.feeding.append(Arrival(value, f"{what} for stage {stage}", sending))


def fetch_parameter(ex: StepExecutable, ins: FetchParameter, move: Move, state: StepState) -> None:
    value = move(state.placed[ins.leaf][ins.owner])
    _feeding(ex, value, ins.via.src, ins.stage, f"parameter in{ins.leaf} fetched", state)
    state.operands[(ins.stage, ins.position)] = value


def feed_value(ex: StepExecutable, ins: FeedValue, ready: None, state: StepState) -> None:
    if ex.local[ins.stage]:
        state.operands[(ins.stage, ins.position)] = state.value(ins.value, ins.mesh)
        if (ins.value, ins.mesh) in state.remote:
            state.feeding.append(state.remote.pop((ins.value, ins.mesh)))


def prepare_constant(ex: StepExecutable, ins: FeedConstant) -> jax.Array | None:
    """The constant placed once, where its stage is."""
    return put(ex.step_program.consts[ins.const], ins.sharding) if ex.local[ins.stage] else None


def feed_constant(ex: StepExecutable, ins: FeedConstant, placed: jax.Array | None, state: StepState) -> None:
    if ex.local[ins.stage]:
        state.operands[(ins.stage, ins.position)] = placed


def fold_key(ex: StepExecutable, ins: FoldKey, ready: None, state: StepState) -> None:
    if ex.local[ins.stage]:
        wait_pending(state.remote, [(ins.key, ins.mesh)], ex.timeout_s, "moves around the pipeline",
                     lambda: f"folding key {ins.key}")
        state.operands[(ins.stage, ins.position)] = _FOLD_ALL(state.value(ins.key, ins.mesh), ins.num_micro_batches)


def prepare_slicing(ex: StepExecutable, ins: SliceMicroBatches) -> Callable | None:
    """One program cutting the value shaped ``[M, micro-batch, ...]`` (each micro-batch already
    where the stage reads it) into the M micro-batches, where the stage is."""
    if not ex.local[ins.stage]:
        return None
    M = ins.num_micro_batches
    return jax.jit(lambda x: [x[m] for m in range(M)], out_shardings=[ins.sharding] * M)


def slice_micro_batches(ex: StepExecutable, ins: SliceMicroBatches, unstack: Callable | None,
                        state: StepState) -> None:
    if not ex.local[ins.stage]:
        return
    if ins.unplaced:
        leaf = state.leaves[ins.value.index]
        on_devices = isinstance(leaf, jax.Array) and leaf.is_fully_addressable and jax.process_count() == 1
        leaf = leaf if on_devices else np.asarray(leaf)
    else:
        leaf = state.value(ins.value, ins.mesh)
    stacked = put(leaf.reshape(ins.num_micro_batches, ins.micro_batch_size, *leaf.shape[1:]), ins.stacked,
                  f"stage {ins.stage}'s operand {ins.position} ({ins.value})")
    state.operands[(ins.stage, ins.position)] = unstack(stacked)


def prepare_micro_batch_moves(ex: StepExecutable, ins: MoveMicroBatches) -> tuple[Move, ...]:
    # Every process joins each move of a global batch, whichever stage reads it.
    return tuple(ex.move(k) for k in ins.batch.moves)


def move_micro_batches(ex: StepExecutable, ins: MoveMicroBatches, moves: tuple[Move, ...], state: StepState) -> None:
    batch = ins.batch
    leaf = state.leaves[batch.leaf]
    if leaf.sharding != batch.source:
        raise ValueError(f"batch leaf {batch.leaf}: laid out as {leaf.sharding}, but the step "
                         f"was compiled for {batch.source}")
    column = [move(micro_batch_view(leaf, rows, ins.micro_batch_size)) for rows, move in zip(batch.rows, moves)]
    for m, (rows, moved) in enumerate(zip(batch.rows, column)):
        _feeding(ex, moved, rows.sharding, ins.stage, f"micro-batch {m} of batch leaf {batch.leaf}", state)
    state.operands[(ins.stage, ins.position)] = column


def _fold_all(key: jax.Array, num_micro_batches: int) -> list[jax.Array]:
    """``key`` folded with each micro-batch index: micro-batch ``m`` draws from ``fold_in(key, m)``."""
    return [jax.random.fold_in(key, m) for m in range(num_micro_batches)]


_FOLD_ALL = jax.jit(_fold_all, static_argnums=1)


def slice_ahead(walk: AheadWalk, ins: SliceMicroBatches, slicing: Any) -> None:
    # The slicing program: the whole value placed ``[M, micro-batch, ...]``.
    if walk.ex.local[ins.stage]:
        aval = walk.ex.operand_aval(ins.stage, ins.position)
        walk.program(slicing, jax.ShapeDtypeStruct((ins.num_micro_batches, *aval.shape), aval.dtype,
                                                   sharding=ins.stacked))


HANDLERS = {
    FetchParameter: StepHandler(fetch_parameter, lambda ex, ins: ex.move(ins.via.move_key)),
    FeedValue: StepHandler(feed_value),
    FeedConstant: StepHandler(feed_constant, prepare_constant),
    FoldKey: StepHandler(fold_key),
    SliceMicroBatches: StepHandler(slice_micro_batches, prepare_slicing, slice_ahead),
    MoveMicroBatches: StepHandler(move_micro_batches, prepare_micro_batch_moves),
}
