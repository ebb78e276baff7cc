"""Pipeline schedules as pure task lists: order, warm-up depth and in-flight micro-batches."""

import pytest

from meshpar.passes.pipeline_schedule import SCHEDULES, make_schedule


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _u_shape(S):
    """Adjacent stages plus the U-Transformer's long skips: stage i feeds stage S-1-i."""
    return _chain(S) + [(i, S - 1 - i) for i in range(S // 2) if S - 1 - i > i + 1]


def _per_stage(schedule, s):
    return [t for t in schedule.order if t.kind in ("forward", "backward") and t.where == s]


def _forwards_before_first_backward(seq):
    return next(k for k, t in enumerate(seq) if t.kind == "backward")


def _peak_in_flight(seq):
    live = peak = 0
    for t in seq:
        live += 1 if t.kind == "forward" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("edges_of", [_chain, _u_shape])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_warm_up_depth_and_in_flight_bound(name, S, M, edges_of):
    schedule = make_schedule(name, S, M, edges_of(S))  # runs verify_schedule
    for s in range(S):
        seq = _per_stage(schedule, s)
        ahead = {"gpipe": M, "1f1b": min(M, S - s), "eager_1f1b": min(M, 2 * (S - s) - 1)}[name]
        assert _forwards_before_first_backward(seq) == ahead
        assert _peak_in_flight(seq) == ahead
        # Paper Table 1: eager-1F1B keeps at most S more micro-batches alive than 1F1B.
        if name == "eager_1f1b":
            assert ahead <= min(M, S - s) + S


def test_launch_orders_for_two_stages_and_four_micro_batches():
    orders = {name: " ".join(map(str, make_schedule(name, 2, 4, [(0, 1)]).order)) for name in ("1f1b", "eager_1f1b")}
    assert orders["1f1b"] == ("F0.0 A0.0 F1.0 F0.1 A0.1 B1.0 G0.0 B0.0 F1.1 F0.2 A0.2 B1.1 G0.1 B0.1 "
                              "F1.2 F0.3 A0.3 B1.2 G0.2 B0.2 F1.3 B1.3 G0.3 B0.3")
    # Stage 0 runs three forwards before its first backward: micro-batch 2's
    # forward fills the wait for micro-batch 0's gradient.
    assert orders["eager_1f1b"] == ("F0.0 A0.0 F1.0 F0.1 A0.1 B1.0 G0.0 F0.2 A0.2 F1.1 B0.0 B1.1 G0.1 F0.3 "
                                    "A0.3 F1.2 B0.1 B1.2 G0.2 B0.2 F1.3 B1.3 G0.3 B0.3")


def test_unknown_schedule_is_named():
    with pytest.raises(ValueError, match="schedule: unknown 'zb'"):
        make_schedule("zb", 2, 4, [(0, 1)])
