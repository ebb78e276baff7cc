"""Pass: decompose a resharding task into unit communication tasks (§2.2).

A unit task is the intersection of one source tile and one destination tile:
a unique data slice, every source device that holds it (the sender
candidates), and every destination device that needs it (the receivers).
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from ..model.tiles import Bounds
from ..verification import PlanVerificationError
from .resharding_task import ReshardingTask

__all__ = ["UnitTask", "decompose", "verify_decomposition"]


@dataclasses.dataclass(frozen=True)
class UnitTask:
    """One data slice to multicast from any of ``senders`` to all ``receivers``.

    Attributes:
      index: position in decomposition order (destination-tile-major).
      bounds: ``(start, stop)`` per tensor dimension; non-empty.
      senders: source device ids holding the slice, ascending.
      receivers: destination device ids needing it, ascending.
      nbytes: size of the slice in bytes.
    """

    index: int
    bounds: Bounds
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in self.bounds)


def decompose(task: ReshardingTask) -> tuple[UnitTask, ...]:
    """Unit tasks of ``task`` in destination-tile-major, then source-tile order.

    Tiles are products of per-dimension intervals, so the overlaps are found
    per dimension and multiplied out: the cost is the number of unit tasks,
    not the product of the tile counts.
    """
    src_by_block = {t.block: t for t in task.src_tiles}
    rank = len(task.shape)
    # Per dimension: the distinct (block index, interval) pairs of the source.
    src_intervals = [
        sorted({(t.block[d], t.bounds[d]) for t in task.src_tiles}) for d in range(rank)
    ]
    overlap_cache: dict[tuple[int, tuple[int, int]], list[tuple[int, tuple[int, int]]]] = {}

    def overlaps(d: int, lo: int, hi: int) -> list[tuple[int, tuple[int, int]]]:
        key = (d, (lo, hi))
        if key not in overlap_cache:
            overlap_cache[key] = [
                (block, (max(a, lo), min(b, hi))) for block, (a, b) in src_intervals[d] if max(a, lo) < min(b, hi)
            ]
        return overlap_cache[key]

    units: list[UnitTask] = []
    for dst in task.dst_tiles:
        if dst.size == 0:
            continue
        per_dim = [overlaps(d, *dst.bounds[d]) for d in range(rank)]
        for combo in itertools.product(*per_dim):
            block = tuple(b for b, _ in combo)
            bounds = tuple(iv for _, iv in combo)
            size = int(np.prod([e - s for s, e in bounds], dtype=np.int64))
            units.append(
                UnitTask(
                    index=len(units),
                    bounds=bounds,
                    senders=tuple(sorted(src_by_block[block].devices)),
                    receivers=tuple(sorted(dst.devices)),
                    nbytes=size * task.itemsize,
                )
            )
    return tuple(units)


def _contains(outer: Bounds, inner: Bounds) -> bool:
    return all(a <= s and e <= b for (a, b), (s, e) in zip(outer, inner))


def verify_decomposition(task: ReshardingTask, units: tuple[UnitTask, ...]) -> None:
    """Checks that every destination device receives exactly its tile.

    Each unit lies inside the source tile of every sender and the destination
    tile of every receiver, and for each destination tile the units cover it
    with no gap and no overlapping write.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    src_tile_of = {d: t for t in task.src_tiles for d in t.devices}
    dst_tile_of = {d: t for t in task.dst_tiles for d in t.devices}
    by_dst_tile: dict[tuple[int, ...], list[UnitTask]] = {}
    for u in units:
        if not u.senders or not u.receivers:
            raise PlanVerificationError(f"unit task {u.index} has no sender or no receiver")
        for s in u.senders:
            if s not in src_tile_of or not _contains(src_tile_of[s].bounds, u.bounds):
                raise PlanVerificationError(f"unit task {u.index}: sender {s} does not hold {u.bounds}")
        tiles_hit = {dst_tile_of[r].block for r in u.receivers if r in dst_tile_of}
        if len(tiles_hit) != 1 or len(u.receivers) != len(dst_tile_of[u.receivers[0]].devices):
            raise PlanVerificationError(
                f"unit task {u.index}: receivers {u.receivers} are not exactly the holders of one destination tile"
            )
        tile = dst_tile_of[u.receivers[0]]
        if not _contains(tile.bounds, u.bounds):
            raise PlanVerificationError(f"unit task {u.index}: {u.bounds} lies outside destination tile {tile.bounds}")
        by_dst_tile.setdefault(tile.block, []).append(u)
    for tile in task.dst_tiles:
        mine = by_dst_tile.get(tile.block, [])
        if tile.size == 0:
            if mine:
                raise PlanVerificationError(f"empty destination tile {tile.block} receives data")
            continue
        # Cut the tile into the grid of all unit boundaries and count how often
        # each cell is written: exactly once everywhere means exact cover.
        cuts = [
            np.unique([*tile.bounds[d], *(x for u in mine for x in u.bounds[d])])
            for d in range(len(tile.bounds))
        ]
        counts = np.zeros([len(c) - 1 for c in cuts], dtype=np.int32)
        for u in mine:
            index = tuple(
                slice(int(np.searchsorted(c, s)), int(np.searchsorted(c, e))) for c, (s, e) in zip(cuts, u.bounds)
            )
            counts[index] += 1
        if counts.size and not np.all(counts == 1):
            kind = "overlapping writes" if counts.max() > 1 else "a gap"
            raise PlanVerificationError(
                f"destination tile {tile.block} {tile.bounds} has {kind} among its {len(mine)} unit tasks"
            )
