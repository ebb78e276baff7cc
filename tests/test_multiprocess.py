"""meshpar across two local processes (gloo over localhost), 4 CPU devices each."""

import os
import socket
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(script: str, nproc: int, timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Runs ``script PID NPROC PORT`` in ``nproc`` processes; kills all on timeout."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, script), str(i), str(nproc), port],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for i in range(nproc)
    ]
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, ""))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate()[0] for p in procs]
        pytest.fail(f"{script} did not finish within {timeout_s} s:\n" + "\n---\n".join(o[-3000:] for o in outs))
    return results


@pytest.mark.multiprocess
def test_reshard_across_two_processes():
    results = run_processes("mp_reshard_worker.py", 2, timeout_s=600)
    for pid, r in enumerate(results):
        assert r.returncode == 0, "\n".join(f"--- process {i} ---\n{q.stdout[-4000:]}" for i, q in enumerate(results))
        assert f"process {pid}: ALL OK" in r.stdout
        assert "reshard checks passed" in r.stdout


@pytest.mark.multiprocess
def test_p2p_without_a_transfer_server_names_the_fix():
    results = run_processes("mp_no_transfer_server_worker.py", 2, timeout_s=300)
    for pid, r in enumerate(results):
        assert r.returncode == 0, "\n".join(f"--- process {i} ---\n{q.stdout[-4000:]}" for i, q in enumerate(results))
        assert f"process {pid}: ALL OK" in r.stdout


@pytest.mark.multiprocess
def test_pipeline_across_two_processes():
    """(data, model, pipeline) = (2, 2, 2) with one stage per process, against jax.jit."""
    results = run_processes("mp_pipeline_worker.py", 2, timeout_s=600)
    output = "\n".join(f"--- process {i} ---\n{r.stdout[-4000:]}" for i, r in enumerate(results))
    for pid, r in enumerate(results):
        assert r.returncode == 0, output
        assert f"process {pid}: ALL OK" in r.stdout, output
    assert "step 2 loss" in results[1].stdout, output
    assert "collective transfers match" in results[1].stdout, output
    assert "skipped peer detected" in results[0].stdout, output


@pytest.mark.multiprocess
def test_p2p_moves_overlap_with_the_senders_compute_and_collective_ones_do_not():
    results = run_processes("mp_overlap_worker.py", 2, timeout_s=300)
    output = "\n".join(f"--- process {i} ---\n{r.stdout[-4000:]}" for i, r in enumerate(results))
    for pid, r in enumerate(results):
        assert r.returncode == 0, output
        assert f"process {pid}: ALL OK" in r.stdout, output
    assert "p2p: sender compute finished while the receiver was busy" in results[0].stdout, output
    assert "collective: sender compute waited for the receiver" in results[0].stdout, output
    assert "p2p: the move delivered every shard" in results[1].stdout, output
    assert "collective: the move delivered every shard" in results[1].stdout, output
