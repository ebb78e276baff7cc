"""Weight delaying: the option's validation, the "auto" delays, and the FLOP estimate behind them."""

import random
from fractions import Fraction

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from meshpar.passes.cost_model import jaxpr_flops
from meshpar.passes.pipeline_schedule import SCHEDULES
from meshpar.passes.weight_delay import check_weight_delay, weight_delays


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_check_weight_delay_accepts_the_three_values(name):
    for value in (False, True, "auto"):
        if name == "zb_h1" and value is not False:
            with pytest.raises(ValueError, match="^weight_delay:.*zb_h1.*places the weight passes itself"):
                check_weight_delay(value, name)
        else:
            check_weight_delay(value, name)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
@pytest.mark.parametrize("value", [1, 0, "yes", None, "AUTO", 1.0])
def test_check_weight_delay_rejects_other_values(name, value):
    with pytest.raises(ValueError, match="^weight_delay:") as info:
        check_weight_delay(value, name)
    assert repr(value) in str(info.value)


def test_false_and_true():
    assert weight_delays(False, [1.0, 2.0], [1.0, 2.0], [3.0, 0.0]) is None
    assert weight_delays(True, [1.0, 2.0, 3.0], [1.0, 1.0, 1.0], [9.0, 9.0, 0.0]) == (1, 1, 1)


def _least_delay(f, i, r):
    """Brute force, in exact arithmetic: 0 without a round trip, else the least d >= 1 covering it."""
    f, i, r = map(Fraction, (f, i, r))
    if r <= 0:
        return 0
    d = 1
    while d * (f + i) / 2 < r:
        d += 1
    return d


def test_auto_is_the_least_delay_covering_the_round_trip():
    rng = random.Random(0)
    for _ in range(300):
        S = rng.randint(1, 5)
        # Multiples of 1/8: exact in binary, so float and exact arithmetic agree.
        f = [rng.randint(1, 40) / 8 for _ in range(S)]
        i = [rng.randint(1, 40) / 8 for _ in range(S)]
        r = [rng.choice([0, rng.randint(1, 200) / 8]) for _ in range(S - 1)] + [0.0]
        assert weight_delays("auto", f, i, r) == tuple(map(_least_delay, f, i, r))


def test_auto_exact_boundaries():
    # (1 + 1) / 2 = 1 per compute task: a round trip of exactly d needs d, a hair more needs d + 1.
    assert weight_delays("auto", [1.0] * 4, [1.0] * 4, [0.0, 0.5, 1.0, 3.0]) == (0, 1, 1, 3)
    assert weight_delays("auto", [1.0], [1.0], [3.0000001]) == (4,)
    assert weight_delays("auto", [3.0], [1.0], [0.0]) == (0,)  # the last stage never delays


def test_auto_is_monotone_in_the_round_trip():
    rng = random.Random(1)
    for _ in range(50):
        f, i = rng.uniform(0.1, 3), rng.uniform(0.1, 3)
        trips = sorted(rng.uniform(0, 30) for _ in range(40))
        delays = [weight_delays("auto", [f], [i], [r])[0] for r in trips]
        assert delays == sorted(delays)
        assert all(d >= 1 for d, r in zip(delays, trips) if r > 0)


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
