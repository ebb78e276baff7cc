"""What a strategy lowers one scheduled unit task to: chains of hops (``Strategy.chains``).

A *chain* is a box of the tensor that starts on one device (in its source tile) and hops,
device to device, along a list of receivers, each of which keeps it. Both lowerings (the
collective ``transfer_program`` and the point-to-point ``hop_program``) pack the same chains
into steps; they differ only in how a box is cut (``split``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

__all__ = ["Box", "Chain", "Split", "split_box", "split_box_exact"]

Box = tuple[tuple[int, int], ...]
# (box, parts) -> pieces covering it; ``split_box`` or ``split_box_exact``.
Split = Callable[[Box, int], list[Box]]


@dataclasses.dataclass(frozen=True)
class Chain:
    """A box of the tensor that starts on ``devices[0]`` (in its source tile) and
    hops along ``devices[1:]``, each of which keeps it in its destination tile."""

    box: Box  # global bounds
    devices: tuple[int, ...]


def split_box(box: Box, parts: int) -> list[Box]:
    """``parts`` equal-shaped pieces covering ``box`` along its longest dimension.

    Fewer pieces when the dimension is shorter than ``parts``; the last
    piece is shifted back to end at the box edge (overlapping its neighbour).
    """
    lengths = [b - a for a, b in box]
    d = max(range(len(box)), key=lambda i: (lengths[i], -i))
    length = lengths[d]
    size = -(-length // max(1, min(parts, length)))
    count = -(-length // size)
    out = []
    for p in range(count):
        start = box[d][0] + min(p * size, length - size)
        piece = list(box)
        piece[d] = (start, start + size)
        out.append(tuple(piece))
    return out


def split_box_exact(box: Box, parts: int) -> list[Box]:
    """Up to ``parts`` disjoint pieces covering ``box`` along its longest dimension,
    their lengths differing by at most one (for runtimes without static shapes)."""
    lengths = [b - a for a, b in box]
    d = max(range(len(box)), key=lambda i: (lengths[i], -i))
    count = max(1, min(parts, lengths[d]))
    out = []
    for p in range(count):
        piece = list(box)
        piece[d] = (box[d][0] + p * lengths[d] // count, box[d][0] + (p + 1) * lengths[d] // count)
        out.append(tuple(piece))
    return out
