"""The schedule simulator: closed forms, schedule comparisons, memory peaks, invariants, and an
independent fixed-point solution of the same timing equations. No devices needed."""

import random

import pytest

from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, make_schedule
from meshpar.passes.program.tasks import Task, TaskKind, task_dependencies
from meshpar.passes.simulation.schedule_simulator import (
    StageSeconds, TaskDurations, simulate, stage_seconds_from, transfer_seconds_from,
)
from meshpar.passes.program.timeline import Lane, LaneKind, Timeline, TimelineEvent
from meshpar.passes.simulation.weight_delay import max_delay, weight_delays

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT
A, G = TaskKind.SEND_ACT, TaskKind.SEND_GRAD


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _u_shape(S):  # as in test_pipeline_schedule: adjacent stages plus skips i -> S-1-i
    return _chain(S) + [(i, S - 1 - i) for i in range(S // 2) if S - 1 - i > i + 1]


def _skip(S):
    """Two edges 0 -> 1 (a skip connection beside the main path): they share the link."""
    return [(0, 1)] + _chain(S) if S > 1 else []


GRAPHS = [_chain, _u_shape, _skip]


def _stage(f, i, w):
    return StageSeconds(f, i + w, i, w)


def _uniform(S, E, f, i, w, act=0.0, grad=0.0):
    return TaskDurations((_stage(f, i, w),) * S, (act,) * E, (grad,) * E)


def _random_stages(rng, S):
    return tuple(_stage(rng.uniform(0.1, 3), rng.uniform(0.1, 3), rng.uniform(0.1, 3)) for _ in range(S))


def _random_case(rng, max_stages=5, max_micro_batches=8):
    """A random schedule (any name, split or not) on a random graph, with random durations; a V
    schedule on its 2P stages over P meshes with at least 2P micro-batches."""
    name = rng.choice(list(SCHEDULES))
    kind = SCHEDULES[name]
    if kind.stages_per_mesh:
        P = rng.randint(1, max_stages // 2)
        S, M = kind.stages_per_mesh * P, rng.randint(kind.min_micro_batches(P), 2 * kind.min_micro_batches(P))
    else:
        S = P = rng.randint(1, max_stages)
        M = rng.randint(1, max_micro_batches)
    edges = rng.choice(GRAPHS)(S)
    delays = None if kind.places_weight_passes or rng.random() < 0.4 else [rng.randint(0, 3) for _ in range(P)]
    activation, gradient = (tuple(rng.choice([0.0, rng.uniform(0, 4)]) for _ in edges) for _ in range(2))
    durations = TaskDurations(_random_stages(rng, S), activation, gradient)
    return make_schedule(name, S, M, edges, delays, P), durations


def _step(name, S, M, edges, durations, delays=None, overlap=True):
    return simulate(make_schedule(name, S, M, edges, delays), durations, overlap).step_seconds


# -- closed forms and schedule comparisons ------------------------------------------------------


@pytest.mark.parametrize("edges_of", GRAPHS)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_uniform_stages_without_transfer_time_take_m_plus_s_minus_1_slots(name, edges_of):
    f, i, w = 0.75, 0.5, 0.75  # multiples of 1/4: exact sums
    for S in range(1, 6):
        for M in range(1, 9):
            edges = edges_of(S)
            step = _step(name, S, M, edges, _uniform(S, len(edges), f, i, w))
            assert step == (M + S - 1) * (f + i + w), (S, M)


@pytest.mark.parametrize("edges_of", GRAPHS)
def test_without_transfer_time_eager_1f1b_takes_as_long_as_1f1b_with_uniform_stages(edges_of):
    rng = random.Random(0)
    for _ in range(60):
        S, M = rng.randint(1, 6), rng.randint(1, 10)
        edges = edges_of(S)
        durations = _uniform(S, len(edges), *(rng.randint(1, 12) / 4 for _ in range(3)))
        assert _step("eager_1f1b", S, M, edges, durations) == _step("1f1b", S, M, edges, durations)


def test_without_transfer_time_but_unequal_stages_eager_1f1b_can_win_or_lose():
    """Why the equality above needs uniform stages: with per-stage durations (f, b) the extra
    forwards in flight can shorten the step or, behind a slow stage, lengthen it."""
    faster = TaskDurations((StageSeconds(1, 2, 1, 1), StageSeconds(1, 1, 0.5, 0.5)), (0.0,), (0.0,))
    assert (_step("1f1b", 2, 3, [(0, 1)], faster), _step("eager_1f1b", 2, 3, [(0, 1)], faster)) == (10, 9)
    slower = TaskDurations((StageSeconds(1, 2, 1, 1), StageSeconds(2, 1, 0.5, 0.5), StageSeconds(1, 1, 0.5, 0.5)),
                           (0.0, 0.0), (0.0, 0.0))
    assert (_step("1f1b", 3, 3, _chain(3), slower), _step("eager_1f1b", 3, 3, _chain(3), slower)) == (13, 14)


def _link_seconds(edges, seconds):
    """Per directed link, one micro-batch's transfer time summed over the edges sharing it."""
    out = {}
    for (p, c), t in zip(edges, seconds):
        out[(p, c)] = out.get((p, c), 0.0) + t
    return out


def test_eager_1f1b_is_never_slower_than_1f1b_when_compute_hides_each_transfer():
    """Eager-1F1B keeps one more micro-batch in flight per stage so that a boundary transfer
    overlaps with compute. Its premise: each link's transfers of one micro-batch take no longer
    than the compute they hide behind, a forward or a backward (uniform stages). Then eager-1F1B
    is never slower; without it it can be, e.g. S = M = 3 on a chain with f = 2, b = 1.75,
    activations (4.75, 0.5) and gradients (4.5, 2.5): 1F1B 34.0, eager-1F1B 35.25 (checked
    below); several edges on one link can also break it when each alone fits but together do not."""
    rng = random.Random(1)
    for _ in range(300):
        S, M = rng.randint(2, 6), rng.randint(1, 12)
        edges = rng.choice(GRAPHS)(S)
        f, i, w = rng.uniform(0.05, 3), rng.uniform(0.05, 3), rng.uniform(0.05, 3)
        budget = min(f, i + w)
        share = [sum(1 for e in edges if e == edge) for edge in edges]
        transfers = [tuple(rng.choice([0.0, budget / k, rng.uniform(0, budget / k)]) for k in share) for _ in range(2)]
        assert all(t <= budget * (1 + 1e-12) for seconds in transfers for t in _link_seconds(edges, seconds).values())
        durations = TaskDurations((_stage(f, i, w),) * S, *transfers)
        one, eager = _step("1f1b", S, M, edges, durations), _step("eager_1f1b", S, M, edges, durations)
        assert eager <= one * (1 + 1e-9), (S, M, edges, durations)
    beyond = TaskDurations((StageSeconds(2, 1.75, 0.875, 0.875),) * 3, (4.75, 0.5), (4.5, 2.5))
    assert (_step("1f1b", 3, 3, _chain(3), beyond), _step("eager_1f1b", 3, 3, _chain(3), beyond)) == (34.0, 35.25)


def test_zb_h1_bubble_is_at_most_1f1b_bubble_with_uniform_stages():
    """With b = i + w. Uniform stages matter: S = M = 2 with stage (f, i, w) = (2.5, 0.25, 1.25)
    and (0.25, 0.25, 1.75), no transfer time, takes 8.75 under 1F1B and 9.0 under ZB-H1."""
    rng = random.Random(2)
    for _ in range(400):
        S, M = rng.randint(1, 6), rng.randint(1, 12)
        edges = rng.choice(GRAPHS)(S)
        zero = rng.random() < 0.5
        transfers = [tuple(0.0 if zero else rng.uniform(0, 3) for _ in edges) for _ in range(2)]
        durations = TaskDurations((_random_stages(rng, 1)[0],) * S, *transfers)
        one = simulate(make_schedule("1f1b", S, M, edges), durations)
        zb = simulate(make_schedule("zb_h1", S, M, edges), durations)
        assert zb.bubble_fraction <= one.bubble_fraction + 1e-9
    unequal = TaskDurations((_stage(2.5, 0.25, 1.25), _stage(0.25, 0.25, 1.75)), (0.0,), (0.0,))
    assert (_step("1f1b", 2, 2, [(0, 1)], unequal), _step("zb_h1", 2, 2, [(0, 1)], unequal)) == (8.75, 9.0)


def test_bubble_fraction_is_idle_compute_time():
    S, M, f, i, w = 3, 4, 1.0, 1.0, 2.0
    step = simulate(make_schedule("gpipe", S, M, _chain(S)), _uniform(S, S - 1, f, i, w))
    assert step.bubble_fraction == pytest.approx((S - 1) / (M + S - 1))  # GPipe's (S - 1) / (M + S - 1)


def test_without_overlap_a_step_is_never_faster():
    rng = random.Random(3)
    for _ in range(300):
        schedule, durations = _random_case(rng)
        assert simulate(schedule, durations, overlap=False).step_seconds >= simulate(schedule, durations).step_seconds


def test_without_transfer_time_blocking_transfers_cost_nothing_for_one_micro_batch_only():
    """A collective is a rendezvous: even with no transfer time it waits for both meshes, and the
    receiver launched it before its own next task. With one micro-batch nothing else could run
    meanwhile, so both models agree; with more they need not: 1F1B, S = 2, M = 3, f = 1, b = 2
    takes 12 overlapped but 14 blocking, as stage 1 queues A0.2 before B1.1 and waits for stage
    0 to finish F0.2."""
    rng = random.Random(4)
    for _ in range(200):
        S = rng.randint(1, 6)
        edges = rng.choice(GRAPHS)(S)
        name = rng.choice([n for n, k in SCHEDULES.items() if k.min_micro_batches is None])
        durations = TaskDurations(_random_stages(rng, S), (0.0,) * len(edges), (0.0,) * len(edges))
        schedule = make_schedule(name, S, 1, edges)
        assert simulate(schedule, durations, overlap=False).step_seconds == simulate(schedule, durations).step_seconds
    schedule, durations = make_schedule("1f1b", 2, 3, [(0, 1)]), _uniform(2, 1, 1.0, 1.0, 1.0)
    assert (simulate(schedule, durations).step_seconds, simulate(schedule, durations, overlap=False).step_seconds) == (
        12.0, 14.0)


# -- memory -------------------------------------------------------------------------------------


def _sequence_peaks(schedule, opens, closes):
    """The runtime's count: per stage, intervals opened minus closed along its mesh's sequence."""
    held, peak = [0] * schedule.num_stages, [0] * schedule.num_stages
    for seq in schedule.sequences:
        for t in seq:
            held[t.where] += (t.kind is opens) - (t.kind is closes)
            peak[t.where] = max(peak[t.where], held[t.where])
    return tuple(peak)


@pytest.mark.parametrize("edges_of", GRAPHS)
def test_peak_live_activations_of_1f1b_and_eager_1f1b(edges_of):
    """1F1B holds min(S - s, M) micro-batches' residuals on stage s, eager-1F1B min(2(S - s) - 1, M):
    at most S more (paper Table 1), with or without weight delaying, whatever the durations."""
    rng = random.Random(5)
    for S in range(1, 6):
        for M in range(1, 10):
            edges = edges_of(S)
            durations = TaskDurations(_random_stages(rng, S), *(tuple(rng.uniform(0, 2) for _ in edges) for _ in range(2)))
            delays = rng.choice([None, [rng.randint(0, 3) for _ in range(S)]])
            one = simulate(make_schedule("1f1b", S, M, edges, delays), durations).peak_live_activations
            eager = simulate(make_schedule("eager_1f1b", S, M, edges, delays), durations).peak_live_activations
            assert one == tuple(min(S - s, M) for s in range(S))
            assert eager == tuple(min(2 * (S - s) - 1, M) for s in range(S))
            assert all(e <= o + S for e, o in zip(eager, one))


def test_peaks_match_the_runtime_count_along_each_sequence():
    rng = random.Random(6)
    for _ in range(300):
        schedule, durations = _random_case(rng)
        step = simulate(schedule, durations, overlap=rng.random() < 0.5)
        assert step.peak_live_activations == _sequence_peaks(schedule, F, I if schedule.split_backward else B)
        assert step.peak_weight_states == _sequence_peaks(schedule, I, W)
        assert (max(step.peak_weight_states) > 0) == schedule.split_backward


# -- invariants and an independent solution -----------------------------------------------------


def _transfer_ends(schedule, task):
    """The meshes a transfer leaves and reaches (the same one between two stages of a mesh)."""
    p, c = (schedule.stage_mesh[s] for s in schedule.edges[task.where])
    return (p, c) if task.kind is A else (c, p)


def test_timeline_invariants():
    rng = random.Random(7)
    for _ in range(300):
        schedule, durations = _random_case(rng)
        overlap = rng.random() < 0.5
        step = simulate(schedule, durations, overlap)
        events = {e.task: e for e in step.timeline.events}
        assert len(events) == len(step.timeline.events) == len(schedule.order) and set(events) == set(schedule.order)
        assert step.timeline.source == "simulated"
        assert step.step_seconds == pytest.approx(max(e.end for e in events.values()))
        for t, e in events.items():
            assert e.end - e.start == pytest.approx(durations.seconds(t))
            for d in task_dependencies(t, schedule.edges, schedule.split_backward):
                assert e.start >= events[d].end
            if t.kind.is_compute:
                assert e.lane == Lane(LaneKind.COMPUTE, schedule.stage_mesh[t.where])
            else:
                assert e.lane == Lane(LaneKind.LINK, *_transfer_ends(schedule, t))
        # What holds each lane: its own events, and without overlap a transfer holds both meshes too.
        held = {}
        for t, e in events.items():
            lanes = [e.lane]
            if not overlap and not t.kind.is_compute and len(set(_transfer_ends(schedule, t))) == 2:
                lanes += [Lane(LaneKind.COMPUTE, s) for s in _transfer_ends(schedule, t)]
            for lane in lanes:
                held.setdefault(lane, []).append(e)
        for lane, on_lane in held.items():
            on_lane.sort(key=lambda e: (e.start, e.end))
            assert all(a.end <= b.start for a, b in zip(on_lane, on_lane[1:])), lane
        for s, seq in enumerate(schedule.sequences):
            assert [events[t].start for t in seq] == sorted(events[t].start for t in seq)


def _fixed_point_starts(schedule, durations, overlap):
    """The timing equations solved by iteration: start = the latest end among a task's data
    dependencies and its predecessors on each resource it holds (in launch order), from all
    zeros until nothing moves."""
    holders = {}
    for t in schedule.order:
        if t.kind.is_compute:
            resources = [("mesh", schedule.stage_mesh[t.where])]
        else:
            src, dst = _transfer_ends(schedule, t)
            resources = [("link", src, dst)] if overlap or src == dst else [("mesh", src), ("mesh", dst)]
        for r in resources:
            holders.setdefault(r, []).append(t)
    before = {t: [] for t in schedule.order}
    for tasks in holders.values():
        for a, b in zip(tasks, tasks[1:]):
            before[b].append(a)
    for t in schedule.order:
        before[t] += task_dependencies(t, schedule.edges, schedule.split_backward)
    start = {t: 0.0 for t in schedule.order}
    for _ in range(len(start) + 1):
        new = {t: max([start[d] + durations.seconds(d) for d in before[t]], default=0.0) for t in start}
        if new == start:
            return start
        start = new
    raise AssertionError("the timing equations did not settle: a cycle")


def test_simulation_agrees_with_a_fixed_point_iteration():
    rng = random.Random(8)
    for _ in range(150):
        schedule, durations = _random_case(rng, max_stages=4, max_micro_batches=5)
        overlap = rng.random() < 0.5
        expected = _fixed_point_starts(schedule, durations, overlap)
        got = {e.task: e.start for e in simulate(schedule, durations, overlap).timeline.events}
        assert got == pytest.approx(expected)


# -- measured durations and validation ----------------------------------------------------------


def _event(kind, where, m, start, end, dst=None):
    lane = Lane(LaneKind.COMPUTE, where) if dst is None else Lane(LaneKind.LINK, where, dst)
    return TimelineEvent(Task(kind, where, m), lane, start, end)


def test_stage_seconds_from_takes_medians_and_splits_a_whole_backward_in_half():
    timeline = Timeline((
        _event(F, 0, 0, 0, 1), _event(F, 0, 1, 1, 4), _event(F, 0, 2, 4, 6),  # 1, 3, 2: median 2
        _event(A, 0, 0, 1, 9, dst=1),  # transfers are not stage time
        _event(B, 0, 0, 6, 10), _event(B, 0, 1, 10, 16),  # 4, 6: median 5
        _event(F, 1, 0, 9, 10),
        _event(I, 1, 0, 10, 11.5), _event(W, 1, 0, 11.5, 12), _event(I, 1, 1, 12, 12.5), _event(W, 1, 1, 13, 13.5),
    ), "measured")
    assert stage_seconds_from(timeline, 2) == (StageSeconds(2, 5, 2.5, 2.5), StageSeconds(1, 1.5, 1.0, 0.5))


def test_stage_seconds_from_a_simulated_step_gives_back_its_durations():
    durations = TaskDurations((_stage(1, 2, 3), StageSeconds(0.5, 4, 2, 2)), (0.25,), (0.5,))
    split = simulate(make_schedule("1f1b", 2, 4, [(0, 1)], [1, 2]), durations)
    assert stage_seconds_from(split.timeline, 2) == durations.stages
    whole = simulate(make_schedule("1f1b", 2, 4, [(0, 1)]), durations)
    assert stage_seconds_from(whole.timeline, 2) == (StageSeconds(1, 5, 2.5, 2.5), StageSeconds(0.5, 4, 2, 2))


def test_stage_seconds_pool_several_steps_and_transfers_take_medians():
    first = Timeline((_event(F, 0, 0, 0, 1), _event(B, 0, 0, 1, 3), _event(A, 0, 0, 1, 2, dst=1),
                      _event(G, 0, 0, 5, 5.5, dst=0)), "measured")
    second = Timeline((_event(F, 0, 0, 0, 9), _event(B, 0, 0, 9, 11), _event(A, 0, 0, 1, 4, dst=1)), "measured")
    third = Timeline((_event(F, 0, 0, 0, 2), _event(B, 0, 0, 2, 8), _event(A, 0, 0, 1, 1.5, dst=1)), "measured")
    # Forwards 1, 9, 2 and backwards 2, 2, 6: the outlier step moves neither median.
    assert stage_seconds_from([first, second, third], 1) == (StageSeconds(2, 2, 1, 1),)
    assert transfer_seconds_from([first, second, third], 2) == ((1.0, None), (0.5, None))


def test_meshes_sharing_cores_compute_in_turn():
    """Two meshes on one group of cores: no two compute tasks overlap, so with free transfers
    the step is every task's compute summed; on their own cores it is shorter."""
    durations = TaskDurations((_stage(1, 1, 1), _stage(2, 1, 1)), (0.0,), (0.0,))
    schedule = make_schedule("1f1b", 2, 4, [(0, 1)])
    shared = simulate(schedule, durations, cores=[0, 0])
    compute = [e for e in shared.timeline.events if e.task.kind.is_compute]
    for a in compute:
        assert not any(b is not a and a.start < b.end and b.start < a.end for b in compute), a
    assert shared.step_seconds == pytest.approx(4 * (1 + 2) + 4 * (2 + 2))
    assert simulate(schedule, durations).step_seconds < shared.step_seconds
    assert shared.bubble_fraction == pytest.approx(0.0)  # the one group of cores never idles
    assert simulate(schedule, durations, cores=[0, 1]).step_seconds == simulate(schedule, durations).step_seconds
    with pytest.raises(ValueError, match=r"cores: expected one group per mesh \(2\), got 1"):
        simulate(schedule, durations, cores=[0])


def test_stage_seconds_from_names_a_stage_without_forwards():
    timeline = Timeline((_event(F, 0, 0, 0, 1), _event(B, 0, 0, 1, 2), _event(B, 1, 0, 2, 3)), "measured")
    with pytest.raises(ValueError, match="stage 1 has no forward events"):
        stage_seconds_from(timeline, 2)


@pytest.mark.parametrize("make, match", [
    (lambda: StageSeconds(1, -1, 0, 0), r"^StageSeconds.backward: expected finite non-negative seconds, got -1"),
    (lambda: StageSeconds(float("nan"), 1, 0, 0), r"^StageSeconds.forward:"),
    (lambda: TaskDurations((), (float("inf"),), (0.0,)), r"^TaskDurations.activation:"),
    (lambda: TaskDurations((), (1.0,), (-0.5,)), r"^TaskDurations.gradient: .*got -0.5"),
    (lambda: TaskDurations((), (1.0,), ()), r"^TaskDurations.gradient: expected one per edge \(1\), got 0"),
])
def test_durations_are_validated(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_simulate_rejects_durations_of_another_size():
    schedule = make_schedule("1f1b", 3, 2, _chain(3))
    with pytest.raises(ValueError, match="^durations: 2 stages' seconds for a 3-stage schedule"):
        simulate(schedule, _uniform(2, 2, 1, 1, 1))
    with pytest.raises(ValueError, match="^durations: 1 edges' transfer seconds for a schedule of 2 edges"):
        simulate(schedule, _uniform(3, 1, 1, 1, 1))


# -- weight delays chosen by simulation ---------------------------------------------------------


def test_auto_weight_delays_are_never_slower_than_uniform_delays_or_no_split():
    """Coordinate descent from the fastest uniform delay keeps only changes that help, and a split
    with no delay is never slower than the whole backward when transfers overlap, so "auto"
    beats every uniform delay and the whole backward; its delays are a local optimum (no one
    stage's change helps).

    Starting from all zeros instead would stop short of all-ones in GPipe, S = 3, M = 2, stage
    (f, i, w) = (1, 3, 2), (1, 4, 3), (1, 4, 3), no transfer time: no single stage's delay
    helps, but all three at 1 take 23 instead of 24 (checked below). What it does not promise:
    zero delays without transfer time (1F1B, S = M = 2, f = i = w = 1: (0, 2) takes 7, no delay
    8), nor beating the whole backward without overlap, where a blocking gradient between I and
    W holds both meshes."""
    rng = random.Random(9)
    for _ in range(25):
        S, M = rng.randint(1, 4), rng.randint(1, 6)
        edges = rng.choice(GRAPHS)(S)
        name = rng.choice(["gpipe", "1f1b", "eager_1f1b"])
        durations = TaskDurations(_random_stages(rng, S), *(tuple(rng.uniform(0, 4) for _ in edges) for _ in range(2)))
        auto = weight_delays("auto", SCHEDULES[name], M, edges, durations, True)
        assert len(auto) == S and all(0 <= d <= max_delay(S, M) for d in auto)
        best = _step(name, S, M, edges, durations, auto)
        for d in range(max_delay(S, M) + 1):
            assert best <= _step(name, S, M, edges, durations, (d,) * S) * (1 + 1e-9)
        assert best <= _step(name, S, M, edges, durations) * (1 + 1e-9)
        for s in range(S):
            for d in range(max_delay(S, M) + 1):
                moved = auto[:s] + (d,) + auto[s + 1:]
                assert best <= _step(name, S, M, edges, durations, moved) * (1 + 1e-9)
    local = TaskDurations((_stage(1, 3, 2), _stage(1, 4, 3), _stage(1, 4, 3)), (0.0, 0.0), (0.0, 0.0))
    assert [_step("gpipe", 3, 2, _chain(3), local, d) for d in ((0, 0, 0), (1, 1, 1))] == [24, 23]
    assert _step("gpipe", 3, 2, _chain(3), local,
                 weight_delays("auto", SCHEDULES["gpipe"], 2, _chain(3), local, True)) <= 23
    no_transfers = _uniform(2, 1, 1.0, 1.0, 1.0)
    assert weight_delays("auto", SCHEDULES["1f1b"], 2, [(0, 1)], no_transfers, True) == (0, 2)
    assert [_step("1f1b", 2, 2, [(0, 1)], no_transfers, d) for d in ((0, 2), (0, 0))] == [7, 8]


@pytest.mark.parametrize("P,v,M", [(2, 2, 2), (2, 2, 4), (2, 2, 8), (4, 2, 4), (4, 2, 8), (4, 2, 16), (2, 3, 4),
                                   (3, 2, 6), (4, 4, 8)])
def test_interleaved_bubble_is_the_papers(P, v, M):
    """Narayanan et al. (SC'21) §2.2: with equal stage times and free transfers, interleaved 1F1B's
    bubble is (P - 1) / (v·M) of the ideal step, v times smaller than 1F1B's (P - 1) / M on
    meshes running the same model as one stage each."""
    S, f, b = P * v, 1.0, 2.0
    interleaved = simulate(make_schedule("interleaved_1f1b", S, M, _chain(S), num_meshes=P),
                           _uniform(S, S - 1, f, b / 2, b / 2))
    ideal = M * v * (f + b)
    assert interleaved.step_seconds == pytest.approx(ideal * (1 + (P - 1) / (v * M)))
    assert interleaved.bubble_fraction == pytest.approx(1 - ideal / interleaved.step_seconds)
    one_f_one_b = simulate(make_schedule("1f1b", P, M, _chain(P)), _uniform(P, P - 1, v * f, v * b / 2, v * b / 2))
    assert one_f_one_b.step_seconds == pytest.approx(ideal * (1 + (P - 1) / M))


def test_stages_sharing_a_mesh_share_its_lane():
    # Two stages on one mesh never compute at once: the step is at least their summed work.
    schedule = make_schedule("interleaved_1f1b", 4, 2, _chain(4), num_meshes=2)
    step = simulate(schedule, _uniform(4, 3, 1.0, 1.0, 1.0))
    for mesh in range(2):
        events = sorted((e.start, e.end) for e in step.timeline.events
                        if e.task.kind.is_compute and schedule.stage_mesh[e.task.where] == mesh)
        assert len(events) == 2 * 2 * 2
        assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(events, events[1:]))
