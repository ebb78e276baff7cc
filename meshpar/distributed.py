"""``meshpar.distributed.initialize``: join a multi-process job ready for meshpar's transfers."""

from __future__ import annotations

import math
import random
import socket
from collections.abc import Sequence
from typing import Any

import jax

from meshpar.passes import jax_ir

__all__ = ["MIN_HEARTBEAT_TIMEOUT_S", "ephemeral_ports", "free_port", "heartbeat_timeout", "initialize", "own_address"]

# JAX's client heartbeats every half of the timeout from a thread of its own, so compiles and
# busy Python threads do not delay it; this floor keeps a loaded machine's scheduling hiccups
# from passing for a dead process when ``timeout_s`` is small.
MIN_HEARTBEAT_TIMEOUT_S = 10


def own_address(coordinator_address: str) -> str:
    """This machine's IP address on the route to the coordinator (no packet is sent)."""
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


# Where the kernel picks ports for outgoing connections and binds to port 0 (Linux's default).
_EPHEMERAL = (32768, 60999)
# The lowest port a transfer server is given; below are well-known and registered services'.
_LOWEST_PORT = 10000


def ephemeral_ports() -> tuple[int, int]:
    """The range the kernel assigns ephemeral ports from (``ip_local_port_range``, else Linux's
    default)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(p) for p in f.read().split())
        return low, high
    except (OSError, ValueError):
        return _EPHEMERAL


def free_port(address: str, rng: random.Random | None = None) -> int:
    """A port free on ``address`` now, outside the ephemeral range when there is room below it.

    The transfer server binds its port only at the first cross-process transfer, long after
    this probe closes. A port from the ephemeral range may by then be taken by any outgoing
    connection (gloo's, the coordinator's), and the transfer fails with "bind: Address already
    in use"; below the range only an explicit bind can take it.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    low, _ = ephemeral_ports()
    rng = rng or random.Random()
    for _ in range(64 if low - _LOWEST_PORT > 1000 else 0):
        port = rng.randrange(_LOWEST_PORT, low)
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def heartbeat_timeout(timeout_s: float) -> int:
    """The coordination service's heartbeat timeout for a job whose processes wait ``timeout_s``
    for each other: ``timeout_s`` rounded up, at least ``MIN_HEARTBEAT_TIMEOUT_S``."""
    return max(MIN_HEARTBEAT_TIMEOUT_S, math.ceil(timeout_s))


# What JAX's ``initialization_timeout`` defaults to (0.10.2 to 0.12): the time a process waits for
# the coordinator, and a launcher's API (Kubernetes') for the coordinator's name.
_JAX_INITIALIZATION_TIMEOUT_S = 300


# How long a transfer waits for its peer's transfer server address (JAX's flag; absent: left alone).
_TRANSFER_TIMEOUT = "jax_cross_host_transfer_timeout_seconds"


def _launchers_looked_for(cluster_detection_method: str | None) -> str:
    """The launchers detection tried, for an error saying none was found."""
    if cluster_detection_method == "deactivate":
        return "JAX_COORDINATOR_ADDRESS only (cluster_detection_method='deactivate')"
    names = [f"{cls} ({method!r})" if method else cls
             for cls, (method, _, opt_in) in jax_ir.cluster_launchers().items()
             if (method == cluster_detection_method if cluster_detection_method else not opt_in)]
    return ", ".join(names) + " and JAX_COORDINATOR_ADDRESS"


def _detection_method(cluster_detection_method: str | None) -> None:
    """Raises ``ValueError`` unless JAX can detect a job with ``cluster_detection_method``."""
    if cluster_detection_method is None or cluster_detection_method == "deactivate":
        return
    launchers = {method: present for method, present, _ in jax_ir.cluster_launchers().values() if method}
    if cluster_detection_method not in launchers:
        raise ValueError(f"cluster_detection_method: expected None, 'deactivate' or one of {sorted(launchers)}, "
                         f"got {cluster_detection_method!r}")
    if not launchers[cluster_detection_method]:
        # JAX 0.10.2 only logs this and then fails reading the launcher's variables.
        raise ValueError(f"cluster_detection_method: {cluster_detection_method!r} is not usable in this process "
                         f"(its launcher's environment is missing, or for 'mpi4py' the mpi4py package)")


def _use_transfer_server(coordinator_address: str, transfer_address: str | None,
                         transport_addresses: tuple[str, ...] | None, timeout_s: float) -> None:
    """Sets gloo as the CPU collectives, this process's transfer server addresses and how long a
    transfer waits for a peer's server (``timeout_s``); JAX reads them when its backend starts."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A process's first pull from a peer waits, inside jax.device_put, for the peer's server
    # address, which the peer publishes at its own first cross-process transfer: for a peer
    # killed before that, JAX's default (60 s) held the survivor's step that long. Tied to
    # timeout_s, as the heartbeat is, unless set already.
    if jax.config.values.get(_TRANSFER_TIMEOUT, 0) is None:
        jax.config.update(_TRANSFER_TIMEOUT, heartbeat_timeout(timeout_s))
    if transfer_address is None:
        # Port 0 does not work: the transfer server publishes the address it
        # was given, not the port it bound.
        address = own_address(coordinator_address)
        port = free_port(address)
        transfer_address = f"{address}:{port}" if ":" not in address else f"[{address}]:{port}"
    if transfer_address:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
        if transport_addresses is None:
            host = transfer_address.rsplit(":", 1)[0]
            transport_addresses = (f"{host}:0",)
        jax.config.update("jax_cross_host_transport_addresses", ",".join(transport_addresses))


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cluster_detection_method: str | None = None,
    timeout_s: float = 120.0,
    transfer_address: str | None = None,
    transport_addresses: tuple[str, ...] | None = None,
    **kwargs: Any,
) -> None:
    """``jax.distributed.initialize`` with what meshpar's cross-process moves need.

    Call it in every process before anything else touches JAX's backend. With
    no arguments it finds the job as ``jax.distributed.initialize()`` does:
    from ``JAX_COORDINATOR_ADDRESS`` and a launcher JAX detects (SLURM's
    ``srun``, Open MPI's ``mpirun``, Kubernetes, Cloud TPU; mpi4py with
    ``cluster_detection_method="mpi4py"``), through JAX's own detection, run
    here first so that the coordinator's address is known before the backend
    starts. Arguments given win over detected ones. Then it sets the CPU
    collectives to gloo, and the address of this process's cross-host
    transfer server (``jax_cross_host_transfer_socket_address``): CPUs move
    arrays between processes through it; GPU clients move them natively and
    start the server only if ever asked to fall back. Then it calls
    ``jax.distributed.initialize`` with ``heartbeat_timeout_seconds`` tied to
    ``timeout_s``.

    A process that called ``jax.distributed.initialize`` itself may call this
    afterwards, with no job arguments, as long as nothing has touched the
    backend yet: it only sets the collectives and the transfer server (the
    heartbeat timeout stays what that call gave, JAX's default 100 s).

    A process that dies or freezes stops heartbeating. The coordination
    service declares it dead ``heartbeat_timeout_seconds`` after its last
    heartbeat (sent every half of that: between a half and all of it after
    the death), and JAX then terminates every other process (SIGABRT,
    logging "Terminating process because the JAX distributed service
    detected fatal errors" with the dead process's index). No survivor exits
    before that: at exit ``jax.distributed.shutdown`` waits in a barrier for
    every process. With JAX's default of 100 s a survivor hung that long at
    exit; tied to ``timeout_s`` it is gone within about ``timeout_s`` of the
    death. A frozen peer is usually declared dead before a meshpar wait on it
    times out. JAX's ``shutdown_timeout_seconds`` (300 s), the exit barrier's
    wait for a process that is alive, is left alone: processes may finish
    minutes apart (one saving a checkpoint).

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator; default
        detected.
      num_processes: processes in the job; default detected.
      process_id: this process's index; default detected.
      local_device_ids: the local devices this process uses (GPUs: JAX sets
        the visible ones); default ``JAX_LOCAL_DEVICE_IDS``, else under SLURM
        and Open MPI JAX's one device per process (the launcher's local rank),
        else all.
      cluster_detection_method: which launcher to detect the job from
        (``"slurm"``, ``"ompi"``, ``"mpi4py"``, ...), ``"deactivate"`` for
        none; default the first JAX finds.
      timeout_s: how long processes wait for each other: the ``timeout_s``
        given to meshpar's methods (their default is 120 s too). Sets
        ``heartbeat_timeout_seconds`` to ``heartbeat_timeout(timeout_s)``
        unless ``kwargs`` has it. Heartbeats come from a thread of JAX's
        own, so a long compile does not miss them. Also sets how long a
        transfer waits for its peer's transfer server to start
        (``jax_cross_host_transfer_timeout_seconds``, JAX's default 60 s)
        to the same, unless already set.
      transfer_address: ``ip:port`` for this process's transfer server;
        default this machine's address towards the coordinator and a free
        port. ``""`` leaves the setting alone.
      transport_addresses: ``ip:port`` of the server's bulk data sockets;
        default one socket on this machine's address, any free port. JAX's
        default, four on ``0.0.0.0:0``, breaks across machines (peers are
        told to connect to ``0.0.0.0``) and, on NIC-bound links, lets several
        flows per peer fight over one NIC: with NICs shaped to 0.25 Gbit/s,
        eager p2p moves ran at 1.03-2.31x of the link bound with four
        sockets and 1.03-1.38x with one (BENCHMARKS.md).
      **kwargs: passed on to ``jax.distributed.initialize``
        (``initialization_timeout`` also bounds detection).

    Raises:
      ValueError: an argument of the wrong kind; or the job's coordinator,
        size or this process's index neither given nor detected (the message
        names which, and the launchers looked for); or job arguments that
        differ from those of an earlier ``jax.distributed.initialize``.
      RuntimeError: JAX's backend has already started in this process.
    """
    if coordinator_address is not None and (not isinstance(coordinator_address, str) or ":" not in coordinator_address):
        raise ValueError(f"coordinator_address: expected 'host:port', got {coordinator_address!r}")
    if num_processes is not None and (not isinstance(num_processes, int) or num_processes < 1):
        raise ValueError(f"num_processes: expected a positive integer, got {num_processes!r}")
    if process_id is not None and (
            not isinstance(process_id, int) or not 0 <= process_id < (num_processes or math.inf)):
        bound = num_processes if num_processes is not None else "num_processes"
        raise ValueError(f"process_id: expected an integer in [0, {bound}), got {process_id!r}")
    if isinstance(local_device_ids, int):
        local_device_ids = [local_device_ids]
    if local_device_ids is not None:
        if isinstance(local_device_ids, str) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in local_device_ids):
            raise ValueError(f"local_device_ids: expected a device id or a sequence of them (non-negative "
                             f"integers), got {local_device_ids!r}")
        local_device_ids = list(local_device_ids)
    if cluster_detection_method is not None and not isinstance(cluster_detection_method, str):
        raise ValueError(f"cluster_detection_method: expected a launcher's name or None, got "
                         f"{cluster_detection_method!r}")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise ValueError(f"timeout_s: expected a positive number of seconds, got {timeout_s!r}")
    if transfer_address is not None and not isinstance(transfer_address, str):
        raise ValueError(f"transfer_address: expected 'ip:port' or '', got {transfer_address!r}")
    if transport_addresses is not None and (
        isinstance(transport_addresses, str) or not all(isinstance(a, str) and ":" in a for a in transport_addresses)
    ):
        raise ValueError(f"transport_addresses: expected a sequence of 'ip:port' strings, got {transport_addresses!r}")
    if jax_ir.backends_are_initialized():
        raise RuntimeError(
            "meshpar.distributed.initialize: JAX's backend has already started in this process; "
            "call it first, before any jax.devices(), array creation or computation"
        )
    joined = jax_ir.distributed_params()
    if joined is not None:
        # jax.distributed.initialize ran already: the job is joined, only the settings the
        # backend reads when it starts can still be made.
        given = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                 "process_id": process_id}
        refused = {k: v for (k, v), j in zip(given.items(), joined) if v is not None and v != j}
        refused |= {k: v for k, v in (("local_device_ids", local_device_ids),
                                      ("cluster_detection_method", cluster_detection_method)) if v is not None}
        refused |= kwargs
        if refused:
            raise ValueError(
                f"meshpar.distributed.initialize: this process already joined its job with "
                f"jax.distributed.initialize(coordinator_address={joined[0]!r}, num_processes={joined[1]}, "
                f"process_id={joined[2]}), which these cannot change: "
                f"{', '.join(f'{k}={v!r}' for k, v in refused.items())}; call meshpar.distributed.initialize() "
                f"without them")
        _use_transfer_server(joined[0], transfer_address, transport_addresses, timeout_s)
        return
    _detection_method(cluster_detection_method)
    if None in (coordinator_address, num_processes, process_id):
        # A job given whole is joined exactly as before detection existed (the four-process test
        # hung in 4 runs of 4 when its explicit arguments went through detection; passed after).
        initialization_timeout = kwargs.get("initialization_timeout", _JAX_INITIALIZATION_TIMEOUT_S)
        coordinator_address, num_processes, process_id, local_device_ids = jax_ir.detect_distributed_params(
            coordinator_address, num_processes, process_id, local_device_ids, cluster_detection_method,
            initialization_timeout)
    missing = [name for name, value in (("coordinator_address", coordinator_address),
                                        ("num_processes", num_processes), ("process_id", process_id))
               if value is None]
    if missing:
        raise ValueError(
            f"meshpar.distributed.initialize: {', '.join(missing)} not given and not detected; looked for "
            f"{_launchers_looked_for(cluster_detection_method)}. Launch with srun or mpirun, pass "
            f"cluster_detection_method='mpi4py' under another MPI launcher, or pass "
            f"coordinator_address='host:port', num_processes and process_id")
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address: expected 'host:port', detected {coordinator_address!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes: expected a positive integer, detected {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id: expected an integer in [0, {num_processes}), got {process_id!r}")
    _use_transfer_server(coordinator_address, transfer_address, transport_addresses, timeout_s)
    kwargs.setdefault("heartbeat_timeout_seconds", heartbeat_timeout(timeout_s))
    detection = {k: v for k, v in (("local_device_ids", local_device_ids),
                                   ("cluster_detection_method", cluster_detection_method)) if v is not None}
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        **detection, **kwargs
    )
