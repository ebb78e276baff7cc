"""The planner benchmark's own arithmetic: rank correlation and the summary table."""

import numpy as np
import pytest

from benchmarks.planner import spearman, table


def test_spearman_against_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.permutation(8).astype(float), rng.permutation(8).astype(float)
        d = x - y  # distinct ranks: 1 - 6 sum d^2 / (n (n^2 - 1))
        assert spearman(x, y) == pytest.approx(1 - 6 * np.sum(d ** 2) / (8 * 63))
    assert spearman([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)  # ties share ranks
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_table_reports_correlation_picks_against_the_best_and_simulated_rows():
    records = [
        {"part": "cpu", "model": "gpt", "config": "a", "source": "grid", "predicted_step_s": 0.01, "measured_step_s": 0.10},
        {"part": "cpu", "model": "gpt", "config": "b", "source": "grid", "predicted_step_s": 0.02, "measured_step_s": 0.20},
        {"part": "cpu", "model": "gpt", "config": "a", "source": "pick:meshpar", "predicted_step_s": 0.01,
         "measured_step_s": 0.11},
        {"part": "cpu", "model": "gpt", "config": "a", "source": "planning:meshpar", "planning_s": 0.5},
        {"part": "cpu", "model": "gpt", "config": "dp", "source": "jax.jit", "measured_step_s": 0.05},
        {"part": "simulated", "model": "gpt96", "config": "dgx_h100 x16", "source": "pick:meshpar", "error": "no plan",
         "planning_s": 1.0},
        {"part": "simulated", "model": "gpt96", "config": "dgx_h100 x1024: S=8", "source": "pick:meshpar",
         "predicted_step_s": 2.0, "peak_memory_bytes": 7e10, "planning_s": 9.0},
    ]
    text = table(records)
    assert "Spearman ρ predicted vs measured = 1.00" in text and "50.0 (best)" in text
    assert "| pick:meshpar | a | 10.0 | 110.0 | 2.20x | 0.50 |" in text
    assert "| jax.jit | dp |  | 50.0 | 1.00x |  |" in text
    assert "no plan" in text and "peak 70.0 GB | 2000 |" in text
