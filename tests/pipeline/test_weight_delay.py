"""Weight delaying: the option's validation, the "auto" delays, and the cost model behind them
(the simulator's own properties are in test_schedule_simulator)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

from meshpar.passes.pipeline.cutting.jaxpr_flops import jaxpr_flops
from meshpar.passes.simulation.cost_model import DEVICE_FLOPS, estimate_durations
from meshpar.passes.program.moves import Direction, EdgeTransfer, TransferKind
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, make_schedule
from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate
from meshpar.passes.pipeline.cutting.stage_graph import Ref, Stage
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.pipeline.cutting.stage_parts import stage_parts
from meshpar.passes.simulation.weight_delay import check_weight_delay, max_delay, weight_delays


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_check_weight_delay_accepts_the_three_values(name):
    for value in (False, True, "auto"):
        if SCHEDULES[name].places_weight_passes and value is not False:
            with pytest.raises(ValueError, match=f"^weight_delay:.*{name}.*places the weight passes itself"):
                check_weight_delay(value, SCHEDULES[name])
        else:
            check_weight_delay(value, SCHEDULES[name])


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("value", [1, 0, "yes", None, "AUTO", 1.0])
def test_check_weight_delay_rejects_other_values(name, value):
    with pytest.raises(ValueError, match="^weight_delay:") as info:
        check_weight_delay(value, SCHEDULES[name])
    assert repr(value) in str(info.value)


def _durations(S, f=1.0, i=1.0, w=1.0, transfer=0.0):
    return TaskDurations((StageSeconds(f, i + w, i, w),) * S, (transfer,) * (S - 1), (transfer,) * (S - 1))


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def test_false_and_true():
    assert weight_delays(False, SCHEDULES["1f1b"], 4, _chain(2), _durations(2), True) is None
    assert weight_delays(True, SCHEDULES["gpipe"], 4, _chain(3), _durations(3), False) == (1, 1, 1)


@pytest.mark.parametrize("S, M, expected", [(1, 1, 1), (1, 4, 2), (3, 2, 3), (3, 8, 6), (4, 100, 8)])
def test_max_delay_is_2s_capped_where_every_weight_pass_is_already_last(S, M, expected):
    assert max_delay(S, M) == expected


def _step(name, M, durations, delays):
    S = len(durations.stages)
    return simulate(make_schedule(name, S, M, _chain(S), delays), durations).step_seconds


def test_auto_picks_the_delays_the_simulator_finds_fastest():
    """Eager-1F1B, S = 3, M = 6, f = i = w = 1, transfers of 1: the last stage's weight passes
    waiting 4 tasks let its input passes, which the others wait for, run first."""
    durations = _durations(3, transfer=1.0)
    auto = weight_delays("auto", SCHEDULES["eager_1f1b"], 6, _chain(3), durations, True)
    assert auto == (0, 0, 4)
    assert [_step("eager_1f1b", 6, durations, d) for d in (auto, (0, 0, 0), (1, 1, 1), None)] == [24, 26, 27, 28]
    assert weight_delays("auto", SCHEDULES["eager_1f1b"], 6, _chain(3), durations, True) == auto  # deterministic


def test_auto_with_transfers_longer_than_compute_splits_without_delaying():
    """1F1B with transfers of 5 (f = i = w = 1): sending cotangents after the input pass is what
    helps; a delayed weight pass only holds up the forwards behind it."""
    durations = _durations(3, transfer=5.0)
    assert weight_delays("auto", SCHEDULES["1f1b"], 6, _chain(3), durations, True) == (0, 0, 0)
    assert [_step("1f1b", 6, durations, d) for d in ((0, 0, 0), (1, 1, 1), None)] == [69, 70, 74]


def test_auto_with_one_stage_does_not_delay():
    """Nothing waits on a lone stage: every delay takes as long, and the smallest wins."""
    assert weight_delays("auto", SCHEDULES["1f1b"], 4, [], _durations(1), True) == (0,)


def test_auto_prefers_the_smaller_delay_on_a_tie():
    """GPipe with no transfer time, uniform stages: the last stage's weight passes take as long
    at any delay (they wait for nothing), stage 1's at 0 or 1; the smaller, holding less, wins."""
    S, M = 3, 4
    durations = _durations(S)
    assert {_step("gpipe", M, durations, (0, 0, d)) for d in range(max_delay(S, M) + 1)} == {16}
    assert _step("gpipe", M, durations, (0, 1, 0)) == _step("gpipe", M, durations, (0, 0, 0)) == 16
    assert weight_delays("auto", SCHEDULES["gpipe"], M, _chain(S), durations, True) == (0, 0, 0)


def test_estimate_durations_from_flops_and_bytes():
    """Compute: a stage's FLOPs over its mesh's devices; transfers: an edge's bytes per direction
    over the intra-host bandwidth for jax.device_put, the inter-host one otherwise."""
    x, w = jnp.ones((4, 8)), jnp.ones((8, 8))
    stage = Stage(1, jax.make_jaxpr(lambda x, w: (jnp.tanh(x @ w),))(x, w), (Ref(RefKind.ACT, 0, 0), Ref(RefKind.PARAM, 0)),
                  (Ref(RefKind.ACT, 1, 0),))
    parts = stage_parts(stage)
    devices = np.array(jax.devices()[:4])
    meshes = [Mesh(devices[:2].reshape(2, 1), ("data", "model")), Mesh(devices[2:].reshape(2, 1), ("data", "model"))]

    def move(edge, direction, kind, shape):
        return EdgeTransfer(edge, direction, 0, 1, 0, shape, np.dtype(np.float32), None, None, kind)

    transfers = [
        move(0, Direction.ACTIVATION, TransferKind.DEVICE_PUT, (4, 8)),
        move(0, Direction.COTANGENT, TransferKind.P2P, (4, 8)),
        move(1, Direction.COTANGENT, TransferKind.COLLECTIVE, (2,)),
    ]
    durations = estimate_durations([dataclasses.replace(parts, stage=s) for s in range(2)], meshes, transfers,
                                   num_edges=2, inter_host_bandwidth=1e3, intra_host_bandwidth=1e5)
    flops = DEVICE_FLOPS[jax.devices()[0].platform] * 2
    assert durations.stages[0] == durations.stages[1] == StageSeconds(
        jaxpr_flops(parts.forward) / flops, jaxpr_flops(parts.backward) / flops,
        jaxpr_flops(parts.backward_input) / flops, jaxpr_flops(parts.backward_weight) / flops)
    assert durations.activation == (128 / 1e5, 0.0)
    assert durations.gradient == (128 / 1e3, 8 / 1e3)


def test_matmul_flops():
    m, k, n = 3, 5, 7
    a, b = jnp.ones((m, k)), jnp.ones((k, n))
    assert jaxpr_flops(jax.make_jaxpr(lambda a, b: a @ b)(a, b)) == 2 * m * k * n
    assert jaxpr_flops(jax.make_jaxpr(lambda a, b: jnp.tanh(a @ b))(a, b)) == 2 * m * k * n + m * n


def test_batched_matmul_flops():
    a, b = jnp.ones((4, 3, 5)), jnp.ones((4, 5, 2))
    assert jaxpr_flops(jax.make_jaxpr(jnp.matmul)(a, b)) == 4 * 2 * 3 * 5 * 2


@pytest.mark.parametrize("length", [1, 4, 9])
def test_scan_counts_its_body_length_times(length):
    n = 6
    w = jnp.ones((n, n))

    def body(x, _):
        return jnp.tanh(x @ w), None

    def run(x):
        return lax.scan(body, x, None, length=length)[0]

    one_step = 2 * n * n * n + n * n
    closed = jax.make_jaxpr(run)(jnp.ones((n, n)))
    assert jaxpr_flops(closed) == length * one_step
    assert jaxpr_flops(closed.jaxpr) == length * one_step  # a bare Jaxpr as well


def test_jit_nested_body_counted_once():
    a, w = jnp.ones((2, 3)), jnp.ones((3, 2))
    inner = jax.jit(lambda x, w: jnp.tanh(x @ w))
    assert jaxpr_flops(jax.make_jaxpr(lambda x, w: inner(x, w) + 1.0)(a, w)) == 2 * 2 * 3 * 2 + 4 + 4
