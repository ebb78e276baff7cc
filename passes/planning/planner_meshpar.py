"""meshpar's automatic planner: stage cuts, per-stage mesh shapes, micro-batches and schedule,
priced with what the other planners leave out: each cross-mesh edge by the resharding plan
(``plan_resharding``) between the actual stage meshes, which may differ in shape, and the step
by the schedule simulator, which overlaps transfers with compute.

Search, for every stage count ``S`` dividing the devices and micro-batch count ``M``:

1. a DP over contiguous layer partitions minimising the slowest stage, each stage on its
   fastest (data, model) shape that fits the memory budget at its position in the schedule
   (stage ``s`` of a 1F1B pipeline keeps ``min(S - s, M)`` micro-batches alive; eager-1F1B
   ``min(2(S - s) - 1, M)``);
2. the step of that partition simulated under 1F1B and eager-1F1B with every edge's
   resharding priced, and the data-parallel gradient all-reduce where it runs
   (``gradient_reduction``, below); candidates in the order of a lower bound on their step,
   until the bound passes the fifth fastest simulated (branch and bound: a 1,024-device
   cluster has ~150 candidates, and the long schedules among them take seconds each to build
   and simulate).

Costs (per micro-batch of ``b`` examples, stage on a ``(d, t)`` mesh of devices of
``device_flops``): forward ``flops · b / (d · t · device_flops)`` plus the tensor-parallel
all-reduces ``2 (t - 1) / t · tp_bytes · b / d / B'`` (Megatron's two per layer, ATP's Eq. 4 with
its hierarchical bandwidth ``B'`` of the model axis: ``tensor_parallel_bandwidth``; ``tp_bytes`` sized by the
step's compiled HLO when planned on local devices: ``meshpar.planning.compiled_tensor_parallel``); backward twice the forward's compute
and as much communication. On an emulated cluster whose devices share a few cores
(``Hardware.total_flops``), no step is faster than all its FLOPs at that rate, and none is
faster than the host launching its tasks one by one (``Hardware.dispatch_s``).

The gradient all-reduce of a stage, a ring over its mesh's data axis of its parameter bytes
over ``t``, ``2 (d - 1) / d · param_bytes / t / B_data``, runs as ``gradient_reduction``
(``pipeline_options.GRADIENT_REDUCTIONS``) says: ``"per_step"`` once per step, priced after the
simulated step (the slowest stage's); ``"per_micro_batch"`` in every backward, which it
lengthens: ``M`` per step, on the critical path, and counted in the partition DP's stage time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from ..model.cluster import Cluster
from ..model.mesh import DeviceMesh
from ..model.sharding_spec import ShardingSpec

from .layer_profile import ModelProfile
from ..pipeline.pipeline_options import GRADIENT_REDUCTIONS
from ..pipeline.scheduling.pipeline_schedule import make_schedule, schedule_kind
from ..resharding.plan_resharding import plan_resharding
from .planner_atp import mesh_bandwidths
from ..resharding.resharding_task import ReshardingTask
from ..simulation.schedule_simulator import StageSeconds, TaskDurations, simulate

__all__ = ["Hardware", "StagePlan", "PipelinePlan", "stage_meshes", "tensor_parallel_bandwidth", "predict", "search",
           "NoPlanFits"]

SCHEDULES = ("1f1b", "eager_1f1b")
# Plans search ranks exactly, fastest first (the chosen one and four alternatives).
NUM_RANKED = 5


class NoPlanFits(ValueError):
    """No plan fits the memory budget."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What a device computes: ``device_flops`` sustained FLOP/s each; ``total_flops`` caps the
    whole cluster (virtual CPU devices sharing a few cores), ``inf`` when devices are real;
    ``dispatch_s`` host seconds to launch one task (the runtime launches every task of a step
    from one thread, so no step is faster than its launches); ``compute_scale`` multiplies
    every compute estimate: a model's measured step over its FLOP-and-op estimate on this
    machine (what fusion and memory traffic make of its FLOPs), 1 when not calibrated;
    ``task_s`` the seconds each compute task of a pipeline (a forward or a backward of one
    stage and micro-batch) costs beyond its compute per device of its stage's mesh (launching
    its program on each device, its operands and results, its share of the stage's update:
    on CPU each device's partition is launched and run on its own), and ``move_s`` the seconds
    each move between two stage meshes costs beyond its bytes (its latency): 0 until fitted on
    a measured pipeline
    (``meshpar.planning.calibrate_pipeline``). A step of one stage and one micro-batch runs as
    one program and pays neither."""

    device_flops: float
    total_flops: float = math.inf
    dispatch_s: float = 0.0
    op_s: tuple[float, float] = (0.0, 0.0)
    compute_scale: float = 1.0
    task_s: float = 0.0
    move_s: float = 0.0

    def __post_init__(self) -> None:
        if (not self.device_flops > 0 or not self.total_flops > 0 or not self.dispatch_s >= 0
                or len(self.op_s) != 2 or not min(self.op_s) >= 0 or not self.compute_scale > 0
                or not self.task_s >= 0 or not self.move_s >= 0):
            raise ValueError(f"device_flops, total_flops, dispatch_s, op_s, task_s, move_s: expected positive "
                             f"FLOP/s and seconds >= 0, got {self}")

    def op_seconds(self, num_devices: int) -> float:
        """Seconds one operation of a program on ``num_devices`` devices takes besides its
        FLOPs: ``op_s[0] + op_s[1] · num_devices`` (virtual CPU devices run every operation
        on shared cores; on accelerators a kernel launch, whatever the mesh)."""
        return self.op_s[0] + self.op_s[1] * num_devices

    @property
    def shared(self) -> bool:
        """Whether the devices share compute (``total_flops`` is finite): stages then do not
        run in parallel, and no step beats the sum of its tasks' work."""
        return math.isfinite(self.total_flops)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Layers ``[start, stop)`` on a ``(data, model)`` mesh."""

    start: int
    stop: int
    shape: tuple[int, int]


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """A planner's choice and what it predicts.

    Attributes:
      stages: contiguous, covering every layer once, in order.
      num_micro_batches: M.
      schedule: a ``pipeline_schedule.SCHEDULES`` name.
      predicted_step_s: seconds per step.
      peak_memory_bytes: per stage, the most bytes one of its devices holds.
      planner: which planner chose it.
    """

    stages: tuple[StagePlan, ...]
    num_micro_batches: int
    schedule: str
    predicted_step_s: float
    peak_memory_bytes: tuple[float, ...]
    planner: str = "meshpar"

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def cut_points(self) -> tuple[int, ...]:
        """The markers that cut: after layer ``stop - 1`` of every stage but the last."""
        return tuple(s.stop - 1 for s in self.stages[:-1])

    def summary(self) -> str:
        shapes = ", ".join(f"L{s.start}-{s.stop - 1} on {s.shape}" for s in self.stages)
        return (f"{self.planner}: {self.num_stages} stages [{shapes}], {self.num_micro_batches} micro-batches, "
                f"{self.schedule}: {self.predicted_step_s * 1e3:.2f} ms/step predicted, peak "
                f"{max(self.peak_memory_bytes) / 2**20:.1f} MiB/device")


def _shapes(n: int) -> list[tuple[int, int]]:
    return [(d, n // d) for d in range(1, n + 1) if n % d == 0]


def stage_meshes(cluster: Cluster, shapes: Sequence[tuple[int, int]]) -> list[DeviceMesh]:
    """The stage meshes of ``shapes``, cut host-major from ``cluster``'s devices in order."""
    flat = [(d, h) for h, devs in enumerate(cluster.host_devices) for d in devs]
    out, at = [], 0
    for d, t in shapes:
        chunk = flat[at:at + d * t]
        if len(chunk) < d * t:
            raise ValueError(f"shapes: {list(shapes)} need more than the cluster's {len(flat)} devices")
        ids = np.array([c[0] for c in chunk]).reshape(d, t)
        hosts = np.array([c[1] for c in chunk]).reshape(d, t)
        out.append(DeviceMesh(ids, hosts, ("data", "model")))
        at += d * t
    return out


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


def _all_reduce_s(num_bytes: float, ring: int, bandwidth: float) -> float:
    return 0.0 if ring <= 1 else 2.0 * (ring - 1) / ring * num_bytes / bandwidth


def _check_gradient_reduction(gradient_reduction: str) -> None:
    if gradient_reduction not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction: expected one of {GRADIENT_REDUCTIONS}, got {gradient_reduction!r}")


class _Prefix:
    """Prefix sums of the layers' figures: a span's totals in O(1), vectorised over spans."""

    def __init__(self, profile: ModelProfile) -> None:
        def prefix(values):
            return np.concatenate([[0.0], np.cumsum(values)])

        layers = profile.layers
        self.flops = prefix([x.flops for x in layers])
        self.tp = prefix([x.tp_bytes for x in layers])
        self.static = prefix([x.param_bytes + x.optimizer_bytes for x in layers])
        self.params = prefix([x.param_bytes for x in layers])
        self.acts = prefix([x.activation_bytes for x in layers])
        self.ops = prefix([x.num_ops for x in layers])

    @staticmethod
    def span(p: np.ndarray, i, j):
        return p[j] - p[i]


def _live(schedule: str, s: int, S: int, M: int) -> int:
    return schedule_kind(schedule).peak_live(s, S, M)


def _stage_seconds(pre: _Prefix, i, j, shape: tuple[int, int], b: int, hardware: Hardware, tp_bw: float):
    d, t = shape
    compute = pre.span(pre.flops, i, j) * b / (d * t * hardware.device_flops)
    compute = (compute + pre.span(pre.ops, i, j) * hardware.op_seconds(d * t)) * hardware.compute_scale
    comm = _all_reduce_s(pre.span(pre.tp, i, j) * b / d, t, tp_bw)
    return compute + comm, 2.0 * compute + comm


def _gradient_all_reduce_s(pre: _Prefix, i, j, shape: tuple[int, int], cluster: Cluster, mesh: DeviceMesh):
    """One all-reduce of layers ``[i, j)``'s parameter gradients over the data axis of ``mesh``
    (shaped ``shape``): each device holds ``1 / t`` of them."""
    d, t = shape
    return _all_reduce_s(pre.span(pre.params, i, j) / t, d, _axis_bandwidth(cluster, mesh, 0))


def _memory(pre: _Prefix, i, j, shape: tuple[int, int], b: int, live: int):
    d, t = shape
    return pre.span(pre.static, i, j) / t + live * pre.span(pre.acts, i, j) * b / (d * t)


def predict(profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
            num_micro_batches: int, schedule: str, planner: str = "meshpar", *,
            gradient_reduction: str = "per_step") -> PipelinePlan:
    """The step time and per-stage memory of running ``stages`` with ``num_micro_batches``
    under ``schedule``: compute and tensor-parallel time per stage, every crossing value's
    resharding plan between its stages' meshes, simulated; the gradient all-reduce after the
    simulated step (``"per_step"``) or inside each backward (``"per_micro_batch"``, module
    doc). A stage's memory holds as many micro-batches' activations as the simulated schedule
    keeps alive there at once.

    Raises:
      ValueError: ``num_micro_batches`` not dividing the batch, or ``gradient_reduction`` not
        one of ``GRADIENT_REDUCTIONS``.
    """
    _check_gradient_reduction(gradient_reduction)
    S, M = len(stages), num_micro_batches
    if profile.batch_size % M:
        raise ValueError(f"num_micro_batches: {M} does not divide the batch of {profile.batch_size}")
    b = profile.batch_size // M
    pre = _Prefix(profile)
    meshes = stage_meshes(cluster, [s.shape for s in stages])
    seconds, after = _stage_costs(pre, cluster, hardware, stages, meshes, b, gradient_reduction)
    stage_of = [k for k, st in enumerate(stages) for _ in range(st.start, st.stop)]
    edge_bytes: dict[tuple[int, int], float] = {}
    for value in profile.crossing():
        src = stage_of[value.producer]
        for dst in sorted({stage_of[c] for c in value.consumers} - {src}):
            edge_bytes[(src, dst)] = edge_bytes.get((src, dst), 0.0) + value.bytes_per_example * b
    edges = sorted(edge_bytes)
    times = [_edge_seconds(cluster, meshes[p], meshes[c], stages[p].shape, stages[c].shape, edge_bytes[(p, c)], b)
             + hardware.move_s for p, c in edges]
    pipelined = not S == M == 1
    if pipelined and hardware.task_s:
        seconds = [StageSeconds(*(t + _task_overhead(hardware, plan) for t in (
                       st.forward, st.backward, st.backward_input, st.backward_weight)))
                   for st, plan in zip(seconds, stages)]
    simulated = simulate(make_schedule(schedule, S, M, edges),
                         TaskDurations(tuple(seconds), tuple(times), tuple(times)), overlap=True)
    step = simulated.step_seconds
    memory = [float(_memory(pre, st.start, st.stop, st.shape, b, live))
              for st, live in zip(stages, simulated.peak_live_activations)]
    # Compute and transfer tasks, then each stage's update; one stage and one micro-batch run
    # as one program (PipeshardParallel.single_program).
    launches = M * (2 * S + 2 * len(edges)) + 2 * S if pipelined else 1
    step = max(step + after, launches * hardware.dispatch_s)
    if hardware.shared:
        work = 3.0 * float(pre.flops[-1]) * profile.batch_size / hardware.total_flops + 3.0 * M * sum(
            pre.span(pre.ops, st.start, st.stop) * hardware.op_seconds(st.shape[0] * st.shape[1]) for st in stages)
        # A task's overhead is work of the shared cores too.
        overheads = 2 * M * sum(_task_overhead(hardware, st) for st in stages) if pipelined else 0.0
        step = max(step, work * hardware.compute_scale + overheads)
    return PipelinePlan(tuple(stages), M, schedule, step, tuple(memory), planner)


def _task_overhead(hardware: Hardware, stage: StagePlan) -> float:
    """What one compute task of ``stage`` costs beyond its compute: ``task_s`` per device."""
    return hardware.task_s * stage.shape[0] * stage.shape[1]


def _stage_costs(pre: _Prefix, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
                 meshes: Sequence[DeviceMesh], b: int, gradient_reduction: str) -> tuple[list[StageSeconds], float]:
    """Per stage, one micro-batch's forward and backward seconds, and the seconds the gradient
    all-reduces add after the simulated step (module doc): the slowest stage's with
    ``"per_step"``, none with ``"per_micro_batch"``, whose backwards include theirs."""
    seconds, sync = [], []
    offsets = np.cumsum([0] + [s.shape[0] * s.shape[1] for s in stages])
    for k, (st, mesh) in enumerate(zip(stages, meshes)):
        f, bw = _stage_seconds(pre, st.start, st.stop, st.shape, b, hardware,
                               tensor_parallel_bandwidth(cluster, st.shape, int(offsets[k])))
        reduce = _gradient_all_reduce_s(pre, st.start, st.stop, st.shape, cluster, mesh)
        if gradient_reduction == "per_micro_batch":
            # The weight pass makes the parameter cotangents, so a split backward's input pass
            # (which the previous stage waits for) runs without the all-reduce.
            seconds.append(StageSeconds(f, bw + reduce, bw / 2, bw / 2 + reduce))
        else:
            seconds.append(StageSeconds(f, bw, bw / 2, bw / 2))
            sync.append(reduce)
    return seconds, max(sync, default=0.0)


def _step_lower_bound(pre: _Prefix, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
                      M: int, b: int, gradient_reduction: str = "per_step") -> float:
    """No simulated step of ``stages`` is shorter: a stage runs its ``M`` forwards and
    backwards (with their all-reduces, ``"per_micro_batch"``) one after another, and a
    ``"per_step"`` gradient all-reduce follows the last of them."""
    meshes = stage_meshes(cluster, [s.shape for s in stages])
    seconds, after = _stage_costs(pre, cluster, hardware, stages, meshes, b, gradient_reduction)
    return M * max(s.forward + s.backward for s in seconds) + after


def _edge_seconds(cluster: Cluster, src: DeviceMesh, dst: DeviceMesh, src_shape, dst_shape, num_bytes: float,
                  b: int) -> float:
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


def _partition(pre: _Prefix, L: int, S: int, M: int, b: int, n: int, schedule: str, hardware: Hardware,
               cluster: Cluster, budget: float, by_memory: bool = False,
               gradient_reduction: str = "per_step") -> tuple[list[StagePlan], float] | None:
    """The contiguous partition into ``S`` stages of ``n`` devices minimising the slowest
    stage (each on its fastest shape that fits; a stage's time is one micro-batch's forward
    and backward, the latter with its all-reduce under ``"per_micro_batch"``), or ``None``
    when none fits the budget; with ``by_memory``, minimising the largest per-device memory
    instead."""
    idx_i, idx_j = np.meshgrid(np.arange(L + 1), np.arange(L + 1), indexing="ij")
    valid = idx_j > idx_i
    shapes = [sh for sh in _shapes(n) if b % sh[0] == 0]
    if not shapes:
        return None
    per_shape = []
    for k, shape in enumerate(shapes):
        f, bw = _stage_seconds(pre, idx_i, idx_j, shape, b, hardware, tensor_parallel_bandwidth(cluster, shape))
        if gradient_reduction == "per_micro_batch":
            # Priced on the cluster's first devices, as the tensor-parallel bandwidth: where a
            # stage lands is known only once the partition is.
            bw = bw + _gradient_all_reduce_s(pre, idx_i, idx_j, shape, cluster, stage_meshes(cluster, [shape])[0])
        per_shape.append((f + bw, shape))
    INF = math.inf
    best = np.full((S + 1, L + 1), INF)
    choice = np.zeros((S + 1, L + 1), dtype=np.int64)
    shape_at = {}
    best[0, 0] = 0.0
    for s in range(S):
        live = _live(schedule, s, S, M)
        cost = np.full((L + 1, L + 1), INF)
        which = np.full((L + 1, L + 1), -1)
        for k, (time, shape) in enumerate(per_shape):
            memory = _memory(pre, idx_i, idx_j, shape, b, live)
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


def search(profile: ModelProfile, cluster: Cluster, hardware: Hardware, memory_budget_bytes: float | None = None,
           schedules: Sequence[str] = SCHEDULES, max_micro_batches: int | None = None,
           num_stages: int | None = None, num_micro_batches: int | None = None,
           num_ranked: int = NUM_RANKED, *, gradient_reduction: str = "per_step") -> list[PipelinePlan]:
    """Every stage count, micro-batch count (dividing the batch, at most ``max_micro_batches``,
    default the batch) and schedule's best partition, ranked fastest first (module docstring);
    ``num_stages`` / ``num_micro_batches`` fix one; every step priced with the gradient
    all-reduce where ``gradient_reduction`` runs it.

    Candidates are simulated in the order of a lower bound on their step
    (``_step_lower_bound``) until the bound reaches the ``num_ranked``-th fastest simulated
    step: the first ``num_ranked`` plans returned are the fastest of all, exactly, and the
    long schedules (many stages and micro-batches) that cannot be among them are never built.

    Raises:
      NoPlanFits: nothing fits ``memory_budget_bytes``, naming the smallest memory any plan needs.
      ValueError: ``max_micro_batches`` or ``num_ranked`` not a positive integer,
        ``gradient_reduction`` not one of ``GRADIENT_REDUCTIONS``.
    """
    N, L, B = cluster.num_devices, profile.num_layers, profile.batch_size
    if max_micro_batches is None:
        max_micro_batches = B
    if not isinstance(max_micro_batches, int) or max_micro_batches < 1:
        raise ValueError(f"max_micro_batches: expected a positive integer or None, got {max_micro_batches!r}")
    if not isinstance(num_ranked, int) or num_ranked < 1:
        raise ValueError(f"num_ranked: expected a positive integer, got {num_ranked!r}")
    _check_gradient_reduction(gradient_reduction)
    budget = math.inf if memory_budget_bytes is None else float(memory_budget_bytes)
    pre = _Prefix(profile)
    candidates = []
    stage_counts = [num_stages] if num_stages is not None else [s for s in range(1, min(N, L) + 1) if N % s == 0]
    for S in stage_counts:
        counts = ([num_micro_batches] if num_micro_batches is not None else
                  [m for m in range(1, min(B, max_micro_batches) + 1) if B % m == 0 and (m == 1 or m >= S)])
        for M in counts:
            for schedule in schedules:
                found = _partition(pre, L, S, M, B // M, N // S, schedule, hardware, cluster, budget,
                                   gradient_reduction=gradient_reduction)
                if found is not None:
                    bound = _step_lower_bound(pre, cluster, hardware, found[0], M, B // M, gradient_reduction)
                    candidates.append((bound, len(candidates), found[0], M, schedule))
    if not candidates:
        raise NoPlanFits(f"memory_budget_bytes: {budget:.4g} bytes per device fits no plan; the least any plan "
                         f"needs is {_least_memory(profile, cluster, max_micro_batches):.4g} bytes")
    plans: list[PipelinePlan] = []
    for bound, _, stages, M, schedule in sorted(candidates, key=lambda c: c[:2]):
        if len(plans) >= num_ranked and bound >= sorted(p.predicted_step_s for p in plans)[num_ranked - 1]:
            break
        plans.append(predict(profile, cluster, hardware, stages, M, schedule, gradient_reduction=gradient_reduction))
    return sorted(plans, key=lambda p: (p.predicted_step_s, max(p.peak_memory_bytes)))


def _least_memory(profile: ModelProfile, cluster: Cluster, max_micro_batches: int) -> float:
    """The smallest per-device memory of any plan: each stage count's partition minimising its
    largest stage's memory (1F1B, which keeps no more alive than eager-1F1B)."""
    N, L, B = cluster.num_devices, profile.num_layers, profile.batch_size
    pre, least = _Prefix(profile), math.inf
    for S in (s for s in range(1, min(N, L) + 1) if N % s == 0):
        for M in (m for m in range(1, min(B, max_micro_batches) + 1) if B % m == 0 and (m == 1 or m >= S)):
            found = _partition(pre, L, S, M, B // M, N // S, "1f1b", Hardware(1.0), cluster, math.inf, by_memory=True)
            if found is not None:
                least = min(least, found[1])
    return least
