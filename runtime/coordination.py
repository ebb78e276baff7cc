"""Multi-process agreement through the ``jax.distributed`` key-value store.

Before processes enter a collective program together they must agree on
what it is: a process that compiled a different plan would otherwise hang
inside the collective or corrupt data silently. Every wait here has a
timeout and says which processes did not answer or disagreed; a value
another process was sending that fails in transit (the sender died) is
reported naming that process and the value.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

import jax

from meshpar.passes import jax_ir

__all__ = [
    "Arrival", "CoordinationError", "LaunchRendezvous", "PeerLostError", "agree", "kv_client", "named_processes",
    "not_delivered", "owns_a_device_of",
    "raise_lost_collective_peer", "raise_lost_peer", "senders", "wait_arrivals", "wait_ready",
]


class CoordinationError(RuntimeError):
    """Processes disagreed, or one did not arrive in time."""


class PeerLostError(CoordinationError):
    """A value another process was sending this one failed in transit: that process exited, or
    the connection to it broke."""


@dataclasses.dataclass(frozen=True)
class Arrival:
    """A value other processes send this one.

    Attributes:
      value: the array that arrives here.
      what: what it is, for error messages (``None``: unnamed).
      senders: the other processes owning a device it is sent from.
    """

    value: jax.Array
    what: str | None
    senders: tuple[int, ...]


def kv_client():
    """The distributed runtime's client, or ``None`` in a single-process run."""
    return jax_ir.distributed_client()


_rounds: dict[str, int] = {}


def agree(topic: str, value: dict, participants: Sequence[int], *, timeout_s: float, what: str) -> None:
    """Publishes ``value`` under ``topic`` and checks every participant published the same.

    Each call for a topic is numbered per process, so repeated agreements on
    one topic pair up in call order.

    Args:
      topic: names what is agreed on; the same string on every participant.
      value: JSON-serialisable; compared for equality.
      participants: process indices that take part (this one included).
      timeout_s: how long to wait for each other process.
      what: a description for error messages.

    Raises:
      CoordinationError: a participant published something else, or nothing
        within ``timeout_s``.
    """
    client = kv_client()
    if client is None or len(participants) <= 1:
        return
    me = jax.process_index()
    n = _rounds.get(topic, 0)
    _rounds[topic] = n + 1
    prefix = f"meshpar/{topic}/{n}"
    mine = json.dumps(value, sort_keys=True)
    client.key_value_set(f"{prefix}/{me}", mine)
    disagree = []
    for p in participants:
        if p == me:
            continue
        try:
            theirs = client.blocking_key_value_get(f"{prefix}/{p}", int(timeout_s * 1000))
        except Exception as e:  # the client raises JaxRuntimeError(DEADLINE_EXCEEDED)
            raise CoordinationError(
                f"{what}: process {p} did not reach the same call within {timeout_s:g} s "
                f"(process {me} is waiting; do all processes make the same meshpar calls in the same order?)"
            ) from e
        if theirs != mine:
            disagree.append((p, json.loads(theirs)))
    if disagree:
        lines = "; ".join(f"process {p} has {v}" for p, v in disagree)
        raise CoordinationError(f"{what}: processes disagree: process {me} has {value}; {lines}")


class LaunchRendezvous:
    """The processes of one mesh meeting on the host before each launch of a program on it.

    Call ``meet()`` before every launch on the mesh; every process owning a device of it makes
    the same launches in the same order (``passes.pipeline.lowering.launch_sequences`` verifies
    it), so the ``n``-th meeting of each is the same launch. Why: a program whose collectives
    span processes parks XLA:CPU's device threads in gloo until every peer joins it, and those
    threads also serve the transfer server's pulls (each copies a buffer to the host first). A
    peer that still waits for a value this process sends, before it can launch the same program,
    then never gets it: both wait until their timeouts (the four-process test's hang, 3 runs in
    12 under load). Waiting on the host instead keeps the threads free until every peer is ready
    to launch. The keys of a meeting are deleted once every peer has passed the next one.

    Args:
      name: names the mesh, the same on every process (its devices' ids).
      peers: the other processes owning a device of the mesh.
      timeout_s: how long to wait for each peer at a meeting.
      where: describes the mesh for error messages.
    """

    def __init__(self, name: str, peers: Sequence[int], timeout_s: float, where: str) -> None:
        self.name, self.peers, self.timeout_s, self.where = name, tuple(peers), timeout_s, where
        self.meetings = 0

    def meet(self) -> None:
        """Returns once every peer has reached this meeting.

        Raises:
          CoordinationError: naming the peer that did not reach it within ``timeout_s``.
        """
        client = kv_client()
        if client is None or not self.peers:
            return
        me, n = jax.process_index(), self.meetings
        self.meetings += 1
        client.key_value_set(f"meshpar/launch/{self.name}/{n}/{me}", "")
        for p in self.peers:
            try:
                client.blocking_key_value_get(f"meshpar/launch/{self.name}/{n}/{p}", int(self.timeout_s * 1000))
            except Exception as e:  # the client raises JaxRuntimeError(DEADLINE_EXCEEDED)
                raise CoordinationError(
                    f"launch {n} on {self.where}: process {p} did not reach it within {self.timeout_s:g} s "
                    f"(process {me} is waiting to launch it; is process {p} alive and responsive, and did "
                    f"every process make the same meshpar calls?)"
                ) from e
        if n:  # every peer set its key n, so it has read this process's key n - 1
            client.key_value_delete(f"meshpar/launch/{self.name}/{n - 1}/{me}")


def wait_ready(arrays: Sequence[jax.Array], timeout_s: float, what: str, names: Sequence[str] | None = None) -> None:
    """Waits until every array in ``arrays`` is computed or has arrived.

    Unlike ``block_until_ready`` this gives up: a transfer whose sender never
    sends (a peer that crashed, or skipped the call) raises instead of hanging.

    Args:
      arrays: what to wait for.
      timeout_s: for all of them together.
      what: a description for the error message.
      names: optional, one per array: the error names the first missing one.

    Raises:
      CoordinationError: naming ``what``, how many arrays were still missing
        and (with ``names``) the first of them.
      jax.errors.JaxRuntimeError: an array failed (``wait_arrivals`` names its sender).
    """
    if not _block(arrays, timeout_s, what):
        named = [Arrival(a, names[k] if names else None, ()) for k, a in enumerate(arrays)]
        raise not_delivered(named, timeout_s, what, "waiting")


def _block(arrays: Sequence[jax.Array], timeout_s: float, what: str) -> bool:
    """Whether every array was ready within ``timeout_s``; raises the error of one that failed."""
    # A helper thread blocks (releasing the GIL), so the caller wakes the moment the last array
    # is ready instead of at a polling tick; if the wait gives up, the thread is left blocked.
    done = threading.Event()
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            for a in arrays:
                a.block_until_ready()
        except BaseException as e:  # noqa: BLE001 -- handed to the caller
            failed.append(e)
        finally:
            done.set()

    threading.Thread(target=wait, daemon=True, name=f"meshpar wait: {what}").start()
    if not done.wait(timeout_s):
        return False
    if failed:
        raise failed[0]
    return True


def owns_a_device_of(mesh: jax.sharding.Mesh) -> bool:
    """Whether this process owns a device of ``mesh``."""
    me = jax.process_index()
    return any(d.process_index == me for d in mesh.devices.flat)


def senders(sharding: jax.sharding.Sharding) -> tuple[int, ...]:
    """The processes other than this one that own a device of ``sharding``, in order."""
    me = jax.process_index()
    return tuple(sorted({d.process_index for d in sharding.device_set} - {me}))


def named_processes(indices: Sequence[int]) -> str:
    """``process 3`` or ``processes 1, 2``: how errors name processes."""
    return ("process " if len(indices) == 1 else "processes ") + ", ".join(map(str, indices))


def wait_arrivals(arrivals: Sequence[Arrival], timeout_s: float, what: str, doing: str) -> None:
    """Waits until every value in ``arrivals`` has arrived, like ``wait_ready``; errors name
    ``what`` was waited for, the processes at fault and what this process was ``doing``.

    Raises:
      PeerLostError: a value failed in transit (see ``raise_lost_peer``).
      CoordinationError: some did not arrive within ``timeout_s`` (see ``not_delivered``).
    """
    try:
        finished = _block([a.value for a in arrivals], timeout_s, what)
    except jax.errors.JaxRuntimeError as e:
        raise_lost_peer(e, arrivals, what, doing)
    if not finished:
        raise not_delivered(arrivals, timeout_s, what, doing)


def wait_pending(pending: dict[Any, Arrival], keys: Iterable[Any], timeout_s: float, what: str,
                 doing: Callable[[], str]) -> None:
    """Waits (bounded, as ``wait_arrivals``) for the values at ``keys`` of ``pending`` (values
    other processes send here that nothing has waited for yet), and forgets them.

    Called before launching a program that reads them: XLA:CPU runs a launched program whose
    operand has not arrived in the launching thread, holding the device, so a program waiting
    there on a peer that waits on a send this device has still to run never returns, and no
    timeout reaches into it (seen with four processes). Waiting on the host leaves the device
    free and is bounded. ``doing()`` says what waits, for the error: called only when something
    is waited for, since describing a launch can cost more than the launch."""
    if not pending:  # one process, or nothing in flight: the common case costs nothing
        return
    arrivals = [pending.pop(k) for k in keys if k in pending]
    arrivals = [a for a in arrivals if not a.value.is_ready()]
    if arrivals:
        wait_arrivals(arrivals, timeout_s, what, doing())


def raise_lost_peer(error: Exception, arrivals: Sequence[Arrival], what: str, doing: str) -> NoReturn:
    """Raises ``error`` (the runtime's, e.g. ``INTERNAL: SocketServer: Connection closed``) as a
    ``PeerLostError`` naming the value, the processes sending it and what this process was
    ``doing`` when one of ``arrivals`` has failed in transit; as it is when none has (the error
    is this process's own). Waits for none of them. A first transfer from a process that never
    started its transfer server is raised as a ``CoordinationError`` naming it (``_unstarted_peer``)."""
    lost = _lost_peer(arrivals, what, doing) or _unstarted_peer(error, what, doing)
    if lost is None:
        raise error
    raise lost from error


# The key JAX's cross-host transfer server publishes a process's address under (XLA's
# pjrt_transfer_server.cc), at that process's first cross-process transfer. A process's first
# pull from another waits for it, in the call that moves the value (``jax.device_put``), for
# ``jax_cross_host_transfer_timeout_seconds`` (``meshpar.distributed.initialize`` sets it).
_TRANSFER_SERVER_ADDRESS = re.compile(r"ifrt_cross_host_socket_address_(\d+)")


def _unstarted_peer(error: Exception, what: str, doing: str) -> CoordinationError | None:
    """The error for ``error`` when it is JAX's wait for a process's transfer server address timing
    out: that process exited (or is stuck) before its first cross-process transfer. ``None`` else."""
    message = str(error)
    found = _TRANSFER_SERVER_ADDRESS.search(message)
    if found is None or "DEADLINE_EXCEEDED" not in message:
        return None
    p = int(found.group(1))
    return CoordinationError(
        f"{what}: process {p} did not start its cross-host transfer server in time ({message}). "
        f"Process {jax.process_index()} was {doing}; is process {p} alive (see its log), and did every "
        f"process make the same meshpar calls?"
    )


def raise_lost_collective_peer(error: Exception, peers: Sequence[int], what: str) -> NoReturn:
    """Raises ``error``, a program's failure, as a ``PeerLostError`` naming ``peers`` (the other
    processes its collectives run with) when gloo, XLA:CPU's cross-process collectives, failed
    (``Gloo all-reduce failed: ... Connection reset by peer``: one of them exited or the
    connection to it broke); as it is otherwise (the error is this process's own)."""
    if not peers or "gloo" not in str(error).lower():
        raise error
    lost = named_processes(peers) if len(peers) == 1 else f"one of {named_processes(peers)}"
    raise PeerLostError(
        f"{what}: lost {lost}: its collectives with {named_processes(peers)} failed ({error}). "
        f"Process {jax.process_index()} was running it; {lost} exited or the connection to it broke "
        f"(see its log)"
    ) from error


def _lost_peer(arrivals: Sequence[Arrival], what: str, doing: str) -> PeerLostError | None:
    for a in arrivals:
        if a.value.is_deleted() or not a.value.is_ready():
            continue
        try:
            a.value.block_until_ready()
        except jax.errors.JaxRuntimeError as failure:
            lost = named_processes(a.senders) if a.senders else "a process"
            return PeerLostError(
                f"{what}: lost {lost}: {a.what} failed in transit ({failure}). "
                f"Process {jax.process_index()} was {doing}; {lost} exited or the connection to it broke "
                f"(see its log)"
            )
    return None


def not_delivered(arrivals: Sequence[Arrival], timeout_s: float, what: str, doing: str) -> CoordinationError:
    """The error for ``arrivals`` some of which did not arrive within ``timeout_s`` while this
    process was ``doing``: how many, the first of them and every process that did not deliver."""
    missing = [a for a in arrivals if not a.value.is_ready()]
    late = sorted({p for a in missing for p in a.senders})
    first = f", the first being {missing[0].what}" if missing and missing[0].what else ""
    by = f"; not delivered by {named_processes(late)}" if late else ""
    ask = f"is {named_processes(late)} alive and responsive, and did" if late else "did"
    return CoordinationError(
        f"{what}: {len(missing)} of {len(arrivals)} did not arrive within {timeout_s:g} s{first}{by} "
        f"(process {jax.process_index()} is {doing}; {ask} every process make the same meshpar calls?)"
    )
