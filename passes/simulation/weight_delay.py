"""Pass: how long each mesh delays its weight-gradient passes (the paper's backward weight delaying).

``weight_delay`` is ``False`` (backwards stay whole), ``True`` (each weight
pass runs after the stage's next compute task) or ``"auto"``: the paper's
"delay the least to cover all communications", chosen with the schedule
simulator (``passes.schedule_simulator``) on the cost model's task
durations. A weight pass nobody waits for can fill the time a stage would
otherwise spend waiting for a cotangent, but held too long it delays the
forwards other stages wait for and keeps its weight state alive.

``"auto"`` first simulates every uniform delay (each stage the same, 0 to
``max_delay``) and starts from the fastest; then, by coordinate descent, for
each stage in turn it simulates the step with every delay from 0 to
``max_delay`` and keeps the fastest, the smaller delay on a tie (it holds
less memory); rounds repeat until no stage changes, at most
``MAX_ROUNDS``. Each kept change makes the step faster or the delays
smaller, so the result is never slower than any uniform delay, no delay
included (up to rounding); like any coordinate descent it can stop at a
local optimum, where only moving several stages' delays at once would help.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from ..compiler_pass import compiler_pass
from ..pipeline.scheduling.pipeline_schedule import ScheduleKind, make_schedule
from .schedule_simulator import TaskDurations, simulate

__all__ = ["WEIGHT_DELAYS", "MAX_ROUNDS", "check_weight_delay", "max_delay", "weight_delays"]

WEIGHT_DELAYS = (False, True, "auto")

MAX_ROUNDS = 6
"""Rounds of the ``"auto"`` search at most: it usually settles within three, and each round
simulates up to ``S * (max_delay + 1)`` schedules."""

# Step times this close (relative) are the same step summed in another order.
_SAME_STEP = 1e-9


def check_weight_delay(weight_delay: object, kind: ScheduleKind) -> None:
    """Raises ``ValueError`` naming ``weight_delay`` when it is unknown or does not fit the
    schedule ``kind`` (registered, or an order loaded from CSV)."""
    if not any(weight_delay is v or (isinstance(v, str) and weight_delay == v) for v in WEIGHT_DELAYS):
        raise ValueError(f"weight_delay: expected False, True or 'auto', got {weight_delay!r}")
    if kind.places_weight_passes and weight_delay is not False:
        raise ValueError(
            f"weight_delay: {kind.name} always splits backwards and places the weight passes itself; "
            f"leave weight_delay=False, got {weight_delay!r}"
        )


def max_delay(num_stages: int, num_micro_batches: int) -> int:
    """The largest delay ``"auto"`` tries: ``2S``, past the deepest warm-up of any schedule
    (eager-1F1B's ``2S - 1`` forwards), and at most ``2M - 1``, which already puts every
    weight pass after all of the stage's ``2M`` forwards and input passes."""
    return min(2 * num_stages, 2 * num_micro_batches - 1)


@compiler_pass
def weight_delays(
    weight_delay: bool | str,
    kind: ScheduleKind,
    num_micro_batches: int,
    edges: Sequence[tuple[int, int]],
    durations: TaskDurations,
    overlap: bool,
    num_meshes: int | None = None,
) -> tuple[int, ...] | None:
    """Per mesh, the compute tasks each weight pass waits after its input pass (``None``: no split).

    Args:
      weight_delay: ``False``, ``True`` or ``"auto"`` (module doc).
      kind, num_micro_batches, edges: the schedule to delay in.
      durations: estimated task durations, one stage each.
      overlap: whether transfers overlap with compute (``simulate``).
      num_meshes: the meshes the stages are placed on (default one stage per mesh).
    """
    if weight_delay is False:
        return None
    P = len(durations.stages) if num_meshes is None else num_meshes
    if weight_delay is True:
        return (1,) * P
    return _search(kind, num_micro_batches, tuple(edges), durations, overlap, P)


def _search(kind: ScheduleKind, num_micro_batches: int, edges: tuple[tuple[int, int], ...], durations: TaskDurations,
            overlap: bool, num_meshes: int) -> tuple[int, ...]:
    S, P = len(durations.stages), num_meshes

    @functools.cache
    def step_seconds(delays: tuple[int, ...]) -> float:
        return simulate(make_schedule(kind, S, num_micro_batches, edges, delays, P), durations,
                        overlap).step_seconds

    # Start from the fastest uniform delay, so the result is never slower than any of them.
    # A mesh runs S / P stages' tasks: the deepest warm-up grows with them.
    limit = max_delay(S, num_micro_batches * (S // P))
    uniform = [(d,) * P for d in range(limit + 1)]
    fastest = min(map(step_seconds, uniform))
    delays = next(c for c in uniform if step_seconds(c) <= fastest * (1 + _SAME_STEP))
    for _ in range(MAX_ROUNDS):
        before = delays
        for s in range(P):
            candidates = [delays[:s] + (d,) + delays[s + 1:] for d in range(limit + 1)]
            fastest = min(map(step_seconds, candidates))
            delays = next(c for c in candidates if step_seconds(c) <= fastest * (1 + _SAME_STEP))
        if delays == before:
            break
    return delays
