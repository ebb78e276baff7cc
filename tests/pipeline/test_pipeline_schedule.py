"""Pipeline schedules as pure task lists: order, warm-up depth and in-flight micro-batches."""

import pytest

from meshpar.passes.pipeline.scheduling.dependency_graph import dependency_graph, verify_acyclic
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, make_schedule
from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.verification import PlanVerificationError

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _u_shape(S):
    """Adjacent stages plus the U-Transformer's long skips: stage i feeds stage S-1-i."""
    return _chain(S) + [(i, S - 1 - i) for i in range(S // 2) if S - 1 - i > i + 1]


def _per_stage(schedule, s):
    return [t for t in schedule.order if t.kind.is_compute and t.where == s]


def _forwards_before_first_backward(seq):
    return next(k for k, t in enumerate(seq) if t.kind in (B, I))


def _peak_in_flight(seq):
    """Micro-batches whose forward residuals are held: from F until the (input) backward."""
    live = peak = 0
    for t in seq:
        live += {F: 1, B: -1, I: -1, W: 0}[t.kind]
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("edges_of", [_chain, _u_shape])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 6, 8])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("name", sorted(n for n, k in SCHEDULES.items() if k.stages_per_mesh is None))
def test_warm_up_depth_and_in_flight_bound(name, S, M, edges_of):
    schedule = make_schedule(name, S, M, edges_of(S))  # runs verify_schedule
    for s in range(S):
        seq = _per_stage(schedule, s)
        # Interleaved 1F1B with one stage per mesh is Megatron's order for v = 1: eager-1F1B's
        # warm-up, or every forward first when the micro-batches make one round. Interleaved
        # zero bubble with one stage per mesh is ZB-H1.
        ahead = {"gpipe": M, "1f1b": min(M, S - s), "eager_1f1b": min(M, 2 * (S - s) - 1), "zb_h1": min(M, S - s),
                 "interleaved_1f1b": M if M == S else min(M, 2 * (S - s) - 1),
                 "interleaved_zb": min(M, S - s)}[name]
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


@pytest.mark.parametrize("edges_of", [_chain, _u_shape])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
def test_zb_h1_holds_back_s_weight_passes_and_keeps_1f1b_memory(S, M, edges_of):
    """ZB-H1 (Qi et al.): the forward/input-pass order of 1F1B; stage s runs its weight passes
    in micro-batch order, never more than s behind its input passes, all at the end once
    the forwards are done."""
    zb = make_schedule("zb_h1", S, M, edges_of(S))
    one = make_schedule("1f1b", S, M, edges_of(S))
    for s in range(S):
        seq = _per_stage(zb, s)
        assert [(t.kind is F, t.micro_batch) for t in seq if t.kind is not W] == [
            (t.kind is F, t.micro_batch) for t in _per_stage(one, s)]
        assert _peak_in_flight(seq) == _peak_in_flight(_per_stage(one, s))
        assert [t.micro_batch for t in seq if t.kind is W] == list(range(M))
        inputs = weights = 0
        for k, t in enumerate(seq):
            inputs += t.kind is I
            weights += t.kind is W
            forwards_left = any(u.kind is F for u in seq[k + 1:])
            if t.kind is I and forwards_left:
                assert inputs - weights <= s + 1
            assert inputs - weights <= max(s, 0) + 1


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager_1f1b"])
@pytest.mark.parametrize("delay", [0, 1, 2, 5])
@pytest.mark.parametrize("S, M", [(2, 4), (3, 6), (4, 4), (4, 2)])
def test_weight_delay_puts_each_weight_pass_delay_compute_tasks_after_its_input_pass(name, delay, S, M):
    split = make_schedule(name, S, M, _chain(S), [delay] * S)
    whole = make_schedule(name, S, M, _chain(S))
    for s in range(S):
        seq = _per_stage(split, s)
        # Without the weight passes it is the unsplit schedule, input passes for backwards.
        assert [(t.kind is F, t.micro_batch) for t in seq if t.kind is not W] == [
            (t.kind is F, t.micro_batch) for t in _per_stage(whole, s)]
        others = [t for t in seq if t.kind is not W]
        for m in range(M):
            at_input = others.index(Task(I, s, m))
            passed = [t for t in seq[: seq.index(Task(W, s, m))] if t.kind is not W]
            # The weight pass sits after `delay` more compute tasks, or at the end if fewer remain.
            assert len(passed) == min(at_input + 1 + delay, len(others))


def test_dependency_graph_finds_a_deadlock_and_names_the_cycle():
    # Stage 0 wants micro-batch 0's backward before its forward.
    sequences = [[Task(B, 0, 0), Task(F, 0, 0)], [Task(F, 1, 0), Task(B, 1, 0)]]
    graph = dependency_graph(sequences, [(0, 1)], False, 1)
    with pytest.raises(PlanVerificationError, match=r"deadlocks: .*B0.0"):
        verify_acyclic(graph, "handmade")
    good = dependency_graph([[Task(k, s, m) for k in (F, B) for m in (0, 1)] for s in (0, 1)], [(0, 1)], False, 2)
    verify_acyclic(good, "handmade")
    assert good.edges[Task(TaskKind.SEND_GRAD, 0, 0), Task(B, 0, 0)]["kind"] == "data"
    assert good.edges[Task(F, 0, 0), Task(F, 0, 1)]["kind"] == "sequence"


def test_weight_delay_with_zb_h1_or_bad_delays_is_rejected():
    with pytest.raises(ValueError, match="weight_delay: zb_h1 places"):
        make_schedule("zb_h1", 2, 4, [(0, 1)], [1, 1])
    with pytest.raises(ValueError, match="weight_delay: expected 2 non-negative"):
        make_schedule("1f1b", 2, 4, [(0, 1)], [1, -1])


def test_interleaved_places_stage_k_on_mesh_k_mod_P_and_visits_chunks_in_rounds():
    schedule = make_schedule("interleaved_1f1b", 4, 4, _chain(4), num_meshes=2)
    assert schedule.stage_mesh == (0, 1, 0, 1)
    assert schedule.stages_on(0) == (0, 2)
    # Megatron's order on mesh 0 (P=2, v=2, M=4): 2(P-1) + (v-1)P = 4 warm-up forwards, chunk by
    # chunk in rounds of P micro-batches, then one forward and one backward (chunks reversed).
    assert " ".join(map(str, schedule.sequences[0])) == (
        "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3")


@pytest.mark.parametrize("args,match", [
    (("1f1b", 4, 4, 2), r"schedule: '1f1b' runs one stage per mesh.*interleaved_1f1b"),
    (("interleaved_1f1b", 5, 4, 2), r"num_stages: 5 stages do not divide over 2 meshes"),
    (("interleaved_1f1b", 4, 3, 2), r"num_micro_batches: interleaved_1f1b with virtual stages needs a multiple of 2"),
    (("nope", 4, 4, 2), r"schedule: unknown 'nope'"),
])
def test_stage_placement_errors_name_the_argument(args, match):
    from meshpar.passes.pipeline.scheduling.pipeline_schedule import check_stage_placement

    name, S, M, P = args
    with pytest.raises(ValueError, match=match):
        check_stage_placement(name, S, P, M)
    with pytest.raises(ValueError, match=match):
        make_schedule(name, S, M, _chain(S), num_meshes=P)
