"""Pass: where each micro-batch of a global batch already lies, and the move feeding it to a stage.

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ...compiler_pass import compiler_pass
from ..cutting.step_split import OuterKind
from ...verification import PlanVerificationError
from .edge_transfer import MoveKey, TransferKind
from .step_layout import StepLayout

__all__ = ["GlobalBatchFeed", "MicroBatchRows", "global_batch_feed", "global_batch_feeds", "micro_batch_rows",
           "spans_processes", "verify_global_batch_feeds"]

# The axis a view's mesh names its consecutive blocks by.
ROWS_AXIS = "meshpar_rows"


@dataclasses.dataclass(frozen=True)
class MicroBatchRows:
    """Micro-batch rows of a global batch leaf as they lie: ``sharding`` lays out the
    ``(size, ...)`` view over the devices holding them; on each of them the view's piece is
    rows ``[start, start + size)`` of its shard of the whole leaf, or (``whole``) its shard."""

    sharding: NamedSharding
    start: int
    whole: bool


@dataclasses.dataclass(frozen=True)
class GlobalBatchFeed:
    """Operand ``position`` of stage ``stage`` read per micro-batch from input leaf ``leaf``, a
    global array laid out as ``source``: per micro-batch its rows and the move to the stage."""

    stage: int
    position: int
    leaf: int
    source: NamedSharding
    rows: tuple[MicroBatchRows, ...]
    moves: tuple[MoveKey, ...]


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
    array (``spans_processes``), with its rows and moves (``global_batch_feed``). Batch leaves
    given as host data are cut on the host instead (every process holds the same value).

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
            if layout.in_placements[i].meshes or not spans_processes(leaf):
                continue
            if not isinstance(leaf.sharding, NamedSharding):
                raise ValueError(f"batch leaf {i}: a global batch array must be laid out by a NamedSharding "
                                 f"(as jax.make_array_from_process_local_data builds it), got {leaf.sharding}")
            feeds.append(global_batch_feed(s, op.position, i, leaf.shape, leaf.dtype, leaf.sharding, op.sharding,
                                           num_micro_batches))
    return tuple(feeds)


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
