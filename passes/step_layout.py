"""Pass: where every value of a pipelined step lives, decided before anything runs.

Step inputs live on the meshes that read them (a parameter on its owner
stage's mesh with its flax partitioning, values several meshes read
replicated on each); outputs of the new state where the old state lived, so
the next step moves nothing; each stage's non-activation operands with the
sharding it computes on; and the moves after the program: a parameter read
by several stages gets its gradient contributions sent home, the loss goes
to every mesh whose update reads it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .apply_split import ApplySplit, OuterRef
from .edge_transfer import TransferKind, choose_transfer
from .mesh_assignment import batch_sharding, param_sharding
from .stage_graph import StageGraph

__all__ = ["Placement", "StageOperand", "ValueMove", "StepLayout", "layout_step"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a step input or output leaf lives: one sharding per mesh it is on.

    A leaf on several meshes is one array replicated over all their devices.
    No meshes: a batch leaf read only per micro-batch, never placed whole.
    """

    shardings: tuple[NamedSharding, ...]
    meshes: tuple[int, ...]

    def on(self, mesh: int) -> NamedSharding:
        return self.shardings[self.meshes.index(mesh)]


@dataclasses.dataclass(frozen=True)
class ValueMove:
    """One value moving between meshes after the program: ``what`` names it in errors."""

    what: str
    shape: tuple[int, ...]
    dtype: np.dtype
    src: NamedSharding
    dst: NamedSharding
    kind: TransferKind


@dataclasses.dataclass(frozen=True)
class StageOperand:
    """A non-activation input of a stage: input ``position`` of its jaxpr.

    ``source`` is a step input leaf or constant; a ``per_micro_batch`` operand
    is that leaf's micro-batch slice. ``fetch`` moves a leaf placed only on
    other meshes (a parameter several stages read lives on its owner's).
    """

    position: int
    source: OuterRef
    sharding: NamedSharding
    per_micro_batch: bool
    fetch: ValueMove | None = None


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Attributes:
      in_placements, out_placements: per flattened step input / output leaf
        (``None``: an output stays where it is computed).
      stage_operands: per stage, its non-activation inputs in input order.
      grad_shardings: per stage, the sharding of each parameter gradient it
        accumulates, in ``Stage.param_inputs`` order.
      gradient_moves: per stage, per parameter it reads, the move of its
        gradient to the parameter's owner (``None`` on the owner itself).
      loss_moves: mesh -> the loss's move there from the loss stage.
    """

    in_placements: tuple[Placement, ...]
    out_placements: tuple[Placement | None, ...]
    stage_operands: tuple[tuple[StageOperand, ...], ...]
    grad_shardings: tuple[tuple[NamedSharding, ...], ...]
    gradient_moves: tuple[tuple[ValueMove | None, ...], ...]
    loss_moves: dict[int, ValueMove]


def _input_placements(graph: StageGraph, split: ApplySplit, meshes, leaves, specs, batch_leaves) -> list[Placement]:
    needs: list[set[int]] = [set() for _ in leaves]
    for k, leaf in enumerate(split.param_inputs):
        needs[leaf].add(graph.param_owner(k))
    for stage in graph.stages:
        for r in stage.inputs:
            if r.kind == "input":
                ref = split.loss_inputs[r.index]
                if ref.kind == "in" and ref.index not in batch_leaves:
                    needs[ref.index].add(stage.index)
    for apply in split.stages:
        for r in apply.inputs:
            if r.kind == "in":
                needs[r.index].add(apply.mesh)
    placements = []
    for i, (x, spec) in enumerate(zip(leaves, specs)):
        if i in batch_leaves and not needs[i]:
            placements.append(Placement((), ()))
            continue
        where = tuple(sorted(needs[i])) or (0,)
        shape = tuple(np.shape(x))
        if len(where) == 1:
            shardings = (param_sharding(meshes[where[0]], spec, shape),)
        else:
            shardings = tuple(NamedSharding(meshes[m], P()) for m in where)
        placements.append(Placement(shardings, where))
    return placements


def _output_placements(in_tree, out_tree, in_placements) -> list[Placement | None]:
    outs: list[Placement | None] = [None] * out_tree.num_leaves
    in_children, out_children = in_tree.children(), out_tree.children()
    if in_children and out_children and in_children[0] == out_children[0]:
        for j in range(in_children[0].num_leaves):
            outs[j] = in_placements[j]
    return outs


def _move(what: str, aval: Any, src: NamedSharding, dst: NamedSharding, executor: str, strategy: str) -> ValueMove:
    processes = [d.process_index for s in (src, dst) for d in s.mesh.devices.flat]
    kind = choose_transfer(executor, processes, len(aval.shape), strategy)
    return ValueMove(what, tuple(aval.shape), np.dtype(aval.dtype), src, dst, kind)


def layout_step(
    graph: StageGraph,
    split: ApplySplit,
    meshes: Sequence[Mesh],
    leaves: Sequence[Any],
    specs: Sequence[P | None],
    batch_leaves: frozenset[int],
    micro_batch_size: int,
    in_tree: Any,
    out_tree: Any,
    executor: str,
    strategy: str,
) -> StepLayout:
    """The layout of a step over ``meshes`` (one per stage) for inputs ``leaves`` (arrays or shapes)
    with flax partition ``specs``; ``batch_leaves`` are cut into micro-batches of ``micro_batch_size``."""
    in_placements = _input_placements(graph, split, meshes, leaves, specs, batch_leaves)

    def param_on(k: int, stage: int) -> NamedSharding:
        placement = in_placements[split.param_inputs[k]]
        if stage in placement.meshes:
            return placement.on(stage)
        owner = placement.on(placement.meshes[0])
        return param_sharding(meshes[stage], owner.spec, np.shape(leaves[split.param_inputs[k]]))

    operands, grad_shardings, gradient_moves = [], [], []
    for stage in graph.stages:
        s = stage.index
        ops = []
        for pos, (r, aval) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals)):
            if r.kind == "param":
                leaf = split.param_inputs[r.index]
                placement, here = in_placements[leaf], param_on(r.index, s)
                fetch = None if s in placement.meshes else _move(
                    f"parameter {r.index} from its owner {placement.meshes[0]} to stage {s}", aval,
                    placement.shardings[0], here, executor, strategy)
                ops.append(StageOperand(pos, OuterRef("in", leaf), here, False, fetch))
            elif r.kind == "input":
                source = split.loss_inputs[r.index]
                batch = source.kind == "in" and source.index in batch_leaves
                sharding = batch_sharding(meshes[s], aval.shape, micro_batch_size) if batch else NamedSharding(meshes[s], P())
                ops.append(StageOperand(pos, source, sharding, batch))
        operands.append(tuple(ops))
        grad_shardings.append(tuple(param_on(k, s) for k in stage.param_inputs))
        moves = []
        for k, aval in zip(stage.param_inputs, (a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind == "param")):
            owner = graph.param_owner(k)
            moves.append(None if owner == s else _move(
                f"gradient of parameter {k} from stage {s} to its owner {owner}", aval,
                param_on(k, s), param_on(k, owner), executor, strategy))
        gradient_moves.append(tuple(moves))
    loss_stage = graph.loss.index
    loss_aval = graph.stages[loss_stage].jaxpr.out_avals[graph.loss.slot]
    loss_moves = {
        apply.mesh: _move(f"loss from stage {loss_stage} to mesh {apply.mesh}", loss_aval,
                          NamedSharding(meshes[loss_stage], P()), NamedSharding(meshes[apply.mesh], P()),
                          executor, strategy)
        for apply in split.stages if OuterRef("loss") in apply.inputs and apply.mesh != loss_stage
    }
    return StepLayout(
        tuple(in_placements), tuple(_output_placements(in_tree, out_tree, in_placements)), tuple(operands),
        tuple(grad_shardings), tuple(gradient_moves), loss_moves,
    )
