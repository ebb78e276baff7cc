"""``meshpar.plan_parallelism``: choose devices, stage cuts, stage meshes, stages per mesh,
micro-batches and schedule.

The step is traced once (nothing runs; ``meshpar.step_profile``); its loss is cut at every
``mark_stage_boundary()`` into layers; a planner (``PLANNERS``, each a
``passes.planning.protocol.Planner``; the planning package holds both) is taken by its name; on
the machine it will run on, that planner's cost model is calibrated (``meshpar.calibration``)
and the planner ranks plans. The result runs as planned with
``parallelize(step, method=plan.method)``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

from meshpar.calibration import calibrate, calibrate_pipeline, measure_hardware
from meshpar.cluster import Cluster
from meshpar.parallelism_plan import ParallelismPlan
from meshpar.passes.planning.layer_profile import ModelProfile
from meshpar.passes.planning.planners import PLANNERS, get_planner
from meshpar.passes.planning.protocol import Hardware, PlanConstraints, Planner
from meshpar.pipeshard_parallel import PipeshardParallel
from meshpar.step_profile import compiled_tensor_parallel, profile_step

__all__ = ["PLANNERS", "ParallelismPlan", "plan_parallelism"]


def _calibrated(fun: Callable, args: Sequence[Any], batch_argnums: tuple[int, ...], devices: tuple[Any, ...],
                cluster: Cluster, profile: ModelProfile, planner: Planner) -> Hardware:
    """The devices measured (``measure_hardware``), then ``planner``'s cost model fitted to the
    step run as one program on all of them (``calibrate``) and as a two-stage pipeline
    (``calibrate_pipeline``)."""
    hardware = calibrate(measure_hardware(devices), fun, args, batch_argnums, devices, cluster, profile, planner)
    return calibrate_pipeline(hardware, fun, args, batch_argnums, devices, cluster, profile, planner)[0]


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
    schedules: Sequence[str] | None = None,
    gradient_reduction: str = "per_step",
) -> ParallelismPlan:
    """Chooses how to run ``step`` on ``devices``: how many of them, which stage markers cut,
    each mesh's (data, model) shape and stages, micro-batches and schedule. One stage with one
    micro-batch on one device is a candidate too: the step as ``jax.jit`` runs it.

    Args:
      step: a train step (as for ``meshpar.parallelize``), or a parallelized one.
      example_args: its arguments, or anything with their shapes and dtypes.
      devices: default ``jax.devices()``; a plan may use the first few of them only.
      cluster: hosts and links to price transfers on; default one host per process.
      memory_budget_bytes: per device; ``None``: unbounded.
      planner: a key of ``PLANNERS``.
      batch_argnums: positions of the batch arguments (default the parallelized step's, or (1,));
        checked (``meshpar.batch_arguments``) and kept in the plan's ``method``.
      hardware: device FLOP/s; default measured (``measure_hardware``), calibrated on the
        step itself run as plain data parallelism (``calibrate``), then its per-task and
        per-move costs fitted on the step run as a two-stage pipeline (``calibrate_pipeline``),
        both as ``planner`` prices them (its ``predict``).
      num_stages, num_micro_batches: fix one instead of planning it.
      schedules: the schedules to choose among; ``None``: every registered one
        (``meshpar.SCHEDULES``), with one or two stages per mesh where a schedule takes them.
      gradient_reduction: how the plan's step reduces gradients over the data axis
        (``PipeshardParallel.gradient_reduction``), priced as it runs.

    Raises:
      ValueError: an unknown ``planner``, ``gradient_reduction`` or schedule, a budget that is
        not positive; ``passes.planning.protocol.NoPlanFits`` when no plan fits
        ``memory_budget_bytes`` (naming the least memory any plan needs).
    """
    # planning_s is the whole call: tracing, profiling and calibrating (measuring the devices and
    # candidate steps) take most of it; the ranking alone is a small fraction.
    start = time.perf_counter()
    chosen = get_planner(planner)
    constraints = PlanConstraints(memory_budget_bytes, num_stages, num_micro_batches,
                                  None if schedules is None else tuple(schedules),
                                  gradient_reduction=gradient_reduction)
    # A meshpar.parallelize step carries its function and method (parallelize plans through this
    # module, so it is recognised by them rather than imported).
    parallelized = isinstance(getattr(step, "method", None), PipeshardParallel)
    fun = step.fun if parallelized else step
    if batch_argnums is None:
        batch_argnums = step.method.batch_argnums if parallelized else (1,)
    batch_argnums = tuple(batch_argnums)
    devices = tuple(devices) if devices is not None else tuple(jax.devices())
    cluster = cluster if cluster is not None else Cluster.from_devices(list(devices))
    profile = profile_step(fun, example_args, batch_argnums, getattr(fun, "__name__", "step"))
    profile, _ = compiled_tensor_parallel(profile, fun, example_args, batch_argnums, devices)
    if hardware is None:
        hardware = _calibrated(fun, example_args, batch_argnums, devices, cluster, profile, chosen)
    plans = chosen.plan(profile, cluster, hardware, constraints)
    return ParallelismPlan(plans[0], tuple(plans[1:]), profile, devices, cluster, time.perf_counter() - start,
                           batch_argnums)
