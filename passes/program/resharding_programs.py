"""The lowered forms of one resharding, device by device: ``TransferProgram`` (collective steps),
``HopProgram`` (point-to-point hops) and its round ``Gate``s."""

from __future__ import annotations

import dataclasses

__all__ = ["Box", "Cut", "Gate", "Hop", "HopProgram", "Place", "Step", "Transfer", "TransferProgram"]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One box from one device to another.

    Attributes:
      src_device: sender's device id.
      from_source: read from the sender's source tile (``True``) or from the
        destination buffer it is filling (a relay, ``False``).
      src_offset: box start inside that tile.
      dst_device: receiver's device id; writes into its destination buffer.
      dst_offset: box start inside the receiver's destination tile.
      shape: box shape.
    """

    src_device: int
    from_source: bool
    src_offset: tuple[int, ...]
    dst_device: int
    dst_offset: tuple[int, ...]
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Step:
    """Transfers that run together: no device sends twice or receives twice."""

    transfers: tuple[Transfer, ...]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """Distinct box shapes, in first-use order (one collective each)."""
        return tuple(dict.fromkeys(t.shape for t in self.transfers))


@dataclasses.dataclass(frozen=True)
class TransferProgram:
    """Everything a runtime needs to move the tensor, device by device.

    Attributes:
      src_tile_shape, dst_tile_shape: per-device tile shapes (uniform: the
        runtime needs layouts that divide the tensor).
      src_devices, dst_devices: device ids of each mesh, in mesh order.
      steps: run in sequence.
      round_ends: index of the last step of each plan round.
      fingerprint: the plan's fingerprint.
    """

    src_tile_shape: tuple[int, ...]
    dst_tile_shape: tuple[int, ...]
    src_devices: tuple[int, ...]
    dst_devices: tuple[int, ...]
    steps: tuple[Step, ...]
    round_ends: tuple[int, ...]
    fingerprint: str

    @property
    def num_transfers(self) -> int:
        return sum(len(s.transfers) for s in self.steps)


Box = tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Cut:
    """Piece ``piece`` is sliced out of ``device``'s source tile at ``offset``."""

    piece: int
    device: int
    offset: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Hop:
    """Piece ``piece`` moves from ``src_device`` (which has it) to ``dst_device``."""

    piece: int
    src_device: int
    dst_device: int


@dataclasses.dataclass(frozen=True)
class Place:
    """``device`` writes piece ``piece`` into its destination tile at ``offset``."""

    piece: int
    device: int
    offset: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class HopProgram:
    """Everything a point-to-point runtime needs to move one tensor.

    Attributes:
      shape: the global tensor shape (``()`` for a scalar).
      piece_shapes: shape of each piece, indexed by piece id.
      src_tiles, dst_tiles: per device id, its tile shape.
      cuts: every piece's origin; one per piece.
      steps: hops per step, in dispatch order; ``rounds[r]`` is the range of
        step indices of plan round ``r``.
      rounds: ``(first, last + 1)`` step indices per round.
      places: per destination device, where each piece it receives goes.
      fingerprint: identifies the data movement (equal on every process).
    """

    shape: tuple[int, ...]
    piece_shapes: tuple[tuple[int, ...], ...]
    src_tiles: tuple[tuple[int, tuple[int, ...]], ...]
    dst_tiles: tuple[tuple[int, tuple[int, ...]], ...]
    cuts: tuple[Cut, ...]
    steps: tuple[tuple[Hop, ...], ...]
    rounds: tuple[tuple[int, int], ...]
    places: tuple[Place, ...]
    fingerprint: str

    @property
    def num_hops(self) -> int:
        return sum(len(s) for s in self.steps)

    @property
    def src_devices(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.src_tiles)

    @property
    def dst_devices(self) -> tuple[int, ...]:
        return tuple(d for d, _ in self.dst_tiles)


@dataclasses.dataclass(frozen=True)
class Gate:
    """Before round ``round``, the pieces ``pieces`` that ``src_device`` sends across hosts wait
    for a token made of the arrivals ``arrivals`` ((device, piece) keys of earlier rounds, all
    on host ``host``), gathered on ``collector`` (one of those devices)."""

    round: int
    host: int
    arrivals: tuple[tuple[int, int], ...]
    collector: int
    src_device: int
    pieces: tuple[int, ...]
