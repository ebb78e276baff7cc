"""Pass: lower a ``ReshardingPlan`` to a ``HopProgram`` of point-to-point moves.

The target is a runtime where every move is one whole array going from one
device to another (``jax.device_put`` onto a single-device sharding: a local
copy inside a process, the cross-host transfer path across processes), so
nothing needs a static box shape or a program spanning both meshes:

- a *piece* is a box of the tensor; each is cut once out of one sender's
  source tile (``Cut``),
- then *hops* from device to device along its chain (``Hop``): a relay
  forwards the very array it received, no slicing,
- and every device it reaches writes it into its destination tile
  (``Place``).

Chains are the same as the collective lowering's (``transfer_program``):
broadcast pipelines K chunks through the ring; send_recv sends the whole
slice to each receiver; the all-gathers scatter then circulate per ring.
Pieces here are cut exactly (lengths differ by at most one), not shifted to
one static shape, so no byte is sent twice. Tiles may differ in shape
(padded layouts): every per-device tile shape is explicit.

Hops are grouped in *steps* (no device sends twice or receives twice in a
step) inside the plan's rounds; a runtime may dispatch a step's hops
together.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json

from ..compiler_pass import compiler_pass
from ..program.resharding_programs import Box, Cut, Hop, HopProgram, Place
from ..verification import PlanVerificationError
from .chains import Chain, split_box_exact
from .resharding_plan import ReshardingPlan
from .transfer_program import pack_steps

__all__ = ["lower_to_hops", "replicate_scalar", "verify_hop_program"]


def _fingerprint(program_doc: dict) -> str:
    return hashlib.sha256(json.dumps(program_doc, separators=(",", ":")).encode()).hexdigest()[:16]


def _offset(box: Box, origin: tuple[int, ...]) -> tuple[int, ...]:
    """Where ``box`` starts inside a tile that starts at ``origin``."""
    return tuple(a - o for (a, _), o in zip(box, origin))


def _assemble(shape, chains_per_round: list[list[Chain]], src_origin, dst_origin, src_tiles, dst_tiles) -> HopProgram:
    piece_of: dict[tuple[int, Box], int] = {}  # (sender, box) -> piece: a box sent twice is cut once
    piece_shapes: list[tuple[int, ...]] = []
    cuts: list[Cut] = []
    places: dict[tuple[int, int], Place] = {}
    steps: list[tuple[Hop, ...]] = []
    rounds: list[tuple[int, int]] = []
    for chains in chains_per_round:
        first = len(steps)
        pieces = []  # per chain
        for chain in chains:
            key = (chain.devices[0], chain.box)
            if key not in piece_of:
                piece_of[key] = len(piece_shapes)
                piece_shapes.append(tuple(b - a for a, b in chain.box))
                cuts.append(Cut(piece_of[key], chain.devices[0], _offset(chain.box, src_origin[chain.devices[0]])))
            pieces.append(piece_of[key])
        for step in pack_steps(chains):
            hops = []
            for c, j in step:
                piece, receiver = pieces[c], chains[c].devices[j + 1]
                hops.append(Hop(piece, chains[c].devices[j], receiver))
                places.setdefault((receiver, piece), Place(piece, receiver, _offset(chains[c].box, dst_origin[receiver])))
            steps.append(tuple(hops))
        rounds.append((first, len(steps)))
    doc = {
        "shape": shape, "pieces": piece_shapes, "cuts": [dataclasses.astuple(c) for c in cuts],
        "steps": [[dataclasses.astuple(h) for h in s] for s in steps],
        "dst": sorted(dst_tiles.items()), "src": sorted(src_tiles.items()),
    }
    return HopProgram(
        shape=tuple(shape),
        piece_shapes=tuple(piece_shapes),
        src_tiles=tuple(src_tiles.items()),
        dst_tiles=tuple(dst_tiles.items()),
        cuts=tuple(cuts),
        steps=tuple(steps),
        rounds=tuple(rounds),
        places=tuple(sorted(places.values(), key=lambda p: (p.device, p.piece))),
        fingerprint=_fingerprint(doc),
    )


@compiler_pass
def lower_to_hops(plan: ReshardingPlan) -> HopProgram:
    """Lowers ``plan`` to cuts, hops in steps per round, and placements.

    Works for every strategy and for padded (uneven) layouts.
    """
    task = plan.task
    src_origin = {d: tuple(a for a, _ in t.bounds) for t in task.src_tiles for d in t.devices}
    dst_origin = {d: tuple(a for a, _ in t.bounds) for t in task.dst_tiles for d in t.devices}
    src_tiles = {d: t.shape for d in task.src_mesh.devices for t in task.src_tiles if d in t.devices}
    dst_tiles = {d: t.shape for d in task.dst_mesh.devices for t in task.dst_tiles if d in t.devices}
    chains_per_round = [
        # Plan order within a round: the planner's priority decides who goes
        # first when two chains want the same device in the same step.
        [c for t in round_tasks for c in plan.strategy.chains(t, task.host_of, split_box_exact)]
        for round_tasks in plan.rounds
    ]
    return _assemble(task.shape, chains_per_round, src_origin, dst_origin, src_tiles, dst_tiles)


def replicate_scalar(src_devices: tuple[int, ...], dst_devices: tuple[int, ...]) -> HopProgram:
    """A 0-d value replicated on ``src_devices``, to every one of ``dst_devices``:
    one chain from the first source device through the destinations in order."""
    if not src_devices or not dst_devices:
        raise ValueError("src_devices, dst_devices: expected at least one device each")
    chain = Chain((), (src_devices[0], *dst_devices))
    origin = {d: () for d in (*src_devices, *dst_devices)}
    return _assemble((), [[chain]], origin, origin, {d: () for d in src_devices}, {d: () for d in dst_devices})


def verify_hop_program(program: HopProgram) -> None:
    """Checks that the program delivers exactly each destination tile.

    Every piece is cut once, inside its sender's source tile; a hop sends a
    piece its sender already holds (cut there, or received in an earlier
    step); no device sends or receives twice in one step; every destination
    device receives each piece once, places it inside its tile, and its
    pieces cover the tile exactly (overlaps allowed, gaps not).

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    src_tiles, dst_tiles = dict(program.src_tiles), dict(program.dst_tiles)
    holds: set[tuple[int, int]] = set()
    if [c.piece for c in program.cuts] != list(range(len(program.piece_shapes))):
        raise PlanVerificationError("every piece must be cut exactly once, in piece order")
    for c in program.cuts:
        _inside(c.offset, program.piece_shapes[c.piece], src_tiles.get(c.device), f"cut of piece {c.piece} on device {c.device}")
        holds.add((c.device, c.piece))
    expected_steps = [k for a, b in program.rounds for k in range(a, b)]
    if expected_steps != list(range(len(program.steps))):
        raise PlanVerificationError("rounds must cover the steps in order, without gaps")
    received: dict[int, list[int]] = {d: [] for d in dst_tiles}
    for k, step in enumerate(program.steps):
        senders = [h.src_device for h in step]
        receivers = [h.dst_device for h in step]
        if len(set(senders)) != len(senders) or len(set(receivers)) != len(receivers):
            raise PlanVerificationError(f"step {k}: a device sends or receives twice")
        for h in step:
            if (h.src_device, h.piece) not in holds:
                raise PlanVerificationError(f"step {k}: device {h.src_device} sends piece {h.piece} it does not hold")
            if h.dst_device not in dst_tiles:
                raise PlanVerificationError(f"step {k}: device {h.dst_device} is not a destination")
            if h.piece in received[h.dst_device]:
                raise PlanVerificationError(f"step {k}: device {h.dst_device} receives piece {h.piece} twice")
            received[h.dst_device].append(h.piece)
        holds |= {(h.dst_device, h.piece) for h in step}
    placed = {(p.device, p.piece): p for p in program.places}
    for device, tile in dst_tiles.items():
        if sorted(received[device]) != sorted(p for d, p in placed if d == device):
            raise PlanVerificationError(f"device {device}: pieces received and pieces placed differ")
        covered = _covered_cells(tile, [(placed[device, p].offset, program.piece_shapes[p]) for p in received[device]])
        for p in received[device]:
            _inside(placed[device, p].offset, program.piece_shapes[p], tile, f"piece {p} on device {device}")
        if not covered:
            raise PlanVerificationError(f"device {device}: its pieces leave part of its tile {tile} empty")


def _inside(offset: tuple[int, ...], shape: tuple[int, ...], tile: tuple[int, ...] | None, what: str) -> None:
    if tile is None:
        raise PlanVerificationError(f"{what}: the device has no such tile")
    if len(offset) != len(tile) or any(o < 0 or o + n > s for o, n, s in zip(offset, shape, tile)):
        raise PlanVerificationError(f"{what}: box {shape} at {offset} leaves tile {tile}")


def _covered_cells(tile: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> bool:
    """Whether ``boxes`` cover ``tile``: checked on the grid of box edges, so the
    cost is in the number of boxes, not the tile's size."""
    if any(n == 0 for n in tile):
        return True
    cuts = []
    for d, n in enumerate(tile):
        edges = {0, n}
        for offset, shape in boxes:
            edges |= {offset[d], offset[d] + shape[d]}
        cuts.append(sorted(e for e in edges if 0 <= e <= n))
    for cell in itertools.product(*(zip(c[:-1], c[1:]) for c in cuts)):
        if not any(all(o <= a and b <= o + s for (a, b), o, s in zip(cell, offset, shape)) for offset, shape in boxes):
            return False
    return True
