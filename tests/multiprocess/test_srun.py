"""A pipelined GPT job started by SLURM's ``srun`` on a one-node cluster, each process calling
``meshpar.distributed.initialize()`` with no arguments: 2 processes x 4 CPU devices and 4 x 2,
every process's loss and parameter shards against jax.jit's (the worker and checks of
tests/multiprocess/test_mpirun.py).

It needs a running SLURM cluster: ``.ci/start_slurm`` starts one on this machine (CI's
``.ci/run`` installs slurm-wlm and munge, starts it and sets ``MESHPAR_REQUIRE_SLURM=1``, under
which a missing cluster fails the test). Elsewhere, without ``SLURM_CONF`` set to a cluster
that answers, the test is skipped, saying so.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from test_mpirun import WORKER, check_trained, launch

# More tasks than the node's CPUs would wait for them: --overcommit starts them anyway (the
# cluster's node claims 8 CPUs; CI has 2 cores). README.md's "Several processes" shows this line.
SRUN_FLAGS = ("--overcommit",)


def _cluster() -> str:
    """The srun to launch with, once a SLURM controller answers; skips (or fails, where CI
    requires SLURM) otherwise."""
    srun, scontrol = shutil.which("srun"), shutil.which("scontrol")
    answering = bool(srun and scontrol and os.environ.get("SLURM_CONF")) and "UP" in subprocess.run(
        [scontrol, "ping"], capture_output=True, text=True, timeout=30).stdout
    if not answering:
        why = ("no SLURM cluster answers (srun and scontrol on PATH, SLURM_CONF set, `scontrol ping` UP); "
               "`.ci/start_slurm` starts one on this machine")
        if os.environ.get("MESHPAR_REQUIRE_SLURM") == "1":
            pytest.fail(why)
        pytest.skip(why)
    return srun


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc,devices", [(2, 4), (4, 2)])
def test_srun_trains_a_pipelined_gpt_equal_to_jax_jit(nproc, devices):
    srun = _cluster()
    out, message = launch([srun, *SRUN_FLAGS, f"--ntasks={nproc}", sys.executable, WORKER, str(devices)], nproc,
                          keep=("SLURM_CONF",))
    check_trained(out, message, nproc, devices)
