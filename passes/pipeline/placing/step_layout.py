"""Pass: where every value of a pipelined step lives, decided before anything runs.

Step inputs live on the meshes that read them (a parameter on its owner
stage's mesh with its flax partitioning, values several meshes read
replicated on each); outputs of the new state where the old state lived, so
the next step moves nothing; each stage's non-activation operands with the
sharding it computes on; the moves after the program of a parameter read by
several stages (its gradient contributions sent home); and the sharding of
every value the computations around the pipeline move (``step_split``):
replicated scalars and small values, or gradients as their parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.moves import ValueMove
from ...program.shardings import PlaceLeaf
from ...program.step_values import OuterKind, OuterRef, RefKind
from ...program.wire_format import is_key
from ..cutting.stage_graph import StageGraph
from ..cutting.step_split import OuterMove, StepSplit
from .edge_transfer import Executor, choose_transfer
from .mesh_assignment import batch_sharding, param_sharding

__all__ = ["StageOperand", "StepLayout", "layout_step", "value_move", "verify_step_layout"]


@dataclasses.dataclass(frozen=True)
class StageOperand:
    """A non-activation input of a stage: input ``position`` of its jaxpr.

    ``source`` is a step input leaf, a constant or a value computed before the
    pipeline; a ``per_micro_batch`` operand is, for micro-batch ``m``, that value's
    ``m``-th slice along dimension 0, or with ``fold_key`` the key
    ``jax.random.fold_in(value, m)``. ``fetch`` moves a leaf placed only on other
    meshes (a parameter several stages read lives on its owner's).
    """

    position: int
    source: OuterRef
    sharding: NamedSharding
    per_micro_batch: bool
    fetch: ValueMove | None = None
    fold_key: bool = False


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Attributes:
      in_placements, out_placements: per flattened step input / output leaf
        (``None``: an output stays where it is computed).
      stage_operands: per stage, its non-activation inputs in input order.
      grad_shardings: per stage, the sharding of each parameter gradient it
        accumulates, in ``Stage.param_inputs`` order.
      gradient_moves: per stage, per parameter it reads, the move of its
        gradient to the parameter owner's mesh (``None`` on that mesh itself).
      value_shardings: ``(value, mesh)`` -> the sharding a computation around the
        pipeline gives that value there (what it moves as, or an output's placement).
      outer_moves: each ``OuterMove`` of the step split, as a planned move (of one vector
        when it packs several values: replicated on both meshes).
    """

    in_placements: tuple[PlaceLeaf, ...]
    out_placements: tuple[PlaceLeaf | None, ...]
    stage_operands: tuple[tuple[StageOperand, ...], ...]
    grad_shardings: tuple[tuple[NamedSharding, ...], ...]
    gradient_moves: tuple[tuple[ValueMove | None, ...], ...]
    value_shardings: dict[tuple[OuterRef, int], NamedSharding]
    outer_moves: dict[OuterMove, ValueMove]


def _input_placements(graph: StageGraph, split: StepSplit, meshes, home, leaves, specs, batch_leaves,
                      axis_names: tuple[str, str]) -> list[PlaceLeaf]:
    needs: list[set[int]] = [set(n) for n in split.input_needs]
    for k, leaf in enumerate(split.param_inputs):
        needs[leaf].add(home[graph.param_owner(k)])
    placements = []
    for i, (x, spec) in enumerate(zip(leaves, specs)):
        if not needs[i] and (i in batch_leaves or graph.forward_only):
            placements.append(PlaceLeaf((), ()))
            continue
        where = tuple(sorted(needs[i])) or (0,)
        shape = tuple(np.shape(x))
        if len(where) == 1:
            shardings = (param_sharding(meshes[where[0]], spec, shape, axis_names),)
        else:
            shardings = tuple(NamedSharding(meshes[m], P()) for m in where)
        placements.append(PlaceLeaf.of(where, shardings))
    return placements


def value_move(what: str, aval: Any, src: NamedSharding, dst: NamedSharding, executor: Executor) -> ValueMove:
    """``what`` (of ``aval``'s shape and dtype) moving from ``src`` to ``dst`` by the executor
    ``choose_transfer`` picks for them."""
    if is_key(aval):
        raise ValueError(f"{what}: a PRNG key array moving between meshes around the pipeline; compute it "
                         f"inside the loss function, or from values of one mesh")
    processes = [d.process_index for s in (src, dst) for d in s.mesh.devices.flat]
    kind = choose_transfer(executor, processes, len(aval.shape), same_mesh=src.mesh == dst.mesh)
    return ValueMove(what, tuple(aval.shape), np.dtype(aval.dtype), src, dst, kind)


@compiler_pass
def layout_step(
    graph: StageGraph,
    split: StepSplit,
    meshes: Sequence[Mesh],
    stage_mesh: Sequence[int],
    leaves: Sequence[Any],
    specs: Sequence[P | None],
    batch_leaves: frozenset[int],
    micro_batch_size: int,
    counterparts: Sequence[int | None],
    executor: Executor,
    per_micro_batch: Sequence[bool],
    fold_keys: frozenset[int] = frozenset(),
    *,
    axis_names: tuple[str, str],
) -> StepLayout:
    """The layout of a step over ``meshes``, stage ``s`` on ``meshes[stage_mesh[s]]``, for inputs
    ``leaves`` (arrays or shapes)
    with flax partition ``specs``; ``batch_leaves`` are cut into micro-batches of ``micro_batch_size``,
    as is every loss operand flagged in ``per_micro_batch``; the operands in ``fold_keys`` are
    keys folded with the micro-batch index; ``counterparts[j]`` is the input leaf output ``j``
    replaces, if any (that output is placed like it). ``axis_names`` are the meshes' (data,
    model) axes."""
    home = tuple(stage_mesh)
    in_placements = _input_placements(graph, split, meshes, home, leaves, specs, batch_leaves, axis_names)

    def param_on(k: int, mesh: int) -> NamedSharding:
        placement = in_placements[split.param_inputs[k]]
        if mesh in placement.meshes:
            return placement.on(mesh)
        owner = placement.on(placement.meshes[0])
        return param_sharding(meshes[mesh], owner.spec, np.shape(leaves[split.param_inputs[k]]), axis_names)

    operands, grad_shardings, gradient_moves = [], [], []
    for stage in graph.stages:
        s, here_mesh = stage.index, home[stage.index]
        ops = []
        for pos, (r, aval) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals)):
            if r.kind is RefKind.PARAM:
                leaf = split.param_inputs[r.index]
                placement, here = in_placements[leaf], param_on(r.index, here_mesh)
                fetch = None if here_mesh in placement.meshes else value_move(
                    f"parameter {r.index} from its owner's mesh {placement.meshes[0]} to stage {s}", aval,
                    placement.shardings[0], here, executor)
                ops.append(StageOperand(pos, OuterRef(OuterKind.IN, leaf), here, False, fetch))
            elif r.kind is RefKind.INPUT:
                source = split.loss_operands[r.index]
                batch = per_micro_batch[r.index]
                fold = r.index in fold_keys and not batch
                sharding = (batch_sharding(meshes[here_mesh], aval.shape, micro_batch_size, axis_names[0]) if batch
                            else NamedSharding(meshes[here_mesh], P()))
                ops.append(StageOperand(pos, source, sharding, batch or fold, fold_key=fold))
        operands.append(tuple(ops))
        grad_shardings.append(tuple(param_on(k, here_mesh) for k in stage.param_inputs))
        moves = []
        for k, aval in zip(stage.param_inputs, (a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind is RefKind.PARAM)):
            owner = home[graph.param_owner(k)]
            moves.append(None if owner == here_mesh else value_move(
                f"gradient of parameter {k} from stage {s} to its owner's mesh {owner}", aval,
                param_on(k, here_mesh), param_on(k, owner), executor))
        gradient_moves.append(tuple(moves))
    # A state output lives where the input it replaces does.
    out_placements = [None if i is None else in_placements[i] for i in counterparts]
    value_shardings: dict[tuple[OuterRef, int], NamedSharding] = {}
    for (ref, meshes_of), placement in zip(split.outputs, out_placements):
        for m in meshes_of:
            if placement is not None and m in placement.meshes and ref.kind is OuterKind.VALUE:
                value_shardings.setdefault((ref, m), placement.on(m))

    def sharding_of(ref: OuterRef, mesh: int) -> NamedSharding:
        if ref.kind is OuterKind.GRAD:
            return param_on(ref.index, mesh)
        return value_shardings.setdefault((ref, mesh), NamedSharding(meshes[mesh], P()))

    outer_moves = {}
    for mv in split.moved():
        what = f"{', '.join(map(str, mv.values))} from mesh {mv.src} to mesh {mv.dst} around the pipeline"
        if len(mv.values) == 1:
            (ref,) = mv.values
            outer_moves[mv] = value_move(what, split.avals[ref], sharding_of(ref, mv.src), sharding_of(ref, mv.dst),
                                         executor)
            continue
        for ref in mv.values:  # packed on the source mesh, unpacked on the destination
            sharding_of(ref, mv.src)
            sharding_of(ref, mv.dst)
        size = sum(int(np.prod(split.avals[ref].shape, dtype=np.int64)) for ref in mv.values)
        packed = jax_ir.ShapedArray((size,), split.avals[mv.values[0]].dtype)
        outer_moves[mv] = value_move(what, packed, NamedSharding(meshes[mv.src], P()),
                                     NamedSharding(meshes[mv.dst], P()), executor)
    for s, ops in enumerate(operands):
        for op in ops:
            if op.source.kind is OuterKind.VALUE:
                value_shardings.setdefault((op.source, home[s]), NamedSharding(meshes[home[s]], P()))
    return StepLayout(
        tuple(in_placements), tuple(out_placements), tuple(operands),
        tuple(grad_shardings), tuple(gradient_moves), value_shardings, outer_moves,
    )


def verify_step_layout(layout: StepLayout, split: StepSplit, meshes: Sequence[Mesh], stage_mesh: Sequence[int]) -> None:
    """Every sharding on the mesh it is for: each placement on its meshes, each stage's operands
    and gradients on its stage's mesh, each move from where its value is to where it is read;
    every move around the pipeline planned.

    Raises:
      PlanVerificationError: naming the value.
    """
    from ...verification import PlanVerificationError

    def on(sharding: NamedSharding, mesh: int, what: str) -> None:
        if sharding.mesh != meshes[mesh]:
            raise PlanVerificationError(f"{what} is laid out on another mesh than mesh {mesh}")

    for i, placement in enumerate(layout.in_placements):
        if len(placement.shardings) != len(placement.meshes):
            raise PlanVerificationError(f"input leaf {i}: {len(placement.shardings)} shardings for "
                                        f"{len(placement.meshes)} meshes")
        for sharding, mesh in zip(placement.shardings, placement.meshes):
            on(sharding, mesh, f"input leaf {i}")
    for s, (ops, grads, moves) in enumerate(zip(layout.stage_operands, layout.grad_shardings, layout.gradient_moves)):
        home = stage_mesh[s]
        for op in ops:
            on(op.sharding, home, f"stage {s}'s operand {op.position}")
            if op.fetch is not None and op.fetch.dst != op.sharding:
                raise PlanVerificationError(f"stage {s}'s operand {op.position} is fetched to another sharding")
        for k, (sharding, move) in enumerate(zip(grads, moves)):
            on(sharding, home, f"stage {s}'s gradient {k}")
            if move is not None and move.src != sharding:
                raise PlanVerificationError(f"stage {s}'s gradient {k} moves from another sharding than its own")
    for (ref, mesh), sharding in layout.value_shardings.items():
        on(sharding, mesh, f"{ref}")
    missing = [mv for mv in split.moved() if mv not in layout.outer_moves]
    if missing:
        raise PlanVerificationError(f"{missing[0]} around the pipeline has no planned move")
    for mv, vm in layout.outer_moves.items():
        on(vm.src, mv.src, f"the move of {mv.values[0]} (source)")
        on(vm.dst, mv.dst, f"the move of {mv.values[0]} (destination)")
