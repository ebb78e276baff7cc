"""Timing a train step the way every step benchmark here does: untimed steps first (compiles,
layouts settling), then each timed step from its call to its outputs being ready."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["spread_ms", "time_steps"]


def time_steps(step: Callable[[Any, Any], tuple[Any, Any]], state: Any, batch: Any, steps: int,
               untimed: int = 1) -> list[float]:
    """Seconds of each of ``steps`` calls ``state, loss = step(state, batch)`` after ``untimed``
    ones, each to its outputs being ready."""
    import jax

    for _ in range(untimed):
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - start)
    return times


def spread_ms(times: list[float]) -> dict[str, float]:
    """p50, p90 and max of ``times`` (seconds), in ms."""
    return {"p50_ms": 1e3 * float(np.median(times)), "p90_ms": 1e3 * float(np.percentile(times, 90)),
            "max_ms": 1e3 * max(times)}
