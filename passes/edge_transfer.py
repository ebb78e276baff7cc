"""Pass: choose how each value crossing two stage meshes moves.

Decided once, when the pipeline compiles, from which processes own the
devices of the two meshes:

- ``DEVICE_PUT``: one process addresses every device of both meshes, so
  ``jax.device_put`` moves (and relays out) the value inside that process;
- ``P2P``: otherwise, the resharding plan run as asynchronous point-to-point
  moves (``meshpar.runtime.p2p_executor``), which overlap with compute;
- ``COLLECTIVE``: on request, the plan run as one ``ppermute`` program over
  both meshes (the baseline; it cannot overlap with compute). A 0-d value
  has no plan and always goes ``P2P`` unless one process owns everything.
- ``SIGNAL``: with ``resharding="signal"``, one byte crosses instead of the
  value, with the same dependencies (the receiver's value exists only after
  the sender's did), and the receiver gets zeros of the value's shape: the
  communication upper bound of a schedule, for benchmarks only.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

__all__ = ["EXECUTORS", "SIGNAL", "TransferKind", "choose_transfer"]

EXECUTORS = ("auto", "p2p", "collective")


class TransferKind(enum.Enum):
    DEVICE_PUT = "device_put"
    P2P = "p2p"
    COLLECTIVE = "collective"
    SIGNAL = "signal"


SIGNAL = "signal"  # the resharding strategy name that selects TransferKind.SIGNAL


def choose_transfer(executor: str, processes: Iterable[int], ndim: int, strategy: str = "broadcast") -> TransferKind:
    """How a value of rank ``ndim`` moves between meshes whose devices live in ``processes``.

    Args:
      executor: ``"auto"`` (``jax.device_put`` inside one process, p2p across),
        ``"p2p"`` or ``"collective"`` (forced, for comparisons and tests).
      processes: process index of every device of both meshes.
      ndim: the value's rank.
      strategy: the resharding strategy; ``"signal"`` selects ``SIGNAL``.

    Raises:
      ValueError: unknown ``executor``.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor: expected one of {EXECUTORS}, got {executor!r}")
    if strategy == SIGNAL:
        return TransferKind.SIGNAL
    if executor == "auto":
        return TransferKind.DEVICE_PUT if len(set(processes)) == 1 else TransferKind.P2P
    if executor == "collective" and ndim > 0:
        return TransferKind.COLLECTIVE
    return TransferKind.P2P
