"""A pipelined GPT job started by a real ``mpirun`` (Open MPI), each process calling
``meshpar.distributed.initialize()`` with no arguments: 2 processes x 4 CPU devices (one stage
mesh per process) and 4 x 2 (each stage mesh across two processes), every process's loss and
parameter shards against jax.jit's. tests/multiprocess/test_launchers.py covers the same detection with
the launcher's variables set by hand; this is the launcher itself."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest

from repo_paths import ROOT_DIR, TESTS_DIR

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_mpirun_worker.py")
# mpirun refuses to run as root (CI's user) without --allow-run-as-root, and more processes
# than cores (CI has 2) without --oversubscribe. README.md's "Several processes" shows this line.
MPIRUN_FLAGS = ("--allow-run-as-root", "--oversubscribe")
# Launcher variables of an enclosing job (the suite run under srun or mpirun) would be read by
# this job's processes or by mpirun itself; XLA_ flags would change the device count.
_INHERITED_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS", "XLA_")


def _kill_session(session: int) -> None:
    """SIGKILLs every process of ``session`` (a session this test started)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == session:
                    os.kill(int(entry), signal.SIGKILL)
            except ProcessLookupError:
                continue


def launch(command: list[str], nproc: int, keep: tuple[str, ...] = (), timeout_s: float = 240) -> tuple[str, str]:
    """Runs ``command`` (a launcher starting ``nproc`` workers) with this environment less an
    enclosing job's launcher variables (but those named in ``keep``); the job must exit 0 with
    every rank printing ``ALL OK``. Returns the job's output and a failure message holding the
    command, its exit status and the output's end."""
    env = {k: v for k, v in os.environ.items() if k in keep or not k.startswith(_INHERITED_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT_DIR, env.get("PYTHONPATH", "")])
    # A session of its own: mpirun puts each rank in a process group of its own, and a killed
    # mpirun leaves its ranks running (holding the output pipe open); the session holds them all.
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=timeout_s)[0]
    except subprocess.TimeoutExpired:
        # SIGTERM makes the launcher end its ranks; whatever is left after that is killed.
        proc.terminate()
        try:
            out = proc.communicate(timeout=15)[0]
        except subprocess.TimeoutExpired:
            _kill_session(proc.pid)
            out = proc.communicate()[0]
        pytest.fail(f"{' '.join(command)} did not finish within {timeout_s} s:\n{out[-6000:]}")
    message = f"{' '.join(command)} exited {proc.returncode}:\n{out[-8000:]}"
    assert proc.returncode == 0, message
    for rank in range(nproc):
        assert f"process {rank}: ALL OK" in out, message
    return out, message


def check_trained(out: str, message: str, nproc: int, devices: int) -> None:
    """Every rank of the worker's job joined as itself, saw the stage meshes laid out as ``nproc``
    processes of ``devices`` devices make them, and ran its three steps."""
    spans = {2: ("[0]", "[1]"), 4: ("[0, 1]", "[2, 3]")}[nproc]
    for rank in range(nproc):
        assert f"process {rank}: joined as process {rank} of {nproc} with {devices} devices each" in out, message
        for stage, processes in enumerate(spans):
            assert f"process {rank}: stage {stage} on processes {processes}" in out, message
        for i in range(3):
            assert f"process {rank}: step {i} loss" in out, message


def mpirun(nproc: int, devices: int, timeout_s: float = 240) -> tuple[str, str]:
    """The worker under ``mpirun -np nproc`` with ``devices`` CPU devices per process (``launch``)."""
    launcher = shutil.which("mpirun")
    if launcher is None:
        pytest.fail("mpirun is not on PATH: .ci/run installs Open MPI (apt-get install openmpi-bin); "
                    "install it the same way to run this test")
    return launch([launcher, *MPIRUN_FLAGS, "-np", str(nproc), sys.executable, WORKER, str(devices)], nproc,
                  timeout_s=timeout_s)


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,devices", [(2, 4), (4, 2)])
def test_mpirun_trains_a_pipelined_gpt_equal_to_jax_jit(nproc, devices):
    # mpirun forwards each rank's output in pieces that may split a line from its newline, so
    # each rank's messages are looked for in the whole output rather than line by line.
    out, message = mpirun(nproc, devices)
    check_trained(out, message, nproc, devices)
