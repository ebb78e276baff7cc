"""meshpar.checkpoint across two local processes (gloo over localhost), 4 CPU devices each."""

import os
import subprocess
import sys

import pytest

from repo_paths import ROOT_DIR, TESTS_DIR

from test_multiprocess import HERE, run_all_ok


@pytest.mark.multiprocess
def test_checkpoint_and_resume_across_two_processes(tmp_path, monkeypatch):
    """Both processes write one global orbax checkpoint, each its own chunks; a fresh step in the
    same processes resumes bit for bit; one process restores it under another layout and into a
    jax.jit state and trains on; plain orbax, without meshpar, restores the scanned GPT into a
    jax.jit state whose next steps equal the uninterrupted run's."""
    monkeypatch.setenv("MESHPAR_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    results, output = run_all_ok("mp_checkpoint_worker.py", timeout_s=300)
    for r in results:
        assert "one global checkpoint holds both stages'" in r.stdout, output
        assert "resumed training matches the uninterrupted run bit for bit" in r.stdout, output
        assert "the scanned GPT resumed bit for bit" in r.stdout, output

    # The same checkpoint in one process, under another layout and as a plain jax.jit state.
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([TESTS_DIR, ROOT_DIR, env.get("PYTHONPATH", "")])
    restored = subprocess.run([sys.executable, os.path.join(HERE, "restore_elsewhere.py"), str(tmp_path / "ckpt")],
                              env=env, capture_output=True, text=True, timeout=300)
    assert restored.returncode == 0 and "ALL OK" in restored.stdout, restored.stdout[-3000:] + restored.stderr[-3000:]
    for name in ("2 stages on one device each", "a jax.jit state on one device",
                 "4 stages on one device each (the scanned GPT)", "a jax.jit state on one device (the scanned GPT)"):
        assert f"restored under {name}: the next steps match" in restored.stdout, restored.stdout

    plain = subprocess.run([sys.executable, os.path.join(HERE, "restore_with_plain_orbax.py"),
                            str(tmp_path / "ckpt-scanned")], env=env, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0 and "ALL OK" in plain.stdout, plain.stdout[-3000:] + plain.stderr[-3000:]
    assert "with plain orbax, meshpar not imported" in plain.stdout, plain.stdout
    assert "the next steps under jax.jit match the uninterrupted run" in plain.stdout, plain.stdout
