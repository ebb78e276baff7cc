"""Automatic layers for a loss without stage markers (Alpa's layer construction, OSDI 2022 §5.2).

The loss's top-level equations are cut into ``num_layers`` contiguous layers whose FLOPs are
balanced, at the points where the fewest bytes are live: among cuts whose every layer has at
most ``(1 + eps)`` times the average FLOPs, the ones minimising the bytes crossing all cuts
(values computed before a cut and read after it). ``eps`` starts at Alpa's 0.1 and doubles
until such cuts exist. The cuts become ordinary stage markers, so every later pass (stage
splitting, profiling, planning) treats them as if the user had written them.
"""

from __future__ import annotations

import math

import numpy as np
from jax._src import core, source_info_util

from ..simulation.cost_model import _eqn_flops
from .step_primitives import stage_boundary_p

__all__ = ["cut_positions", "insert_layer_markers", "max_layers"]


def _bytes(aval: core.AbstractValue) -> float:
    return float(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _live_bytes(jaxpr: core.Jaxpr) -> np.ndarray:
    """``live[p]``: bytes of values computed by equations before ``p`` and read at or after it
    (by an equation or as an output), for ``p`` in ``0..len(eqns)``."""
    n = len(jaxpr.eqns)
    last_use: dict[core.Var, int] = {}
    for p, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, core.Var):
                last_use[v] = p
    for v in jaxpr.outvars:
        if isinstance(v, core.Var):
            last_use[v] = n
    delta = np.zeros(n + 2)
    for p, eqn in enumerate(jaxpr.eqns):
        for v in eqn.outvars:
            if v in last_use and last_use[v] > p:
                # live over cut points p + 1 .. last_use
                delta[p + 1] += _bytes(v.aval)
                delta[last_use[v] + 1] -= _bytes(v.aval)
    return np.cumsum(delta)[:n + 1]


def cut_positions(flops: np.ndarray, live: np.ndarray, num_layers: int, eps: float = 0.1) -> list[int]:
    """Cut points ``0 < p_1 < ... < p_{L-1} < n`` (a cut at ``p`` ends a layer before equation
    ``p``) minimising ``sum(live[p_k])`` with every layer's FLOPs at most ``(1 + eps)`` times
    the average, ``eps`` doubling until cuts exist. ``flops``: per equation; ``live``: per cut
    point ``0..n`` (``_live_bytes``).

    Raises:
      ValueError: fewer equations with FLOPs than ``num_layers``.
    """
    n, L = len(flops), num_layers
    if L < 1 or int(np.count_nonzero(flops)) < L:
        raise ValueError(f"num_layers: expected 1 to {int(np.count_nonzero(flops))} (the loss's equations with "
                         f"FLOPs), got {num_layers!r}")
    prefix = np.concatenate([[0.0], np.cumsum(flops)])
    span = prefix[None, :] - prefix[:, None]  # span[i, j]: FLOPs of equations i..j-1
    while True:
        cap = (1.0 + eps) * prefix[-1] / L
        allowed = (span <= cap) & (span > 0)
        # best[j]: least cut bytes of layers covering equations 0..j-1, a cut at j counted
        best = np.where(allowed[0], live, math.inf)
        back = []
        for _ in range(L - 1):
            total = np.where(allowed, best[:, None], math.inf)
            at = np.argmin(total, axis=0)
            best = total[at, np.arange(n + 1)] + live
            back.append(at)
        # the last layer ends at n, which is no cut
        if math.isfinite(best[n] - live[n]):
            break
        eps *= 2.0
    cuts, j = [], n
    for at in reversed(back):
        j = int(at[j])
        cuts.append(j)
    return sorted(cuts)


def max_layers(loss_jaxpr: core.ClosedJaxpr) -> int:
    """The most layers ``loss_jaxpr`` can be cut into: its top-level equations with FLOPs."""
    return sum(1 for e in loss_jaxpr.jaxpr.eqns if _eqn_flops(e) > 0)


def insert_layer_markers(loss_jaxpr: core.ClosedJaxpr, num_layers: int) -> core.ClosedJaxpr:
    """``loss_jaxpr`` with a stage marker at each of ``cut_positions``: ``num_layers`` layers.

    Raises:
      ValueError: the loss already has markers (the user's cut points stand), or has fewer
        equations with FLOPs than ``num_layers``.
    """
    jaxpr = loss_jaxpr.jaxpr
    if any(e.primitive is stage_boundary_p for e in jaxpr.eqns):
        raise ValueError("num_layers: the loss has stage markers; automatic layers are for losses without them")
    if num_layers == 1:
        return loss_jaxpr
    flops = np.array([_eqn_flops(e) for e in jaxpr.eqns])
    cuts = set(cut_positions(flops, _live_bytes(jaxpr), num_layers))
    marker_effects = stage_boundary_p.abstract_eval()[1]
    eqns = []
    for p, eqn in enumerate(jaxpr.eqns):
        if p in cuts:
            eqns.append(core.new_jaxpr_eqn([], [], stage_boundary_p, {}, marker_effects,
                                           source_info_util.new_source_info()))
        eqns.append(eqn)
    marked = jaxpr.replace(eqns=eqns, effects=jaxpr.effects | marker_effects)
    return core.ClosedJaxpr(marked, loss_jaxpr.consts)
