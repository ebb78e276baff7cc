"""meshpar.checkpoint across two local processes (gloo over localhost), 4 CPU devices each."""

import pytest

from test_multiprocess import run_all_ok


@pytest.mark.multiprocess
def test_checkpoint_and_resume_across_two_processes(tmp_path, monkeypatch):
    """Each process writes its stage's part; a fresh step in the same processes resumes bit for bit."""
    monkeypatch.setenv("MESHPAR_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    results, output = run_all_ok("mp_checkpoint_worker.py", timeout_s=300)
    for r in results:
        assert "its part holds its stage's" in r.stdout, output
        assert "resumed training matches the uninterrupted run bit for bit" in r.stdout, output
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["process_0", "process_1"]
