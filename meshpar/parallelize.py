"""``@meshpar.parallelize``: run a train step as an MPMD pipeline over stage meshes."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.autodiff import tracing_pipeline
from meshpar.batch_arguments import batch_size as check_batch, describe_arguments
from meshpar.cluster import Cluster
from meshpar.passes.balancers import get_balancer
from meshpar.passes.edge_transfer import EXECUTORS, SIGNAL, Direction, TransferKind, choose_transfer
from meshpar.passes.mesh_assignment import check_stage_split, mesh_shapes
from meshpar.passes.micro_batching import resolve_micro_batching
from meshpar.grad_call import find_grad_call
from meshpar.nnx_state import (NnxStateError, StateUpdates, check_distinct_variables, has_variables,
                               partition_specs, returning_updates, write_back)
from meshpar.passes.pipeline_passes import PipelineOptions, compile_pipeline, state_counterparts
from meshpar.passes.pipeline_schedule import SCHEDULES
from meshpar.passes.stage_graph import RefKind, StageGraph, StageMarkerError, user_location
from meshpar.passes.step_split import GradCallError, OuterCompute, OuterKind, OuterMove
from meshpar.passes.strategies import get_strategy
from meshpar.passes.timeline import Timeline, write_chrome_trace
from meshpar.passes.weight_delay import check_weight_delay
from meshpar.reshard import plan_between, prepare_reshard
from meshpar.runtime.coordination import agree
from meshpar.runtime.pipeline_executor import PipelineExecutable
from meshpar.runtime.p2p_executor import device_sharding
from meshpar.runtime.remote import absent
from meshpar.runtime.signal_move import SignalMove
from meshpar.runtime.spmd_step import SpmdStep
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["AUTO", "PipeshardParallel", "parallelize", "ParallelizedStep"]

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class PipeshardParallel:
    """Inter-op (pipeline) plus intra-op (sharded) parallelism.

    Every argument is checked when this is made, and the ones the devices decide (when
    ``devices`` is not given) when the step first compiles, before it is traced; the errors
    name the argument and a fix.

    Attributes:
      num_micro_batches: micro-batches per step; must divide the batch. ``"auto"``: planned.
      stage_meshes: one ``jax.sharding.Mesh`` per stage, disjoint, each with the
        axis ``data_axis`` or ``model_axis`` (or both); by default the devices
        are cut evenly, host-major.
      num_stages: expected number of stages (stage markers + 1); checked.
        ``"auto"``: ``meshpar.plan_parallelism`` chooses which markers cut, each stage's
        mesh (their shapes may differ) and, unless given, the micro-batches, on the first
        call, and prints its choice (``ParallelizedStep.plan``); the schedule stays this one.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh, two positive
        integers whose product is the devices per stage; default all devices
        of a stage on ``data``. Not with ``stage_meshes``. ``"auto"``: planned, as above.
      schedule: ``gpipe``, ``1f1b``, ``eager_1f1b`` or ``zb_h1``
        (``passes.pipeline_schedule``).
      weight_delay: split each backward into an activation-gradient and a
        weight-gradient pass and run the latter later: ``False`` (whole
        backwards), ``True`` (after the stage's next compute task) or
        ``"auto"`` (the least delay whose compute covers the stage's
        transfer round trip, by the cost model). With ``gpipe`` the weight
        passes then trail the next micro-batch's activation pass. ``zb_h1``
        always splits and places weight passes itself.
      resharding, balancer: strategy and balancer of cross-mesh transfers.
        ``resharding="signal"`` sends one byte per transfer instead, with the
        same dependencies, and delivers zeros: the schedule's communication
        upper bound, for benchmarks only (the step's numbers are not kept).
      executor: how values cross meshes: ``"auto"`` (``jax.device_put``
        when one process owns both meshes, else asynchronous p2p moves that
        overlap with compute), ``"p2p"``, or ``"collective"`` (one
        ``ppermute`` program over both meshes: the no-overlap baseline).
      cluster: hosts and bandwidths for planning transfers; default one host
        per process.
      timeout_s: how long a process waits for its peers (agreeing on the
        compiled pipeline, values other processes send it) before raising;
        ``ParallelizedStep.trace`` waits as long for the traced step's work.
      batch_argnums: positions of the arguments holding the batch (cut into
        micro-batches along dimension 0), a tuple of non-negative integers.
      devices: the distinct ``jax.Device``s to use; default ``jax.devices()``.
      data_axis, model_axis: the stage mesh axes the batch and the parameters
        shard over. Cut meshes are named ``(data_axis, model_axis)``, and a
        flax partitioning name ``"data"`` or ``"model"`` means that axis: for
        meshes with axes ``("dp", "tp")`` pass ``data_axis="dp", model_axis="tp"``.
        When all stage meshes have one shape the step is traced under them,
        and flax constrains parameters by their own names there: then name
        the mesh's axes (``(None, "tp")``).
      cut_points: which ``mark_stage_boundary()`` calls cut the model, numbered from 0 in
        program order; the others are ignored (their layers join a stage). ``None``: every
        marker cuts. ``meshpar.plan_parallelism`` chooses them.
    """

    num_micro_batches: int = 1
    stage_meshes: Sequence[Mesh] | None = None
    num_stages: int | None = None
    stage_mesh_shape: tuple[int, int] | None = None
    schedule: str = "1f1b"
    resharding: str = "broadcast"
    balancer: str = "ensemble"
    cluster: Cluster | None = None
    batch_argnums: tuple[int, ...] = (1,)
    devices: Sequence[Any] | None = None
    executor: str = "auto"
    timeout_s: float = 120.0
    weight_delay: bool | str = False
    data_axis: str = "data"
    model_axis: str = "model"
    cut_points: tuple[int, ...] | None = None
    single_program: bool = True
    auto_layers: int | None = None

    @property
    def planned(self) -> bool:
        """Whether some of the layout is left to the planner (an ``"auto"`` argument)."""
        return AUTO in (self.num_stages, self.stage_mesh_shape, self.num_micro_batches)

    def __post_init__(self) -> None:
        if not isinstance(self.single_program, bool):
            raise ValueError(f"single_program: expected a bool, got {self.single_program!r}")
        if self.auto_layers is not None and not self._is_count(self.auto_layers):
            raise ValueError(f"auto_layers: expected a positive number of layers or None, got {self.auto_layers!r}")
        if self.planned:
            if self.stage_meshes is not None or self.cut_points is not None:
                raise ValueError("num_stages, stage_mesh_shape, num_micro_batches: 'auto' plans the stage meshes "
                                 "and cut points; do not pass stage_meshes or cut_points with it")
            for name in ("num_stages", "num_micro_batches"):
                value = getattr(self, name)
                if value != AUTO and value is not None and not self._is_count(value):
                    raise ValueError(f"{name}: expected a positive integer or 'auto', got {value!r}")
            if self.stage_mesh_shape not in (AUTO, None):
                raise ValueError(f"stage_mesh_shape: with 'auto' elsewhere the planner chooses each stage's "
                                 f"shape; pass stage_mesh_shape='auto' or None, got {self.stage_mesh_shape!r}")
            return
        if self.cut_points is not None:
            cuts = self.cut_points
            if (not isinstance(cuts, tuple) or not all(isinstance(c, int) and c >= 0 for c in cuts)
                    or list(cuts) != sorted(set(cuts))):
                raise ValueError(f"cut_points: expected a tuple of increasing marker numbers (0-based), got {cuts!r}")
            if self.num_stages is not None and self.num_stages != len(cuts) + 1:
                raise ValueError(f"num_stages: {self.num_stages}, but cut_points={cuts!r} make {len(cuts) + 1} stages")
        if not self._is_count(self.num_micro_batches):
            raise ValueError(f"num_micro_batches: expected a positive integer, got {self.num_micro_batches!r}")
        if self.num_stages is not None and not self._is_count(self.num_stages):
            raise ValueError(f"num_stages: expected a positive integer (stage markers + 1) or None, "
                             f"got {self.num_stages!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: unknown {self.schedule!r}; expected one of {sorted(SCHEDULES)}")
        check_weight_delay(self.weight_delay, self.schedule)
        if self.resharding != SIGNAL:
            get_strategy(self.resharding)
        get_balancer(self.balancer)
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor: expected one of {EXECUTORS}, got {self.executor!r}")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {self.timeout_s!r}")
        if self.cluster is not None and not isinstance(self.cluster, Cluster):
            raise ValueError(f"cluster: expected a meshpar.Cluster (e.g. meshpar.Cluster.aws_p3_8xlarge(2)) "
                             f"or None, got {type(self.cluster).__name__}")
        argnums = self.batch_argnums
        if (not isinstance(argnums, tuple) or not argnums
                or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in argnums)):
            example = f"({argnums},)" if isinstance(argnums, int) and argnums >= 0 else "(1,)"
            raise ValueError(f"batch_argnums: expected a non-empty tuple of non-negative integers (the positions "
                             f"of the batch arguments), got {argnums!r}; e.g. batch_argnums={example}")
        for name in ("data_axis", "model_axis"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name}: expected a mesh axis name (a non-empty str), got {getattr(self, name)!r}")
        if self.data_axis == self.model_axis:
            raise ValueError(f"data_axis, model_axis: both are {self.data_axis!r}; pass two different mesh axis "
                             f"names, e.g. data_axis='data', model_axis='model'")
        self._check_stage_mesh_shape()
        self._check_stage_meshes()
        if self.devices is not None:
            devices = self.devices
            if isinstance(devices, np.ndarray):
                devices = list(devices.flat)
            if (isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices
                    or not all(isinstance(d, jax.Device) for d in devices)):
                raise ValueError(f"devices: expected a non-empty list of jax devices (e.g. jax.devices()[:4]) "
                                 f"or None for all of them, got {self.devices!r}")
            if len({d.id for d in devices}) != len(devices):
                raise ValueError(f"devices: device ids {[d.id for d in devices]} repeat; pass each device once")
            # Frozen: a normalised copy keeps the dataclass hashable and its devices flat.
            object.__setattr__(self, "devices", tuple(devices))
            # The devices are known without starting JAX's backend: check them now too.
            self.check_devices()

    @staticmethod
    def _is_count(x: Any) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1

    def _check_stage_mesh_shape(self) -> None:
        shape = self.stage_mesh_shape
        if shape is None:
            return
        if (isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence) or len(shape) != 2
                or not all(self._is_count(n) for n in shape)):
            raise ValueError(f"stage_mesh_shape: expected (data, model), two positive integers, got {shape!r}; "
                             f"e.g. stage_mesh_shape=(2, 2) for 4 devices per stage")
        if self.stage_meshes is not None:
            raise ValueError("stage_mesh_shape: shapes the meshes cut from devices, but stage_meshes are given; "
                             "pass one of stage_meshes or stage_mesh_shape")
        object.__setattr__(self, "stage_mesh_shape", (int(shape[0]), int(shape[1])))

    def _check_stage_meshes(self) -> None:
        meshes = self.stage_meshes
        if meshes is None:
            return
        if (isinstance(meshes, (str, bytes)) or not isinstance(meshes, Sequence) or not meshes
                or not all(isinstance(m, Mesh) for m in meshes)):
            raise ValueError(f"stage_meshes: expected a non-empty list of jax.sharding.Mesh, one per stage "
                             f"(e.g. stage_meshes=[mesh0, mesh1]), got {meshes!r}")
        if self.num_stages is not None and len(meshes) != self.num_stages:
            raise ValueError(f"stage_meshes: {len(meshes)} meshes, but num_stages={self.num_stages}; pass one "
                             f"mesh per stage")
        seen: dict[int, int] = {}
        for i, mesh in enumerate(meshes):
            for d in mesh.devices.flat:
                if d.id in seen:
                    raise ValueError(f"stage_meshes: meshes {seen[d.id]} and {i} overlap on device {d.id}; pass "
                                     f"disjoint meshes (each device in one stage)")
                seen[d.id] = i
            names = tuple(mesh.axis_names)
            missing = [arg for arg in ("data_axis", "model_axis") if getattr(self, arg) not in names]
            # An axis of neither role gets neither the batch nor the parameters: its devices
            # would repeat each other's work, which a misnamed axis does silently.
            idle = [a for a in names if a not in (self.data_axis, self.model_axis) and mesh.shape[a] > 1]
            if missing and idle:
                fix = ", ".join(f"{arg}={a!r}" for arg, a in zip(missing, idle))
                raise ValueError(
                    f"stage_meshes: mesh {i} has axes {names} (shape {dict(mesh.shape)}) but no "
                    f"{' or '.join(f'{arg}={getattr(self, arg)!r}' for arg in missing)}; the batch shards over "
                    f"data_axis and parameters over model_axis, so axis {idle[0]!r} would only repeat work; "
                    f"pass {fix}"
                )
        object.__setattr__(self, "stage_meshes", tuple(meshes))

    def check_devices(self) -> None:
        """Checks the arguments the devices decide, against ``devices`` or else ``jax.devices()``
        (which starts JAX's backend: run when the step first compiles, before tracing, so an
        argument error is not reported as a tracing error).

        Raises:
          ValueError: a stage mesh using a device not in ``devices``; ``num_stages`` that do
            not divide the devices; a ``stage_mesh_shape`` that does not fit them.
        """
        if self.planned:
            return
        devices = list(self.devices) if self.devices is not None else jax.devices()
        if self.stage_meshes is not None:
            pool = {d.id for d in devices}
            for i, mesh in enumerate(self.stage_meshes):
                outside = [d.id for d in mesh.devices.flat if d.id not in pool]
                if outside:
                    raise ValueError(f"stage_meshes: mesh {i} uses device {outside[0]}, which is not among the "
                                     f"devices {sorted(pool)}; build the meshes from those, or pass devices= "
                                     f"including it")
        elif self.num_stages is not None:
            check_stage_split(len(devices), self.num_stages, self.stage_mesh_shape, f"num_stages={self.num_stages}")
        elif self.stage_mesh_shape is not None:
            per_stage = self.stage_mesh_shape[0] * self.stage_mesh_shape[1]
            if len(devices) % per_stage:
                stages = 2 if len(devices) % 2 == 0 else 1
                raise ValueError(
                    f"stage_mesh_shape: {self.stage_mesh_shape} holds {per_stage} devices per stage, but "
                    f"{len(devices)} devices do not split into stages of {per_stage}; pass a shape holding "
                    f"{len(devices)} / (number of stages) devices (for {stages} stage{'s' * (stages > 1)}: "
                    f"{mesh_shapes(len(devices) // stages)}), or stage_meshes=[...] (one jax.sharding.Mesh per "
                    f"stage) for an uneven split"
                )


def parallelize(fun: Callable | None = None, *, method: PipeshardParallel = PipeshardParallel()) -> Any:
    """Decorates a train step ``(state, batch, ...) -> outputs`` to run as a pipeline.

    The step calls ``meshpar.value_and_grad`` (or ``meshpar.grad``) once on a
    loss whose model calls ``meshpar.mark_stage_boundary()`` between stages;
    that module's docstring states how micro-batches combine (loss reduction,
    aux, PRNG keys). The rest of the step runs once per step at the whole
    batch's shapes, each value on the mesh of the parameters it derives from.
    Returns a callable taking and returning the same pytrees; state arrays
    stay sharded on their stage meshes between calls. Its ``trace(path,
    *args)`` runs one step the same way and also records when each task ran,
    written to ``path`` as a Chrome / Perfetto trace (``ParallelizedStep.trace``).
    """
    if fun is None:
        return functools.partial(parallelize, method=method)
    if not isinstance(method, PipeshardParallel):
        raise TypeError(f"method: expected meshpar.PipeshardParallel, got {type(method).__name__}")
    return ParallelizedStep(fun, method)


def _trace_mesh(method: PipeshardParallel) -> Any:
    """A mesh context for tracing, so ``with_sharding_constraint(x, PartitionSpec(...))`` in the
    step means "on my stage's mesh": every stage mesh has the same shape, and the constraint is
    recorded against that abstract shape, then lowered on each stage's own mesh."""
    import contextlib

    if method.stage_meshes:
        shapes = {(tuple(m.axis_names), tuple(m.devices.shape)) for m in method.stage_meshes}
        if len(shapes) == 1:
            return jax.set_mesh(method.stage_meshes[0])
    elif method.stage_mesh_shape is not None:
        devices = list(method.devices) if method.devices is not None else jax.devices()
        n = int(np.prod(method.stage_mesh_shape))
        return jax.set_mesh(Mesh(np.array(devices[:n]).reshape(method.stage_mesh_shape),
                                 (method.data_axis, method.model_axis)))
    return contextlib.nullcontext()


def _dtype(x: Any) -> Any:
    """The dtype JAX gives ``x`` (Python scalars and int64 numpy data canonicalised; typed PRNG
    keys keep their key dtype)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.result_type(x)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return dtype
    return jax.dtypes.canonicalize_dtype(dtype)


class _Compiled(NamedTuple):
    """A compiled step: its executable, and for a step over NNX objects which argument leaves
    its trailing outputs update (``None`` otherwise)."""

    executable: PipelineExecutable | SpmdStep
    updates: StateUpdates | None


class ParallelizedStep:
    """The decorated step: compiles on first call per input structure, then runs."""

    def __init__(self, fun: Callable, method: PipeshardParallel) -> None:
        self.fun = fun
        self.method = method
        # What meshpar.plan_parallelism chose, once an "auto" method has been planned.
        self.plan: Any = None
        self._cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any) -> Any:
        leaves, compiled = self._lookup(args)
        return self._outputs(args, compiled, compiled.executable(leaves))

    @staticmethod
    def _outputs(args: tuple, compiled: _Compiled, leaves: list) -> Any:
        """The step's outputs from the executable's; a step over NNX objects has its updates
        written to their Variables, as ``nnx.jit`` does."""
        out = jax.tree.unflatten(compiled.executable.out_tree, leaves)
        if compiled.updates is None:
            return out
        own, values = out
        write_back(args, compiled.updates, values)
        return own

    def trace(self, path: str, *args: Any, serialize: bool = False) -> tuple[Any, Timeline]:
        """Runs one step like calling this, recording when each task of the pipeline ran.

        Writes the step's measured ``Timeline`` to ``path`` as a Chrome / Perfetto trace (open
        it at https://ui.perfetto.dev); with several processes, process ``i`` records what it
        observes (its meshes' compute, the transfers it receives) and writes
        ``<stem>.p<i><ext>`` with pid ``i``. A step that compiles (the first per input
        structure) is timed with its compilation: trace a later one.

        Args:
          path: the trace file; its directory must exist.
          args: the step's arguments, as for a call.
          serialize: run each instruction alone, waiting for it before launching the next:
            isolated durations per task instead of the step as it overlaps
            (``runtime.step_trace``).

        Returns:
          The step's outputs, as a call returns them, and its timeline (times in seconds from
          the first task's start).

        Raises:
          ValueError: ``path`` is not a file path in an existing directory (before running).
        """
        if not isinstance(path, str) or not path or os.path.isdir(path) \
                or not os.path.isdir(os.path.dirname(path) or "."):
            raise ValueError(f"path: expected a file path in an existing directory, got {path!r}")
        leaves, compiled = self._lookup(args)
        executable = compiled.executable
        if isinstance(executable, SpmdStep):
            raise ValueError("trace: this step has one stage and one micro-batch and runs as one SPMD program, "
                             "which has no pipeline tasks to time; pass PipeshardParallel(single_program=False)")
        with StepRecorder(executable.program, executable.local, serialize, self.method.timeout_s) as recorder:
            outputs = jax.block_until_ready(executable(leaves, recorder))
            timeline = recorder.timeline()
        process = jax.process_index()
        if jax.process_count() > 1:
            stem, ext = os.path.splitext(path)
            path = f"{stem}.p{process}{ext}"
        write_chrome_trace(path, timeline, process)
        return self._outputs(args, compiled, outputs), timeline

    def get_executable(self, *args: Any) -> PipelineExecutable | SpmdStep:
        """The compiled pipeline for these arguments (compiling it if needed).

        A step over flax NNX objects returns its own outputs and then the Variable values it
        updated (``meshpar.nnx_state``): calling the step writes them back."""
        return self._lookup(args)[1].executable

    def _lookup(self, args: tuple) -> tuple[list, _Compiled]:
        """``args``' leaves, and the compiled step for their structure and shapes (compiled on
        the first call with them)."""
        leaves, in_tree = jax.tree.flatten(args)
        key = (in_tree, tuple((np.shape(x), _dtype(x)) for x in leaves))
        if key not in self._cache:
            if self.method.planned:
                self._plan(args)
            self.method.check_devices()
            self._cache[key] = self._compile(args, leaves, in_tree)
        return leaves, self._cache[key]

    def _plan(self, args: tuple) -> None:
        """Replaces the ``"auto"`` arguments with ``meshpar.plan_parallelism``'s choice for ``args``."""
        from meshpar.planning import plan_parallelism

        m = self.method
        self.plan = plan_parallelism(
            self.fun, *args, devices=m.devices, cluster=m.cluster, batch_argnums=m.batch_argnums,
            num_stages=None if m.num_stages in (AUTO, None) else m.num_stages,
            num_micro_batches=None if m.num_micro_batches == AUTO else m.num_micro_batches,
            schedules=(m.schedule,))
        self.method = self.plan.method_with(
            resharding=m.resharding, balancer=m.balancer, batch_argnums=m.batch_argnums, executor=m.executor,
            timeout_s=m.timeout_s, weight_delay=m.weight_delay,
            single_program=m.single_program)
        print(f"meshpar.parallelize({getattr(self.fun, '__name__', 'step')}): {self.plan.describe()}", flush=True)

    def _trace(self, method: PipeshardParallel, traced: Callable[..., Any], abstract: list,
               args: tuple) -> tuple[Any, Any]:
        """The jaxpr and output shapes of ``traced`` (the step as a function of its argument
        leaves) for leaves shaped ``abstract``; ``args`` are the step's arguments (for messages)."""
        try:
            with tracing_pipeline(), _trace_mesh(method):
                return jax.make_jaxpr(traced, return_shape=True)(*abstract)
        except (StageMarkerError, GradCallError, NnxStateError):
            raise
        except Exception as e:
            # A step that fails on micro-batch shapes often has its batch elsewhere: say which
            # arguments were cut.
            raise TypeError(f"{getattr(self.fun, '__name__', 'step')}: cannot be traced by meshpar.parallelize: {e}\n"
                            f"(batch_argnums={method.batch_argnums} cut arguments {list(method.batch_argnums)} "
                            f"into micro-batches; the step's arguments: {describe_arguments(args)})") from e

    def _compile(self, args: tuple, leaves: list, in_tree: Any) -> _Compiled:
        method = self.method
        # 1. Trace to a jaxpr (abstract evaluation only) at micro-batch shapes,
        # so every stage computes on one micro-batch.
        arg_of_leaf = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
        batch_leaves = {i for i, a in enumerate(arg_of_leaf) if a in method.batch_argnums}
        batch_size = check_batch(args, method.batch_argnums)
        M = method.num_micro_batches
        if batch_size % M:
            raise ValueError(f"num_micro_batches: {M} does not divide the batch size {batch_size}")
        micro_batch_size = batch_size // M
        # Traced twice: per micro-batch for the stages, and at the whole batch's shapes for what
        # runs once per step around the pipeline (a count over the whole batch, the update).
        name = getattr(self.fun, '__name__', 'step')
        nnx_arguments = has_variables(args)
        updates: list[StateUpdates] = []
        if nnx_arguments:
            check_distinct_variables(args, name)
            traced = returning_updates(self.fun, in_tree, name, updates)
        else:
            def traced(*ls: Any) -> Any:
                return self.fun(*jax.tree.unflatten(in_tree, ls))
        micro, _ = self._trace(method, traced, [
            jax.ShapeDtypeStruct((micro_batch_size, *np.shape(x)[1:]) if i in batch_leaves else np.shape(x), _dtype(x))
            for i, x in enumerate(leaves)], args)
        outer, out_shapes = self._trace(method, traced, [jax.ShapeDtypeStruct(np.shape(x), _dtype(x)) for x in leaves],
                                        args)
        # 2. Everything else is the pass pipeline's: stages, meshes, layout,
        # stage parts, transfers, schedule and program, each verified.
        grad_micro, grad_whole = (find_grad_call(name, jaxpr, nnx_arguments) for jaxpr in (micro, outer))
        params = grad_micro.params
        num_diff, num_aux = params["num_diff"], params["num_aux"]
        if len(grad_micro.invars) != len(grad_whole.invars) or num_aux != grad_whole.params["num_aux"]:
            raise ValueError(f"{name}: traced per micro-batch and for the whole batch, the loss function reads "
                             f"different values; its structure must not depend on the batch size")
        # Which loss operands follow the batch shows in how their shapes change with it. One
        # micro-batch changes nothing, so a third trace at a smaller batch tells (without it a
        # batch would be read whole, replicated over the data axis: every device computing it).
        probe = M if M > 1 or batch_size == 1 else _smallest_factor(batch_size)
        if probe != M:
            probed, _ = self._trace(method, traced, [
                jax.ShapeDtypeStruct((batch_size // probe, *np.shape(x)[1:]) if i in batch_leaves else np.shape(x),
                                     _dtype(x)) for i, x in enumerate(leaves)], args)
            grad_probe = find_grad_call(name, probed, nnx_arguments)
        else:
            grad_probe = grad_micro
        micro_batching = resolve_micro_batching(
            grad_probe.params, [v.aval for v in grad_probe.invars[num_diff:]],
            [v.aval for v in grad_whole.invars[num_diff:]], [v.aval for v in grad_whole.outvars[1:1 + num_aux]],
            probe, user_location(grad_whole))
        micro_batching = dataclasses.replace(micro_batching, num_micro_batches=M)
        cluster = method.cluster
        options = PipelineOptions(
            M, micro_batch_size, method.schedule, method.weight_delay, method.executor, method.resharding,
            method.stage_meshes, method.stage_mesh_shape,
            cluster.inter_host_bandwidth if cluster else 1.25e9, cluster.intra_host_bandwidth if cluster else 100e9,
            method.data_axis, method.model_axis, method.cut_points, method.auto_layers,
        )
        devices = list(method.devices) if method.devices is not None else jax.devices()
        out_tree = jax.tree.structure(out_shapes)
        if nnx_arguments:
            if len(set(updates)) != 1:
                raise ValueError(f"{name}: traced per micro-batch and for the whole batch, the step updates "
                                 f"different NNX Variables; which it updates must not depend on the batch size")
            state_updates = updates[-1]
            own_tree = out_tree.children()[0]
            replaced = [*state_counterparts(in_tree, own_tree), *state_updates.leaves]
        else:
            state_updates = None
            replaced = state_counterparts(in_tree, out_tree)
        compiled = compile_pipeline(
            outer, params, micro_batching, leaves, partition_specs(args), frozenset(batch_leaves), replaced,
            devices, options, functools.partial(_check_num_stages, method),
        )
        if method.single_program and compiled.graph.num_stages == 1 and M == 1:
            return _Compiled(_single_program(compiled, outer, out_tree, method), state_updates)
        fingerprints: list[str] = []

        def prepare_move(kind: TransferKind, shape: tuple, dtype: Any, src: NamedSharding, dst: NamedSharding):
            if kind is TransferKind.DEVICE_PUT:
                return functools.partial(jax.device_put, device=dst)
            if kind is TransferKind.SIGNAL:
                # The byte leaves from one source device (no collective over the source mesh) and
                # moves as any 0-d value to every device of the destination mesh.
                one = (device_sharding(src.mesh.devices.flat[0]), NamedSharding(dst.mesh, P()))
                processes = [d.process_index for s in one for d in s.mesh.devices.flat]
                carry = (functools.partial(jax.device_put, device=one[1])
                         if choose_transfer("auto", processes, 0) is TransferKind.DEVICE_PUT
                         else prepare_reshard((), np.uint8, *one, executor="p2p")[0])
                return SignalMove(shape, dtype, src, dst, carry)
            executable, _ = prepare_reshard(
                shape, dtype, src, dst, strategy=method.resharding, balancer=method.balancer,
                cluster=method.cluster, executor=kind.value)
            fingerprints.append(executable.program.fingerprint)
            if kind is TransferKind.COLLECTIVE and not executable.participates:
                nothing = absent(shape, dtype, dst)
                return lambda x: nothing
            if kind is TransferKind.COLLECTIVE:
                # Collectives in flight at once could start in different orders on different
                # devices (processes, or a process's device threads) and deadlock: each
                # completes before the next launch.
                return functools.partial(executable, complete_within=method.timeout_s)
            return executable

        executable = PipelineExecutable(
            compiled.graph, compiled.split, compiled.layout, compiled.program, compiled.parts, compiled.meshes,
            micro_batch_size, prepare_move, out_tree, jax.tree.leaves(out_shapes),
            compiled.micro_batching, timeout_s=method.timeout_s,
        )
        if jax.process_count() > 1:
            # One agreement for the whole pipeline: every process compiled the
            # same stages, schedule and moves, or all of them fail here.
            agree(
                f"pipeline/{getattr(self.fun, '__name__', 'step')}",
                {"schedule": [str(t) for t in compiled.schedule.order], "moves": fingerprints},
                list(range(jax.process_count())),
                timeout_s=method.timeout_s,
                what=f"meshpar.parallelize({getattr(self.fun, '__name__', 'step')})",
            )
        executable.describe = functools.partial(_describe, executable, method)  # type: ignore[attr-defined]
        return _Compiled(executable, state_updates)


def _single_program(compiled: Any, outer: Any, out_tree: Any, method: PipeshardParallel) -> SpmdStep:
    """The one-stage, one-micro-batch step as one program, its leaves placed as the pipeline
    would place them (a batch leaf as its stage reads it: the micro-batch is the batch)."""
    layout, mesh = compiled.layout, compiled.meshes[0]
    read_as = {op.source.index: op.sharding for op in layout.stage_operands[0] if op.source.kind is OuterKind.IN}
    ins = [p.on(0) if p.meshes else read_as.get(i, NamedSharding(mesh, P(method.data_axis)))
           for i, p in enumerate(layout.in_placements)]
    outs = [p.on(0) if p is not None and p.meshes else None for p in layout.out_placements]
    step = SpmdStep(outer, compiled.micro_batching, ins, outs, out_tree, layout, compiled.meshes)
    step.describe = lambda: (f"one stage, one micro-batch on mesh {dict(mesh.shape)}: one SPMD program "
                             f"(PipeshardParallel.single_program)")
    return step


def _smallest_factor(n: int) -> int:
    """The smallest divisor of ``n > 1`` above 1."""
    return next(k for k in range(2, n + 1) if n % k == 0)


def _check_num_stages(method: PipeshardParallel, graph: StageGraph) -> None:
    S = graph.num_stages
    if method.num_stages is not None and method.num_stages != S:
        if S == 1:
            raise StageMarkerError(
                f"num_stages: {method.num_stages} stages asked for, but the model calls "
                f"meshpar.mark_stage_boundary() nowhere; mark where each stage ends, pass "
                f"auto_layers={method.num_stages} to cut it automatically, num_stages='auto' to plan it, "
                f"or num_stages=1"
            )
        if method.auto_layers is not None and method.cut_points is None:
            raise StageMarkerError(
                f"num_stages: {method.num_stages} stages asked for, but auto_layers={method.auto_layers} cut the "
                f"loss into {S} layers with {S - 1} automatic markers, one stage each; pass "
                f"auto_layers={method.num_stages}, or cut_points naming which {method.num_stages - 1} of the "
                f"{S - 1} automatic markers (numbered from 0) cut"
            )
        raise StageMarkerError(
            f"num_stages: {method.num_stages} stages asked for, but the model's "
            f"{S - 1} stage markers make {S} stages; pass num_stages={S} (or None), or move the markers"
        )


def _describe(executable: PipelineExecutable, method: PipeshardParallel) -> str:
    """Stages, meshes, shardings, each cross-mesh transfer's plan, and the schedule."""
    schedule = executable.schedule
    split = ("whole backwards" if not schedule.split_backward else
             "backwards split into input (I) and weight (W) passes, "
             + (f"weight passes delayed by {list(schedule.weight_delays)} compute tasks per stage"
                if schedule.weight_delays is not None else "stage s holding back s weight passes"))
    lines = [f"pipeline: {executable.graph.num_stages} stages, {executable.num_micro_batches} micro-batches "
             f"of {executable.micro_batch_size}, schedule {schedule.name}, {split}"]
    for stage in executable.graph.stages:
        mesh = executable.meshes[stage.index]
        specs = [sh.spec for sh in executable.layout.grad_shardings[stage.index]]
        # A spec naming a size-1 axis leaves its dimension whole on every device: not sharded.
        split_over = [{a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)
                       if mesh.shape[a] > 1} for spec in specs]
        sharded = sum(1 for axes in split_over if axes)
        placed = (f"{sharded} sharded over {', '.join(map(repr, sorted(set().union(*split_over))))}, the rest replicated"
               if sharded else "all replicated")
        others = [str(r) for r in stage.inputs if r.kind is not RefKind.PARAM]
        lines.append(
            f"  stage {stage.index}: mesh {dict(mesh.shape)} devices {[d.id for d in mesh.devices.flat]}; "
            f"{len(specs)} parameter leaves ({placed}); also reads {', '.join(others) or 'nothing else'}"
        )
    for t in executable.program.transfers:
        if t.kind is TransferKind.DEVICE_PUT:
            # The plan still says what the move costs on the cluster, and how it runs across processes.
            plan = plan_between(t.shape, t.dtype, t.src, t.dst, strategy=method.resharding,
                                balancer=method.balancer, cluster=method.cluster)
            how = (f"jax.device_put, since one process owns both meshes; across processes the plan is "
                   f"{plan.summary()}")
        elif t.kind is TransferKind.SIGNAL:
            how = "signal: one byte with the same dependencies, zeros delivered (upper-bound run)"
        elif not t.shape:
            how = f"{t.kind.value}: a scalar, replicated to every device"
        else:
            plan = plan_between(t.shape, t.dtype, t.src, t.dst, strategy=method.resharding,
                                balancer=method.balancer, cluster=method.cluster)
            how = f"{t.kind.value}: {plan.summary()}"
        what = "activation" if t.direction is Direction.ACTIVATION else "gradient"
        value = jax.core.ShapedArray(t.shape, t.dtype).str_short()
        lines.append(f"  {what} {executable.edges[t.edge][2]} {value} stage {t.src_stage} -> {t.dst_stage}: {how}")
    lines.append("  launch order: " + " ".join(map(str, schedule.order)))
    mb = executable.micro_batching
    aux = ", ".join(f"aux{k} {r.value}" for k, r in enumerate(mb.aux))
    lines.append(f"  micro-batches combine: loss and gradients by {mb.reduction}" + (f"; {aux}" if aux else "")
                 + (f"; {len(mb.fold_keys)} PRNG key(s) folded with the micro-batch index" if mb.fold_keys else ""))
    for phase, steps in (("before the pipeline", executable.split.before), ("after it", executable.split.after)):
        computes = [st for st in steps if isinstance(st, OuterCompute)]
        moves = [st for st in steps if isinstance(st, OuterMove)]
        if not steps:
            continue
        lines.append(f"  {phase}: {len(computes)} computations on meshes {sorted({c.mesh for c in computes})}"
                     + "".join(f"; {_values_str(executable.split, mv.values)} move{'s' * (len(mv.values) == 1)} "
                               f"mesh {mv.src} -> {mv.dst}" + (" packed into one transfer" if len(mv.values) > 1 else "")
                               for mv in moves))
    return "\n".join(lines)


def _values_str(split: Any, values: Sequence[Any]) -> str:
    """``values`` for a description: each one, or a count when there are many."""
    if len(values) <= 3:
        return ", ".join(f"{v} {split.avals[v].str_short()}" for v in values)
    return f"{len(values)} values ({split.avals[values[0]].str_short()}, ...)"
