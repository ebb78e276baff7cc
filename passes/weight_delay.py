"""Pass: how long each stage delays its weight-gradient passes (the paper's backward weight delaying).

``weight_delay`` is ``False`` (backwards stay whole), ``True`` (each weight
pass runs after the stage's next compute task) or ``"auto"``: the paper's
"delay the least to cover all communications" with a simple per-stage
estimate. After its input pass for micro-batch ``m``, stage ``s`` waits for
a round trip before its next input pass can start: its activation goes to
the next stage and that stage's cotangent comes back. ``"auto"`` delays
each weight pass past the least number of the stage's compute tasks whose
estimated time covers that round trip, so the weight pass fills the wait
instead of holding up the forwards other stages wait for; a stage with no
round trip (the last) does not delay.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["WEIGHT_DELAYS", "check_weight_delay", "weight_delays"]

WEIGHT_DELAYS = (False, True, "auto")


def check_weight_delay(weight_delay: object, schedule: str) -> None:
    """Raises ``ValueError`` naming ``weight_delay`` when it is unknown or does not fit ``schedule``."""
    if not any(weight_delay is v or (isinstance(v, str) and weight_delay == v) for v in WEIGHT_DELAYS):
        raise ValueError(f"weight_delay: expected False, True or 'auto', got {weight_delay!r}")
    if schedule == "zb_h1" and weight_delay is not False:
        raise ValueError(
            "weight_delay: zb_h1 always splits backwards and places the weight passes itself "
            f"(stage s holds back s of them); leave weight_delay=False, got {weight_delay!r}"
        )


def weight_delays(
    weight_delay: bool | str,
    forward_seconds: Sequence[float],
    input_seconds: Sequence[float],
    round_trip_seconds: Sequence[float],
) -> tuple[int, ...] | None:
    """Per stage, the compute tasks each weight pass waits after its input pass (``None``: no split).

    Args:
      forward_seconds, input_seconds: per stage, estimated forward and
        input-pass (activation gradient) time of one micro-batch.
      round_trip_seconds: per stage, the estimated time of its longest
        activation-out, cotangent-back transfer pair (0 for the last stage).
    """
    if weight_delay is False:
        return None
    if weight_delay is True:
        return (1,) * len(forward_seconds)
    delays = []
    for f, i, r in zip(forward_seconds, input_seconds, round_trip_seconds):
        slot = (f + i) / 2
        delays.append(0 if r <= 0 else max(1, math.ceil(r / slot)) if slot > 0 else 1)
    return tuple(delays)
