"""The main job (README: ``python -m examples.train_gpt``) runs as a user runs it, in a process of
its own, and each step's loss equals jax.jit's on one device."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("args,stages", [((), "2 stages on 2 meshes"),
                                          (("--schedule", "interleaved_1f1b", "--stages-per-mesh", "2"),
                                           "4 stages on 2 meshes")])
def test_main_job_trains_as_jit_does(args, stages):
    out = subprocess.run([sys.executable, "-m", "examples.train_gpt", "--steps", "3", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"pipeline: {stages}" in out.stdout, out.stdout
    losses = re.findall(r"^step \d+: loss ([\d.]+)  \(jax.jit on one device: ([\d.]+)\)", out.stdout, re.M)
    assert len(losses) == 3, out.stdout
    for got, want in losses:
        assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (got, want)
