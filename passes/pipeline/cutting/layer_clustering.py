"""Automatic layers for a loss without stage markers (Alpa's layer construction, OSDI 2022 §5.2).

The loss's top-level equations are cut into ``num_layers`` contiguous layers whose FLOPs are
balanced, at the points where the fewest bytes are live: among cuts whose every layer has at
most ``(1 + eps)`` times the average FLOPs, the ones minimising the bytes crossing all cuts
(values computed before a cut and read after it). ``eps`` starts at Alpa's 0.1 and doubles
until such cuts exist. The cuts become ordinary stage markers, so every later pass (stage
splitting, profiling, planning) treats them as if the user had written them.

Each iteration of a scan over layers (``split_scans.layer_scans``) counts as an equation of its
own, with its body's FLOPs: the loss is costed as if such scans were unrolled, and a cut that
falls between two iterations splits the scan there (``split_scans.split_layer_scans``), so a
stack of blocks in one ``nn.scan`` is cut like blocks written one by one. ``even_layer_markers``
is the rule for a stage count without markers: the scanned iterations, all layer scans' in
program order, in runs of equal length.
"""

from __future__ import annotations

import math

import numpy as np
from jax.extend.core.primitives import scan_p

from ...compiler_pass import compiler_pass
from ... import jax_ir
from .jaxpr_flops import eqn_flops
from .split_scans import Provenance, layer_scans, split_layer_scans
from ..step_primitives import stage_boundary_p

__all__ = ["cut_positions", "even_layer_markers", "insert_layer_markers", "max_layers"]


def _bytes(aval: jax_ir.AbstractValue) -> float:
    return float(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def _live_bytes(jaxpr: jax_ir.Jaxpr) -> np.ndarray:
    """``live[p]``: bytes of values computed by equations before ``p`` and read at or after it
    (by an equation or as an output), for ``p`` in ``0..len(eqns)``."""
    n = len(jaxpr.eqns)
    last_use: dict[jax_ir.Var, int] = {}
    for p, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if isinstance(v, jax_ir.Var):
                last_use[v] = p
    for v in jaxpr.outvars:
        if isinstance(v, jax_ir.Var):
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


def _unrolled(loss_jaxpr: jax_ir.ClosedJaxpr, num_params: int) -> tuple[jax_ir.ClosedJaxpr, tuple[Provenance, ...]]:
    """``loss_jaxpr`` with every layer scan split at every iteration (no markers)."""
    scans = layer_scans(loss_jaxpr, num_params)
    return split_layer_scans(loss_jaxpr, {s.index: range(1, s.length) for s in scans}, marked=False)


def _unrolled_flops(jaxpr: jax_ir.Jaxpr, provenance: tuple[Provenance, ...]) -> np.ndarray:
    """Per equation of an unrolled loss, its FLOPs; none for the slices and concatenations the
    unrolling added (they move data the scan indexed in place)."""
    return np.array([0.0 if at.tail or (at.boundary is not None and e.primitive is not scan_p) else eqn_flops(e)
                     for e, at in zip(jaxpr.eqns, provenance)])


def max_layers(loss_jaxpr: jax_ir.ClosedJaxpr, num_params: int) -> int:
    """The most layers ``loss_jaxpr`` (whose first ``num_params`` inputs are parameters) can be
    cut into: its top-level equations with FLOPs, each iteration of a layer scan counted."""
    unrolled, provenance = _unrolled(loss_jaxpr, num_params)
    return int(np.count_nonzero(_unrolled_flops(unrolled.jaxpr, provenance)))


def _check_unmarked(loss_jaxpr: jax_ir.ClosedJaxpr, argument: str) -> None:
    if any(e.primitive is stage_boundary_p for e in loss_jaxpr.jaxpr.eqns):
        raise ValueError(f"{argument}: the loss has stage markers; automatic layers are for losses without them")


@compiler_pass
def insert_layer_markers(loss_jaxpr: jax_ir.ClosedJaxpr, num_layers: int, num_params: int,
                         keep: tuple[int, ...] | None = None) -> jax_ir.ClosedJaxpr:
    """``loss_jaxpr`` cut into ``num_layers`` layers at ``cut_positions`` of its unrolled form:
    a stage marker at each cut, a layer scan split where a cut falls between its iterations.
    With ``keep`` only those cuts (numbered from 0) are made: layers grouped into stages, each
    split scan cut only where a stage ends.

    Raises:
      ValueError: the loss already has markers (the user's cut points stand), or has fewer
        equations with FLOPs (scanned iterations counted) than ``num_layers``.
    """
    _check_unmarked(loss_jaxpr, "num_layers")
    if num_layers == 1:
        return loss_jaxpr
    unrolled, provenance = _unrolled(loss_jaxpr, num_params)
    jaxpr = unrolled.jaxpr
    flops = _unrolled_flops(jaxpr, provenance)
    live = _live_bytes(jaxpr)
    # A piece's slices belong with its scan, a split scan's outputs with its last piece: no cut
    # inside either.
    for p in range(1, len(jaxpr.eqns)):
        before, at = provenance[p - 1], provenance[p]
        if at.index == before.index and (at.tail or at.boundary == before.boundary):
            live[p] = math.inf
    cuts = cut_positions(flops, live, num_layers)
    if keep is not None:
        if any(not 0 <= c < len(cuts) for c in keep):
            raise ValueError(f"cut_points: {list(keep)} name cuts outside the {len(cuts)} of auto_layers={num_layers}")
        cuts = [cuts[c] for c in keep]
    return _mark(loss_jaxpr, [provenance[p] for p in cuts])


def _mark(loss_jaxpr: jax_ir.ClosedJaxpr, before: list[Provenance]) -> jax_ir.ClosedJaxpr:
    """``loss_jaxpr`` with a stage marker before each of ``before`` (equations of its unrolled
    form): between two iterations of a layer scan, the scan is split there."""
    n = len(loss_jaxpr.jaxpr.eqns)
    scan_cuts: dict[int, list[int]] = {}
    markers: set[int] = set()
    for at in before:
        if at.tail:
            markers.add(at.index + 1)
        elif at.boundary is None or at.boundary in (0, loss_jaxpr.jaxpr.eqns[at.index].params["length"]):
            markers.add(at.index)
        else:
            scan_cuts.setdefault(at.index, []).append(at.boundary)
    if n in markers:
        raise ValueError("num_layers: a cut fell after the loss's last equation")
    marked, _ = split_layer_scans(loss_jaxpr, {k: sorted(c) for k, c in scan_cuts.items()}, marked=True,
                                  markers_before=frozenset(markers))
    return marked


@compiler_pass
def even_layer_markers(loss_jaxpr: jax_ir.ClosedJaxpr, num_stages: int, num_params: int) -> jax_ir.ClosedJaxpr | None:
    """``loss_jaxpr`` (without markers) cut into ``num_stages`` stages of equally many scanned
    iterations (``stage_ends``' rule: the earlier stages take one more where the count does not
    divide): the iterations of all its layer scans in program order; equations before the first
    scan run in the first stage, after the last in the last, between two scans in the stage of
    the iterations before them. ``None``: the loss has no layer scan.

    Raises:
      ValueError: fewer scanned iterations than ``num_stages``.
    """
    _check_unmarked(loss_jaxpr, "num_stages")
    scans = layer_scans(loss_jaxpr, num_params)
    if not scans:
        return None
    total = sum(s.length for s in scans)
    if num_stages > total:
        raise ValueError(f"num_stages: {num_stages} stages asked for, but the loss's layer scans have "
                         f"{total} iterations in all; a stage needs at least one: pass num_stages={total} or "
                         f"fewer (or scan over more, smaller layers)")
    base, extra = divmod(total, num_stages)
    ends = np.cumsum([base + (1 if s < extra else 0) for s in range(num_stages - 1)])
    starts = np.cumsum([0, *[s.length for s in scans]])
    before = []
    for end in ends:
        k = int(np.searchsorted(starts, end, side="left"))
        if starts[k] == end:
            # The cut falls between two scans: right after the earlier one.
            before.append(Provenance(scans[k - 1].index, tail=True))
        else:
            scan = scans[k - 1]
            local = int(end - starts[k - 1])
            reverse = loss_jaxpr.jaxpr.eqns[scan.index].params["reverse"]
            before.append(Provenance(scan.index, boundary=scan.length - local if reverse else local))
    return _mark(loss_jaxpr, before)
