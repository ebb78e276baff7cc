"""The main job (README: ``python -m examples.train_gpt``) runs as a user runs it, in a process of
its own, and each step's loss equals jax.jit's on one device."""

import os
import re
import subprocess
import sys

import pytest

from repo_paths import ROOT_DIR

ROOT = ROOT_DIR


@pytest.mark.parametrize("args,stages", [((), "2 stages on 2 meshes"),
                                          pytest.param(("--schedule", "interleaved_1f1b", "--stages-per-mesh", "2"),
                                                       "4 stages on 2 meshes", marks=pytest.mark.slow)])
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


def test_main_job_describe_names_moved_values_by_the_steps_own_code():
    """describe() names what moves between meshes as the step's author knows it, never by its
    number among the traced step's values (``value565``): the global norm optax computes for the
    clipping and the log by the optax function and the step's line that call for it."""
    out = subprocess.run([sys.executable, "-m", "examples.train_gpt", "--steps", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    described = out.stdout[out.stdout.index("pipeline: "):out.stdout.index("after 0 steps")]
    assert not re.search(r"\bvalue\d+\b", described), described
    with open(os.path.join(ROOT, "examples", "train_gpt.py")) as f:
        norm_line = next(n for n, line in enumerate(f, start=1) if "optax.tree.norm(grads)" in line)
    moved = re.search(r"^  after it: .*$", described, re.M)[0]
    assert ("the float32[] computed at optax/tree_utils/_tree_math.py:" in moved
            and f"(tree_norm) called from examples/train_gpt.py:{norm_line} (main_job.<locals>.train_step) moves "
                f"mesh 0 -> 1" in moved), moved


class _Gpu:
    """A stand-in for one GPU as the default backend's only device."""

    platform, id, process_index = "cuda", 0, 0


def test_main_job_falls_back_to_8_virtual_cpu_devices_with_one_line(monkeypatch, capsys):
    import jax

    from examples.train_gpt import job_devices

    cpus = jax.devices("cpu")
    monkeypatch.setattr(jax, "devices", lambda backend=None: cpus if backend == "cpu" else [_Gpu()])
    assert job_devices(8) == cpus[:8]
    out = capsys.readouterr().out.splitlines()
    assert out == ["1 cuda device, fewer than 8: running on 8 virtual CPU devices"]


def test_main_job_uses_8_accelerators_when_there_are_8(monkeypatch, capsys):
    import jax

    from examples.train_gpt import job_devices

    gpus = [type("Gpu", (), {"platform": "cuda", "id": k, "process_index": 0})() for k in range(9)]
    monkeypatch.setattr(jax, "devices", lambda backend=None: gpus)
    assert job_devices(8) == gpus[:8]
    assert capsys.readouterr().out == ""


def test_main_job_says_how_to_allow_the_cpu_when_jax_platforms_excludes_it(monkeypatch):
    import jax

    from examples.train_gpt import job_devices

    def devices(backend=None):
        if backend == "cpu":
            raise RuntimeError("Unknown backend cpu")
        return [_Gpu()]

    monkeypatch.setattr(jax, "devices", devices)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    with pytest.raises(SystemExit, match=r"needs 8 devices: JAX's cuda backend has 1 .*JAX_PLATFORMS=cuda,cpu"):
        job_devices(8)
