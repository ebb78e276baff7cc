"""``meshpar.distributed.initialize()`` with no arguments, as ``jax.distributed.initialize()``:
the job found from the launcher's environment (Open MPI's, SLURM's) by JAX's own detection, a
pipelined step run across the two processes; the error when nothing is found; and processes
that called ``jax.distributed.initialize`` themselves."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys

import pytest

from repo_paths import ROOT_DIR, TESTS_DIR

from meshpar.passes import jax_ir

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "mp_launcher_worker.py")
# Where JAX's Open MPI and SLURM detection put the coordinator without JAX_COORDINATOR_PORT:
# 61440 plus the job id modulo 4096 (Open MPI's job id divided by 4096 first).
_JAX_LAUNCHER_PORTS = 65535 - 2**12 + 1
# Variables of launchers and of JAX's own detection: stripped from the tests' environment, so
# that only what a test sets is detected (the suite itself may run under srun or mpirun).
_LAUNCHER_PREFIXES = ("OMPI_", "PMIX_", "PMI_", "SLURM_", "JAX_COORDINATOR", "JAX_LOCAL_DEVICE_IDS",
                      "KUBERNETES_SERVICE_HOST", "XLA_")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCHER_PREFIXES)}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT_DIR, env.get("PYTHONPATH", "")])
    return env


def _launcher_port() -> int:
    """A port free on 127.0.0.1 among those JAX's launcher detection picks from a job id."""
    rng = random.Random()
    for _ in range(64):
        port = rng.randrange(_JAX_LAUNCHER_PORTS, 65536)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.fail(f"no free port in [{_JAX_LAUNCHER_PORTS}, 65535] on 127.0.0.1")


def _ompi_env(rank: int, size: int, port: int) -> dict[str, str]:
    """What Open MPI 4's mpirun gives rank ``rank``: its job id chosen so that JAX puts the
    coordinator on ``port``; the launcher listed at 127.0.0.1 first, as mpirun lists its
    addresses."""
    job_id = (port - _JAX_LAUNCHER_PORTS) * 2**12
    return {"OMPI_MCA_orte_hnp_uri": f"{job_id}.0;tcp://127.0.0.1,10.255.0.1:41231",
            "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(size)}


def _slurm_env(rank: int, size: int, port: int) -> dict[str, str]:
    """What srun gives task ``rank`` of a one-node step on 127.0.0.1: its job id chosen so that
    JAX puts the coordinator on ``port``."""
    return {"SLURM_JOB_ID": str(port - _JAX_LAUNCHER_PORTS + 2**12 * 7), "SLURM_STEP_NODELIST": "127.0.0.1",
            "SLURM_STEP_NUM_NODES": "1", "SLURM_NTASKS": str(size), "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank)}


LAUNCHERS = {"ompi": _ompi_env, "slurm": _slurm_env}


def launch(launcher: str, mode: str, timeout_s: float = 120, nproc: int = 2) -> tuple[list[str], int]:
    """Runs ``mp_launcher_worker.py mode`` in ``nproc`` processes with ``launcher``'s variables;
    every one must exit 0 having printed ``ALL OK``. Returns their outputs and the coordinator's
    port; kills all on timeout."""
    port = _launcher_port()
    procs = [subprocess.Popen([sys.executable, WORKER, mode], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**_clean_env(), **LAUNCHERS[launcher](rank, nproc, port)})
             for rank in range(nproc)]
    try:
        outs = [p.communicate(timeout=timeout_s)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"{launcher} {mode}: did not finish within {timeout_s} s:\n"
                    + "\n---\n".join(o[-3000:] for o in outs))
    joined = "\n".join(f"--- process {i} ---\n{o[-4000:]}" for i, o in enumerate(outs))
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"process {rank}: ALL OK" in out, joined
    return outs, port


@pytest.mark.multiprocess
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_no_arguments_under_a_launcher_runs_a_pipelined_step(launcher):
    outs, port = launch(launcher, "meshpar")
    for rank, out in enumerate(outs):
        assert f"joined 127.0.0.1:{port} as process {rank} of 2 with 8 devices" in out, out
        assert f"process {rank}: loss" in out and "matches jax.jit" in out, out


@pytest.mark.multiprocess
def test_meshpar_initialize_after_jax_distributed_initialize():
    outs, port = launch("ompi", "jax_then_meshpar")
    for rank, out in enumerate(outs):
        assert "refused to change the joined job" in out, out
        assert f"joined 127.0.0.1:{port} as process {rank} of 2" in out, out
        assert f"process {rank}: loss" in out, out


@pytest.mark.multiprocess
def test_jax_distributed_initialize_alone_names_the_exact_call():
    outs, port = launch("slurm", "jax_only")
    for rank, out in enumerate(outs):
        line = f"meshpar.distributed.initialize(coordinator_address='127.0.0.1:{port}', num_processes=2, " \
               f"process_id={rank})"
        assert f"process {rank}: error names {line}" in out, out


def _initialize_in_a_fresh_process(call: str, env: dict[str, str] | None = None) -> str:
    """Runs ``meshpar.distributed.initialize`` as ``call`` says in a fresh interpreter (this
    one's backend may have started); returns the exception's ``type: message``."""
    code = ("import meshpar.distributed\n"
            f"try:\n    {call}\nexcept Exception as e:\n    print(f'{{type(e).__name__}}: {{e}}')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**_clean_env(), **(env or {})})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_no_launcher_names_the_missing_arguments_and_the_launchers():
    error = _initialize_in_a_fresh_process("meshpar.distributed.initialize()")
    assert error.startswith("ValueError: meshpar.distributed.initialize: coordinator_address, num_processes, "
                            "process_id not given and not detected"), error
    for launcher in ("OmpiCluster ('ompi')", "SlurmCluster ('slurm')", "JAX_COORDINATOR_ADDRESS", "srun", "mpirun"):
        assert launcher in error, error
    # mpi4py is tried only when named, so it is not among those looked for.
    assert "Mpi4pyCluster" not in error, error


def test_a_coordinator_from_the_environment_leaves_only_the_rest_missing():
    error = _initialize_in_a_fresh_process("meshpar.distributed.initialize(num_processes=2)",
                                           {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"})
    assert "ValueError: meshpar.distributed.initialize: process_id not given and not detected" in error, error


def test_a_launcher_named_but_absent_is_refused():
    error = _initialize_in_a_fresh_process("meshpar.distributed.initialize(cluster_detection_method='slurm')")
    assert error.startswith("ValueError: cluster_detection_method: 'slurm' is not usable in this process"), error
    error = _initialize_in_a_fresh_process("meshpar.distributed.initialize(cluster_detection_method='pbs')")
    assert error.startswith("ValueError: cluster_detection_method: expected None, 'deactivate' or one of"), error


def test_detection_fills_only_what_is_not_given(monkeypatch):
    for name in [k for k in os.environ if k.startswith(_LAUNCHER_PREFIXES)]:
        monkeypatch.delenv(name)
    for name, value in _slurm_env(1, 4, 61441).items():
        monkeypatch.setenv(name, value)
    assert jax_ir.detect_distributed_params(None, None, None, None, None, 10) == ("127.0.0.1:61441", 4, 1, [1])
    assert jax_ir.detect_distributed_params("10.0.0.1:99", None, 3, None, None, 10) == ("10.0.0.1:99", 4, 3, [1])
    assert jax_ir.detect_distributed_params(None, None, None, None, "deactivate", 10) == (None, None, None, None)
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "5000")
    assert jax_ir.detect_distributed_params(None, None, None, [0, 1], None, 10) == ("127.0.0.1:5000", 4, 1, [0, 1])
