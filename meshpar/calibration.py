"""Measuring the machine a step is planned on, and the steps the planner's cost model is
calibrated on: the part of calibration that runs on the devices.

``measure_hardware`` times small programs (a matmul, a chain of small operations, launches);
``calibrate`` times the step as one program on one device and on all of them, and
``calibrate_pipeline`` as a two-stage pipeline; each hands the seconds to the device-free fits
(``meshpar.passes.planning.calibration``), which ask the selected planner's ``predict``
(``meshpar.passes.planning.protocol.Planner``). Compiling and running a step needs the API and
the runtime, which the compiler may not import: this driver stays here. What the programs it
compiles warn of is not the user's plan's (a calibration layout may leave a stage nearly
empty): it is not shown.
"""

from __future__ import annotations

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
from meshpar.passes.planning.calibration import (CalibrationPipeline, fit_compute, fit_pipeline, move_latency_s,
                                                 one_program_step)
from meshpar.passes.planning.layer_profile import ModelProfile
from meshpar.passes.planning.protocol import Hardware, PipelinePlan, Planner
from meshpar.passes.simulation.cost_model import DEVICE_FLOPS
from meshpar.runtime.step_trace import StepRecorder
from meshpar.step_compiler import compile_step

__all__ = ["calibrate", "calibrate_pipeline", "measure_hardware"]

# Rounds of timed steps the steps ``calibrate`` and ``calibrate_pipeline`` measure take turns in.
CALIBRATION_ROUNDS = 3


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


def calibrate(hardware: Hardware, fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
              devices: Sequence[Any], cluster: Cluster, profile: ModelProfile, planner: Planner,
              repeats: int = 3) -> Hardware:
    """``hardware`` with ``compute_scale`` and ``op_scale`` fitted so that ``planner`` prices
    the step as measured when run as one program on one device and on all ``devices`` (plain
    data parallelism, the batch split over them), as far as these run (``fit_compute``):
    ``repeats`` steps of each in each of ``CALIBRATION_ROUNDS`` rounds, taking turns. On one
    device only when the step's bytes fit it; on all only when the batch splits over them.
    Unchanged when neither runs or the arguments are only shapes."""
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tuple(args))):
        return hardware
    n = len(devices)
    counts = [c for c in {1, n} if profile.batch_size % c == 0
              and (c > 1 or _fits(one_program_step(planner, profile, cluster, hardware, 1), devices[0]))]
    if not counts:
        return hardware
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = _interleaved_medians({c: _one_program(fun, args, batch_argnums, devices[:c]) for c in counts},
                                        CALIBRATION_ROUNDS, repeats)
    return fit_compute(planner, profile, cluster, hardware, measured)


def calibrate_pipeline(hardware: Hardware, fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int],
                       devices: Sequence[Any], cluster: Cluster, profile: ModelProfile, planner: Planner,
                       repeats: int = 3) -> tuple[Hardware, dict[str, Any]]:
    """``hardware`` with ``move_s``, ``task_s`` and ``pipeline_s`` fitted to one measured
    pipeline (``CalibrationPipeline``: the step in two stages, each on half the ``devices``,
    under 1F1B), run with each of its micro-batch counts, ``repeats`` steps of each in each of
    ``CALIBRATION_ROUNDS`` rounds, taking turns, then once with every move alone (serialized):
    ``move_s`` from those moves (``move_latency_s``), ``task_s`` and ``pipeline_s`` from the
    steps as ``planner`` prices them (``fit_pipeline``).

    Returns:
      The hardware and what was measured (``measured_step_s`` per micro-batch count,
      ``predicted_before_s``, ``move_s``, ``task_s``, ``pipeline_s``); unchanged, with ``{}``,
      when the step cannot be cut so (``CalibrationPipeline.of``) or the arguments are only
      shapes.

    Raises:
      ValueError: ``repeats`` is not a positive integer.
    """
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a positive number of timed steps, got {repeats!r}")
    pipeline = CalibrationPipeline.of(profile, len(devices))
    if pipeline is None or any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tuple(args))):
        return hardware, {}
    counts = pipeline.micro_batch_counts
    plans = {M: ParallelismPlan(pipeline.predict(planner, profile, cluster, hardware, M), (), profile, tuple(devices),
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
    move_s = move_latency_s(timeline, first.program.transfers, cluster)
    fitted = fit_pipeline(planner, profile, cluster, hardware, pipeline, measured, move_s)
    return fitted, {"measured_step_s": {M: measured[M] for M in counts},
                    "predicted_before_s": plans[counts[0]].best.predicted_step_s,
                    "move_s": fitted.move_s, "task_s": fitted.task_s, "pipeline_s": fitted.pipeline_s}
