"""``meshpar.plan_parallelism``: choose stage cuts, stage meshes, micro-batches and schedule.

The step is traced once (nothing runs); its loss is cut at every ``mark_stage_boundary()``
into layers (``passes.profile_layers``); a planner (``PLANNERS``) partitions them. The result
runs as planned with ``parallelize(step, method=plan.method)``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshpar.autodiff import tracing_pipeline
from meshpar.cluster import Cluster
from meshpar.batch_arguments import batch_size
from meshpar.grad_call import find_grad_call
from meshpar.nnx_state import has_variables, partition_specs
from meshpar.passes.pipeline.placing.edge_transfer import Direction, EdgeTransfer, TransferKind
from meshpar.passes.pipeline.pipeline_options import GRADIENT_REDUCTIONS
from meshpar.passes.pipeline.scheduling.pipeline_tasks import TaskKind
from meshpar.passes.simulation.cost_model import DEVICE_FLOPS
from meshpar.passes.planning.hlo_collectives import all_reduce_equivalent_bytes
from meshpar.passes.planning.layer_profile import ModelProfile
from meshpar.passes.planning.planner_alpa import search as alpa_search
from meshpar.passes.planning.planner_amp import MEGATRON_PLACEMENT, search as amp_search
from meshpar.passes.planning.planner_galvatron import search as galvatron_search
from meshpar.passes.planning.planner_meshpar import Hardware, NoPlanFits, PipelinePlan, StagePlan, predict, search, stage_meshes
from meshpar.passes.planning.profile_layers import profile_layers
from meshpar.passes.pipeline.cutting.layer_clustering import insert_layer_markers, max_layers
from meshpar.passes.pipeline.cutting.stage_graph import count_markers, split_stages
from meshpar.pipeshard_parallel import PipeshardParallel
from meshpar.reshard import plan_between
from meshpar.runtime.step_trace import StepRecorder
from meshpar.step_compiler import compile_step, leaf_dtype

# Layers a loss without stage markers is cut into for planning.
AUTO_LAYERS = 8

__all__ = ["PLANNERS", "ParallelismPlan", "plan_parallelism", "measure_hardware", "calibrate", "calibrate_pipeline",
           "estimated_transfer_s", "profile_step",
           "compiled_tensor_parallel"]

def _amp(profile: ModelProfile, cluster: Cluster, hardware: Hardware, budget: float | None, stages: int | None,
         micro: int | None, schedules: Sequence[str], gradient_reduction: str) -> list[PipelinePlan]:
    """AMP's search (``passes.planner_amp``) as ``PipelinePlan``s: its plans with Megatron's
    placement (the stage meshes meshpar cuts), priced by AMP's own model, 1F1B, whose gradient
    synchronisation is its paper's whatever ``gradient_reduction`` the runtime uses. AMP knows a
    device by its FLOP/s: the calibrated rate (``Hardware.compute_scale``), as meshpar's own."""
    try:
        found = amp_search(profile, cluster, hardware.device_flops / hardware.compute_scale, budget)
    except ValueError as e:
        raise NoPlanFits(str(e)) from None
    plans = [PipelinePlan(tuple(StagePlan(a, b, (p.dp, p.tp)) for a, b in zip(p.partition, p.partition[1:])),
                          p.num_micro_batches, "1f1b", p.predicted_step_s, (p.peak_memory_bytes,) * p.pp, "amp")
             for p in found if p.placement == MEGATRON_PLACEMENT]
    plans = [p for p in plans if (stages is None or p.num_stages == stages)
             and (micro is None or p.num_micro_batches == micro)]
    if not plans:
        raise NoPlanFits(f"planner: AMP found no plan with Megatron's placement"
                         f"{'' if stages is None else f', {stages} stages'}"
                         f"{'' if micro is None else f', {micro} micro-batches'}")
    return plans


def _galvatron(profile: ModelProfile, cluster: Cluster, hardware: Hardware, budget: float | None,
               stages: int | None, micro: int | None, schedules: Sequence[str],
               gradient_reduction: str) -> list[PipelinePlan]:
    """Galvatron-BMW's search (``passes.planner_galvatron``) as ``PipelinePlan``s, priced by its
    own model (Eq. 9), 1F1B-Flush as the paper runs it (its gradient synchronisation too,
    whatever ``gradient_reduction`` the runtime uses). Its per-layer strategies collapse to one
    ``(data, model)`` shape per stage (``GalvatronPlan.stage_shapes``): meshpar gives a stage
    one mesh. Devices run at the calibrated rate, as for meshpar's own planner."""
    try:
        found = galvatron_search(profile, cluster, hardware.device_flops / hardware.compute_scale, budget)
    except ValueError as e:
        raise NoPlanFits(str(e)) from None
    plans = [PipelinePlan(tuple(StagePlan(a, b, shape) for a, b, shape in zip(p.partition, p.partition[1:],
                                                                             p.stage_shapes)),
                          p.num_micro_batches, "1f1b", p.predicted_step_s, p.peak_memory_bytes, "galvatron")
             for p in found
             if (stages is None or p.pp == stages) and (micro is None or p.num_micro_batches == micro)]
    if not plans:
        raise NoPlanFits(f"planner: Galvatron-BMW found no plan"
                         f"{'' if stages is None else f' with {stages} stages'}"
                         f"{'' if micro is None else f' with {micro} micro-batches'}")
    return plans


# name -> (profile, cluster, hardware, memory budget, fixed stages, fixed micro-batches, schedules,
# gradient reduction) -> plans. meshpar's own planner prices the reduction as the runtime runs
# it; the baselines price what their papers model.
PLANNERS: dict[str, Callable[..., list[PipelinePlan]]] = {
    "meshpar": lambda profile, cluster, hardware, budget, stages, micro, schedules, reduction: search(
        profile, cluster, hardware, budget, schedules=schedules, num_stages=stages, num_micro_batches=micro,
        gradient_reduction=reduction),
    "amp": _amp,
    "galvatron": _galvatron,
    "alpa_dp": lambda profile, cluster, hardware, budget, stages, micro, schedules, reduction: alpa_search(
        profile, cluster, hardware, budget, num_stages=stages, num_micro_batches=micro),
}


@dataclasses.dataclass(frozen=True)
class ParallelismPlan:
    """A planner's choice for one step.

    Attributes:
      best: the chosen plan (stages and their layers, each stage's (data, model) shape,
        micro-batches, schedule, predicted step time and peak memory per stage).
      alternatives: the other plans the planner ranked, fastest first.
      profile: the layers the planner partitioned.
      devices: the devices the plan runs on, in the order its meshes are cut.
      cluster: the hosts and links it was priced on.
      planning_s: seconds the planner took.
      batch_argnums: the step's batch arguments, as planned; ``method`` keeps them.
    """

    best: PipelinePlan
    alternatives: tuple[PipelinePlan, ...]
    profile: ModelProfile
    devices: tuple[Any, ...]
    cluster: Cluster
    planning_s: float
    batch_argnums: tuple[int, ...] = (1,)

    @property
    def method(self) -> PipeshardParallel:
        """A ``PipeshardParallel`` that runs this plan under ``meshpar.parallelize``."""
        return self.method_with()

    def method_with(self, base: PipeshardParallel = PipeshardParallel(), **options: Any) -> PipeshardParallel:
        """``base`` running this plan: what planning chose (stage meshes, named by ``base``'s
        axes, cut points, micro-batches, schedule) and fixed (devices, cluster, batch_argnums)
        replace ``base``'s, every other option of ``base`` is kept, and ``options`` (any
        ``PipeshardParallel`` field) override both. An ``"auto"`` ``base`` comes out planned."""
        meshes = stage_meshes(self.cluster, [s.shape for s in self.best.stages])
        by_id = {d.id: d for d in self.devices}
        axes = (base.data_axis, base.model_axis)
        jax_meshes = [jax.sharding.Mesh(np.vectorize(by_id.get, otypes=[object])(m.device_ids), axes)
                      for m in meshes]
        # The stage count, mesh shape and stages per mesh (one) are the meshes' now: base's
        # "auto" would be planned again, its counts checked against a plan that replaced them.
        planned = dict(num_micro_batches=self.best.num_micro_batches, stage_meshes=jax_meshes, num_stages=None,
                       stage_mesh_shape=None, stages_per_mesh=None, schedule=self.best.schedule,
                       cut_points=self.best.cut_points, cluster=self.cluster, devices=self.devices,
                       auto_layers=self.profile.auto_layers, batch_argnums=self.batch_argnums)
        return dataclasses.replace(base, **{**planned, **options})

    def describe(self) -> str:
        """The chosen plan, its stages' layers and meshes, and the runners-up."""
        lines = [f"planned {self.profile.name}: {self.profile.num_layers} layers, batch {self.profile.batch_size}, "
                 f"{len(self.devices)} devices, in {self.planning_s:.2f} s", "  chosen: " + self.best.summary()]
        lines += ["  then:   " + p.summary() for p in self.alternatives[:4]]
        return "\n".join(lines)


def measure_hardware(devices: Sequence[Any]) -> Hardware:
    """Sustained FLOP/s of one device and of all of them at once, measured with a matmul on
    CPUs (virtual devices share the host's cores), the platform's nominal rate elsewhere; and
    the host seconds to launch one small sharded program, measured everywhere."""
    platform = devices[0].platform
    n = 256
    matmul = jax.jit(lambda a: a @ a)
    arrays = [jax.device_put(jnp.ones((n, n), jnp.float32), d) for d in devices]
    for a in arrays:
        matmul(a).block_until_ready()

    def rate(chosen: Sequence[jax.Array], repeats: int = 8) -> float:
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready([matmul(a) for a in chosen])
        return 2.0 * n**3 * repeats * len(chosen) / (time.perf_counter() - start)

    mesh = jax.sharding.Mesh(np.array(devices[:len(devices) // 2 or 1]), ("data",))
    x = jax.device_put(jnp.ones((len(mesh.devices.flat) * 8, 16)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    step = jax.jit(lambda v: v * 2.0 + 1.0)
    step(x).block_until_ready()
    launches, start = 200, time.perf_counter()
    outs = [step(x) for _ in range(launches)]
    dispatch = (time.perf_counter() - start) / launches
    jax.block_until_ready(outs)
    op_s = (_op_seconds(devices[:1]), _op_seconds(devices))
    slope = max(0.0, (op_s[1] - op_s[0]) / max(1, len(devices) - 1))
    ops = (max(0.0, op_s[0] - slope), slope)
    if platform != "cpu":
        return Hardware(DEVICE_FLOPS.get(platform, DEVICE_FLOPS["gpu"]), dispatch_s=dispatch, op_s=ops)
    return Hardware(rate(arrays[:1]), rate(arrays), dispatch, ops)


def calibrate(hardware: Hardware, fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
              devices: Sequence[Any], cluster: Cluster, profile: ModelProfile, repeats: int = 3) -> Hardware:
    """``hardware`` with ``compute_scale`` set so that the cost model predicts the step as
    measured when run as plain data parallelism (one program on all ``devices``, the batch
    split over them): what the FLOP and op counts miss on this machine. Unchanged when the
    batch does not split over the devices or the arguments are only shapes."""
    n = len(devices)
    if profile.batch_size % n or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tuple(args))):
        return hardware
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    split, whole = jax.sharding.NamedSharding(mesh, P("data")), jax.sharding.NamedSharding(mesh, P())
    placed = [jax.device_put(a, split if i in batch_argnums else whole) for i, a in enumerate(args)]
    run = jax.jit(fun)
    jax.block_until_ready(run(*placed))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(run(*placed))
        times.append(time.perf_counter() - start)
    predicted = predict(profile, cluster, hardware, [StagePlan(0, profile.num_layers, (n, 1))], 1, "1f1b")
    return dataclasses.replace(hardware, compute_scale=float(np.median(times)) / predicted.predicted_step_s)


def estimated_transfer_s(transfer: EdgeTransfer, cluster: Cluster, strategy: str = "broadcast") -> float:
    """What the planner's cost model says one micro-batch of ``transfer`` takes on ``cluster``:
    nothing between two stages of one mesh, a byte's worth for a signal, the bytes at the host's
    copy rate for a ``jax.device_put``, the resharding plan's estimate otherwise."""
    num_bytes = transfer.dtype.itemsize * math.prod(transfer.shape)
    if transfer.kind is TransferKind.LOCAL:
        return 0.0
    if transfer.kind is TransferKind.SIGNAL:
        return cluster.latency + 1 / cluster.inter_host_bandwidth
    if transfer.kind is TransferKind.DEVICE_PUT:
        return num_bytes / cluster.intra_host_bandwidth
    return plan_between(transfer.shape, transfer.dtype, transfer.src, transfer.dst, strategy=strategy,
                        balancer="ensemble", cluster=cluster).estimated_time


def calibrate_pipeline(hardware: Hardware, fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
                       devices: Sequence[Any], cluster: Cluster, profile: ModelProfile,
                       repeats: int = 3) -> tuple[Hardware, dict[str, float]]:
    """``hardware`` with ``move_s`` and ``task_s`` fitted to one measured pipeline: the step cut
    in two stages of half the layers, each on half the ``devices`` as a ``(data, 1)`` mesh, two
    micro-batches under 1F1B (the smallest pipeline that has every cost a one-program step
    lacks: per-task launches, moves between meshes, per-stage updates).

    ``move_s`` is the median over the moves of a serialized step (each move alone) of its time
    minus ``estimated_transfer_s``; ``task_s`` (per device of a stage's mesh) then makes
    ``predict`` give the pipeline's measured step (the median of ``repeats``), by bisection
    (the prediction grows with it), 0 when the prediction without it is already as slow.

    Returns:
      The hardware and what was measured (``measured_step_s``, ``predicted_before_s``,
      ``move_s``, ``task_s``); unchanged, with ``{}``, when the step cannot be cut so (fewer
      than two layers or devices, a batch that does not split over the devices, arguments that
      are only shapes).

    Raises:
      ValueError: ``repeats`` is not a positive integer.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive number of timed steps, got {repeats!r}")
    n, L = len(devices), profile.num_layers
    if (n < 2 or n % 2 or L < 2 or profile.batch_size % n
            or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tuple(args)))):
        return hardware, {}
    stages = [StagePlan(0, L // 2, (n // 2, 1)), StagePlan(L // 2, L, (n // 2, 1))]
    plan = ParallelismPlan(predict(profile, cluster, hardware, stages, 2, "1f1b"), (), profile, tuple(devices),
                           cluster, 0.0, tuple(batch_argnums))
    leaves, in_tree = jax.tree.flatten(tuple(args))
    executable = compile_step(fun, plan.method_with(single_program=False), tuple(args), leaves, in_tree).executable
    jax.block_until_ready(executable(leaves))
    with StepRecorder(executable.program, executable.mesh_local, serialize=True) as recorder:
        jax.block_until_ready(executable(leaves, recorder))
        timeline = recorder.timeline()
    transfers = {(t.edge, t.direction is Direction.ACTIVATION): t for t in executable.program.transfers}
    gaps = [e.end - e.start - estimated_transfer_s(transfers[(e.task.where, e.task.kind is TaskKind.SEND_ACT)],
                                                   cluster)
            for e in timeline.events if e.task.kind in (TaskKind.SEND_ACT, TaskKind.SEND_GRAD)]
    move_s = max(0.0, float(np.median(gaps))) if gaps else 0.0
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(executable(leaves))
        times.append(time.perf_counter() - start)
    measured = float(np.median(times))

    def predicted(task_s: float) -> float:
        fitted = dataclasses.replace(hardware, move_s=move_s, task_s=task_s)
        return predict(profile, cluster, fitted, stages, 2, "1f1b").predicted_step_s

    task_s = 0.0
    if predicted(0.0) < measured:
        low, high = 0.0, measured
        for _ in range(40):
            mid = (low + high) / 2
            low, high = (mid, high) if predicted(mid) < measured else (low, mid)
        task_s = (low + high) / 2
    return dataclasses.replace(hardware, move_s=move_s, task_s=task_s), {
        "measured_step_s": measured, "predicted_before_s": plan.best.predicted_step_s, "move_s": move_s,
        "task_s": task_s}


def compiled_tensor_parallel(profile: ModelProfile, fun: Callable, args: Sequence[Any],
                             batch_argnums: Sequence[int], devices: Sequence[Any]) -> tuple[ModelProfile, float]:
    """``profile`` with its tensor-parallel bytes as XLA compiles them: the step is compiled
    (not run) as one program on a ``(1, len(devices))`` mesh, every parameter split over
    ``model`` as its flax partitioning names, and the collectives of its HLO
    (``passes.hlo_collectives``, all of them tensor-parallel on a mesh without a data axis)
    replace Megatron's rule. Per example, forward and backward together move
    ``2 · Σ tp_bytes`` by that rule; every layer's ``tp_bytes`` is scaled by the compiled
    program's bytes over that (the rule places the bytes among layers, the program sizes them).

    Returns:
      The profile and the scale; unchanged (scale 1) on one device or when no parameter is
      split over ``model`` (no layer has ``tp_bytes``).
    """
    if not isinstance(profile, ModelProfile):
        raise TypeError(f"profile: expected a ModelProfile, got {type(profile).__name__}")
    devices = tuple(devices)
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: expected distinct devices, got {list(devices)}")
    rule = 2.0 * sum(layer.tp_bytes for layer in profile.layers)
    if len(devices) < 2 or rule == 0.0:
        return profile, 1.0
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, len(devices)), ("data", "model"))
    method = PipeshardParallel(num_micro_batches=1, stage_meshes=[mesh], cut_points=(), devices=tuple(devices),
                               batch_argnums=tuple(batch_argnums), single_program=True)
    leaves, in_tree = jax.tree.flatten(tuple(args))
    program = compile_step(fun, method, tuple(args), leaves, in_tree).executable
    hlo = program.lower(jax.tree.leaves(tuple(args))).compile().as_text()
    scale = all_reduce_equivalent_bytes(hlo, len(devices)) / profile.batch_size / rule
    layers = tuple(dataclasses.replace(layer, tp_bytes=layer.tp_bytes * scale) for layer in profile.layers)
    return dataclasses.replace(profile, layers=layers), scale


def _op_seconds(devices: Sequence[Any], num_ops: int = 400) -> float:
    """Seconds per operation of a chain of small unfusable operations on a mesh of ``devices``."""
    def chain(x):
        for k in range(num_ops // 4):  # four operations: multiply, add, tanh, barrier
            x = jax.lax.optimization_barrier(jnp.tanh(x * 1.01 + k))
        return x

    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    x = jax.device_put(jnp.ones((16 * len(devices), 32)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
    run = jax.jit(chain)
    run(x).block_until_ready()
    repeats, start = 5, time.perf_counter()
    for _ in range(repeats):
        run(x).block_until_ready()
    return (time.perf_counter() - start) / repeats / num_ops


def profile_step(fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int], name: str = "model",
                 num_layers: int = AUTO_LAYERS) -> ModelProfile:
    """The layers of ``fun``'s loss, from one trace at the arguments' shapes (nothing runs):
    between its stage markers, or, when it has none, ``num_layers`` layers cut automatically
    (``passes.layer_clustering``; fewer if the loss has fewer equations with FLOPs)."""
    leaves, in_tree = jax.tree.flatten(tuple(args))
    size = batch_size(args, tuple(batch_argnums))
    abstract = [jax.ShapeDtypeStruct(np.shape(x), leaf_dtype(x)) for x in leaves]
    with tracing_pipeline():
        outer = jax.make_jaxpr(lambda *ls: fun(*jax.tree.unflatten(in_tree, ls)))(*abstract)
    grad = find_grad_call(getattr(fun, "__name__", "step"), outer, has_variables(tuple(args)))
    params = grad.params
    loss, auto = params["loss_jaxpr"], None
    if count_markers(loss) == 0:
        auto = min(num_layers, max_layers(loss, params["num_diff"]))
        loss = insert_layer_markers(loss, auto, params["num_diff"])
    graph = split_stages(loss, params["num_diff"])
    specs = partition_specs(tuple(args))
    leaf_of = {v: i for i, v in enumerate(outer.jaxpr.invars)}
    sharded = [any(e is not None for e in (specs[leaf_of[v]] or ())) if v in leaf_of else False
               for v in grad.invars[:params["num_diff"]]]
    return profile_layers(graph, size, size, sharded, name=name, auto_layers=auto)


def plan_parallelism(
    step: Callable,
    *example_args: Any,
    devices: Sequence[Any] | None = None,
    cluster: Cluster | None = None,
    memory_budget_bytes: float | None = None,
    planner: str = "meshpar",
    batch_argnums: Sequence[int] | None = None,
    hardware: Hardware | None = None,
    num_stages: int | None = None,
    num_micro_batches: int | None = None,
    schedules: Sequence[str] = ("1f1b", "eager_1f1b"),
    gradient_reduction: str = "per_step",
) -> ParallelismPlan:
    """Chooses how to run ``step`` on ``devices``: which stage markers cut, each stage's mesh and
    (data, model) shape, micro-batches and schedule.

    Args:
      step: a train step (as for ``meshpar.parallelize``), or a parallelized one.
      example_args: its arguments, or anything with their shapes and dtypes.
      devices: default ``jax.devices()``.
      cluster: hosts and links to price transfers on; default one host per process.
      memory_budget_bytes: per device; ``None``: unbounded.
      planner: a key of ``PLANNERS``.
      batch_argnums: positions of the batch arguments (default the parallelized step's, or (1,));
        checked (``meshpar.batch_arguments``) and kept in the plan's ``method``.
      hardware: device FLOP/s; default measured (``measure_hardware``), calibrated on the
        step itself run as plain data parallelism (``calibrate``), then its per-task and
        per-move costs fitted on the step run as a two-stage pipeline (``calibrate_pipeline``).
      num_stages, num_micro_batches: fix one instead of planning it.
      schedules: the schedules to choose among.
      gradient_reduction: how the plan's step reduces gradients over the data axis
        (``PipeshardParallel.gradient_reduction``), priced as it runs.

    Raises:
      ValueError: an unknown ``planner`` or ``gradient_reduction``; ``passes.planner_meshpar.NoPlanFits``
        when no plan fits ``memory_budget_bytes`` (naming the least memory any plan needs).
    """
    if planner not in PLANNERS:
        raise ValueError(f"planner: expected one of {sorted(PLANNERS)}, got {planner!r}")
    if gradient_reduction not in GRADIENT_REDUCTIONS:
        raise ValueError(f"gradient_reduction: expected one of {GRADIENT_REDUCTIONS}, got {gradient_reduction!r}")
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes: expected a positive number of bytes or None, got {memory_budget_bytes!r}")
    # A meshpar.parallelize step carries its function and method (parallelize plans through this
    # module, so it is recognised by them rather than imported).
    parallelized = isinstance(getattr(step, "method", None), PipeshardParallel)
    fun = step.fun if parallelized else step
    if batch_argnums is None:
        batch_argnums = step.method.batch_argnums if parallelized else (1,)
    devices = tuple(devices) if devices is not None else tuple(jax.devices())
    cluster = cluster if cluster is not None else Cluster.from_devices(list(devices))
    profile = profile_step(fun, example_args, tuple(batch_argnums), getattr(fun, "__name__", "step"))
    profile, _ = compiled_tensor_parallel(profile, fun, example_args, tuple(batch_argnums), devices)
    if hardware is None:
        hardware = calibrate(measure_hardware(devices), fun, example_args, tuple(batch_argnums), devices, cluster,
                             profile)
        hardware, _ = calibrate_pipeline(hardware, fun, example_args, tuple(batch_argnums), devices, cluster, profile)
    start = time.perf_counter()
    plans = PLANNERS[planner](profile, cluster, hardware, memory_budget_bytes, num_stages, num_micro_batches,
                              tuple(schedules), gradient_reduction)
    return ParallelismPlan(plans[0], tuple(plans[1:]), profile, devices, cluster, time.perf_counter() - start,
                           tuple(batch_argnums))

