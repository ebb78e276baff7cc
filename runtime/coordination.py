"""Multi-process agreement through the ``jax.distributed`` key-value store.

Before processes enter a collective program together they must agree on
what it is: a process that compiled a different plan would otherwise hang
inside the collective or corrupt data silently. Every wait here has a
timeout and says which processes did not answer or disagreed.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence

import jax

__all__ = ["CoordinationError", "agree", "kv_client", "wait_ready"]


class CoordinationError(RuntimeError):
    """Processes disagreed, or one did not arrive in time."""


def kv_client():
    """The distributed runtime's client, or ``None`` in a single-process run."""
    from jax._src import distributed

    return distributed.global_state.client


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
    """
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
        pending = [k for k in range(len(arrays)) if not arrays[k].is_ready()]
        first = f", the first being {names[pending[0]]}" if names and pending else ""
        raise CoordinationError(
            f"{what}: {len(pending)} of {len(arrays)} did not arrive within {timeout_s:g} s{first} "
            f"(process {jax.process_index()} is waiting; did every process make the same meshpar calls?)"
        )
    if failed:
        raise failed[0]
