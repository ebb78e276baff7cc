"""Pass: choose which stage markers cut, when a model has more of them than a stage count needs.

Every ``mark_stage_boundary()`` is a candidate cut. Asked for ``num_stages`` stages of a loss
with more than ``num_stages - 1`` top-level markers (and no ``cut_points``), the compiler groups
the segments between consecutive markers into ``num_stages`` contiguous stages, balanced by its
cost estimate: each segment's forward FLOPs (``jaxpr_flops.eqn_flops``, as ``layer_clustering``
costs layers) times three for forward plus backward (a backward does twice a forward's work, as
the planner prices it). The grouping minimises the largest stage's cost (the linear partition
problem, solved exactly by dynamic programming over prefix sums); among the groupings that
reach that minimum it takes the one with the least sum of squared stage costs, so the stages
other than the bottleneck are balanced too. The chosen markers are the ``cut_points`` that
``split_stages`` takes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ...compiler_pass import compiler_pass
from ... import jax_ir
from ...verification import PlanVerificationError
from ..step_primitives import stage_boundary_p
from .jaxpr_flops import eqn_flops
from .stage_graph import MarkerGrouping, count_markers, user_location

__all__ = ["FORWARD_BACKWARD", "balanced_partition", "group_markers", "segment_flops", "verify_marker_grouping"]

# A segment's forward plus backward FLOPs per forward FLOP: the backward of a matmul is two
# matmuls of its size (the input's and the weight's gradients).
FORWARD_BACKWARD = 3.0


def segment_flops(loss_jaxpr: jax_ir.ClosedJaxpr) -> np.ndarray:
    """Per segment between ``loss_jaxpr``'s top-level stage markers (``count_markers + 1`` of
    them), the forward FLOPs of its equations (``eqn_flops``)."""
    flops = [0.0]
    for eqn in loss_jaxpr.jaxpr.eqns:
        if eqn.primitive is stage_boundary_p:
            flops.append(0.0)
        else:
            flops[-1] += eqn_flops(eqn)
    return np.array(flops)


def _best_partition(part_cost: np.ndarray, num_parts: int,
                    combine: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> tuple[float, list[int]]:
    """The least total, under ``combine`` (``np.maximum`` or ``np.add``), of ``num_parts``
    contiguous non-empty parts covering items ``0..n-1``, where ``part_cost[i, j]`` is the cost
    of a part of items ``i..j-1`` (``inf`` where not allowed, and for ``j <= i``); with the
    items each later part starts at."""
    n = part_cost.shape[0] - 1
    # best[j]: the least total of the parts so far covering items 0..j-1.
    best = part_cost[0].copy()
    back = []
    for _ in range(num_parts - 1):
        total = combine(best[:, None], part_cost)
        at = np.argmin(total, axis=0)
        best = total[at, np.arange(n + 1)]
        back.append(at)
    starts, j = [], n
    for at in reversed(back):
        j = int(at[j])
        starts.append(j)
    return float(best[n]), sorted(starts)


def balanced_partition(costs: Sequence[float], num_parts: int) -> tuple[int, ...]:
    """The ``num_parts - 1`` increasing cut points ``c`` (a part ends after item ``c``) that group
    ``costs`` into ``num_parts`` contiguous non-empty parts minimising the largest part's sum;
    among those, the least sum of squared part sums.

    Raises:
      ValueError: ``num_parts`` not in ``1..len(costs)``, or a negative cost.
    """
    costs = np.asarray(costs, dtype=np.float64)
    n = len(costs)
    if not 1 <= num_parts <= n:
        raise ValueError(f"num_parts: expected 1 to {n} (the items), got {num_parts!r}")
    if np.any(costs < 0):
        raise ValueError(f"costs: expected non-negative costs, got {costs.tolist()}")
    prefix = np.concatenate([[0.0], np.cumsum(costs)])
    span = prefix[None, :] - prefix[:, None]  # span[i, j]: sum of items i..j-1
    nonempty = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)
    largest, _ = _best_partition(np.where(nonempty, span, np.inf), num_parts, np.maximum)
    # ``largest`` is one of the ``span`` entries, computed alike: ``<=`` admits its parts exactly.
    allowed = nonempty & (span <= largest)
    _, starts = _best_partition(np.where(allowed, span ** 2, np.inf), num_parts, np.add)
    return tuple(s - 1 for s in starts)


@compiler_pass
def group_markers(loss_jaxpr: jax_ir.ClosedJaxpr, num_stages: int | None) -> MarkerGrouping | None:
    """Which of ``loss_jaxpr``'s top-level stage markers cut it into ``num_stages`` stages of
    balanced cost (module doc). ``None`` where there is nothing to choose: no stage count asked
    for, or at most ``num_stages - 1`` markers (every marker cuts; too few for the stages is the
    stage-count check's error)."""
    num_markers = count_markers(loss_jaxpr)
    if num_stages is None or num_markers <= num_stages - 1:
        return None
    costs = FORWARD_BACKWARD * segment_flops(loss_jaxpr)
    locations = tuple(user_location(e) for e in loss_jaxpr.jaxpr.eqns if e.primitive is stage_boundary_p)
    return MarkerGrouping(balanced_partition(costs, num_stages), locations, tuple(map(float, costs)))


def verify_marker_grouping(grouping: MarkerGrouping | None, loss_jaxpr: jax_ir.ClosedJaxpr,
                           num_stages: int | None) -> None:
    """``grouping`` is ``group_markers``' for ``loss_jaxpr`` and ``num_stages``: ``None`` only where
    there was nothing to choose; else ``num_stages - 1`` increasing cut points among the loss's
    markers, a location per marker and a non-negative cost per segment.

    Raises:
      AssertionError subclass ``PlanVerificationError`` on a broken invariant.
    """
    num_markers = count_markers(loss_jaxpr)
    if grouping is None:
        if num_stages is not None and num_markers > num_stages - 1:
            raise PlanVerificationError(f"{num_markers} stage markers for {num_stages} stages, but none chosen")
        return
    cuts = list(grouping.cut_points)
    if num_stages is None or len(cuts) != num_stages - 1:
        raise PlanVerificationError(f"cut points {cuts} for num_stages={num_stages}")
    if cuts != sorted(set(cuts)) or not all(0 <= c < num_markers for c in cuts):
        raise PlanVerificationError(f"cut points {cuts} are not increasing markers in [0, {num_markers})")
    if len(grouping.locations) != num_markers or len(grouping.segment_costs) != num_markers + 1:
        raise PlanVerificationError(f"{len(grouping.locations)} locations and {len(grouping.segment_costs)} segment "
                                    f"costs for {num_markers} markers")
    if any(not c >= 0 for c in grouping.segment_costs):
        raise PlanVerificationError(f"segment costs {list(grouping.segment_costs)} are not all non-negative")
