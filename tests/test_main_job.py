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


@pytest.mark.slow
def test_main_job_with_its_blocks_in_one_scan_cuts_the_scan_and_holds_slices():
    out = subprocess.run([sys.executable, "-m", "examples.train_gpt", "--steps", "3", "--scan-layers"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "pipeline: 2 stages on 2 meshes" in out.stdout, out.stdout
    # 11 stacked parameters and their two Adam moments, cut 4 + 4 inside the scan.
    assert "stacked leaves: 33 split 4 + 4 along axis 0, one piece per stage; returned as one array" in out.stdout
    losses = re.findall(r"^step \d+: loss ([\d.]+)  \(jax.jit on one device: ([\d.]+)\)", out.stdout, re.M)
    assert len(losses) == 3, out.stdout
    for got, want in losses:
        assert abs(float(got) - float(want)) <= 1e-5 * max(1.0, abs(float(want))), (got, want)
