"""meshpar's automatic planner: devices, stage cuts, per-stage mesh shapes, stages per mesh,
micro-batches and schedule, priced with what the other planners leave out: each cross-mesh edge
by the resharding plan (``plan_resharding``) between the actual stage meshes, which may differ
in shape, and the step by the schedule simulator, which runs any registered schedule (virtual
stages included) and overlaps transfers with compute.

The search (``plan``; with ``predict``, this module is a ``protocol.Planner``) covers what a
user can run:

- the devices: every count ``n`` of the cluster's first devices that is a divisor of a host's
  devices or a whole number of hosts dividing the hosts (``PlanConstraints.device_subsets``),
  down to one device: one stage there with one micro-batch is the one-program step
  ``jax.jit`` runs, so a small model is not pipelined into a slower step;
- ``P`` meshes of ``n / P`` devices, each running ``v`` stages (``stages_per_mesh``),
  ``S = P · v`` stages in all, and ``M`` micro-batches dividing the batch;
- every schedule of the registry (``pipeline_schedule.SCHEDULES``) that places ``S`` stages
  on ``P`` meshes with ``M`` micro-batches (``check_stage_placement``).

For each such layout and schedule:

1. a DP over contiguous layer partitions minimising the slowest stage, each stage on its
   fastest (data, model) shape that fits the memory budget at its position in the schedule
   (stage ``s`` keeps the schedule's ``peak_live`` micro-batches alive); stages sharing a mesh
   (``v > 1``) share one shape, tried in turn, each stage within ``1 / v`` of the budget;
2. the step of that partition simulated under the schedule with every edge's resharding
   priced (nothing between two stages of one mesh), and the data-parallel gradient all-reduce
   where it runs (``gradient_reduction``, below).

Layouts and partitions are taken best first by a lower bound on their step (a layout's from
its devices, micro-batches and meshes alone: ``_layout_bound``; a partition's from its stage
times: ``_step_lower_bound``), until the bound passes the ``num_ranked``-th fastest simulated
step: the plans ranked first are the fastest of all, exactly, and what cannot be among them
is neither partitioned nor simulated (a 1,024-device cluster has thousands of layouts, most
on too few devices to matter). Plans that run the same programs in the same order (one
program under any schedule; schedules whose order coincides) are ranked once, under the
first schedule named.

Costs (per micro-batch of ``b`` examples, stage on a ``(d, t)`` mesh of devices of
``device_flops``): forward ``flops · b / (d · t · device_flops)`` for layers whose parameters
split over the model axis (``LayerProfile.splits_over_model``), ``flops · b / (d ·
device_flops)`` for the others, whose model-axis rows repeat them; plus the tensor-parallel
all-reduces ``2 (t - 1) / t · tp_bytes · b / d / B'`` (``collectives.ring_all_reduce_s``:
Megatron's two per layer, ATP's Eq. 4 with its hierarchical bandwidth ``B'`` of the model
axis: ``tensor_parallel_bandwidth``; ``tp_bytes`` sized by the step's compiled HLO when planned
on local devices: ``hlo_collectives.sized_by_program``); backward twice the
forward's compute and as much communication. On an emulated cluster whose devices share a few
cores (``Hardware.total_flops``), no step is faster than all its FLOPs at that rate (repeated
ones counted each time), and none is faster than the host launching its tasks one by one
(``Hardware.dispatch_s``).

The gradient all-reduce of a stage, a ring over its mesh's data axis of the parameter bytes
each device holds, runs as ``gradient_reduction`` (``pipeline_options.GradientReduction``)
says: ``"per_step"`` once per step and mesh for all its stages, simulated right after the
mesh's last gradient task; ``"per_micro_batch"`` in every backward, which it lengthens: ``M``
per step, on the critical path, and counted in the partition DP's stage time.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections.abc import Iterator, Sequence

import numpy as np

from ..model.cluster import Cluster
from ..model.mesh import DeviceMesh
from ..model.sharding_spec import ShardingSpec
from ..pipeline.pipeline_options import GradientReduction
from ..pipeline.scheduling.pipeline_schedule import (SCHEDULES, PipelineSchedule, ScheduleKind, check_stage_placement,
                                                     make_schedule, mesh_sequences, schedule_kind)
from ..resharding.plan_resharding import plan_resharding
from ..resharding.resharding_task import ReshardingTask
from ..simulation.collectives import ring_all_reduce_s
from ..simulation.schedule_simulator import StageSeconds, TaskDurations, simulate
from .layer_profile import ModelProfile
from .planner_atp import mesh_bandwidths
from .protocol import (Hardware, NoPlanFits, PipelinePlan, PlanConstraints, StagePlan, first_devices,
                       stage_meshes)

__all__ = ["NUM_RANKED", "device_counts", "plan", "predict", "tensor_parallel_bandwidth"]

# Plans ``plan`` ranks exactly, fastest first: the chosen one and its runner-up. Ranking more
# simulates more near-equal candidates (every schedule of a good cut): on 1,024 GPUs each long
# schedule takes seconds to build and simulate.
NUM_RANKED = 2


def _shapes(n: int) -> list[tuple[int, int]]:
    return [(d, n // d) for d in range(1, n + 1) if n % d == 0]


def device_counts(cluster: Cluster) -> list[int]:
    """The device counts a plan may use, ascending: the divisors of the first host's devices,
    then every whole number of hosts dividing the hosts (when every host has as many
    devices), and all of them. A plan runs on the cluster's first devices, host-major."""
    first = len(cluster.host_devices[0])
    within = [n for n in range(1, first + 1) if first % n == 0]
    uniform = all(len(h) == first for h in cluster.host_devices)
    hosts = cluster.num_hosts
    across = [h * first for h in range(2, hosts + 1) if hosts % h == 0] if uniform else []
    return sorted({*within, *across, cluster.num_devices})


def _axis_bandwidth(cluster: Cluster, mesh: DeviceMesh, axis: int) -> float:
    """Bytes/s of a ring along mesh ``axis``: intra-host if every ring stays in a host, else the
    NIC shared by the host's devices on the ring's axis."""
    hosts = mesh.host_ids
    within = np.all(hosts == hosts.take([0], axis=axis))
    if within:
        return cluster.intra_host_bandwidth
    per_host = max(1, cluster.devices_per_host // max(1, mesh.device_ids.shape[1 - axis]))
    return cluster.inter_host_bandwidth / per_host


def tensor_parallel_bandwidth(cluster: Cluster, shape: tuple[int, int], first_device: int = 0) -> float:
    """``B'`` of the model axis of a ``(data, model)`` stage mesh on devices ``first_device ..``
    of ``cluster``: ATP's hierarchical model (``planner_atp.mesh_bandwidths``, Eq. 3), with every
    data-parallel row's tensor-parallel ring running at once."""
    return mesh_bandwidths(cluster, shape, first_device=first_device).link[1]


class _Prefix:
    """Prefix sums of the layers' figures: a span's totals in O(1), vectorised over spans. The
    figures a model axis splits (``LayerProfile.splits_over_model``) are kept apart from those
    it repeats."""

    def __init__(self, profile: ModelProfile) -> None:
        layers = profile.layers
        split = np.array([x.splits_over_model for x in layers], dtype=bool)

        def prefix(values, where=True):
            return np.concatenate([[0.0], np.cumsum(np.where(where, np.asarray(values, dtype=np.float64), 0.0))])

        figures = {"flops": [x.flops for x in layers], "params": [x.param_bytes for x in layers],
                   "static": [x.param_bytes + x.optimizer_bytes for x in layers],
                   "acts": [x.activation_bytes for x in layers]}
        self._split = {k: prefix(v, split) for k, v in figures.items()}
        self._whole = {k: prefix(v, ~split) for k, v in figures.items()}
        self.tp = prefix([x.tp_bytes for x in layers])
        self.ops = prefix([x.num_ops for x in layers])
        self.flops = prefix(figures["flops"])

    @staticmethod
    def span(p: np.ndarray, i, j):
        return p[j] - p[i]

    def repeated(self, figure: str, i, j):
        """Layers ``[i, j)``'s total of ``figure`` (``flops``, ``params``, ``static`` or
        ``acts``) over those a model axis does not split: each of its devices holds or runs all
        of it."""
        return self.span(self._whole[figure], i, j)

    def per_model_device(self, figure: str, i, j, t: int):
        """Layers ``[i, j)``'s total of ``figure`` (``flops``, ``params``, ``static`` or
        ``acts``) on one device of a model axis of ``t``: ``1 / t`` of what the axis splits,
        all of what it repeats."""
        return self.span(self._split[figure], i, j) / t + self.repeated(figure, i, j)


def _live(schedule: ScheduleKind, s: int, S: int, M: int, num_meshes: int | None = None) -> int:
    return schedule.peak_live(s, S, M, num_meshes)


def _compute_s(pre: _Prefix, i, j, shape: tuple[int, int], b: int, hardware: Hardware):
    """One micro-batch's forward compute of layers ``[i, j)`` on a ``shape`` mesh, calibrated."""
    d, t = shape
    flops = pre.per_model_device("flops", i, j, t) * b / (d * hardware.device_flops)
    return flops * hardware.compute_scale + pre.span(pre.ops, i, j) * hardware.op_seconds(d * t)


def _stage_seconds(pre: _Prefix, i, j, shape: tuple[int, int], b: int, hardware: Hardware, tp_bw: float):
    d, t = shape
    compute = _compute_s(pre, i, j, shape, b, hardware)
    comm = ring_all_reduce_s(pre.span(pre.tp, i, j) * b / d, t, tp_bw)
    return compute + comm, 2.0 * compute + comm


def _gradient_all_reduce_s(pre: _Prefix, i, j, shape: tuple[int, int], cluster: Cluster, mesh: DeviceMesh):
    """One all-reduce of layers ``[i, j)``'s parameter gradients over the data axis of ``mesh``
    (shaped ``shape``): each device holds ``1 / t`` of those the model axis splits."""
    d, t = shape
    return ring_all_reduce_s(pre.per_model_device("params", i, j, t), d, _axis_bandwidth(cluster, mesh, 0))


def _memory_parts(pre: _Prefix, i, j, shape: tuple[int, int], b: int):
    """The bytes per device of layers ``[i, j)`` on a ``shape`` mesh: what it holds whatever the
    schedule (parameters, optimizer state), and what each live micro-batch of ``b`` adds."""
    d, t = shape
    return pre.per_model_device("static", i, j, t), pre.per_model_device("acts", i, j, t) * b / d


def _memory(pre: _Prefix, i, j, shape: tuple[int, int], b: int, live: int):
    static, per_live = _memory_parts(pre, i, j, shape, b)
    return static + live * per_live


def _stage_mesh(schedule: ScheduleKind, num_stages: int, num_meshes: int) -> tuple[int, ...]:
    placement = schedule.placement
    return tuple(placement.mesh_of(s, num_meshes) for s in range(num_stages))


def _compute_tasks_per_micro_batch(schedule: ScheduleKind) -> int:
    """A stage's compute tasks per micro-batch: forward and backward, or forward, input and
    weight pass for a schedule that splits backwards."""
    return 3 if schedule.places_weight_passes else 2


def _task_overhead(hardware: Hardware, stage: StagePlan) -> float:
    """What one compute task of ``stage`` costs beyond its compute: ``task_s`` per device."""
    return hardware.task_s * stage.num_devices


def _shared_work_s(pre: _Prefix, hardware: Hardware, stages: Sequence[StagePlan], M: int, batch: int,
                   tasks_per_micro_batch: int) -> float:
    """On devices sharing cores, the step's work at the cores' rate: every FLOP (a model axis of
    ``t`` repeating a layer runs its FLOPs ``t`` times), every operation on every device, and
    each stage's ``tasks_per_micro_batch · M`` tasks' overhead (0: one program); 0 on real
    devices."""
    if not hardware.shared:
        return 0.0
    flops = sum(pre.span(pre.flops, st.start, st.stop) + (st.shape[1] - 1) * pre.repeated("flops", st.start, st.stop)
                for st in stages)
    ops = sum(pre.span(pre.ops, st.start, st.stop) * hardware.op_seconds(st.num_devices) for st in stages)
    work = 3.0 * flops * batch / hardware.total_flops * hardware.compute_scale + 3.0 * M * ops
    return work + tasks_per_micro_batch * M * sum(_task_overhead(hardware, st) for st in stages)


def _stage_costs(pre: _Prefix, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
                 stage_mesh: Sequence[int], meshes: Sequence[DeviceMesh], b: int,
                 gradient_reduction: GradientReduction) -> tuple[list[StageSeconds], tuple[float, ...]]:
    """Per stage, one micro-batch's forward and backward seconds; and per mesh, the seconds of
    its one gradient all-reduce per step (its stages' together: ring time is linear in the
    bytes), empty with ``"per_micro_batch"``, whose backwards include theirs (module doc)."""
    seconds = []
    reductions = [0.0] * len(meshes)
    offsets = np.cumsum([0] + [m.device_ids.size for m in meshes])
    for st, m in zip(stages, stage_mesh):
        f, bw = _stage_seconds(pre, st.start, st.stop, st.shape, b, hardware,
                               tensor_parallel_bandwidth(cluster, st.shape, int(offsets[m])))
        reduce = _gradient_all_reduce_s(pre, st.start, st.stop, st.shape, cluster, meshes[m])
        if gradient_reduction.in_backward:
            # The weight pass makes the parameter cotangents, so a split backward's input pass
            # (which the previous stage waits for) runs without the all-reduce.
            seconds.append(StageSeconds(f, bw + reduce, bw / 2, bw / 2 + reduce))
        else:
            seconds.append(StageSeconds(f, bw, bw / 2, bw / 2))
            reductions[m] += reduce
    return seconds, (() if gradient_reduction.in_backward else tuple(reductions))


def _with_task_overheads(seconds: Sequence[StageSeconds], stages: Sequence[StagePlan],
                         hardware: Hardware) -> list[StageSeconds]:
    """Every compute task of a pipeline lengthened by its overhead (``Hardware.task_s``)."""
    return [StageSeconds(*(t + _task_overhead(hardware, plan) for t in (
        st.forward, st.backward, st.backward_input, st.backward_weight))) for st, plan in zip(seconds, stages)]


def _launches(schedule: PipelineSchedule) -> int:
    """Programs the host launches per step: the schedule's compute tasks and moves between two
    meshes, then each stage's update."""
    crossing = sum(1 for t in schedule.order if not t.kind.is_compute
                   and len({schedule.stage_mesh[s] for s in schedule.edges[t.where]}) == 2)
    return sum(1 for t in schedule.order if t.kind.is_compute) + crossing + 2 * schedule.num_stages


def _edge_bytes(profile: ModelProfile, stages: Sequence[StagePlan], b: int) -> dict[tuple[int, int], float]:
    """Per stage edge ``(producer, consumer)``, the bytes of one micro-batch of ``b`` examples
    crossing it (a value read by several later stages crosses to each)."""
    stage_of = [k for k, st in enumerate(stages) for _ in range(st.start, st.stop)]
    edge_bytes: dict[tuple[int, int], float] = {}
    for value in profile.crossing():
        src = stage_of[value.producer]
        for dst in sorted({stage_of[c] for c in value.consumers} - {src}):
            edge_bytes[(src, dst)] = edge_bytes.get((src, dst), 0.0) + value.bytes_per_example * b
    return edge_bytes


def _first_forward_starts(seconds: Sequence[StageSeconds], edges: Sequence[tuple[int, int]]) -> list[float]:
    """Per stage, the earliest its first forward can start: after every stage it reads from has
    run its own first forward (the longest path of forwards to it; ``edges`` go from a lower
    stage to a higher one)."""
    start = [0.0] * len(seconds)
    for p, c in sorted(edges):
        start[c] = max(start[c], start[p] + seconds[p].forward)
    return start


def predict(profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
            num_micro_batches: int, schedule: str | ScheduleKind, planner: str = "meshpar", *,
            gradient_reduction: str | GradientReduction = GradientReduction.PER_STEP,
            stages_per_mesh: int = 1) -> PipelinePlan:
    """The step time and per-mesh memory of running ``stages`` (``stages_per_mesh`` on each mesh,
    as ``schedule`` places them, meshes cut from ``cluster``'s first devices) with
    ``num_micro_batches`` under ``schedule``: compute and tensor-parallel time per stage, every
    crossing value's resharding plan between its stages' meshes (none within a mesh),
    simulated; the gradient all-reduce after each mesh's last gradient task (``"per_step"``)
    or inside each backward (``"per_micro_batch"``, module doc). A stage's memory holds as
    many micro-batches' activations as the simulated schedule keeps alive there at once; a
    mesh's, its stages' peaks together. ``protocol.Planner.predict``: what calibration fits
    ``hardware`` to, for every registered planner (``protocol``'s doc).

    Raises:
      ValueError: ``num_micro_batches`` not dividing the batch, ``gradient_reduction`` not
        one of ``GradientReduction``'s names, a placement ``schedule`` cannot make, stages of one mesh
        with different shapes.
    """
    # A planner entry point (tests and benchmarks price plans with it): names resolve here.
    gradient_reduction = GradientReduction.of(gradient_reduction, "gradient_reduction")
    schedule = schedule_kind(schedule)
    S, M = len(stages), num_micro_batches
    if profile.batch_size % M:
        raise ValueError(f"num_micro_batches: {M} does not divide the batch of {profile.batch_size}")
    b = profile.batch_size // M
    layout = PipelinePlan(tuple(stages), M, schedule.name, 0.0, (0.0,), planner, stages_per_mesh)
    stage_mesh = layout.stage_mesh
    pre = _Prefix(profile)
    meshes = stage_meshes(cluster, layout.mesh_shapes)
    seconds, reductions = _stage_costs(pre, cluster, hardware, stages, stage_mesh, meshes, b, gradient_reduction)
    edge_bytes = _edge_bytes(profile, stages, b)
    edges = sorted(edge_bytes)
    times = [0.0 if stage_mesh[p] == stage_mesh[c] else
             _edge_seconds(cluster, meshes[stage_mesh[p]], meshes[stage_mesh[c]], edge_bytes[(p, c)], b)
             + hardware.move_s for p, c in edges]
    pipelined = not layout.one_program
    if pipelined and hardware.task_s:
        seconds = _with_task_overheads(seconds, stages, hardware)
    built = make_schedule(schedule, S, M, edges, num_meshes=layout.num_meshes)
    simulated = simulate(built, TaskDurations(tuple(seconds), tuple(times), tuple(times), reductions), overlap=True)
    memory = [0.0] * layout.num_meshes
    for st, m, live in zip(stages, stage_mesh, simulated.peak_live_activations):
        memory[m] += float(_memory(pre, st.start, st.stop, st.shape, b, live))
    # One stage and one micro-batch run as one program (PipeshardParallel.single_program).
    once = hardware.pipeline_s if pipelined else 0.0
    step = max(simulated.step_seconds + once, (_launches(built) if pipelined else 1) * hardware.dispatch_s,
               _shared_work_s(pre, hardware, stages, M, profile.batch_size,
                              _compute_tasks_per_micro_batch(schedule) if pipelined else 0) + once)
    return dataclasses.replace(layout, predicted_step_s=step, peak_memory_bytes=tuple(memory))


def _step_lower_bound(profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
                      M: int, gradient_reduction: GradientReduction = GradientReduction.PER_STEP, *,
                      schedule: ScheduleKind = SCHEDULES["1f1b"],
                      stages_per_mesh: int = 1, pre: _Prefix | None = None) -> float:
    """No simulated step of ``stages`` under ``schedule`` is shorter: each mesh starts no earlier
    than the first forward of one of its stages can (``_first_forward_starts``), then runs its
    stages' ``M`` forwards and backwards (with their all-reduces, ``"per_micro_batch"``) one
    after another, and a ``"per_step"`` gradient all-reduce follows the last of them; nor is
    it shorter than its launches or (shared cores) its work (``predict``'s floors). ``pre``:
    ``profile``'s prefix sums, when already made."""
    pre = _Prefix(profile) if pre is None else pre
    b = profile.batch_size // M
    layout = PipelinePlan(tuple(stages), M, schedule.name, 0.0, (0.0,), "meshpar", stages_per_mesh)
    stage_mesh = layout.stage_mesh
    meshes = stage_meshes(cluster, layout.mesh_shapes)
    seconds, reductions = _stage_costs(pre, cluster, hardware, stages, stage_mesh, meshes, b, gradient_reduction)
    pipelined = not layout.one_program
    tasks = _compute_tasks_per_micro_batch(schedule) if pipelined else 0
    starts = _first_forward_starts(seconds, list(_edge_bytes(profile, stages, b)))
    busy = [0.0] * layout.num_meshes
    start = [math.inf] * layout.num_meshes
    for s, (st, m, sec) in enumerate(zip(stages, stage_mesh, seconds)):
        busy[m] += M * (sec.forward + sec.backward + tasks * _task_overhead(hardware, st))
        start[m] = min(start[m], starts[s])
    lanes = max(start[m] + t + (reductions[m] if reductions else 0.0) for m, t in enumerate(busy))
    launches = (M * tasks + 2) * len(stages) if pipelined else 1
    return max(lanes, launches * hardware.dispatch_s,
               _shared_work_s(pre, hardware, stages, M, profile.batch_size, tasks))


def _edge_seconds(cluster: Cluster, src: DeviceMesh, dst: DeviceMesh, num_bytes: float, b: int) -> float:
    """One boundary value of ``num_bytes`` (``b`` examples, float32) resharded between the two
    stage meshes, batch-sharded over ``data`` on each, by the broadcast plan."""
    return _edge_seconds_cached(cluster, src, dst, int(num_bytes), b)


@functools.lru_cache(maxsize=4096)
def _edge_seconds_cached(cluster: Cluster, src: DeviceMesh, dst: DeviceMesh, num_bytes: int, b: int) -> float:
    if num_bytes <= 0:
        return 0.0
    width = max(1, num_bytes // (4 * b))
    shape = (b, width)

    def spec(mesh: DeviceMesh) -> ShardingSpec:
        d = mesh.device_ids.shape[0]
        return ShardingSpec(((0,) if d > 1 and b % d == 0 else (), ()))

    task = ReshardingTask(shape, 4, src, spec(src), dst, spec(dst), pad=True)
    return plan_resharding(task, cluster, strategy="broadcast", balancer="load_balance").estimated_time


def _partition(pre: _Prefix, L: int, S: int, M: int, b: int, n: int, schedule: ScheduleKind, hardware: Hardware,
               cluster: Cluster, budget: float, by_memory: bool = False,
               gradient_reduction: GradientReduction = GradientReduction.PER_STEP, *,
               num_meshes: int | None = None, shapes: Sequence[tuple[int, int]] | None = None,
               lives: Sequence[int] | None = None) -> tuple[list[StagePlan], float] | None:
    """The contiguous partition into ``S`` stages of ``n`` devices each (placed on ``num_meshes``
    meshes, default one per stage) minimising the slowest stage (each on its fastest of
    ``shapes``, default every shape of ``n`` devices splitting the micro-batch, that fits the
    ``budget`` with the micro-batches ``schedule`` keeps alive there, or ``lives[s]`` when
    given; a stage's time is one micro-batch's forward and backward, the latter with its
    all-reduce under ``"per_micro_batch"``), and that slowest stage's time; ``None`` when none
    fits the budget; with ``by_memory``, minimising the largest per-device memory instead."""
    idx_i, idx_j = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    valid = idx_j > idx_i
    shapes = [sh for sh in (_shapes(n) if shapes is None else shapes) if b % sh[0] == 0]
    if not shapes:
        return None
    per_shape = []
    for shape in shapes:
        f, bw = _stage_seconds(pre, idx_i, idx_j, shape, b, hardware, tensor_parallel_bandwidth(cluster, shape))
        if gradient_reduction.in_backward:
            # Priced on the cluster's first devices, as the tensor-parallel bandwidth: where a
            # stage lands is known only once the partition is.
            bw = bw + _gradient_all_reduce_s(pre, idx_i, idx_j, shape, cluster, stage_meshes(cluster, [shape])[0])
        # A span's memory is static + live · per_live (``_memory``): both parts once per shape.
        per_shape.append((f + bw, shape, *_memory_parts(pre, idx_i, idx_j, shape, b)))
    best = np.full((S + 1, L + 1), math.inf)
    choice = np.zeros((S + 1, L + 1), dtype=np.int64)
    shape_at = {}
    best[0, 0] = 0.0
    for s in range(S):
        live = _live(schedule, s, S, M, num_meshes) if lives is None else lives[s]
        cost = np.full((L + 1, L + 1), math.inf)
        which = np.full((L + 1, L + 1), -1)
        for k, (time, _, static, per_live) in enumerate(per_shape):
            memory = static + live * per_live
            value = memory if by_memory else time
            better = valid & (memory <= budget) & (value < cost)
            cost = np.where(better, value, cost)
            which = np.where(better, k, which)
        # best[s + 1, j] = min_i max(best[s, i], cost[i, j])
        candidates = np.maximum(best[s][:, None], cost)
        choice[s + 1] = np.argmin(candidates, axis=0)
        best[s + 1] = candidates[choice[s + 1], np.arange(L + 1)]
        shape_at[s] = which
    if not np.isfinite(best[S, L]):
        return None
    stages, j = [], L
    for s in range(S, 0, -1):
        i = int(choice[s, j])
        stages.append(StagePlan(i, j, per_shape[int(shape_at[s - 1][i, j])][1]))
        j = i
    return stages[::-1], float(best[S, L])


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where a plan runs before its cut: the first ``num_devices`` devices as ``num_meshes``
    meshes of equal size, ``stages_per_mesh`` stages each, ``num_micro_batches``, and the
    schedules (in the order asked) that place it."""

    num_devices: int
    num_meshes: int
    stages_per_mesh: int
    num_micro_batches: int
    schedules: tuple[ScheduleKind, ...]

    @property
    def num_stages(self) -> int:
        return self.num_meshes * self.stages_per_mesh

    @property
    def mesh_size(self) -> int:
        return self.num_devices // self.num_meshes

    @property
    def one_program(self) -> bool:
        return self.num_stages == 1 and self.num_micro_batches == 1


def _places(schedule: ScheduleKind, num_stages: int, num_meshes: int, num_micro_batches: int) -> bool:
    """Whether ``schedule`` runs ``num_stages`` stages on ``num_meshes`` meshes with
    ``num_micro_batches`` (the runtime's own check, ``check_stage_placement``)."""
    try:
        check_stage_placement(schedule, num_stages, num_meshes, num_micro_batches)
    except ValueError:
        return False
    return True


def _layouts(profile: ModelProfile, cluster: Cluster, constraints: PlanConstraints,
             max_micro_batches: int) -> Iterator[_Layout]:
    """Every layout the constraints admit that some of their schedules place (module doc)."""
    L, B = profile.num_layers, profile.batch_size
    counts = device_counts(cluster) if constraints.device_subsets else [cluster.num_devices]
    micro = ([constraints.num_micro_batches] if constraints.num_micro_batches is not None else
             [m for m in range(1, min(B, max_micro_batches) + 1) if B % m == 0])
    for n in counts:
        for P in (p for p in range(1, n + 1) if n % p == 0):
            for v in constraints.stages_per_mesh:
                S = P * v
                if S > L or constraints.num_stages not in (None, S):
                    continue
                for M in micro:
                    placed = tuple(s for s in constraints.schedule_kinds if _places(s, S, P, M))
                    if placed:
                        yield _Layout(n, P, v, M, placed)


def _layer_seconds(pre: _Prefix, cluster: Cluster, hardware: Hardware, layout: _Layout, batch: int,
                   gradient_reduction: GradientReduction) -> np.ndarray:
    """Per layer, the least seconds it adds to the mesh running it in a step of ``layout``, over
    the shapes a mesh may take (those splitting the micro-batch) and the places a mesh may sit
    (its links): its ``M`` forwards and backwards with their tensor-parallel all-reduces, and
    its gradient all-reduce, once or in every backward. Shape ``(L,)``; ``inf`` everywhere when
    no shape splits the micro-batch."""
    M, size, L = layout.num_micro_batches, layout.mesh_size, len(pre.ops) - 1
    i, j, b = np.arange(L), np.arange(1, L + 1), batch // M
    best = np.full(L, math.inf)
    for shape in (sh for sh in _shapes(size) if b % sh[0] == 0):
        # Meshes laid over hosts alike have the same links: price one of each kind.
        places = {}
        for k, mesh in enumerate(stage_meshes(cluster, [shape] * layout.num_meshes)):
            places.setdefault(tuple((mesh.host_ids - mesh.host_ids.min()).flat), (k * size, mesh))
        tp = max(tensor_parallel_bandwidth(cluster, shape, first) for first, _ in places.values())
        f, bw = _stage_seconds(pre, i, j, shape, b, hardware, tp)
        reduce = np.min([_gradient_all_reduce_s(pre, i, j, shape, cluster, mesh) for _, mesh in places.values()],
                        axis=0)
        best = np.minimum(best, M * (f + bw) + gradient_reduction.reductions_per_step(M) * reduce)
    return best


def _layout_bound(pre: _Prefix, hardware: Hardware, layout: _Layout, batch: int, layer_seconds: float) -> float:
    """No plan of ``layout`` steps faster: whatever the partition, each stage's forward of a
    micro-batch costs at least its FLOPs over all its mesh's devices and its operations, so
    with ``X`` that of the whole model, micro-batch 0's forwards and input passes run one after
    another (``2 X``); a mesh's lane holds the seconds its layers add at the least
    (``layer_seconds``: ``_layer_seconds`` summed over the layers), so the busiest at least
    ``1 / P`` of them; and launches and (shared cores) work bound the step as in ``predict``."""
    P, M, S, size = layout.num_meshes, layout.num_micro_batches, layout.num_stages, layout.mesh_size
    x = (float(pre.flops[-1]) * (batch // M) / (size * hardware.device_flops) * hardware.compute_scale
         + float(pre.ops[-1]) * hardware.op_seconds(size))
    tasks = 0 if layout.one_program else min(_compute_tasks_per_micro_batch(s) for s in layout.schedules)
    overhead = hardware.task_s * size if tasks else 0.0
    chain = 2.0 * (x + S * overhead)
    lanes = (layer_seconds + M * S * tasks * overhead) / P
    launches = (M * tasks + 2) * S if tasks else 1
    shared = 0.0
    if hardware.shared:
        shared = (3.0 * float(pre.flops[-1]) * batch / hardware.total_flops * hardware.compute_scale
                  + 3.0 * M * float(pre.ops[-1]) * hardware.op_seconds(size) + M * S * tasks * overhead)
    return max(chain, lanes, launches * hardware.dispatch_s, shared)


def _signature(layout: _Layout, schedule: ScheduleKind, stages: Sequence[StagePlan]) -> tuple:
    """What a plan runs: its stages, and the one program or each mesh's tasks in order and which
    stages it hosts (two schedules giving the same are one plan)."""
    if layout.one_program:
        return tuple(stages), "one program"
    sequences = tuple(map(tuple, mesh_sequences(schedule, layout.num_stages, layout.num_micro_batches,
                                                layout.num_meshes)))
    return tuple(stages), layout.num_micro_batches, _stage_mesh(schedule, layout.num_stages,
                                                                 layout.num_meshes), sequences


class _Partitions:
    """The partition DP of each layout and schedule, each distinct DP computed once: the
    schedule enters only through the micro-batches it keeps alive, against the budget."""

    def __init__(self, pre: _Prefix, profile: ModelProfile, cluster: Cluster, hardware: Hardware,
                 constraints: PlanConstraints) -> None:
        self._pre, self._profile, self._cluster, self._hardware = pre, profile, cluster, hardware
        self._constraints = constraints
        self._found: dict[tuple, tuple[list[StagePlan], float] | None] = {}
        self._live: dict[tuple[ScheduleKind, int, int, int], tuple[int, ...]] = {}

    def __call__(self, layout: _Layout, schedule: ScheduleKind) -> list[StagePlan] | None:
        """The fastest partition of ``layout`` under ``schedule`` fitting the budget, or ``None``."""
        S, M, budget = layout.num_stages, layout.num_micro_batches, self._constraints.budget
        # No stage keeps more than M micro-batches alive: when the fastest partition of all fits
        # with that many, it is every schedule's (and counting a schedule's live micro-batches,
        # which builds its tasks, is spared).
        worst = self._dp(layout, (M,) * S, budget)
        if math.isinf(budget) or (worst is not None and worst[1] == self._dp(layout, (M,) * S, math.inf)[1]):
            return None if worst is None else worst[0]
        exact = self._dp(layout, self._lives(layout, schedule), budget)
        return None if exact is None else exact[0]

    def _lives(self, layout: _Layout, schedule: ScheduleKind) -> tuple[int, ...]:
        S, P, M = layout.num_stages, layout.num_meshes, layout.num_micro_batches
        if (schedule, S, P, M) not in self._live:
            self._live[(schedule, S, P, M)] = tuple(_live(schedule, s, S, M, P) for s in range(S))
        return self._live[(schedule, S, P, M)]

    def _dp(self, layout: _Layout, lives: tuple[int, ...], budget: float) -> tuple[list[StagePlan], float] | None:
        key = (layout.num_devices, layout.num_meshes, layout.stages_per_mesh, layout.num_micro_batches, lives,
               budget)
        if key in self._found:
            return self._found[key]
        cluster = first_devices(self._cluster, layout.num_devices)
        v = layout.stages_per_mesh
        # Stages sharing a mesh share its shape: one DP per shape, each stage within 1 / v of
        # the budget (so the mesh's stages together fit it).
        options = [None] if v == 1 else [[shape] for shape in _shapes(layout.mesh_size)]
        found = [_partition(self._pre, self._profile.num_layers, layout.num_stages, layout.num_micro_batches,
                            self._profile.batch_size // layout.num_micro_batches, layout.mesh_size,
                            layout.schedules[0], self._hardware, cluster, budget / v,
                            gradient_reduction=self._constraints.gradient_reduction,
                            num_meshes=layout.num_meshes, shapes=shapes, lives=lives) for shapes in options]
        found = [f for f in found if f is not None]
        self._found[key] = min(found, key=lambda f: f[1]) if found else None
        return self._found[key]


def plan(profile: ModelProfile, cluster: Cluster, hardware: Hardware,
         constraints: PlanConstraints = PlanConstraints(), *, max_micro_batches: int | None = None,
         num_ranked: int = NUM_RANKED) -> list[PipelinePlan]:
    """meshpar's plans for ``profile`` on ``cluster``, ranked fastest first (module doc):
    ``protocol.Planner.plan``. Micro-batch counts divide the batch, at most
    ``max_micro_batches`` (default the batch).

    Layouts, then partitions, are taken in the order of a lower bound on their step
    (``_layout_bound``, ``_step_lower_bound``) until the bound reaches the ``num_ranked``-th
    fastest simulated step: the first ``num_ranked`` plans returned are the fastest of all,
    exactly, and what cannot be among them is never partitioned or simulated.

    Raises:
      NoPlanFits: nothing fits ``constraints.memory_budget_bytes`` (naming the smallest memory
        any plan needs), or no layout meets the fixed counts and schedules.
      ValueError: ``max_micro_batches`` or ``num_ranked`` not a positive integer.
    """
    if max_micro_batches is None:
        max_micro_batches = profile.batch_size
    if not isinstance(max_micro_batches, int) or max_micro_batches < 1:
        raise ValueError(f"max_micro_batches: expected a positive integer or None, got {max_micro_batches!r}")
    if not isinstance(num_ranked, int) or num_ranked < 1:
        raise ValueError(f"num_ranked: expected a positive integer, got {num_ranked!r}")
    pre = _Prefix(profile)
    partitions = _Partitions(pre, profile, cluster, hardware, constraints)
    B, reduction = profile.batch_size, constraints.gradient_reduction
    layer_seconds: dict[tuple[int, int, int], float] = {}

    def bound(layout: _Layout) -> float:
        key = (layout.num_devices, layout.num_meshes, layout.num_micro_batches)
        if key not in layer_seconds:
            layer_seconds[key] = float(np.sum(_layer_seconds(pre, first_devices(cluster, layout.num_devices),
                                                             hardware, layout, B, reduction)))
        return _layout_bound(pre, hardware, layout, B, layer_seconds[key])

    # Best first: (lower bound, tie-break, layout, schedule and stages once partitioned).
    queue: list[tuple[float, int, _Layout, tuple[ScheduleKind, list[StagePlan]] | None]] = [
        (bound(layout), k, layout, None) for k, layout in enumerate(_layouts(profile, cluster, constraints,
                                                                            max_micro_batches))]
    if not queue:
        raise NoPlanFits(f"num_stages, num_micro_batches, schedules: no layout of {cluster.num_devices} devices, "
                         f"{profile.num_layers} layers and a batch of {profile.batch_size}{constraints.fixed_counts()} "
                         f"runs under {constraints.schedule_names} with stages_per_mesh in "
                         f"{constraints.stages_per_mesh}")
    heapq.heapify(queue)
    counter = len(queue)
    plans: list[PipelinePlan] = []
    steps: list[float] = []
    seen: set[tuple] = set()
    while queue:
        bound, _, layout, cut = heapq.heappop(queue)
        if len(steps) >= num_ranked and bound >= steps[num_ranked - 1]:
            break
        if cut is None:
            sub = first_devices(cluster, layout.num_devices)
            for schedule in layout.schedules:
                stages = partitions(layout, schedule)
                if stages is not None:
                    tight = _step_lower_bound(profile, sub, hardware, stages, layout.num_micro_batches, reduction,
                                              schedule=schedule, stages_per_mesh=layout.stages_per_mesh, pre=pre)
                    heapq.heappush(queue, (max(bound, tight), counter, layout, (schedule, stages)))
                    counter += 1
            continue
        schedule, stages = cut
        signature = _signature(layout, schedule, stages)
        if signature in seen:
            continue
        seen.add(signature)
        priced = predict(profile, first_devices(cluster, layout.num_devices), hardware, stages,
                         layout.num_micro_batches, schedule, gradient_reduction=reduction,
                         stages_per_mesh=layout.stages_per_mesh)
        plans.append(priced)
        steps = sorted(steps + [priced.predicted_step_s])
    if not plans:
        least = _least_memory(profile, cluster, constraints, max_micro_batches)
        raise NoPlanFits(f"memory_budget_bytes: {constraints.budget:.4g} bytes per device fits no plan; the least "
                         f"any plan needs is {least:.4g} bytes")
    return sorted(plans, key=lambda p: (p.predicted_step_s, max(p.peak_memory_bytes), p.num_devices))


def _least_memory(profile: ModelProfile, cluster: Cluster, constraints: PlanConstraints,
                  max_micro_batches: int) -> float:
    """The smallest per-device memory a plan of the search needs: over the layouts on every
    device (fewer devices hold more), each schedule's partition minimising its largest stage's
    memory, times the stages sharing a mesh (as the search budgets them)."""
    pre, least = _Prefix(profile), math.inf
    unbounded = dataclasses.replace(constraints, memory_budget_bytes=None, device_subsets=False)
    done = set()
    for layout in _layouts(profile, cluster, unbounded, max_micro_batches):
        S, P, v, M = layout.num_stages, layout.num_meshes, layout.stages_per_mesh, layout.num_micro_batches
        for schedule in layout.schedules:
            live = tuple(_live(schedule, s, S, M, P) for s in range(S))
            if (P, v, M, live) in done:
                continue
            done.add((P, v, M, live))
            for shapes in [None] if v == 1 else [[shape] for shape in _shapes(layout.mesh_size)]:
                found = _partition(pre, profile.num_layers, S, M, profile.batch_size // M, layout.mesh_size,
                                   schedule, Hardware(1.0), cluster, math.inf, by_memory=True, num_meshes=P,
                                   shapes=shapes)
                if found is not None:
                    least = min(least, found[1] * v)
    return least
