"""meshpar.checkpoint across two local processes (gloo over localhost), 4 CPU devices each."""

import os
import subprocess
import sys

import pytest

from test_multiprocess import HERE, run_all_ok


@pytest.mark.multiprocess
def test_checkpoint_and_resume_across_two_processes(tmp_path, monkeypatch):
    """Each process writes its stage's part; a fresh step in the same processes resumes bit for
    bit; one process restores it under another layout and into a jax.jit state and trains on."""
    monkeypatch.setenv("MESHPAR_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    results, output = run_all_ok("mp_checkpoint_worker.py", timeout_s=300)
    for r in results:
        assert "its part holds its stage's" in r.stdout, output
        assert "resumed training matches the uninterrupted run bit for bit" in r.stdout, output
        assert "the scanned GPT resumed bit for bit" in r.stdout, output
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.is_dir()) == ["process_0", "process_1"]

    # The same checkpoint in one process, under another layout and as a plain jax.jit state.
    env = {k: v for k, v in os.environ.items() if not k.startswith("XLA_")}
    env["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), env.get("PYTHONPATH", "")])
    restored = subprocess.run([sys.executable, os.path.join(HERE, "restore_elsewhere.py"), str(tmp_path / "ckpt")],
                              env=env, capture_output=True, text=True, timeout=300)
    assert restored.returncode == 0 and "ALL OK" in restored.stdout, restored.stdout[-3000:] + restored.stderr[-3000:]
    for name in ("2 stages on one device each", "a jax.jit state on one device",
                 "4 stages on one device each (the scanned GPT)", "a jax.jit state on one device (the scanned GPT)"):
        assert f"restored under {name}: the next steps match" in restored.stdout, restored.stdout
