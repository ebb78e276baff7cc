"""Communication strategies for one unit task and their costs (paper §3.1).

Each strategy moves one data slice of ``S`` bytes from one sender device to
a set of receiver devices. Costs use the host-level model of §3: a host's
NIC sends at ``bw`` bytes/s and, separately, receives at ``bw``; devices in
one host exchange data at ``bw_intra``; every message pays ``latency``.
Writing ``t = S / bw`` and ``A`` for the number of receiver hosts other than
the sender's, with ``B`` devices each, and ignoring latency and intra-host
time, the costs are:

- ``send_recv``: one copy to every remote receiver device, ``A*B*t``.
- ``local_allgather``: one copy per remote host, split into ``B`` parts that
  the host's devices then all-gather (Alpa's strategy), ``A*t``.
- ``global_allgather``: scatter ``S/n`` to each of the ``n = A*B`` devices,
  then a ring all-gather over all of them, ``t + (n-1)/n * t``, about ``2t``.
- ``broadcast``: a ring from the sender through every receiver in ``K``
  chunks, pipelined: ``t + (A-1)*t/K``; the paper writes ``t + A*t/K``,
  counting one more step. ``K`` is picked by the cost model unless given.

Besides the cost, each strategy says which host NICs it keeps busy
(``resources``): two tasks that share one may not overlap in time (Eq. 3); and
how it is lowered (``chains``, the hops ``transfer_program`` and ``hop_program``
pack into steps). A strategy owns all three, so a new one is one class here (or
in a module of its own) and one entry of ``STRATEGIES``.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import ClassVar

from ..model.cluster import Cluster
from .chains import Chain, Split
from .scheduled_task import ScheduledTask

__all__ = [
    "Broadcast",
    "GlobalAllGather",
    "LocalAllGather",
    "Multicast",
    "SendRecv",
    "Strategy",
    "STRATEGIES",
    "get_strategy",
    "ring_route",
    "send_resource",
    "recv_resource",
    "is_recv_resource",
    "MAX_CHUNKS",
]

# Chunks beyond this buy nothing measurable: per-chunk latency dominates.
MAX_CHUNKS = 1024


def send_resource(host: int) -> int:
    """Resource id of a host's outgoing NIC bandwidth."""
    return 2 * host


def recv_resource(host: int) -> int:
    """Resource id of a host's incoming NIC bandwidth."""
    return 2 * host + 1


def is_recv_resource(resource: int) -> bool:
    return resource % 2 == 1


def ring_route(sender: int, receivers: Sequence[int], host_of: Callable[[int], int]) -> tuple[int, ...]:
    """Order of receivers along a ring that starts at ``sender``.

    Receivers on the sender's host come first, then the other hosts in
    ascending order, devices ascending within a host, so the ring crosses each
    host boundary exactly once.
    """
    home = host_of(sender)
    return tuple(sorted(receivers, key=lambda d: (host_of(d) != home, host_of(d), d)))


@dataclasses.dataclass(frozen=True)
class Multicast:
    """What a strategy's cost depends on: the slice size and where receivers sit.

    Attributes:
      nbytes: size of the slice.
      sender_host: host of the sending device.
      hosts: ``(host, number of receiver devices)`` in ring order.
    """

    nbytes: int
    sender_host: int
    hosts: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, nbytes: int, sender: int, receivers: Sequence[int], host_of: Callable[[int], int]) -> Multicast:
        counts: dict[int, int] = {}
        for d in ring_route(sender, receivers, host_of):
            counts[host_of(d)] = counts.get(host_of(d), 0) + 1
        return cls(int(nbytes), host_of(sender), tuple(counts.items()))

    @property
    def remote(self) -> tuple[tuple[int, int], ...]:
        return tuple((h, b) for h, b in self.hosts if h != self.sender_host)

    @property
    def local_devices(self) -> int:
        return sum(b for h, b in self.hosts if h == self.sender_host)

    @property
    def cost_key(self) -> tuple:
        """Equal keys have equal costs under every strategy: host names do not matter."""
        return (self.nbytes, tuple((h == self.sender_host, b) for h, b in self.hosts))


def _inter(cluster: Cluster, nbytes: float) -> float:
    return cluster.latency + nbytes / cluster.inter_host_bandwidth


def _intra(cluster: Cluster, nbytes: float) -> float:
    return cluster.latency + nbytes / cluster.intra_host_bandwidth


@dataclasses.dataclass(frozen=True)
class Strategy(abc.ABC):
    """A way to multicast one slice from a sender device to receiver devices: what it costs
    (``seconds``), which host NICs it holds (``resources``) and the chains of hops it is lowered
    to (``chains``). See the module docstring for the built-in ones.

    A new strategy is one subclass, a frozen dataclass with its ``name``, implementing
    ``seconds`` and ``chains`` (and ``forwarding_hosts``, ``chunked`` where they differ), plus
    one entry of ``STRATEGIES``: the planner prices it, both lowerings (``transfer_program``,
    ``hop_program``) take its chains, and every API accepts its name.

    Invariants: ``chains`` of a scheduled task deliver the whole slice (``task.unit.bounds``)
    to every device of ``task.route``, starting from ``task.sender``; only a ``chunked``
    strategy reads ``task.chunks``; ``seconds`` prices what ``chains`` moves, and
    ``resources`` names every NIC that moving it keeps busy.
    """

    name: str
    # Whether the slice is cut into chunks pipelined through the receivers (``best_chunks``).
    chunked: ClassVar[bool] = False

    @abc.abstractmethod
    def seconds(self, multicast: Multicast, cluster: Cluster, chunks: int) -> float:
        """Seconds to deliver the slice to every receiver, cut in ``chunks`` (>= 1)."""

    @abc.abstractmethod
    def chains(self, task: ScheduledTask, host_of: Callable[[int], int], split: Split) -> list[Chain]:
        """The chains that carry scheduled ``task``; ``split`` cuts a box into pieces."""

    def forwarding_hosts(self, remote: Sequence[int]) -> Sequence[int]:
        """Of the remote receiver hosts (ascending, at least two), those that send data on to
        other hosts: none unless the receivers relay (a ring, an all-gather among them)."""
        return ()

    def cost(self, multicast: Multicast, cluster: Cluster, chunks: int = 1) -> float:
        """Seconds to deliver the slice to every receiver."""
        if chunks < 1:
            raise ValueError(f"chunks: expected >= 1, got {chunks}")
        return self.seconds(multicast, cluster, chunks)

    def resources(self, multicast: Multicast) -> frozenset[int]:
        """NIC resources the task occupies for its whole duration.

        The sender host's outgoing NIC (when any receiver is remote) and the
        incoming NIC of every remote receiver host; strategies whose receivers
        pass data on to other hosts (``forwarding_hosts``: ring broadcast, global
        all-gather) also hold those hosts' outgoing NICs.
        """
        remote = sorted(h for h, _ in multicast.remote)
        if not remote:
            return frozenset()
        res = {send_resource(multicast.sender_host)} | {recv_resource(h) for h in remote}
        if len(remote) > 1:
            res |= {send_resource(h) for h in self.forwarding_hosts(remote)}
        return frozenset(res)

    def best_chunks(self, multicast: Multicast, cluster: Cluster, num_elements: int) -> int:
        """The chunk count with the lowest cost (1 for unchunked strategies).

        ``num_elements`` caps it: a chunk holds at least one element.
        """
        if not self.chunked:
            return 1
        limit = max(1, min(MAX_CHUNKS, num_elements))
        candidates = {1, limit}
        k = 1
        while k < limit:
            candidates.add(k)
            k *= 2
        hops = len(multicast.remote)
        if cluster.latency > 0 and hops > 1:
            # Stationary point of (K + hops - 1)(latency + t/K).
            k_star = math.sqrt((hops - 1) * multicast.nbytes / cluster.inter_host_bandwidth / cluster.latency)
            candidates |= {max(1, min(limit, int(k_star))), max(1, min(limit, math.ceil(k_star)))}
        return min(sorted(candidates), key=lambda c: (self.seconds(multicast, cluster, c), c))


def _rings(task: ScheduledTask, rings: Sequence[Sequence[int]], split: Split) -> list[Chain]:
    """Per ring of receivers, the slice cut in one part per receiver: part q goes from the sender
    to the ring's q-th device and then around the ring (a ring all-gather)."""
    chains = []
    for ring in rings:
        for q, piece in enumerate(split(task.unit.bounds, len(ring))):
            chains.append(Chain(piece, (task.sender, *ring[q:], *ring[:q])))
    return chains


@dataclasses.dataclass(frozen=True)
class SendRecv(Strategy):
    """One copy to every receiver device, all from the sender: ``A*B*t``."""

    name: str = "send_recv"

    def seconds(self, s: Multicast, c: Cluster, chunks: int) -> float:
        remote_devices = sum(b for _, b in s.remote)
        return remote_devices * _inter(c, s.nbytes) + s.local_devices * _intra(c, s.nbytes)

    def chains(self, task: ScheduledTask, host_of: Callable[[int], int], split: Split) -> list[Chain]:
        return [Chain(task.unit.bounds, (task.sender, r)) for r in task.route]


@dataclasses.dataclass(frozen=True)
class LocalAllGather(Strategy):
    """One copy per receiving host, cut in ``B`` parts that the host's devices all-gather
    (Alpa's strategy): ``A*t``."""

    name: str = "local_allgather"

    def seconds(self, s: Multicast, c: Cluster, chunks: int) -> float:
        # One copy per host, cut in B parts (one message each) that the host's
        # devices all-gather over the fast interconnect, hosts in parallel.
        send = sum(b * c.latency + s.nbytes / c.inter_host_bandwidth for _, b in s.remote)
        if s.local_devices:
            send = max(send, _intra(c, s.nbytes))
        gather = max((b - 1) * _intra(c, s.nbytes / b) for _, b in s.hosts)
        return send + gather

    def chains(self, task: ScheduledTask, host_of: Callable[[int], int], split: Split) -> list[Chain]:
        groups: dict[int, list[int]] = {}
        for r in task.route:
            groups.setdefault(host_of(r), []).append(r)
        return _rings(task, list(groups.values()), split)


@dataclasses.dataclass(frozen=True)
class GlobalAllGather(Strategy):
    """Scatter ``S/n`` to each of the ``n`` receivers, then a ring all-gather over all of them:
    about ``2t``."""

    name: str = "global_allgather"

    def seconds(self, s: Multicast, c: Cluster, chunks: int) -> float:
        n = sum(b for _, b in s.hosts)
        part = s.nbytes / n
        remote_devices = sum(b for _, b in s.remote)
        scatter = c.latency + remote_devices * part / c.inter_host_bandwidth if remote_devices else 0.0
        scatter = max(scatter, _intra(c, s.local_devices * part) if s.local_devices else 0.0)
        # Ring all-gather over all n receivers: n-1 steps of one part per device;
        # with several hosts each step crosses a host boundary.
        step = _inter(c, part) if len(s.hosts) > 1 else _intra(c, part)
        return scatter + (n - 1) * step

    def chains(self, task: ScheduledTask, host_of: Callable[[int], int], split: Split) -> list[Chain]:
        return _rings(task, [list(task.route)], split)

    def forwarding_hosts(self, remote: Sequence[int]) -> Sequence[int]:
        return remote  # an all-gather among every receiver host


@dataclasses.dataclass(frozen=True)
class Broadcast(Strategy):
    """A ring from the sender through every receiver, in ``K`` pipelined chunks:
    ``t + (A-1)*t/K``."""

    name: str = "broadcast"
    chunked: ClassVar[bool] = True

    def seconds(self, s: Multicast, c: Cluster, chunks: int) -> float:
        # Pipelined ring: chunk k+1 leaves a device while chunk k moves on, so the
        # makespan is one pass of a chunk through every hop plus K-1 chunks
        # through the slowest hop.
        piece = s.nbytes / chunks
        hops = []
        prev = s.sender_host
        for h, b in s.hosts:
            for i in range(b):
                hops.append(_inter(c, piece) if (i == 0 and h != prev) else _intra(c, piece))
            prev = h
        return sum(hops) + (chunks - 1) * max(hops)

    def chains(self, task: ScheduledTask, host_of: Callable[[int], int], split: Split) -> list[Chain]:
        # Each chunk one chain through the whole ring; chunk k+1 leaves the sender while chunk k moves on.
        return [Chain(piece, (task.sender, *task.route)) for piece in split(task.unit.bounds, task.chunks)]

    def forwarding_hosts(self, remote: Sequence[int]) -> Sequence[int]:
        return remote[:-1]  # every host of the ring but its last passes the data on


# Name -> strategy; a new strategy is one ``Strategy`` subclass and one entry here (its name is
# resolved only by ``get_strategy``, at the API).
STRATEGIES: dict[str, Strategy] = {
    s.name: s for s in (SendRecv(), LocalAllGather(), GlobalAllGather(), Broadcast())
}


def get_strategy(name: str | Strategy, arg: str = "strategy") -> Strategy:
    """The strategy called ``name`` (a ``Strategy`` is itself); ``ValueError`` naming ``arg`` and
    listing the choices otherwise."""
    if isinstance(name, Strategy):
        return name
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"{arg}: unknown {name!r}; expected one of {sorted(STRATEGIES)}") from None
