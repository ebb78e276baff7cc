"""The handler of ``PlaceInputs``: every input leaf placed as its ``PlaceLeaf`` says, a global batch
leaf by its planned moves, and a train state handed back as the last step returned it passed
through as it is."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from meshpar.passes.program.batch_rows import GlobalBatchPlacement
from meshpar.passes.program.step_instructions import PlaceInputs
from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.passes.program.wire_format import leaf_dtype
from meshpar.runtime.coordination import Arrival, senders
from meshpar.runtime.move_handlers import Move
from meshpar.runtime.placement import on_meshes, place
from meshpar.runtime.step_state import AheadWalk, StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS", "Placing", "placed_shapes"]


class Placing:
    """What placing needs across steps: per global batch leaf placed by moves, its placement and
    its prepared moves; the last step's outputs that live on one mesh, weakly (the caller owns
    them: per output leaf, ``(array, mesh)`` or ``None``); and, per input leaf, the output leaf
    whose array, handed back as the next step's input, placing returned as it was."""

    def __init__(self, moved: dict[int, tuple[GlobalBatchPlacement, list[Move]]]) -> None:
        self.moved = moved
        self.returned: list[tuple[weakref.ref, int] | None] = []
        self.passes_through: dict[int, int] | None = None

    def remember(self, state: StepState) -> None:
        """Notes the outputs ``state`` returns that are one mesh's array as assembled (sharing or
        joining replaced the others)."""
        assembled = state.on_one_mesh
        self.returned = [(weakref.ref(out), assembled[j]) if j in assembled and out is state.assembled[j] else None
                         for j, out in enumerate(state.outputs)]


def prepare_placing(ex: StepExecutable, ins: PlaceInputs) -> Placing:
    return Placing({p.leaf: (p, [ex.move(k) for k in p.moves]) for p in ins.global_batches})


def place_inputs(ex: StepExecutable, ins: PlaceInputs, placing: Placing, state: StepState) -> None:
    """Each input leaf on the meshes of its placement. A leaf that is the array the last step
    returned at an output that, handed back before, placing returned as it was (a train state
    passed back as the step returned it) is used as it is: one identity check instead of placing
    it."""
    moved, returned, passes = placing.moved, placing.returned, placing.passes_through
    placed: list[dict[int, jax.Array]] = []
    for i, (v, p) in enumerate(zip(state.leaves, ins.placements)):
        j = passes.get(i) if passes is not None else None
        if j is not None and returned[j] is not None and returned[j][0]() is v:
            placed.append({returned[j][1]: v})
        elif i in moved:
            placed.append(_place_global_batch(ex, i, v, *moved[i], state))
        else:
            placed.append(place(v, p, f"step input leaf {i}"))
    if passes is None and returned:
        # Once, on the first step fed a previous step's outputs: where placing returned such an
        # array as it was, later steps skip placing it (deterministic: the same program makes
        # that output, laid out alike, every step).
        at = {id(r[0]()): j for j, r in enumerate(returned) if r is not None}
        placing.passes_through = {}
        for i, (v, d) in enumerate(zip(state.leaves, placed)):
            j = at.get(id(v))
            if j is not None and returned[j][0]() is v and len(d) == 1 and d.get(returned[j][1]) is v:
                placing.passes_through[i] = j
    state.placed = placed
    state.at_end.append(placing.remember)


def _place_global_batch(ex: StepExecutable, i: int, leaf: Any, batch: GlobalBatchPlacement, moves: Sequence[Move],
                        state: StepState) -> dict[int, jax.Array]:
    """Global batch leaf ``i`` on each mesh of its placement, by its planned moves (every process
    joins each); what other processes send here is awaited by what reads it."""
    if leaf.sharding != batch.source:
        raise ValueError(f"batch leaf {i}: laid out as {leaf.sharding}, but the step was compiled for "
                         f"{batch.source}")
    arrays = [move(leaf) for move in moves]
    meshes = batch.placement.meshes
    placed = on_meshes(arrays[0], batch.placement) if batch.union else dict(zip(meshes, arrays))
    sending = senders(batch.source)
    for m, array in placed.items():
        if sending and ex.mesh_local[m]:
            arrival = Arrival(array, f"batch leaf {i} moved whole to mesh {m}", sending)
            state.arrivals.append(arrival)
            state.remote[(OuterRef(OuterKind.IN, i), m)] = arrival
    return placed


def placed_shapes(leaves: Sequence[Any], ins: PlaceInputs) -> list[dict[int, jax.ShapeDtypeStruct]]:
    """Per input leaf of ``leaves``, per mesh ``ins`` places it on, its type there."""
    moved = {p.leaf for p in ins.global_batches}
    placed = []
    for i, (leaf, placement) in enumerate(zip(leaves, ins.placements)):
        # ``put`` keeps a jax.Array's weak type (one array per mesh); a view of one array
        # over several meshes, or host data, is not weak.
        weak = bool(getattr(leaf, "weak_type", False)) and placement.union is None and i not in moved
        placed.append({m: jax.ShapeDtypeStruct(np.shape(leaf), leaf_dtype(leaf), sharding=placement.on(m),
                                               weak_type=weak) for m in placement.meshes})
    return placed


def place_ahead(walk: AheadWalk, ins: PlaceInputs, placing: Placing) -> None:
    if walk.leaves is not None:
        walk.placed.extend(placed_shapes(walk.leaves, ins))


HANDLERS = {PlaceInputs: StepHandler(place_inputs, prepare_placing, place_ahead)}
