"""A process killed in any phase of a step: every other process exits within its timeout, naming it.

Issue 42, item 3 ("kills"). Each test launches mp_kill_phase_worker.py (timeout_s = 10) in
several processes; process 1 (the victim) SIGKILLs itself as it enters the phase. A phase is one
entry of the worker's ``PHASES`` and one ``Case`` here. Every wait has a time limit, and a
process still running at the end is asked where its threads are (SIGUSR1) and killed.

Two tests per phase:

- as started by ``meshpar.distributed.initialize(timeout_s=10)``: each survivor exits, non-zero,
  within ``timeout_s + 10`` s of the death, its output naming process 1. Usually JAX's
  coordination service gets there first: it declares the victim dead 5-10 s after its last
  heartbeat and terminates every survivor, naming it ("stopped sending heartbeats): 1").
  Whatever the step raised before that names process 1 too.
- with JAX's heartbeat timeout long (60 s): meshpar's own waits are left alone to notice, so
  each survivor's step raises within ``timeout_s + 10`` s, naming process 1 (the survivors are
  then killed: their exit waits for JAX's heartbeat timeout, which the first test covers).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest

from repo_paths import ROOT_DIR, TESTS_DIR

from meshpar.runtime.coordination import CoordinationError, PeerLostError, raise_lost_collective_peer, raise_lost_peer

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_kill_phase_worker.py")
TIMEOUT_S = 10  # the worker's
VICTIM = 1  # the worker's
STARTUP_S = 180  # every process up, compiled and into the phase, on a loaded machine
GRACE_S = 10  # what a survivor may take beyond timeout_s
LONG_HEARTBEAT_S = 60  # JAX's heartbeat timeout when meshpar's waits are tested alone

# How a survivor names the dead process: a meshpar error ("lost process 1", "not delivered by
# processes 1, 3", "process 1 did not reach the same call"), or JAX's coordination service
# terminating it ("... stopped sending heartbeats):\n1", the dead processes' indices).
NAMES_VICTIM = re.compile(rf"\bprocess(?:es)? (?:\d+, )*{VICTIM}\b|stopped sending heartbeats\):\s*{VICTIM}\b")


@dataclass(frozen=True)
class Case:
    phase: str  # the worker's PHASES key
    nproc: int


# One per phase.
# Mid-pipeline runs three stages on three processes and kills the middle one: both of its
# neighbours, process 0 (the coordinator's) and process 2, lose it.
CASES = [
    Case("compile", 2),
    Case("first_transfer", 2),
    Case("mid_pipeline", 3),
    Case("gradient_reduction", 2),
    Case("checkpoint_save", 2),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class Survivor:
    pid: int
    returncode: int | None  # None: still running at the end (then killed)
    exit_delay: float | None  # seconds from the victim's going to this process's exit
    raised: str | None  # what its step raised (type: message), if it printed it
    raise_delay: float | None  # seconds from the victim's going to that
    output: str

    def report(self, phase: str) -> str:
        exited = (f"exited (rc {self.returncode}) {self.exit_delay:.1f} s after the kill" if self.exit_delay is not None
                  else "was still running when the test ended")
        raised = (f"raised {self.raise_delay:.1f} s after it: {self.raised[:300]}" if self.raised
                  else "raised nothing (terminated by JAX first)")
        return f"{phase}: process {self.pid} {exited}; {raised}"


@dataclass(frozen=True)
class Run:
    victim: str  # its output
    survivors: list[Survivor]

    def context(self, s: Survivor) -> str:
        return f"process {s.pid}:\n{s.output[-4000:]}\n--- process {VICTIM} ---\n{self.victim[-2000:]}"


def _gone(output: str) -> float | None:
    found = re.search(rf"^process {VICTIM}: gone at ([0-9.]+)$", output, re.MULTILINE)
    return float(found.group(1)) if found else None


def _raised(pid: int, output: str) -> tuple[float, str] | None:
    """When the survivor's step raised and what (the worker prints it on one line)."""
    found = re.search(rf"^process {pid}: raised at ([0-9.]+) [^:]*: (.*)$", output, re.MULTILINE)
    return (float(found.group(1)), found.group(2)) if found else None


def _run(case: Case, tmp_path: Path, heartbeat_s: int | None = None) -> Run:
    """Runs the worker in ``case.nproc`` processes until every survivor exited (or, with
    ``heartbeat_s``, exited or raised), at most ``timeout_s + GRACE_S`` and a little more after the
    victim's going; returns what each did, and when."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT_DIR, env.get("PYTHONPATH", "")])
    logs = [tmp_path / f"process{i}.log" for i in range(case.nproc)]
    extra = [str(heartbeat_s)] if heartbeat_s is not None else []
    procs: list[subprocess.Popen] = []
    exited: dict[int, float] = {}
    try:
        for i, log in enumerate(logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    [sys.executable, "-u", WORKER, str(i), str(case.nproc), port, case.phase, *extra],
                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path))
        survivors = [i for i in range(case.nproc) if i != VICTIM]
        # Until the victim goes, at most STARTUP_S; then a survivor has TIMEOUT_S + GRACE_S, and a
        # little more, to report how late it was rather than only that it was.
        deadline, gone = time.time() + STARTUP_S, None
        while time.time() < deadline:
            for i, p in enumerate(procs):
                if i not in exited and p.poll() is not None:
                    exited[i] = time.time()
            if gone is None:
                gone = _gone(logs[VICTIM].read_text())
                if gone is not None:
                    deadline = gone + TIMEOUT_S + GRACE_S + 20
            done = [i for i in survivors if i in exited or
                    (heartbeat_s is not None and _raised(i, logs[i].read_text()) is not None)]
            if len(done) == len(survivors) or len(exited) == len(procs):
                break
            time.sleep(0.05)
    finally:
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGUSR1)  # the worker prints its threads' stacks
        if alive:
            time.sleep(1)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
    outputs = [log.read_text() for log in logs]
    gone = _gone(outputs[VICTIM])
    assert gone is not None, (f"process {VICTIM} did not get to {case.phase}:\n{outputs[VICTIM][-3000:]}\n" +
                              "\n".join(f"--- process {i} ---\n{o[-3000:]}" for i, o in enumerate(outputs)
                                        if i != VICTIM))
    survivors = []
    for i in range(case.nproc):
        if i == VICTIM:
            continue
        raised = _raised(i, outputs[i])
        survivors.append(Survivor(i, procs[i].returncode if i in exited else None,
                                  exited[i] - gone if i in exited else None,
                                  raised[1] if raised else None, raised[0] - gone if raised else None, outputs[i]))
    return Run(outputs[VICTIM], survivors)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=[c.phase for c in CASES])
def test_every_survivor_of_a_kill_exits_promptly_naming_the_dead_process(case, tmp_path):
    run = _run(case, tmp_path)
    for s in run.survivors:
        print("\n" + s.report(case.phase))
        assert s.returncode is not None, f"did not exit: {run.context(s)}"
        assert s.exit_delay <= TIMEOUT_S + GRACE_S, f"exited {s.exit_delay:.1f} s after the kill: {run.context(s)}"
        assert s.returncode != 0, f"exited cleanly: {run.context(s)}"
        assert "finished without its peer" not in s.output, run.context(s)
        assert NAMES_VICTIM.search(s.output), f"does not name process {VICTIM}: {run.context(s)}"
        # What the step raised names the victim too (not the runtime's bare error).
        assert s.raised is None or NAMES_VICTIM.search(s.raised), \
            f"raised without naming process {VICTIM}: {run.context(s)}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=[c.phase for c in CASES])
def test_meshpar_alone_names_the_dead_process_within_its_timeout(case, tmp_path):
    run = _run(case, tmp_path, heartbeat_s=LONG_HEARTBEAT_S)
    for s in run.survivors:
        print("\n" + s.report(case.phase))
        assert s.raised is not None, f"raised nothing: {run.context(s)}"
        assert s.raise_delay <= TIMEOUT_S + GRACE_S, f"raised {s.raise_delay:.1f} s after the kill: {run.context(s)}"
        assert NAMES_VICTIM.search(s.raised), f"raised without naming process {VICTIM}: {run.context(s)}"


# -- the messages, without processes ---------------------------------------------------------------

def test_a_collective_failing_in_gloo_names_the_processes_it_runs_with():
    failure = jax.errors.JaxRuntimeError("UNKNOWN: Gloo all-reduce failed: [external/gloo/gloo/transport/tcp/"
                                         "pair.cc:547] Connection closed by peer [127.0.0.1]:40832")
    with pytest.raises(PeerLostError, match=r"^a program on mesh m: lost process 1: its collectives with process 1 "
                                            r"failed \(UNKNOWN: Gloo all-reduce failed") as caught:
        raise_lost_collective_peer(failure, (1,), "a program on mesh m")
    assert caught.value.__cause__ is failure
    with pytest.raises(PeerLostError, match=r"lost one of processes 1, 3: its collectives with processes 1, 3"):
        raise_lost_collective_peer(failure, (1, 3), "a program on mesh m")


def test_a_programs_own_failure_is_raised_as_it_is():
    own = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(jax.errors.JaxRuntimeError, match="out of memory"):
        raise_lost_collective_peer(own, (1,), "a program on mesh m")


def test_a_peer_that_never_started_its_transfer_server_is_named():
    timeout = jax.errors.JaxRuntimeError(
        "DEADLINE_EXCEEDED: GetKeyValue() timed out with key: transfer_server:ifrt_cross_host_socket_address_3 and "
        "duration: 10s [type.googleapis.com/tensorflow.CoordinationServiceError='']")
    with pytest.raises(CoordinationError, match=r"^pipeline transfers: process 3 did not start its cross-host "
                                                r"transfer server in time \(DEADLINE_EXCEEDED.*was launching x; "
                                                r"is process 3 alive") as caught:
        raise_lost_peer(timeout, [], "pipeline transfers", "launching x")
    assert caught.value.__cause__ is timeout
