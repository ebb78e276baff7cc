"""A peer that dies or freezes: the survivor names it and what was in flight, and exits promptly.

The two-process tests launch mp_peer_loss_worker.py (timeout_s = 10); every wait has a time limit,
and a process still running at the end is killed.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import jax
import pytest

from repo_paths import ROOT_DIR, TESTS_DIR

import meshpar.distributed
from meshpar.runtime.coordination import Arrival, CoordinationError, PeerLostError, not_delivered, raise_lost_peer

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_peer_loss_worker.py")
TIMEOUT_S = 10  # the worker's
STARTUP_S = 120  # both processes up, compiled and one step run, on a loaded machine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _survive(mode: str, tmp_path) -> SimpleNamespace:
    """Runs the worker in two processes, process 1 leaving as ``mode`` says; returns process 0's
    output, return code and the seconds from process 1's going to process 0's exit."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT_DIR, env.get("PYTHONPATH", "")])
    logs = [tmp_path / f"process{i}.log" for i in range(2)]
    procs = []
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, WORKER, str(i), "2", port, mode],
                                              stdout=out, stderr=subprocess.STDOUT, env=env))
        try:
            procs[0].wait(timeout=STARTUP_S + 3 * TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"process 0 did not exit:\n{logs[0].read_text()[-3000:]}")
        exited = time.time()
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)  # also ends a stopped process
            p.wait(timeout=30)
    output, peer = logs[0].read_text(), logs[1].read_text()
    gone = re.search(r"process 1: gone at ([0-9.]+)", peer)
    assert gone, f"process 1 did not get to leave:\n{peer[-3000:]}\n--- process 0 ---\n{output[-3000:]}"
    return SimpleNamespace(output=output, returncode=procs[0].returncode, elapsed=exited - float(gone.group(1)))


@pytest.mark.multiprocess
def test_a_killed_peer_is_named_with_the_transfer_and_the_survivor_exits_promptly(tmp_path):
    run = _survive("kill", tmp_path)
    assert "PeerLostError" in run.output, run.output[-3000:]
    error = next(line for line in run.output.splitlines() if line.startswith("process 0: PeerLostError"))
    assert "lost process 1" in error and "gradient of act0.0 stage 1 -> 0" in error, error
    assert "Connection closed" in error, error  # the runtime's own words are kept
    assert "second step returned" not in run.output
    # Before: the step raised the runtime's error alone, and the exit hung about 100 s.
    assert run.elapsed <= TIMEOUT_S + 10, (run.elapsed, run.output[-3000:])


@pytest.mark.multiprocess
def test_a_frozen_peer_is_named_and_the_survivor_exits_promptly(tmp_path):
    run = _survive("stop", tmp_path)
    assert "second step returned" not in run.output
    # Whichever comes first names process 1: meshpar's wait, or JAX's heartbeat check, which
    # then terminates the survivor (its default), usually first (see meshpar.distributed).
    assert re.search(r"not delivered by process 1\b|stopped sending heartbeats\):\s*1\b", run.output), \
        run.output[-3000:]
    assert run.returncode != 0
    assert run.elapsed <= TIMEOUT_S + 10, (run.elapsed, run.output[-3000:])


# -- the messages and settings, without processes ----------------------------------------------

class _Value:
    """Stands for an arriving array: ready or not, failed or not."""

    def __init__(self, ready: bool, failure: Exception | None = None) -> None:
        self.ready, self.failure = ready, failure

    def is_deleted(self) -> bool:
        return False

    def is_ready(self) -> bool:
        return self.ready

    def block_until_ready(self) -> "_Value":
        if self.failure is not None:
            raise self.failure
        return self


def _runtime_error(message: str) -> Exception:
    return jax.errors.JaxRuntimeError(message)


def test_not_delivered_names_the_first_missing_value_and_every_late_sender():
    arrivals = [Arrival(_Value(True), "a", (1,)), Arrival(_Value(False), "b", (2,)), Arrival(_Value(False), "c", (1, 3))]
    error = not_delivered(arrivals, 5, "pipeline transfers", "waiting")
    assert isinstance(error, CoordinationError)
    assert "2 of 3 did not arrive within 5 s, the first being b; not delivered by processes 1, 2, 3" in str(error)


def test_a_failed_arrival_becomes_a_peer_lost_error_naming_its_sender():
    failure = _runtime_error("INTERNAL: SocketServer: Connection closed recv() == 0.")
    arrivals = [Arrival(_Value(False), "pending", (2,)), Arrival(_Value(True, failure), "gradient g", (1,))]
    with pytest.raises(PeerLostError, match=r"lost process 1: gradient g failed in transit "
                                            r"\(INTERNAL: SocketServer: Connection closed") as caught:
        raise_lost_peer(_runtime_error("downstream"), arrivals, "pipeline transfers", "launching x")
    assert caught.value.__cause__ is not None


def test_an_error_no_arrival_explains_is_raised_as_it_is():
    own = _runtime_error("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(type(own), match="out of memory"):
        raise_lost_peer(own, [Arrival(_Value(True), "fine", (1,))], "pipeline transfers", "launching x")


def test_the_heartbeat_timeout_follows_timeout_s_with_a_floor():
    assert meshpar.distributed.heartbeat_timeout(120) == 120
    assert meshpar.distributed.heartbeat_timeout(30.2) == 31
    assert meshpar.distributed.heartbeat_timeout(1) == meshpar.distributed.MIN_HEARTBEAT_TIMEOUT_S


@pytest.mark.parametrize("timeout_s", [0, -1, True, "10", float("inf")])
def test_initialize_rejects_a_bad_timeout_before_touching_jax(timeout_s):
    with pytest.raises(ValueError, match="timeout_s: expected a positive number of seconds"):
        meshpar.distributed.initialize("127.0.0.1:1234", 2, 0, timeout_s=timeout_s)
