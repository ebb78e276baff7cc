"""The V schedules (``zb_v``, ``dualpipev``) as pure task lists: placement, each task once, the
references' orders (PyTorch's golden DualPipeV CSV, a hand-derived ZB-V case), the papers'
bubbles and activation memory in the simulator, and the errors naming the argument. No devices.
"""

import re
from pathlib import Path

import pytest

from repo_paths import TESTS_DIR

from meshpar.passes.pipeline.scheduling.pipeline_schedule import (
    SCHEDULES, StagePlacement, check_stage_placement, make_schedule,
)
from meshpar.passes.program.tasks import Task, TaskKind
from meshpar.passes.pipeline.scheduling.v_schedules import dualpipev_overlapped_pairs
from meshpar.passes.simulation.schedule_simulator import StageSeconds, TaskDurations, simulate

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT
V_NAMES = ("zb_v", "dualpipev")
ARTIFACTS = Path(TESTS_DIR) / "artifacts"


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _u_shape(S):
    """Adjacent stages plus the U-Transformer's long skips i -> S-1-i: on the V, each skip stays
    on its mesh."""
    return _chain(S) + [(i, S - 1 - i) for i in range(S // 2) if S - 1 - i > i + 1]


def _v(name, P, M, edges_of=_chain):
    return make_schedule(name, 2 * P, M, edges_of(2 * P), num_meshes=P)


def _text(seq):
    return " ".join(map(str, seq))


def _equal_passes(S, t):
    """Every stage's forward, input pass and weight pass take ``t``; transfers are free."""
    return TaskDurations((StageSeconds(t, 2 * t, t, t),) * S, (0.0,) * (S - 1), (0.0,) * (S - 1))


def _mesh_spans(schedule, step):
    """Per mesh, ``(first start, last end, busy seconds)`` of its compute."""
    spans = []
    for mesh in range(schedule.num_meshes):
        events = [e for e in step.timeline.events
                  if e.task.kind.is_compute and schedule.stage_mesh[e.task.where] == mesh]
        spans.append((min(e.start for e in events), max(e.end for e in events), sum(e.end - e.start for e in events)))
    return spans


def _in_span_idle(schedule, step):
    """Per mesh, its idle time between its first task's start and its last task's end: the
    zero-bubble paper's bubble (its scheduler counts a stage's idle from its first forward on;
    the parallelogram's ramps are not bubble, as steps overlap once nothing synchronizes them)."""
    return [end - start - busy for start, end, busy in _mesh_spans(schedule, step)]


def _mesh_peak_live(sequence):
    """Most micro-batches whose forward residuals a mesh holds at once, over all its stages (a
    forward opens one, an input pass or whole backward closes it), counted along its order."""
    live = peak = 0
    for t in sequence:
        live += {F: 1, B: -1, I: -1}.get(t.kind, 0)
        peak = max(peak, live)
    return peak


# ---------------------------------------------------------------------------------------------
# Placement and shape


def test_v_placement_puts_stage_i_and_its_mirror_on_mesh_i():
    assert [StagePlacement.V.mesh_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [StagePlacement.LOOP.mesh_of(s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    for stage in (-1, 8):
        with pytest.raises(ValueError, match="^stage: the V places 2 x 4 stages"):
            StagePlacement.V.mesh_of(stage, 4)
    for name in V_NAMES:
        kind = SCHEDULES[name]
        assert (kind.placement, kind.virtual_stages, kind.places_weight_passes, kind.stages_per_mesh) == (
            StagePlacement.V, True, True, 2)


@pytest.mark.parametrize("P,rounds", [(2, 2), (2, 3), (2, 4), (4, 2), (4, 3), (4, 4), (3, 2), (1, 2), (4, 9)])
@pytest.mark.parametrize("name", V_NAMES)
def test_every_task_once_on_its_v_mesh_in_micro_batch_order(name, P, rounds):
    M = P * rounds
    schedule = _v(name, P, M)  # builds the dependency graph, checks it acyclic, verifies the order
    assert _v(name, P, M, _u_shape).sequences == schedule.sequences
    S = 2 * P
    assert schedule.split_backward and schedule.weight_delays is None
    assert schedule.stage_mesh == tuple(min(s, S - 1 - s) for s in range(S))
    expected = {Task(k, s, m) for k in (F, I, W) for s in range(S) for m in range(M)}
    tasks = [t for seq in schedule.sequences for t in seq]
    assert len(tasks) == len(expected) and set(tasks) == expected
    for r, seq in enumerate(schedule.sequences):
        assert len(seq) == 6 * M and len(set(seq)) == 6 * M
        assert {t.where for t in seq} == {r, S - 1 - r} == set(schedule.stages_on(r))
        for kind in (F, I, W):
            for stage in (r, S - 1 - r):
                assert [t.micro_batch for t in seq if (t.kind, t.where) == (kind, stage)] == list(range(M))
        position = {t: k for k, t in enumerate(seq)}
        assert all(position[Task(W, t.where, t.micro_batch)] > k for k, t in enumerate(seq) if t.kind is I)


# ---------------------------------------------------------------------------------------------
# The references' orders


_TORCH_ACTION = re.compile(r"(\d+)(F|I|B|W)(\d+)$")


def _torch_tasks(action):
    """One entry of torch's action notation as meshpar compute tasks: ``2F0`` (forward),
    ``2I0`` / ``2W0`` (input / weight pass), ``2B0`` (a whole backward: its input pass then its
    weight pass, as meshpar splits every backward of a schedule that splits any),
    ``(0F7;7B3)OVERLAP_F_B`` (the two sub-actions in order); communication actions
    (``SEND_F``, ``RECV_B``, ...) give none."""
    if action.startswith("("):
        inner, kind = action[1:].split(")")
        assert kind == "OVERLAP_F_B", action
        return [t for sub in inner.split(";") for t in _torch_tasks(sub)]
    match = _TORCH_ACTION.match(action)
    if match is None:
        return []
    stage, kind, micro_batch = int(match[1]), match[2], int(match[3])
    if kind == "B":
        return [Task(I, stage, micro_batch), Task(W, stage, micro_batch)]
    return [Task({"F": F, "I": I, "W": W}[kind], stage, micro_batch)]


def _torch_rank(line):
    """A rank's CSV line: its compute tasks, and the positions ``(k, k + 1)`` of its overlapped
    pairs among them."""
    tasks, pairs = [], []
    for action in line.strip().split(","):
        if action.endswith("OVERLAP_F_B"):
            pairs.append((len(tasks), len(tasks) + 1))
        tasks += _torch_tasks(action)
    return tasks, pairs


def test_dualpipev_matches_torchs_golden_order_for_4_ranks_and_10_micro_batches():
    """``dualpipev_4rank_10mb.csv`` (PyTorch's ``ScheduleDualPipeV`` test artifact, one rank a
    line), with each whole backward as its input pass then its weight pass."""
    lines = (ARTIFACTS / "dualpipev_4rank_10mb.csv").read_text().splitlines()
    assert len(lines) == 4
    ours = SCHEDULES["dualpipev"].actions(4, 2, 10)
    pairs = dualpipev_overlapped_pairs(4, 10)
    for rank, line in enumerate(lines):
        tasks, overlapped = _torch_rank(line)
        assert _text(ours[rank]) == _text(tasks), f"rank {rank}"
        assert pairs[rank] == overlapped, f"rank {rank}"
    # The golden order is also a schedule meshpar can run: acyclic on the chain, verified.
    assert _v("dualpipev", 4, 10).sequences == tuple(map(tuple, ours))


@pytest.mark.parametrize("P,M", [(2, 4), (4, 8), (4, 10), (3, 7), (4, 16)])
def test_dualpipev_overlapped_pairs_are_one_stages_forward_and_the_others_backward(P, M):
    for r, (seq, pairs) in enumerate(zip(SCHEDULES["dualpipev"].actions(P, 2, M), dualpipev_overlapped_pairs(P, M))):
        for k, k1 in pairs:
            f, i, w = seq[k], seq[k1], seq[k1 + 1]
            assert k1 == k + 1 and (f.kind, i.kind, w.kind) == (F, I, W)
            assert {f.where, i.where} == {r, 2 * P - 1 - r} and (w.where, w.micro_batch) == (i.where, i.micro_batch)
        # DualPipe's main phase: M - 2P + r + 1 rounds of two pairs, the last mesh's first pair
        # not overlapped (the V's turn), then P - r - 1 more pairs.
        assert len(pairs) == 2 * (M - 2 * P + r + 1) - (r == P - 1) + (P - r - 1)


def test_zb_v_order_for_two_meshes_and_four_micro_batches():
    """Hand-derived from the handcrafted ZB-V (sail-sg's ``get_zb_v_schedule``, torch's
    ``ScheduleZBVZeroBubble``). Mesh 0 (stages 0 and 3): 2P - 1 = 3 forwards of stage 0, P = 2
    rounds of F I W on stage 3, the steady rounds, then P input+weight pairs of stage 0. Mesh 1
    (stages 1 and 2): 1 forward, one (F2, F1) pair, one F I W of stage 2, the steady rounds,
    then r = 1 input pair, one input+weight pair, and the weight passes left (stage 2's first)."""
    meshes = SCHEDULES["zb_v"].actions(2, 2, 4)
    assert _text(meshes[0]) == ("F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I3.1 W3.1 F0.3 I0.0 W0.0 F3.2 I3.2 W3.2 "
                                "I0.1 W0.1 F3.3 I3.3 W3.3 I0.2 W0.2 I0.3 W0.3")
    assert _text(meshes[1]) == ("F1.0 F2.0 F1.1 F2.1 I2.0 W2.0 F1.2 I1.0 W1.0 F2.2 I2.1 W2.1 F1.3 I1.1 W1.1 "
                                "F2.3 I2.2 W2.2 I1.2 I2.3 I1.3 W1.2 W2.3 W1.3")


# ---------------------------------------------------------------------------------------------
# Simulated bubbles (the zero-bubble README's table, T_F = T_B = T_W, free transfers)


@pytest.mark.parametrize("P,M", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 12), (4, 16)])
def test_bubbles_with_equal_passes_are_the_papers(P, M):
    """Qi et al.'s table (sail-sg README: 1F1B (p-1)/m, ZB-H1 (p-1)/3m, ZB-V 0), bubble rate =
    the largest idle time of a mesh inside its span over the ideal m(T_F + T_B + T_W).

    The V schedules run 2P stages of ``t`` per pass; 1F1B and ZB-H1 run the same model as P
    stages of ``2t`` per pass, so every mesh has the same 6Mt of work (``ideal``)."""
    t = 1.0
    ideal = M * 3 * (2 * t)

    one = make_schedule("1f1b", P, M, _chain(P))
    one_step = simulate(one, _equal_passes(P, 2 * t))
    assert one_step.step_seconds == pytest.approx((M + P - 1) * 6 * t)
    assert max(_in_span_idle(one, one_step)) / ideal == pytest.approx((P - 1) / M)

    h1 = make_schedule("zb_h1", P, M, _chain(P))
    h1_step = simulate(h1, _equal_passes(P, 2 * t))
    assert max(_in_span_idle(h1, h1_step)) / ideal == pytest.approx((P - 1) / (3 * M))

    # ZB-V: no mesh ever waits between its first task and its last (the parallelogram): zero
    # bubble. One step alone still has its ramps: mesh r starts after r chunk forwards and ends
    # P - 1 - r chunk forwards before the last, so the step is the ideal plus (P - 1) t.
    zb_v = _v("zb_v", P, M)
    zb_v_step = simulate(zb_v, _equal_passes(2 * P, t))
    assert _in_span_idle(zb_v, zb_v_step) == pytest.approx([0.0] * P)
    assert [start for start, _, _ in _mesh_spans(zb_v, zb_v_step)] == pytest.approx([r * t for r in range(P)])
    assert zb_v_step.step_seconds == pytest.approx(ideal + (P - 1) * t)
    assert zb_v_step.bubble_fraction == pytest.approx((P - 1) / (6 * M + P - 1))
    assert zb_v_step.step_seconds < h1_step.step_seconds < one_step.step_seconds

    # DualPipeV (DeepSeek's README): bubble (PP/2 - 1)(F&B + B - 3W) for PP = 2P stages, with B
    # a whole backward and F&B an overlapped pair, here run back to back (F&B = F + B = 3t).
    dual = _v("dualpipev", P, M)
    dual_step = simulate(dual, _equal_passes(2 * P, t))
    readme = (P - 1) * ((t + 2 * t) + 2 * t - 3 * t)
    assert max(_in_span_idle(dual, dual_step)) <= readme + 1e-9
    # What the simulator gives: mesh r idles (P - 1 - r) t; the step is ZB-V's.
    assert _in_span_idle(dual, dual_step) == pytest.approx([(P - 1 - r) * t for r in range(P)])
    assert dual_step.step_seconds == pytest.approx(zb_v_step.step_seconds)


# ---------------------------------------------------------------------------------------------
# Activation memory


@pytest.mark.parametrize("P,M", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (5, 10)])
def test_peak_live_activations_per_mesh(P, M):
    """Counted per mesh over both its stages, in micro-batches of one stage (a chunk: half of
    what a mesh holds of the model). ZB-V holds 2P on every mesh: 1F1B's peak (P micro-batches
    of a whole-mesh stage, on its first mesh) in the same bytes, as Qi et al. claim ("activation
    memory 1x 1F1B"). DualPipeV holds PP + 1 = 2P + 1, DeepSeek's README (PP the stages)."""
    zb_v, dual = _v("zb_v", P, M), _v("dualpipev", P, M)
    one = make_schedule("1f1b", P, M, _chain(P))
    assert [_mesh_peak_live(seq) for seq in one.sequences] == [P - r for r in range(P)]
    assert [_mesh_peak_live(seq) for seq in zb_v.sequences] == [2 * max(_mesh_peak_live(s) for s in one.sequences)] * P
    assert [_mesh_peak_live(seq) for seq in dual.sequences] == [2 * P + 1] * P
    # The per-stage count the runtime keeps agrees with the simulator's over time.
    durations = _equal_passes(2 * P, 1.0)
    for name, schedule in (("zb_v", zb_v), ("dualpipev", dual)):
        per_stage = [SCHEDULES[name].peak_live(s, 2 * P, M, P) for s in range(2 * P)]
        assert list(simulate(schedule, durations).peak_live_activations) == per_stage


# ---------------------------------------------------------------------------------------------
# Errors naming the argument


@pytest.mark.parametrize("name", V_NAMES)
def test_actions_reject_other_stage_counts_and_too_few_micro_batches(name):
    actions = SCHEDULES[name].actions
    for per_mesh in (1, 3):
        with pytest.raises(ValueError, match=f"^stages_per_mesh: {name} places exactly 2 stages"):
            actions(4, per_mesh, 8)
    with pytest.raises(ValueError, match=f"^num_micro_batches: {name} needs at least 2 x meshes = 8 .*got 7"):
        actions(4, 2, 7)
    with pytest.raises(ValueError, match="^num_micro_batches: dualpipev needs at least 2 x meshes = 4"):
        dualpipev_overlapped_pairs(2, 3)


@pytest.mark.parametrize("name", V_NAMES)
@pytest.mark.parametrize("S,M,P,match", [
    (8, 7, 4, r"^num_micro_batches: {name} needs at least 8 micro-batches on 4 meshes, got 7"),
    (4, 3, 2, r"^num_micro_batches: {name} needs at least 4 micro-batches on 2 meshes, got 3"),
    (8, 8, 8, r"^stages_per_mesh, num_meshes: {name} places exactly 2 stages on each mesh, so 8 stages need "
              r"num_meshes=4, got 8 meshes \(1 per mesh\); pass stages_per_mesh=2"),
    (8, 8, 2, r"^stages_per_mesh, num_meshes: .*8 stages need num_meshes=4, got 2 meshes \(4 per mesh\)"),
    (8, 8, 3, r"^stages_per_mesh, num_meshes: .*got 3 meshes"),
    (7, 8, 3, r"^num_stages: {name} places exactly 2 stages on each mesh, so it needs a multiple of 2 stages, "
              r"got 7"),
    (2, 2, 2, r"^stages_per_mesh, num_meshes: .*2 stages need num_meshes=1, got 2 meshes"),
])
def test_stage_placement_errors_name_the_argument(name, S, M, P, match):
    match = match.format(name=name)
    with pytest.raises(ValueError, match=match):
        check_stage_placement(name, S, P, M)
    with pytest.raises(ValueError, match=match):
        make_schedule(name, S, M, _chain(S), num_meshes=P)


@pytest.mark.parametrize("name", V_NAMES)
def test_one_stage_per_mesh_or_weight_delays_are_rejected(name):
    # make_schedule's default is one stage per mesh, which the V cannot be.
    with pytest.raises(ValueError, match="^stages_per_mesh, num_meshes: .*8 stages need num_meshes=4"):
        make_schedule(name, 8, 8, _chain(8))
    with pytest.raises(ValueError, match=f"^weight_delay: {name} places its weight passes itself"):
        make_schedule(name, 8, 8, _chain(8), [1] * 4, num_meshes=4)
