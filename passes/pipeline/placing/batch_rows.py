"""Passes: where each micro-batch of a global batch already lies, and the move feeding it to a
stage; and the moves placing a global batch leaf whole where the work around the pipeline reads it.

A batch leaf passed as a global ``jax.Array`` (each process holding its own rows, as
``jax.make_array_from_process_local_data`` builds it) is never gathered: micro-batch ``m``
(rows ``[m * size, (m + 1) * size)``) is a view of the shards that hold those rows, laid out
by a ``NamedSharding`` of its own over just those devices, and one planned point-to-point
move (``plan_moves``, the same planner as every move between meshes) carries it to the
sharding the stage reads it with. The view may share devices with the stage's mesh (a batch
laid out over every device): a piece already on its device stays there.

Which rows a shard holds follows from the batch's sharding alone: dimension 0 split in
``N`` blocks of ``r`` rows over the mesh axes its spec names there (in the spec's order),
replicated over the other axes. A micro-batch is one block's slice (``r`` a multiple of
``size``) or ``size / r`` whole consecutive blocks (``size`` a multiple of ``r``).

A global batch leaf the computations around the pipeline read too (a mask summed into a
normaliser, a metric of the batch) has a ``PlaceLeaf`` on their meshes (``step_layout``). No
process can fetch it to place it from the host, so ``global_batch_placements`` plans one
point-to-point move of the whole leaf from its own sharding to each array its ``PlaceLeaf`` lays
it out as (``PlaceLeaf.targets``: one array over the union of the meshes on one platform, else
one per mesh); the runtime runs that move and nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...compiler_pass import compiler_pass
from ...program.batch_rows import ROWS_AXIS, GlobalBatchFeed, GlobalBatchPlacement, MicroBatchRows
from ...program.moves import MoveKey, TransferKind
from ...program.step_values import OuterKind
from ...verification import PlanVerificationError
from .step_layout import StepLayout

__all__ = ["global_batch_feed", "global_batch_feeds", "global_batch_placements", "micro_batch_rows", "spans_processes",
           "verify_global_batch_feeds", "verify_global_batch_placements"]


def _dim0_axes(spec: P) -> tuple[str, ...]:
    first = spec[0] if len(spec) else None
    if first is None:
        return ()
    return tuple(first) if isinstance(first, (tuple, list)) else (first,)


def micro_batch_rows(shape: Sequence[int], sharding: NamedSharding, num_micro_batches: int) -> tuple[MicroBatchRows, ...]:
    """Per micro-batch, where its rows of a ``shape`` leaf laid out by ``sharding`` lie.

    Raises:
      ValueError: naming ``num_micro_batches`` when micro-batches cut across the batch's shards
        (neither a shard's rows nor a micro-batch's a multiple of the other's).
    """
    B = int(shape[0])
    size = B // num_micro_batches
    mesh, spec = sharding.mesh, sharding.spec
    rows_axes = _dim0_axes(spec)
    rest = tuple(spec[1:])
    others = [a for a in mesh.axis_names if a not in rows_axes]
    N = math.prod(mesh.shape[a] for a in rows_axes)
    r = B // N
    # The mesh's devices with the row axes first (in the spec's order, so block b is index b of
    # their flattening), then the others.
    order = [mesh.axis_names.index(a) for a in (*rows_axes, *others)]
    blocks = np.transpose(mesh.devices, order).reshape(N, *(mesh.shape[a] for a in others))
    out = []
    for m in range(num_micro_batches):
        lo = m * size
        if r % size == 0:
            b = lo // r
            # The block's devices; with no other axes, a mesh of one axis of them.
            sub = Mesh(blocks[b], tuple(others)) if others else Mesh(blocks[b: b + 1], (ROWS_AXIS,))
            out.append(MicroBatchRows(NamedSharding(sub, P(None, *rest)), lo % r, False))
        elif size % r == 0:
            sub = Mesh(blocks[lo // r: (lo + size) // r], (ROWS_AXIS, *others))
            out.append(MicroBatchRows(NamedSharding(sub, P(ROWS_AXIS, *rest)), 0, True))
        else:
            raise ValueError(
                f"num_micro_batches: {num_micro_batches} micro-batches of {size} rows cut across the batch's shards "
                f"of {r} rows ({sharding.spec} over mesh {dict(mesh.shape)}); choose a count whose micro-batches "
                f"hold whole shards or lie within one")
    return tuple(out)


def global_batch_feed(stage: int, position: int, leaf: int, shape: Sequence[int], dtype: np.dtype,
                      source: NamedSharding, target: NamedSharding, num_micro_batches: int) -> GlobalBatchFeed:
    """The feed of a stage operand read per micro-batch with ``target`` from a global batch leaf
    laid out as ``source``: each micro-batch's rows and its point-to-point move."""
    rows = micro_batch_rows(shape, source, num_micro_batches)
    view_shape = (int(shape[0]) // num_micro_batches, *map(int, shape[1:]))
    moves = tuple(MoveKey.of(TransferKind.P2P, view_shape, dtype, r.sharding, target) for r in rows)
    return GlobalBatchFeed(stage, position, leaf, source, rows, moves)


def spans_processes(leaf: object) -> bool:
    """Whether ``leaf`` is a ``jax.Array`` with shards on other processes' devices (a global batch)."""
    return isinstance(leaf, jax.Array) and not leaf.is_fully_addressable


@compiler_pass
def global_batch_feeds(layout: StepLayout, leaves: Sequence[object], num_micro_batches: int) -> tuple[GlobalBatchFeed, ...]:
    """Every stage operand read per micro-batch straight from a batch leaf that is a global
    array (``spans_processes``), with its rows and moves (``global_batch_feed``), also when the
    work around the pipeline reads the leaf whole (``global_batch_placements`` places that copy).
    Batch leaves given as host data are cut on the host instead (every process holds the same value).

    Raises:
      ValueError: naming the leaf, when a global batch leaf is not laid out by a ``NamedSharding``.
    """
    feeds = []
    for s, operands in enumerate(layout.stage_operands):
        for op in operands:
            if not op.per_micro_batch or op.fold_key or op.source.kind is not OuterKind.IN:
                continue
            i = op.source.index
            leaf = leaves[i]
            if not spans_processes(leaf):
                continue
            feeds.append(global_batch_feed(s, op.position, i, leaf.shape, leaf.dtype, _global_source(i, leaf),
                                           op.sharding, num_micro_batches))
    return tuple(feeds)


def _lies_as(leaf: jax.Array, targets: Sequence[NamedSharding]) -> bool:
    """Whether ``leaf`` is laid out as the one array ``targets`` names (placed as it is)."""
    return len(targets) == 1 and (leaf.sharding == targets[0] or leaf.sharding.is_equivalent_to(targets[0], leaf.ndim))


def _global_source(i: int, leaf: jax.Array) -> NamedSharding:
    """The sharding of global batch leaf ``i``, which must be a ``NamedSharding``."""
    if not isinstance(leaf.sharding, NamedSharding):
        raise ValueError(f"batch leaf {i}: a global batch array must be laid out by a NamedSharding "
                         f"(as jax.make_array_from_process_local_data builds it), got {leaf.sharding}")
    return leaf.sharding


@compiler_pass
def global_batch_placements(layout: StepLayout, leaves: Sequence[object],
                            batch_leaves: frozenset[int]) -> tuple[GlobalBatchPlacement, ...]:
    """Every batch leaf given as a global array (``spans_processes``) that the computations
    around the pipeline read whole (a ``PlaceLeaf`` on some mesh), with the point-to-point moves
    of the whole leaf from its own sharding to where it is placed (``PlaceLeaf.targets``): no
    process fetches it to the host. Host data is placed from the host (every process holds the
    same value), as is a leaf already laid out as its placement.

    Raises:
      ValueError: naming the leaf, when a global batch leaf is not laid out by a ``NamedSharding``.
    """
    out = []
    for i in sorted(batch_leaves):
        placement, leaf = layout.in_placements[i], leaves[i]
        if not placement.meshes or not spans_processes(leaf):
            continue
        source = _global_source(i, leaf)
        targets = placement.targets
        if _lies_as(leaf, targets):
            continue
        moves = tuple(MoveKey.of(TransferKind.P2P, leaf.shape, leaf.dtype, source, t) for t in targets)
        out.append(GlobalBatchPlacement(i, source, placement, moves))
    return tuple(out)


def verify_global_batch_placements(placements: Sequence[GlobalBatchPlacement], layout: StepLayout,
                                   leaves: Sequence[object], batch_leaves: frozenset[int]) -> None:
    """Each placed leaf is a batch leaf of ``leaves`` given as a global array laid out as the
    placement's ``source``, placed as the layout says, once; its moves are point-to-point ones
    of the whole leaf, each from that sharding to one of ``PlaceLeaf.targets``, in their order;
    every other such leaf with a placement already lies as it (no process would fetch it).

    Raises:
      PlanVerificationError: naming the leaf.
    """
    seen = set()
    for p in placements:
        what = f"the placement of global batch leaf {p.leaf}"
        if p.leaf in seen or p.leaf not in batch_leaves:
            raise PlanVerificationError(f"{what}: not a batch leaf, or placed twice")
        seen.add(p.leaf)
        if p.placement != layout.in_placements[p.leaf] or not p.placement.meshes:
            raise PlanVerificationError(f"{what}: not the layout's placement of that leaf")
        leaf = leaves[p.leaf]
        if not spans_processes(leaf) or leaf.sharding != p.source:
            raise PlanVerificationError(f"{what}: the leaf is not a global array laid out as {p.source}")
        targets = p.placement.targets
        if tuple(m.dst for m in p.moves) != targets:
            raise PlanVerificationError(f"{what}: moves to {len(p.moves)} shardings, not to the placement's "
                                        f"{len(targets)} arrays")
        for move in p.moves:
            if (move.kind is not TransferKind.P2P or move.src != p.source or move.shape != tuple(leaf.shape)
                    or move.dtype != np.dtype(leaf.dtype)):
                raise PlanVerificationError(f"{what}: a move that is not a point-to-point one of the whole leaf "
                                            f"from its sharding")
    for i in sorted(batch_leaves - seen):
        placement = layout.in_placements[i]
        if placement.meshes and spans_processes(leaves[i]) and not _lies_as(leaves[i], placement.targets):
            raise PlanVerificationError(f"global batch leaf {i}: placed on meshes {placement.meshes} by no move")


def verify_global_batch_feeds(feeds: Sequence[GlobalBatchFeed], layout: StepLayout, num_micro_batches: int) -> None:
    """Each feed is of a stage operand read per micro-batch, has one view and one move per
    micro-batch, each view on devices of the batch's sharding, each move into the operand's
    sharding; no operand is fed twice.

    Raises:
      PlanVerificationError: naming the feed.
    """
    seen = set()
    for feed in feeds:
        what = f"the global batch feed of stage {feed.stage}'s operand {feed.position}"
        ops = {op.position: op for op in layout.stage_operands[feed.stage]}
        op = ops.get(feed.position)
        if op is None or not op.per_micro_batch or (feed.stage, feed.position) in seen:
            raise PlanVerificationError(f"{what}: not an operand read per micro-batch, or fed twice")
        seen.add((feed.stage, feed.position))
        if len(feed.rows) != num_micro_batches or len(feed.moves) != num_micro_batches:
            raise PlanVerificationError(f"{what}: {len(feed.rows)} views and {len(feed.moves)} moves for "
                                        f"{num_micro_batches} micro-batches")
        for rows, move in zip(feed.rows, feed.moves):
            if not set(rows.sharding.device_set) <= set(feed.source.device_set):
                raise PlanVerificationError(f"{what}: a view on devices the batch does not lie on")
            if move.src != rows.sharding or move.dst != op.sharding or move.kind is not TransferKind.P2P:
                raise PlanVerificationError(f"{what}: a move that is not a point-to-point one from the view to "
                                            f"the operand's sharding")
