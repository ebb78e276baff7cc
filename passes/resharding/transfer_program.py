"""Pass: lower a ``ReshardingPlan`` to a device-level ``TransferProgram``.

Every strategy lowers each scheduled task to a set of *chains* (``Strategy.chains``,
``chains.Chain``): a box of the tensor that starts on one device and hops, device to
device, along a list of receivers.

- ``broadcast``: the unit slice cut into K chunks, each chunk one chain
  through the whole ring (sender, then every receiver in route order); chunk
  k+1 leaves the sender while chunk k moves on.
- ``send_recv``: one single-hop chain per receiver, all from the sender.
- ``local_allgather``: per receiving host, the slice cut into B parts; part q
  goes from the sender to the host's q-th device and then around that host's
  devices (a ring all-gather).
- ``global_allgather``: the same over all receivers at once.

Chains are then packed into *steps*: in one step a device sends at most one
box and receives at most one box, and a hop runs only after the hop that
brought its box. Rounds of the plan stay apart (round r+1's hops start after
round r's last), so tasks the planner kept off each other's NICs never
overlap.

Uneven splits keep one static box shape: pieces are ``ceil(L/K)`` long and
the last one is shifted back to end at ``L``, overlapping its neighbour;
overlapping writes carry identical data.
"""

from __future__ import annotations

from collections.abc import Callable

from ..compiler_pass import compiler_pass
from ..program.resharding_programs import Step, Transfer, TransferProgram
from ..verification import PlanVerificationError
from .chains import Chain, Split, split_box, split_box_exact
from .resharding_plan import ReshardingPlan, ScheduledTask
from .strategies import Strategy

__all__ = ["Chain", "lower_plan", "pack_steps", "plan_chains", "split_box", "split_box_exact", "verify_program"]


def plan_chains(t: ScheduledTask, strategy: Strategy, host_of: Callable[[int], int],
                split: Split = split_box) -> list[Chain]:
    """The chains that carry scheduled task ``t`` under ``strategy`` (``Strategy.chains``);
    ``split`` cuts boxes."""
    return strategy.chains(t, host_of, split)


def pack_steps(chains: list[Chain]) -> list[list[tuple[int, int]]]:
    """Packs the hops of ``chains`` into steps: per step a device sends at most one
    box and receives at most one, and a hop runs after the hop that brought its box.

    Chains are taken in the given order, so earlier chains win contested devices.
    Returns, per step, ``(chain index, hop index)`` pairs.
    """
    done = [0] * len(chains)
    pending = list(range(len(chains)))
    steps: list[list[tuple[int, int]]] = []
    while pending:
        sending: set[int] = set()
        receiving: set[int] = set()
        moved: list[int] = []
        for c in pending:
            s, r = chains[c].devices[done[c]], chains[c].devices[done[c] + 1]
            if s in sending or r in receiving:
                continue
            sending.add(s)
            receiving.add(r)
            moved.append(c)
        steps.append([(c, done[c]) for c in moved])
        for c in moved:
            done[c] += 1
        pending = [c for c in pending if done[c] < len(chains[c].devices) - 1]
    return steps


@compiler_pass
def lower_plan(plan: ReshardingPlan) -> TransferProgram:
    """Lowers ``plan`` to steps of device-to-device transfers.

    Raises:
      ValueError: the layouts need padding (uneven tiles); the runtime moves
        only layouts that divide the tensor, as ``jax.sharding`` requires.
    """
    task = plan.task
    if task.pad:
        raise ValueError("task: the runtime needs layouts that divide the tensor (pad=False)")
    src_origin = {d: tuple(a for a, _ in t.bounds) for t in task.src_tiles for d in t.devices}
    dst_origin = {d: tuple(a for a, _ in t.bounds) for t in task.dst_tiles for d in t.devices}

    def hop(chain: Chain, j: int) -> Transfer:
        sender, receiver = chain.devices[j], chain.devices[j + 1]
        start = tuple(a for a, _ in chain.box)
        origin = src_origin[sender] if j == 0 else dst_origin[sender]
        return Transfer(
            src_device=sender,
            from_source=j == 0,
            src_offset=tuple(s - o for s, o in zip(start, origin)),
            dst_device=receiver,
            dst_offset=tuple(s - o for s, o in zip(start, dst_origin[receiver])),
            shape=tuple(b - a for a, b in chain.box),
        )

    steps: list[Step] = []
    round_ends: list[int] = []
    for round_tasks in plan.rounds:
        # Chains in plan order: the planner's priority decides who goes first
        # when two chains want the same device in the same step.
        chains = [c for t in round_tasks for c in plan.strategy.chains(t, task.host_of, split_box)]
        steps += [Step(tuple(hop(chains[c], j) for c, j in step)) for step in pack_steps(chains)]
        round_ends.append(len(steps) - 1)
    return TransferProgram(
        src_tile_shape=task.src_tiles[0].shape,
        dst_tile_shape=task.dst_tiles[0].shape,
        src_devices=task.src_mesh.devices,
        dst_devices=task.dst_mesh.devices,
        steps=tuple(steps),
        round_ends=tuple(round_ends),
        fingerprint=plan.fingerprint,
    )


def verify_program(program: TransferProgram) -> None:
    """Checks step exclusivity and that boxes stay inside their tiles.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    src, dst = set(program.src_devices), set(program.dst_devices)
    for k, step in enumerate(program.steps):
        senders = [t.src_device for t in step.transfers]
        receivers = [t.dst_device for t in step.transfers]
        if len(set(senders)) != len(senders) or len(set(receivers)) != len(receivers):
            raise PlanVerificationError(f"step {k}: a device sends or receives twice")
        for t in step.transfers:
            tile = program.src_tile_shape if t.from_source else program.dst_tile_shape
            if (t.src_device not in src) if t.from_source else (t.src_device not in dst):
                raise PlanVerificationError(f"step {k}: device {t.src_device} reads a tile it does not have")
            if t.dst_device not in dst:
                raise PlanVerificationError(f"step {k}: device {t.dst_device} is not a destination")
            for offsets, shape in ((t.src_offset, tile), (t.dst_offset, program.dst_tile_shape)):
                if any(o < 0 or o + n > s for o, n, s in zip(offsets, t.shape, shape)):
                    raise PlanVerificationError(f"step {k}: box {t.shape} at {offsets} leaves tile {shape}")

