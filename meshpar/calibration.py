"""Measuring the machine a step is planned on, and calibrating the planner's cost model there.

``measure_hardware`` times small programs (a matmul, a chain of small operations, launches);
``calibrate`` fits ``Hardware.compute_scale`` and ``op_scale`` to the step run as one program on
one device and on all of them;
``calibrate_pipeline`` fits ``Hardware.task_s`` and ``move_s`` to the step run as a two-stage
pipeline. These run on the devices, so they live beside the runtime, not in the device-free
planner (``meshpar.passes.planning``). What the programs they compile warn of is not the
user's plan's (a calibration layout may leave a stage nearly empty): it is not shown.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshpar.cluster import Cluster
from meshpar.parallelism_plan import ParallelismPlan
from meshpar.passes.pipeline.placing.edge_transfer import Direction, EdgeTransfer, TransferKind
from meshpar.passes.pipeline.scheduling.pipeline_tasks import TaskKind
from meshpar.passes.planning.layer_profile import ModelProfile
from meshpar.passes.planning.planner_meshpar import predict
from meshpar.passes.planning.protocol import Hardware, PipelinePlan, StagePlan, first_devices
from meshpar.passes.simulation.cost_model import DEVICE_FLOPS
from meshpar.reshard import plan_between
from meshpar.runtime.step_trace import StepRecorder
from meshpar.step_compiler import compile_step

__all__ = ["calibrate", "calibrate_pipeline", "estimated_transfer_s", "fit_scales", "measure_hardware"]

# Rounds of timed steps the steps ``calibrate`` and ``calibrate_pipeline`` measure take turns in.
CALIBRATION_ROUNDS = 3
# The micro-batch counts calibrate_pipeline runs its two-stage pipeline with.
CALIBRATION_MICRO_BATCHES = (2, 4)


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


def _one_program(fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
                 devices: Sequence[Any]) -> Callable[[], Any]:
    """A call of ``fun`` as one ``jax.jit`` program on ``devices``: the batch split over them,
    every other argument on all of them."""
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    split, whole = jax.sharding.NamedSharding(mesh, P("data")), jax.sharding.NamedSharding(mesh, P())
    placed = [jax.device_put(a, split if i in batch_argnums else whole) for i, a in enumerate(args)]
    run = jax.jit(fun)
    return lambda: run(*placed)


def _interleaved_medians(runs: dict[Any, Callable[[], Any]], rounds: int, repeats: int) -> dict[Any, float]:
    """Per run, the median seconds of its calls over ``rounds`` rounds of ``repeats`` calls each,
    the runs taking turns (a machine whose speed drifts slows them alike), after one untimed
    call each (it compiles)."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for run in runs.values():
        jax.block_until_ready(run())
    for _ in range(rounds):
        for key, run in runs.items():
            for _ in range(repeats):
                start = time.perf_counter()
                jax.block_until_ready(run())
                times[key].append(time.perf_counter() - start)
    return {key: float(np.median(t)) for key, t in times.items()}


def _fits(plan: PipelinePlan, device: Any) -> bool:
    """Whether ``device`` holds ``plan``'s peak bytes per device (assumed where the platform does
    not say how much it holds, as on CPUs)."""
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return limit is None or max(plan.peak_memory_bytes) <= limit


def _solve(f: Callable[[float], float], target: float, increasing: bool, low: float = 1e-6,
           high: float = 1e6, steps: int = 60) -> float:
    """``x`` in ``[low, high]`` with ``f(x) = target`` by bisection on ``log x``, ``f`` monotone
    (``increasing`` or not); the nearer end when ``target`` is beyond ``f``'s range there."""
    lo, hi = math.log(low), math.log(high)
    for _ in range(steps):
        mid = (lo + hi) / 2
        below = f(math.exp(mid)) < target
        lo, hi = (mid, hi) if below == increasing else (lo, mid)
    return math.exp((lo + hi) / 2)


def fit_scales(predicted: Callable[[float, float, int], float], measured: dict[int, float]) -> tuple[float, float]:
    """``(compute_scale, op_scale)`` making ``predicted(compute_scale, op_scale, n)`` equal
    ``measured[n]``, the seconds of the step as one program on ``n`` devices, for one or two
    device counts. ``predicted`` grows with both scales; it weighs operations more, against
    FLOPs, on more devices (each device runs every operation; the FLOPs split). With one count
    the two scales are one; with two, the operations' weight is what makes both steps as
    measured (bisection: a heavier weight, once the larger count matches, predicts the smaller
    count's step faster), clamped to ``[1e-3, 1e3]`` where no weight does.

    Raises:
      ValueError: ``measured`` is not one or two positive step times.
    """
    if not 1 <= len(measured) <= 2 or not all(t > 0 for t in measured.values()):
        raise ValueError(f"measured: expected one or two positive step times by device count, got {measured!r}")
    (few, few_s), (many, many_s) = min(measured.items()), max(measured.items())

    def matching_many(weight: float) -> float:
        return _solve(lambda k: predicted(k, k * weight, many), many_s, increasing=True, steps=40)

    def few_at(weight: float) -> float:
        scale = matching_many(weight)
        return predicted(scale, scale * weight, few)

    if few == many:
        scale = matching_many(1.0)
        return scale, scale
    # Beyond a thousandfold either way the two steps differ by more than the split between
    # FLOPs and operations explains (a noisy measurement): the other plans' prices stay sane.
    weight = _solve(few_at, few_s, increasing=False, low=1e-3, high=1e3, steps=40)
    scale = matching_many(weight)
    return scale, scale * weight


def calibrate(hardware: Hardware, fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
              devices: Sequence[Any], cluster: Cluster, profile: ModelProfile, repeats: int = 3) -> Hardware:
    """``hardware`` with ``compute_scale`` and ``op_scale`` set so that the cost model predicts
    the step as measured when run as one program on one device and on all ``devices`` (plain
    data parallelism, the batch split over them), as far as these run: what the FLOP and
    operation counts miss on this machine (``fit_scales``): ``repeats`` steps of each in each of
    ``CALIBRATION_ROUNDS`` rounds, taking turns. On one device only when the step's bytes fit
    it; on all only when the batch splits over them. Unchanged when neither runs or the
    arguments are only shapes."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tuple(args))):
        return hardware
    L, n = profile.num_layers, len(devices)

    def plan(scales: Hardware, num_devices: int) -> PipelinePlan:
        return predict(profile, first_devices(cluster, num_devices), scales, [StagePlan(0, L, (num_devices, 1))],
                       1, "1f1b")

    counts = [c for c in {1, n} if profile.batch_size % c == 0 and (c > 1 or _fits(plan(hardware, 1), devices[0]))]
    if not counts:
        return hardware
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = _interleaved_medians({c: _one_program(fun, args, batch_argnums, devices[:c]) for c in counts},
                                        CALIBRATION_ROUNDS, repeats)

    def predicted(compute_scale: float, op_scale: float, num_devices: int) -> float:
        scaled = dataclasses.replace(hardware, compute_scale=compute_scale, op_scale=op_scale)
        return plan(scaled, num_devices).predicted_step_s

    compute_scale, op_scale = fit_scales(predicted, measured)
    return dataclasses.replace(hardware, compute_scale=compute_scale, op_scale=op_scale)


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
    """``hardware`` with ``move_s``, ``task_s`` and ``pipeline_s`` fitted to one measured
    pipeline: the step cut in two stages of half the layers, each on half the ``devices`` as a
    ``(data, 1)`` mesh, under 1F1B (the smallest pipeline that has every cost a one-program
    step lacks: per-task launches, moves between meshes, per-stage updates), run with
    ``CALIBRATION_MICRO_BATCHES`` (2 and 4; 2 alone where the batch does not split in 4 over a
    mesh), ``repeats`` steps of each in each of ``CALIBRATION_ROUNDS`` rounds, taking turns.

    ``move_s`` is the median over the moves of a serialized step (each move alone) of its time
    minus ``estimated_transfer_s``. ``task_s`` (per device of a stage's mesh) makes ``predict``
    grow from 2 to 4 micro-batches as the measured step does (twice the tasks, the same step
    around them), by bisection; ``pipeline_s`` then makes it give the measured step at 2. With
    one count measured, ``task_s`` alone fits it (``pipeline_s`` 0). Each is 0 where the
    prediction without it is already as slow. (Fitting every second of a pipeline's step to its
    tasks priced the 4-stage ZB-V of the U-Transformer at 3.5-4.5x its measured step: the
    second count separates what a step costs once from what each task costs.)

    Returns:
      The hardware and what was measured (``measured_step_s`` per micro-batch count,
      ``predicted_before_s``, ``move_s``, ``task_s``, ``pipeline_s``); unchanged, with ``{}``,
      when the step cannot be cut so (fewer than two layers or devices, a batch that does not
      split over the devices, arguments that are only shapes).

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
    counts = [M for M in CALIBRATION_MICRO_BATCHES if profile.batch_size % (M * (n // 2)) == 0]
    plans = {M: ParallelismPlan(predict(profile, cluster, hardware, stages, M, "1f1b"), (), profile, tuple(devices),
                                cluster, 0.0, tuple(batch_argnums)) for M in counts}
    leaves, in_tree = jax.tree.flatten(tuple(args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        executables = {M: compile_step(fun, plan.method_with(single_program=False), tuple(args), leaves,
                                       in_tree).executable for M, plan in plans.items()}
        measured = _interleaved_medians({M: (lambda e=e: e(leaves)) for M, e in executables.items()},
                                        CALIBRATION_ROUNDS, repeats)
        first = executables[counts[0]]
        with StepRecorder(first.program, first.mesh_local, serialize=True) as recorder:
            jax.block_until_ready(first(leaves, recorder))
            timeline = recorder.timeline()
    transfers = {(t.edge, t.direction is Direction.ACTIVATION): t for t in first.program.transfers}
    gaps = [e.end - e.start - estimated_transfer_s(transfers[(e.task.where, e.task.kind is TaskKind.SEND_ACT)],
                                                   cluster)
            for e in timeline.events if e.task.kind in (TaskKind.SEND_ACT, TaskKind.SEND_GRAD)]
    move_s = max(0.0, float(np.median(gaps))) if gaps else 0.0

    def predicted(M: int, task_s: float, pipeline_s: float = 0.0) -> float:
        fitted = dataclasses.replace(hardware, move_s=move_s, task_s=task_s, pipeline_s=pipeline_s)
        return predict(profile, cluster, fitted, stages, M, "1f1b").predicted_step_s

    low_M, high_M = counts[0], counts[-1]
    if high_M > low_M:
        # The tasks' share: the slope from low_M to high_M micro-batches.
        grows = lambda task_s: predicted(high_M, task_s) - predicted(low_M, task_s)  # noqa: E731
        task_s = _bisect(grows, measured[high_M] - measured[low_M], high=measured[high_M])
    else:
        task_s = _bisect(lambda t: predicted(low_M, t), measured[low_M], high=measured[low_M])
    pipeline_s = max(0.0, measured[low_M] - predicted(low_M, task_s))
    return dataclasses.replace(hardware, move_s=move_s, task_s=task_s, pipeline_s=pipeline_s), {
        "measured_step_s": {M: measured[M] for M in counts}, "predicted_before_s": plans[low_M].best.predicted_step_s,
        "move_s": move_s, "task_s": task_s, "pipeline_s": pipeline_s}


def _bisect(f: Callable[[float], float], target: float, high: float) -> float:
    """The ``x`` in ``[0, high]`` where the increasing ``f`` reaches ``target``; 0 when
    ``f(0)`` already does."""
    if f(0.0) >= target:
        return 0.0
    low = 0.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if f(mid) < target else (low, mid)
    return (low + high) / 2
