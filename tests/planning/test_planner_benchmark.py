"""The planner benchmark's own arithmetic: rank correlation and the summary table."""

import numpy as np
import pytest

from benchmarks.planner import _config, spearman, table
from meshpar.passes.planning.protocol import PipelinePlan, StagePlan


def test_spearman_against_the_definition():
    rng = np.random.default_rng(0)
    for _ in range(20):
        x, y = rng.permutation(8).astype(float), rng.permutation(8).astype(float)
        d = x - y  # distinct ranks: 1 - 6 sum d^2 / (n (n^2 - 1))
        assert spearman(x, y) == pytest.approx(1 - 6 * np.sum(d ** 2) / (8 * 63))
    assert spearman([1, 2, 2, 3], [10, 20, 20, 30]) == pytest.approx(1.0)  # ties share ranks
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_table_reports_correlation_picks_against_the_best_and_simulated_rows():
    def cpu(model):
        return [
            {"part": "cpu", "model": model, "config": "a", "source": "grid", "predicted_step_s": 0.01,
             "measured_step_s": 0.10},
            {"part": "cpu", "model": model, "config": "b", "source": "grid", "predicted_step_s": 0.02,
             "measured_step_s": 0.20},
            {"part": "cpu", "model": model, "config": "a", "source": "pick:meshpar", "predicted_step_s": 0.01,
             "measured_step_s": 0.11},
            {"part": "cpu", "model": model, "config": "a", "source": "planning:meshpar", "planning_s": 0.5},
            {"part": "cpu", "model": model, "config": "dp", "source": "jax.jit", "measured_step_s": 0.05},
        ]

    # "ut" has the interleaved final rounds: its ratios come from them, against their best
    final = [{"part": "cpu", "model": "ut", "config": "a", "source": "final:grid", "measured_step_s": 0.08},
             {"part": "cpu", "model": "ut", "config": "a", "source": "final:meshpar", "measured_step_s": 0.08},
             {"part": "cpu", "model": "ut", "config": "dp", "source": "final:jax.jit", "measured_step_s": 0.04}]
    records = cpu("gpt") + cpu("ut") + final + [
        {"part": "simulated", "model": "gpt96", "config": "dgx_h100 x16", "source": "pick:meshpar", "error": "no plan",
         "planning_s": 1.0},
        {"part": "simulated", "model": "gpt96", "config": "dgx_h100 x1024: S=8", "source": "pick:meshpar",
         "predicted_step_s": 2.0, "peak_memory_bytes": 7e10, "planning_s": 9.0, "simulated_step_s": 2.1,
         "simulated_peak_memory_bytes": 7e10, "memory_budget_bytes": 8e10},
        {"part": "simulated", "model": "gpt96", "config": "dgx_h100 x1024: S=1", "source": "pick:galvatron",
         "predicted_step_s": 3.0, "peak_memory_bytes": 7e10, "planning_s": 4.0, "simulated_step_s": 2.5,
         "simulated_peak_memory_bytes": 9e10, "memory_budget_bytes": 8e10},
    ]
    text = table(records)
    assert text.count("Spearman ρ predicted vs measured = 1.00") == 2 and "| | 100.0 (best) |" in text
    # Against the best of all shown, jax.jit included, and against the best candidate (the pick here)
    assert "| cpu | gpt | pick:meshpar | a | 10.0 | 110.0 | 2.20x | 1.00x | 0.50 |" in text
    assert "| cpu | gpt | jax.jit | dp |  | 50.0 | 1.00x | 0.45x |  |" in text
    assert "| cpu | ut | final:meshpar | a | 10.0 | 80.0 | 2.00x | 1.00x | 0.50 |" in text
    assert "| cpu | ut | final:jax.jit | dp |  | 40.0 | 1.00x | 0.50x |  |" in text
    assert "| cpu | ut | pick:meshpar |" not in text
    assert "| dgx_h100 x16 | meshpar | no plan | | | | 1.00 |" in text
    assert "| dgx_h100 x1024 | meshpar | S=8 | 2.00 | 2.10 | 70.0 | 9.00 |" in text
    assert "| dgx_h100 x1024 | galvatron | S=1 | 3.00 | 2.50 | 90.0 (over budget) | 4.00 |" in text


def test_table_reports_each_small_models_pick_against_jit_on_one_device():
    records = [{"part": "small", "model": "tiny", "config": "one program [0-7] 1x1 on 1 device", "planning_s": 9.5,
                "warnings": [], "pick_p50_ms": 2.2, "pick_p90_ms": 3.0, "pick_max_ms": 3.5, "jit_p50_ms": 2.0,
                "jit_p90_ms": 2.5, "jit_max_ms": 2.6},
               {"part": "small", "model": "gpt", "config": "S=2 [0-3|4-7] 1x1+1x1 v=1 M=2 1f1b", "planning_s": 20.0,
                "warnings": ["a"], "pick_p50_ms": 12.0, "pick_p90_ms": 14.0, "pick_max_ms": 15.0, "jit_p50_ms": 8.0,
                "jit_p90_ms": 9.0, "jit_max_ms": 9.5}]
    text = table(records)
    assert "| tiny | one program [0-7] 1x1 on 1 device | 9.5 | 0 | 2.20 / 3.00 / 3.50 | 2.00 / 2.50 / 2.60 | 1.10x |" in text
    assert "| gpt | S=2 [0-3|4-7] 1x1+1x1 v=1 M=2 1f1b | 20.0 | 1 | 12.00 / 14.00 / 15.00 | 8.00 / 9.00 / 9.50 | 1.50x |" in text


def test_config_names_devices_meshes_and_stages_per_mesh():
    one = PipelinePlan((StagePlan(0, 8, (2, 1)),), 1, "1f1b", 0.0, (0.0,))
    assert _config(one) == "one program [0-7] 2x1 on 2 devices"
    v = PipelinePlan(tuple(StagePlan(2 * k, 2 * k + 2, (4, 1)) for k in range(4)), 4, "zb_v", 0.0, (0.0, 0.0),
                     stages_per_mesh=2)
    assert _config(v) == "S=4 [0-1|2-3|4-5|6-7] 4x1+4x1 v=2 M=4 zb_v"
