"""``benchmarks.host_overhead``: the jit_accum baseline computes what the pipelined step does,
launches are counted from the program, and the fitted line goes through its points."""

import jax
import numpy as np
import pytest

from benchmarks import host_overhead
from examples.gpt import gpt_loss
from examples.train_step import supervised_step


def test_jit_accum_equals_the_step_on_the_whole_batch():
    _, batch, state = host_overhead._model("tiny")
    whole_state, whole_loss = jax.jit(supervised_step(gpt_loss))(state, batch)
    accum_state, accum_loss = host_overhead._jit_accum(4)(state, batch)
    np.testing.assert_allclose(float(accum_loss), float(whole_loss), rtol=1e-5)
    # Adam's first moments, linear in the gradients: its first update is about lr * sign(g), so
    # a gradient near zero flips it on rounding (seen on JAX 0.12) and the parameters say less.
    mu, whole_mu = accum_state.opt_state[0].mu, whole_state.opt_state[0].mu
    for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(whole_mu)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-8)


@pytest.mark.slow
def test_a_run_counts_launches_per_micro_batch_and_fits_each_layout():
    result = host_overhead.run(["tiny"], ["one_mesh_zb_v"], [2, 4], steps=2, rounds=2)
    rows = {(r["layout"], r["num_micro_batches"]): r for r in result["rows"]}
    layouts = ("jit_accum", "one_mesh_zb_v")
    assert set(rows) == {(layout, m) for layout in layouts for m in (2, 4)}
    assert all(r["steps"] == 2 and r["p50_ms"] <= r["p90_ms"] <= r["max_ms"] for r in rows.values())
    fits = {f["layout"]: f for f in result["fits"]}
    for layout, f in fits.items():
        # Two points: the line goes through both.
        p2, p4 = rows[(layout, 2)]["p50_ms"], rows[(layout, 4)]["p50_ms"]
        line = [f["fixed_ms"] + m * f["per_micro_batch_ms"] for m in (2, 4)]
        np.testing.assert_allclose(line, [p2, p4], rtol=1e-6, atol=1e-6)
    assert "launches_per_micro_batch" not in fits["jit_accum"]
    # ZB-V on two stages: a forward, an input and a weight pass of each stage per micro-batch.
    assert fits["one_mesh_zb_v"]["launches_per_micro_batch"] == 6
    assert "| tiny | one_mesh_zb_v | 4 |" in host_overhead.markdown(result)
