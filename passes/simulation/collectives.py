"""What a ring collective costs: the one formula every cost model here prices a collective with.

A ring over ``k`` devices cuts each device's ``x`` bytes into ``k`` chunks and runs ``k - 1``
steps per phase, each device sending one chunk to its neighbour per step, all at once
(Patarasuk and Yuan's bandwidth-optimal all-reduce). Each step costs one message's
``latency`` plus a chunk over the ring's slowest link (``bandwidth`` bytes/s):

    all_gather(x, k) = reduce_scatter(x, k) = (k - 1) · (latency + x / (k · bandwidth))
    all_reduce(x, k) = reduce_scatter + all_gather = 2 (k - 1) · (latency + x / (k · bandwidth))

so an all-reduce moves ``2 (k - 1) / k`` of the bytes through every device; one device
reduces nothing (0 s). The runtime's gradient reduction, meshpar's planner, AMP and ATP price
without ``latency`` (their papers' bandwidth terms: the bytes dominate there);
Galvatron-BMW's cost estimator charges it per step (its §V).

Every argument but ``group_size`` may be a numpy array (broadcast together): the planners
price many layer spans at once.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

__all__ = ["ring_all_gather_s", "ring_all_reduce_s", "ring_reduce_scatter_s"]

# Ring steps per device, per collective: one phase, or a reduce-scatter and an all-gather.
_ONE_PHASE, _TWO_PHASES = 1, 2


def _ring_s(num_bytes: ArrayLike, group_size: int, bandwidth: ArrayLike, latency: ArrayLike,
            phases: int) -> float | np.ndarray:
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)) or group_size < 1:
        raise ValueError(f"group_size: expected at least 1 device, got {group_size}")
    if group_size == 1:
        # One device sends nothing, whatever its (possibly infinite) bandwidth or latency.
        seconds = np.zeros(np.broadcast_shapes(np.shape(num_bytes), np.shape(bandwidth), np.shape(latency)))
    else:
        seconds = phases * (group_size - 1) * (np.asarray(latency, dtype=np.float64)
                                               + np.asarray(num_bytes, dtype=np.float64)
                                               / (group_size * np.asarray(bandwidth, dtype=np.float64)))
    return float(seconds) if seconds.ndim == 0 else seconds


def ring_all_reduce_s(num_bytes: ArrayLike, group_size: int, bandwidth: ArrayLike,
                      latency: ArrayLike = 0.0) -> float | np.ndarray:
    """Seconds of a ring all-reduce of ``num_bytes`` (each device's, >= 0) among ``group_size``
    devices whose slowest link runs at ``bandwidth`` bytes/s: ``2 (k - 1) (latency + bytes /
    (k · bandwidth))`` (module doc); 0 for one device. A float for scalar arguments, else an
    array of their broadcast shape.

    Raises:
      ValueError: ``group_size`` is not an integer of at least 1.
    """
    return _ring_s(num_bytes, group_size, bandwidth, latency, _TWO_PHASES)


def ring_all_gather_s(num_bytes: ArrayLike, group_size: int, bandwidth: ArrayLike,
                      latency: ArrayLike = 0.0) -> float | np.ndarray:
    """Seconds of a ring all-gather whose result is ``num_bytes`` on each device (each holding
    ``1 / group_size`` of it before): ``(k - 1) (latency + bytes / (k · bandwidth))``; 0 for one
    device. Shapes as ``ring_all_reduce_s``.

    Raises:
      ValueError: ``group_size`` is not an integer of at least 1.
    """
    return _ring_s(num_bytes, group_size, bandwidth, latency, _ONE_PHASE)


def ring_reduce_scatter_s(num_bytes: ArrayLike, group_size: int, bandwidth: ArrayLike,
                          latency: ArrayLike = 0.0) -> float | np.ndarray:
    """Seconds of a ring reduce-scatter of ``num_bytes`` on each device (each keeping ``1 /
    group_size`` of the sum): the all-gather's steps run backwards, so its seconds.

    Raises:
      ValueError: ``group_size`` is not an integer of at least 1.
    """
    return _ring_s(num_bytes, group_size, bandwidth, latency, _ONE_PHASE)
