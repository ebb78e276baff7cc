"""``meshpar.distributed.initialize``: join a multi-process job ready for meshpar's transfers."""

from __future__ import annotations

import socket
from typing import Any

import jax

__all__ = ["initialize", "own_address"]


def own_address(coordinator_address: str) -> str:
    """This machine's IP address on the route to the coordinator (no packet is sent)."""
    host = coordinator_address.rsplit(":", 1)[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


def _free_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def initialize(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    *,
    transfer_address: str | None = None,
    transport_addresses: tuple[str, ...] | None = None,
    **kwargs: Any,
) -> None:
    """``jax.distributed.initialize`` with what meshpar's cross-process moves need.

    Call it in every process before anything else touches JAX's backend. It
    sets the CPU collectives to gloo, and the address of this process's
    cross-host transfer server (``jax_cross_host_transfer_socket_address``):
    CPUs move arrays between processes through it; GPU clients move them
    natively and start the server only if ever asked to fall back. Then it
    calls ``jax.distributed.initialize``.

    Args:
      coordinator_address: ``host:port`` of process 0's coordinator.
      num_processes: processes in the job.
      process_id: this process's index.
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
      **kwargs: passed on to ``jax.distributed.initialize``.

    Raises:
      ValueError: an argument of the wrong kind.
      RuntimeError: JAX's backend has already started in this process.
    """
    if not isinstance(coordinator_address, str) or ":" not in coordinator_address:
        raise ValueError(f"coordinator_address: expected 'host:port', got {coordinator_address!r}")
    if not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes: expected a positive integer, got {num_processes!r}")
    if not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id: expected an integer in [0, {num_processes}), got {process_id!r}")
    if transfer_address is not None and not isinstance(transfer_address, str):
        raise ValueError(f"transfer_address: expected 'ip:port' or '', got {transfer_address!r}")
    if transport_addresses is not None and (
        isinstance(transport_addresses, str) or not all(isinstance(a, str) and ":" in a for a in transport_addresses)
    ):
        raise ValueError(f"transport_addresses: expected a sequence of 'ip:port' strings, got {transport_addresses!r}")
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "meshpar.distributed.initialize: JAX's backend has already started in this process; "
            "call it first, before any jax.devices(), array creation or computation"
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if transfer_address is None:
        # Port 0 does not work: the transfer server publishes the address it
        # was given, not the port it bound.
        address = own_address(coordinator_address)
        transfer_address = f"{address}:{_free_port(address)}" if ":" not in address else f"[{address}]:{_free_port(address)}"
    if transfer_address:
        jax.config.update("jax_cross_host_transfer_socket_address", transfer_address)
        if transport_addresses is None:
            host = transfer_address.rsplit(":", 1)[0]
            transport_addresses = (f"{host}:0",)
        jax.config.update("jax_cross_host_transport_addresses", ",".join(transport_addresses))
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id, **kwargs
    )
