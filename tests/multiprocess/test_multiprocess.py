"""meshpar across two (and three) local processes (gloo over localhost), 4 CPU devices each."""

import os
import re
import socket
import subprocess
import sys
from collections.abc import Sequence

import pytest

from repo_paths import ROOT_DIR, TESTS_DIR

HERE = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(script: str, nproc: int, timeout_s: float, args: Sequence[str] = ()) -> list[subprocess.CompletedProcess]:
    """Runs ``script PID NPROC PORT *args`` in ``nproc`` processes; kills all on timeout."""
    port = str(_free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT_DIR, env.get("PYTHONPATH", "")])
    procs = [
        subprocess.Popen([sys.executable, os.path.join(HERE, script), str(i), str(nproc), port, *args],
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


def run_all_ok(script: str, timeout_s: float, args: Sequence[str] = ()) -> tuple[list[subprocess.CompletedProcess], str]:
    """Runs ``script`` in two processes; both must exit 0 having printed ``ALL OK``.
    Returns their results and their joined output (for assertion messages)."""
    results = run_processes(script, 2, timeout_s=timeout_s, args=args)
    output = "\n".join(f"--- process {i} ---\n{r.stdout[-4000:]}" for i, r in enumerate(results))
    for pid, r in enumerate(results):
        assert r.returncode == 0, output
        assert f"process {pid}: ALL OK" in r.stdout, output
    return results, output


@pytest.mark.multiprocess
def test_reshard_across_two_processes():
    results, output = run_all_ok("mp_reshard_worker.py", timeout_s=600)
    assert all("reshard checks passed" in r.stdout for r in results), output


@pytest.mark.multiprocess
def test_round_gated_moves_across_three_processes_are_bit_exact():
    results = run_processes("mp_gated_worker.py", 3, timeout_s=600)
    output = "\n".join(f"--- process {i} ---\n{r.stdout[-4000:]}" for i, r in enumerate(results))
    for pid, r in enumerate(results):
        assert r.returncode == 0 and f"process {pid}: ALL OK" in r.stdout, output


@pytest.mark.multiprocess
def test_p2p_without_a_transfer_server_names_the_fix():
    results, output = run_all_ok("mp_no_transfer_server_worker.py", timeout_s=300)
    assert all("clear error" in r.stdout for r in results), output


@pytest.mark.multiprocess
def test_pipeline_across_two_processes():
    """(data, model, pipeline) = (2, 2, 2) with one stage per process, against jax.jit."""
    results, output = run_all_ok("mp_pipeline_worker.py", timeout_s=600)
    assert "step 2 loss" in results[1].stdout, output
    assert "collective transfers match" in results[1].stdout, output
    for fed in ("over 8 devices, M=4", "over 8 devices, M=8", "over 2 devices, M=4"):
        assert all(f"global batch {fed}, matches" in r.stdout for r in results), output
    assert all("per-process numpy rows refused" in r.stdout for r in results), output
    assert all("every parameter read whole on every process" in r.stdout for r in results), output
    for schedule in ("eager_1f1b with weight_delay=True", "zb_h1 with weight_delay=False", "1f1b with weight_delay=auto"):
        assert all(f"{schedule} matches" in r.stdout for r in results), output
    assert all("global-norm clipping match" in r.stdout for r in results), output
    for M in (1, 8):
        for reduction in ("per_step", "per_micro_batch"):
            assert all(f"gradient_reduction={reduction} M={M} matches" in r.stdout for r in results), output
    for reduction in ("per_step", "per_micro_batch"):
        assert all(f"data axis across processes, gradient_reduction={reduction} matches" in r.stdout
                   for r in results), output
    assert all("signal transfers ran" in r.stdout for r in results), output
    assert all("trace has only its own stage's compute" in r.stdout for r in results), output
    assert "skipped peer detected" in results[0].stdout, output


SCANNED = ("scanned GPT cut 4 + 4", "hand-written lax.scan cut 3 + 2", "nnx.scan stack cut into 2 stages")
SCANNED_SLOW = ("scanned GPT cut 3 + 5", "scanned GPT with remat cut into 4 stages (SGD)")


@pytest.mark.multiprocess
@pytest.mark.slow  # CI's 15 minutes: a scanned GPT across two processes runs in the checkpoint test
@pytest.mark.parametrize("every_case", [False, True])
def test_a_scanned_stack_cut_into_one_stage_per_process(every_case):
    """A GPT in one nn.scan cut 4 + 4 (stacks held across both processes), an nnx.scan stack, a
    hand-written lax.scan cut 3 + 2; in the slow run also the GPT cut 3 + 5 (gathered) and into 4
    stages with remat."""
    results, output = run_all_ok("mp_scanned_worker.py", timeout_s=600, args=["--every-case"] if every_case else [])
    for case in SCANNED + (SCANNED_SLOW if every_case else ()):
        assert all(f"{case} matches" in r.stdout for r in results), output


@pytest.mark.multiprocess
@pytest.mark.parametrize("every_case", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_virtual_stages_across_two_processes(every_case):
    """Several stages per mesh with p2p moves between processes: DualPipeV (GPT on 2 meshes in a
    V, one mesh per process); in the slow run also interleaved 1F1B of the GPT and of a
    U-Transformer on 4 meshes, and ZB-V. None moves a value between two
    stages of one mesh."""
    results, output = run_all_ok("mp_interleaved_worker.py", timeout_s=600, args=["--every-case"] if every_case else [])
    cases = [("dualpipev", "gpt", 2)]
    cases += [("interleaved_1f1b", "gpt", 2), ("interleaved_1f1b", "ut", 4), ("zb_v", "gpt", 2)] if every_case else []
    for schedule, name, meshes in cases:
        assert all(f"{schedule} {name} on {meshes} meshes matches" in r.stdout for r in results), output


@pytest.mark.multiprocess
def test_p2p_moves_overlap_with_the_senders_compute_and_collective_ones_do_not():
    results, output = run_all_ok("mp_overlap_worker.py", timeout_s=300)
    assert "p2p: sender compute finished while the receiver was busy" in results[0].stdout, output
    assert "collective: sender compute waited for the receiver" in results[0].stdout, output
    assert "p2p: the move delivered every shard" in results[1].stdout, output
    assert "collective: the move delivered every shard" in results[1].stdout, output


@pytest.mark.multiprocess
def test_four_processes_with_the_data_axis_across_them():
    """4 processes x 2 devices, each stage mesh spanning two processes along its data axis, a
    tied-embedding GPT with both gradient reductions and a global batch fed by all four, against jax.jit."""
    results = run_processes("mp_four_worker.py", 4, timeout_s=600)
    output = "\n".join(f"--- process {i} ---\n{r.stdout[-3000:]}" for i, r in enumerate(results))
    for pid, r in enumerate(results):
        assert r.returncode == 0, output
        for name in ("gradient_reduction=per_step, the same numpy batch,",
                     "gradient_reduction=per_micro_batch, a global batch fed by its four processes,"):
            assert f"process {pid}: {name} matches" in r.stdout, output
        assert f"process {pid}: ALL OK" in r.stdout, output


@pytest.mark.multiprocess
def test_a_global_batch_read_outside_the_loss_across_two_processes():
    """Each process feeds its own rows as a global array; the step computes a normaliser from the
    mask and returns a metric of the batch (docs/multiprocess.md's masked mean): under 1F1B, 2 stages and 4
    micro-batches, the loss, the metric (on both processes) and the parameters equal jax.jit's
    on the full batch, the batch moved by planned moves and never fetched to a host."""
    results, output = run_all_ok("mp_batch_outside_loss_worker.py", timeout_s=120)
    for r in results:
        assert "planned whole moves of" in r.stdout and "unplanned placement refused" in r.stdout, output
        assert all(f"step {i} loss" in r.stdout for i in range(3)), output


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", ["1f1b", "zb_v"])
def test_the_lm1b_pattern_across_two_processes(schedule):
    """flax's lm1b train step as written (normaliser inside the loss function, batch read
    outside it), each process feeding its own rows as a global array: the loss, read on both
    processes, and the parameters equal jax.jit's on the full batch. Only the first step
    compiles: the state it returns, spanning both processes, runs the programs it compiled."""
    results, output = run_all_ok("mp_public_lm_worker.py", timeout_s=240, args=[schedule])
    assert all("step 2 loss" in r.stdout for r in results), output
    for pid, r in enumerate(results):
        compiled = [int(n) for n in re.findall(rf"process {pid}: step \d loss \S+ matches, (\d+) programs compiled",
                                               r.stdout)]
        # The first step compiling something shows that the worker's listener hears compilations.
        assert len(compiled) == 3 and compiled[0] > 0 and compiled[1:] == [0, 0], output
