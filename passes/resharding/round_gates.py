"""Pass: gate each plan round's cross-host hops on earlier rounds' arrivals, on the devices.

The planner's rounds assume each host's link carries one flow at a time. Dispatching every hop
at once (never blocking the caller) lets a later round's flow share a NIC with an earlier
round's flow to or from another host. Measured on the emulated cluster at 0.25 Gbit/s
(BENCHMARKS.md, ``--hop-trace``): in 1 to 5 of 15 repeats of a case, a sender's two flows
shared its NIC unevenly, and the losing flow (always a later round's) lost packets (4-7x the
tail-loss probes of a gated run, and no retransmission timeout), shrank its window and finished
up to 150 ms late: 2.1x the link bound. Waiting on the host for each round's arrivals keeps the flows apart
but blocks the caller.

A gate keeps them apart on the devices instead. A round-``r`` hop waits for the earlier rounds'
arrivals it would share a NIC with as another flow (``round_gates``): a one-byte token is derived from each,
gathered on one device of their host (``collector``), moved to the hop's sender, and the piece
it sends is made to depend on it. Receivers pull, and a sender's transfer server sends a piece
only once it exists, so the later flow starts when the earlier one has ended, and the caller
never waits.

Hosts are processes (one per host, each with its NIC); hops inside a host are never gated.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..compiler_pass import compiler_pass
from ..program.resharding_programs import Gate, HopProgram
from ..verification import PlanVerificationError

__all__ = ["round_gates", "verify_round_gates"]


@compiler_pass
def round_gates(program: HopProgram, host_of: Mapping[int, int]) -> tuple[Gate, ...]:
    """The gates of ``program``, in round, host, sender order: the same on every process.

    A cross-host hop from host ``a`` into host ``b`` in round ``r`` waits for every earlier
    round's cross-host hop it would share a NIC with as another flow: those into ``b`` from a
    host other than ``a``, and those out of ``a`` into a host other than ``b``. Earlier hops
    between the same two hosts are not waited for (the hop joins their flow), and neither are
    later ones; every earlier round counts, not only the last, since a plan of many rounds
    between the same hosts is in flight at once (case 4 of the paper's table: 16 rounds
    ``0 -> 2``, then 16 rounds ``1 -> 2``, whose first hops otherwise left at once). Only pieces
    the sender holds when the round starts are gated: one relayed within the round already
    waits for its arrival. ``host_of`` maps every device of the program to its host (process)."""
    gates: list[Gate] = []
    earlier: list = []
    held = {(c.device, c.piece) for c in program.cuts}  # when the round starts (_held_before)
    for r, (first, end) in enumerate(program.rounds):
        steps = program.steps[first:end]
        hops = [h for step in steps for h in step if host_of[h.src_device] != host_of[h.dst_device]]
        waits: dict[tuple[int, int], tuple[list[tuple[int, int]], list[int]]] = {}
        for h in hops:
            a, b = host_of[h.src_device], host_of[h.dst_device]
            if (h.src_device, h.piece) not in held:
                continue
            for p in earlier:
                pa, pb = host_of[p.src_device], host_of[p.dst_device]
                if (pb == b and pa != a) or (pa == a and pb != b):
                    arrivals, pieces = waits.setdefault((pb, h.src_device), ([], []))
                    if (p.dst_device, p.piece) not in arrivals:
                        arrivals.append((p.dst_device, p.piece))
                    if h.piece not in pieces:
                        pieces.append(h.piece)
        for (host, src), (arrivals, pieces) in sorted(waits.items()):
            gates.append(Gate(r, host, tuple(arrivals), arrivals[0][0], src, tuple(pieces)))
        earlier += hops
        held |= {(h.dst_device, h.piece) for step in steps for h in step}
    return tuple(gates)


def _held_before(program: HopProgram, r: int) -> set[tuple[int, int]]:
    """The (device, piece) pairs held when round ``r`` starts: cut, or received in an earlier round."""
    held = {(c.device, c.piece) for c in program.cuts}
    for k in range(program.rounds[r][0]):
        held |= {(h.dst_device, h.piece) for h in program.steps[k]}
    return held


def verify_round_gates(program: HopProgram, gates: tuple[Gate, ...], host_of: Mapping[int, int]) -> None:
    """Checks each gate: its arrivals are cross-host hops of earlier rounds into its host,
    its collector is one of their devices, and its sender sends each of its pieces across hosts
    in its round, holding it when the round starts.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    def hops_of(r: int):
        first, end = program.rounds[r]
        return [h for k in range(first, end) for h in program.steps[k]]

    for g in gates:
        if not 1 <= g.round < len(program.rounds):
            raise PlanVerificationError(f"gate {g}: round {g.round} has no previous round")
        into = {(h.dst_device, h.piece) for r in range(g.round) for h in hops_of(r)
                if host_of[h.dst_device] == g.host and host_of[h.src_device] != g.host}
        if not g.arrivals or not set(g.arrivals) <= into:
            raise PlanVerificationError(f"gate {g}: arrivals are not earlier rounds' cross-host arrivals "
                                        f"into host {g.host}")
        if g.collector not in {d for d, _ in g.arrivals}:
            raise PlanVerificationError(f"gate {g}: collector {g.collector} holds none of the arrivals")
        sent = {h.piece for h in hops_of(g.round)
                if h.src_device == g.src_device and host_of[h.dst_device] != host_of[h.src_device]}
        if not g.pieces or not set(g.pieces) <= sent or not {(g.src_device, p) for p in g.pieces} <= _held_before(
                program, g.round):
            raise PlanVerificationError(f"gate {g}: device {g.src_device} does not send pieces {g.pieces} it "
                                        f"holds across hosts in round {g.round}")
