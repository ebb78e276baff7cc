"""``meshpar.PipeshardParallel``: the user's pipeline options, each checked when given.

The options are flat keywords (``PipeshardParallel(num_stages=4, schedule="1f1b")``);
``pipeline_options`` groups them as the compiler reads them
(``passes.pipeline.pipeline_options``). This is the API boundary of a pipeline's policies: each
name the user gives (schedule, resharding strategy, balancer, executor, gradient reduction) is
checked when given and resolved here, by its registry or enum, to the object the compiler takes;
the fields keep what the user passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshpar.cluster import Cluster
from meshpar.logical_partitioning import check_logical_axis_rules
from meshpar.passes.pipeline.pipeline_options import (
    GradientOptions, GradientReduction, PipelineOptions, PlacementOptions, ScheduleOptions, TransferOptions,
)
from meshpar.passes.pipeline.placing.edge_transfer import Executor
from meshpar.passes.pipeline.placing.mesh_assignment import check_stage_split, count_meshes, mesh_shapes
from meshpar.passes.pipeline.scheduling.pipeline_schedule import ScheduleKind, check_stage_placement, schedule_kind
from meshpar.passes.program.devices import DeviceKey, device_key, device_name
from meshpar.passes.resharding.balancers import Balancer, get_balancer
from meshpar.passes.resharding.strategies import Strategy, get_strategy
from meshpar.passes.simulation.weight_delay import check_weight_delay

__all__ = ["AUTO", "PipeshardParallel"]

AUTO = "auto"
# ``resharding="signal"``: the executor ``"signal"`` under the name it was first given (a
# strategy's argument); resolved here, so past the API it is ``Executor.SIGNAL`` alone.
SIGNAL = "signal"
# Stage passes per fused program by default (``fuse_compute``).
FUSE_COMPUTE = 1


@dataclasses.dataclass(frozen=True)
class PipeshardParallel:
    """Inter-op (pipeline) plus intra-op (sharded) parallelism.

    Every argument is checked when this is made, and the ones the devices decide (when
    ``devices`` is not given) when the step first compiles, before it is traced; the errors
    name the argument and a fix.

    Attributes:
      num_micro_batches: micro-batches per step; must divide the batch. ``"auto"``: planned.
      stage_meshes: the ``jax.sharding.Mesh``es the stages run on, disjoint, each with the
        axis ``data_axis`` or ``model_axis`` (or both): one per stage, or fewer, each then
        running ``stages_per_mesh`` stages; by default the devices are cut evenly, host-major.
      num_stages: the number of stages. The model's stage markers are candidate cuts: with
        more than ``num_stages - 1`` of them (and no ``cut_points``) the compiler groups the
        segments between them into ``num_stages`` stages of balanced estimated FLOPs
        (``passes.pipeline.cutting.marker_grouping``); fewer is an error. ``None``: every
        marker cuts.
        ``"auto"``: ``meshpar.plan_parallelism`` chooses which markers cut, each stage's
        mesh (their shapes may differ) and, unless given, the micro-batches, on the first
        call, and prints its choice (``ParallelizedStep.plan``); the schedule stays this one.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh, two positive
        integers whose product is the devices per mesh; default all devices
        of a mesh on ``data``. Not with ``stage_meshes``. ``"auto"``: planned, as above.
      stages_per_mesh: stages each mesh runs (virtual pipeline stages, placed on the meshes as
        the schedule places them). ``None``: ``num_stages / len(stage_meshes)`` with
        ``stage_meshes``, else 1. Above 1 the schedule must run virtual stages and the
        micro-batches fit it (``passes.pipeline.scheduling.pipeline_schedule.check_stage_placement``).
        The devices are cut into ``num_stages / stages_per_mesh`` meshes. Not with ``"auto"``
        (the planner places one stage per mesh).
      schedule: ``gpipe``, ``1f1b``, ``eager_1f1b``, ``zb_h1``, ``interleaved_1f1b`` and
        ``interleaved_zb`` (virtual stages, stage k on mesh k mod P; the latter is torch's
        ``ScheduleInterleavedZeroBubble``), or ``zb_v`` and ``dualpipev`` (exactly
        ``stages_per_mesh=2`` in a V: stages r and 2P-1-r on mesh r, at least 2P micro-batches;
        ``passes.pipeline.scheduling.pipeline_schedule.SCHEDULES``); or a user's own order,
        ``meshpar.load_schedule_csv(path)`` (torch's CSV action format), which fixes the
        meshes, stages and micro-batches it runs (not with ``"auto"``).
      weight_delay: split each backward into an activation-gradient and a
        weight-gradient pass and run the latter later: ``False`` (whole
        backwards), ``True`` (after the stage's next compute task) or
        ``"auto"`` (the least delay whose compute covers the stage's
        transfer round trip, by the cost model). With ``gpipe`` the weight
        passes then trail the next micro-batch's activation pass. ``zb_h1``,
        ``zb_v`` and ``dualpipev`` always split and place weight passes themselves.
      resharding, balancer: strategy and balancer of cross-mesh transfers: a name in
        ``meshpar.STRATEGIES`` (resp. ``meshpar.BALANCERS``) or the object itself.
        ``resharding="signal"`` is ``executor="signal"`` (below), under its older name.
      executor: how values cross meshes: ``"auto"`` (``jax.device_put``
        when one process owns both meshes, else asynchronous p2p moves that
        overlap with compute), ``"p2p"``, ``"collective"`` (one
        ``ppermute`` program over both meshes: the no-overlap baseline), or
        ``"signal"``: one byte per transfer instead, with the same dependencies,
        delivering zeros: the schedule's communication upper bound, for benchmarks
        only (the step's numbers are not kept).
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
      gradient_reduction: ``"per_step"`` (default): each device of a stage mesh accumulates
        the partial gradients of its own examples over the step's micro-batches, and each
        stage mesh reduces them over ``data_axis`` once per step, as soon as its last weight
        gradient is done. ``"per_micro_batch"``: every backward reduces its micro-batch's
        gradients itself (the plain SPMD program; M times the gradient bytes over the data
        links), kept to compare against. See ``passes.pipeline.placing.data_replicas`` for when a
        stage keeps the per-micro-batch reduction anyway.
      accumulation_dtype: the floating dtype the gradients of narrower floating parameters
        (bfloat16, float16) accumulate in over micro-batches (default float32, as
        mixed-precision training expects); the reduced gradient has the parameter's dtype.
      fuse_compute: the most stage passes (forwards, backwards, input and weight passes) a mesh
        runs as one program where they run back to back with only values of that mesh between
        them (``passes.pipeline.lowering.fused_runs``): each program launched costs its device a fixed
        price (XLA's setup of every operation; about a millisecond for a small GPT stage on a
        CPU), which fusing pays once. 1: every pass its own program; ``None``: no limit (a
        mesh hosting every stage then runs its whole pipeline as one program, compiled from
        all of its micro-batches).
      logical_axis_rules: flax's ``(logical name, mesh axis or None)`` pairs mapping the
        logical names of ``nn.with_logical_partitioning`` parameters (and NNX Variables'
        logical ``out_sharding``) to the stage meshes' axes, as ``nn.logical_axis_rules``
        does: a name mapped to ``model_axis`` shards over it, one without a rule is
        replicated. ``None``: the rules active when the step is first called (``with
        nn.logical_axis_rules(...)`` around it); given, they replace those while the step is
        planned, traced and laid out (``meshpar.logical_partitioning``).
    """

    num_micro_batches: int = 1
    stage_meshes: Sequence[Mesh] | None = None
    num_stages: int | None = None
    stage_mesh_shape: tuple[int, int] | None = None
    schedule: str | ScheduleKind = "1f1b"
    resharding: str | Strategy = "broadcast"
    balancer: str | Balancer = "ensemble"
    cluster: Cluster | None = None
    batch_argnums: tuple[int, ...] = (1,)
    devices: Sequence[Any] | None = None
    executor: str | Executor = "auto"
    timeout_s: float = 120.0
    weight_delay: bool | str = False
    data_axis: str = "data"
    model_axis: str = "model"
    cut_points: tuple[int, ...] | None = None
    single_program: bool = True
    auto_layers: int | None = None
    stages_per_mesh: int | None = None
    gradient_reduction: str | GradientReduction = "per_step"
    accumulation_dtype: Any = "float32"
    fuse_compute: int | None = FUSE_COMPUTE
    logical_axis_rules: Sequence[tuple[str, str | None]] | None = None

    @property
    def schedule_kind(self) -> ScheduleKind:
        """``schedule`` resolved: the registered ``ScheduleKind`` it names, or itself.

        Raises:
          ValueError: naming ``schedule`` and the registered names.
        """
        return schedule_kind(self.schedule)

    @property
    def planned(self) -> bool:
        """Whether some of the layout is left to the planner (an ``"auto"`` argument)."""
        return AUTO in (self.num_stages, self.stage_mesh_shape, self.num_micro_batches)

    def __post_init__(self) -> None:
        # A tuple of pairs: the dataclass stays hashable, and a bad rule fails here, not mid-trace.
        object.__setattr__(self, "logical_axis_rules", check_logical_axis_rules(self.logical_axis_rules))
        if not isinstance(self.single_program, bool):
            raise ValueError(f"single_program: expected a bool, got {self.single_program!r}")
        if self.fuse_compute is not None and not self._is_count(self.fuse_compute):
            raise ValueError(f"fuse_compute: expected a positive number of stage passes per program or None "
                             f"(no limit), got {self.fuse_compute!r}")
        if self.auto_layers is not None and not self._is_count(self.auto_layers):
            raise ValueError(f"auto_layers: expected a positive number of layers or None, got {self.auto_layers!r}")
        if self.stages_per_mesh is not None:
            if not self._is_count(self.stages_per_mesh):
                raise ValueError(f"stages_per_mesh: expected a positive integer (stages each mesh runs) or None, "
                                 f"got {self.stages_per_mesh!r}")
            object.__setattr__(self, "stages_per_mesh", int(self.stages_per_mesh))
        if self.planned:
            if self.schedule_kind.size is not None:
                raise ValueError(f"schedule: {self.schedule.name!r} is an order of one size (loaded from CSV), but "
                                 f"'auto' plans the stages and micro-batches; pass num_stages, num_micro_batches "
                                 f"and stage_mesh_shape for its size {self.schedule.size} (stages, meshes, "
                                 f"micro-batches), or a schedule name")
            if self.stages_per_mesh is not None:
                raise ValueError("stages_per_mesh: 'auto' (num_stages, stage_mesh_shape or num_micro_batches) plans "
                                 "one stage per mesh; do not pass stages_per_mesh with it")
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
        GradientReduction.of(self.gradient_reduction, "gradient_reduction")
        self._check_accumulation_dtype()
        if not self._is_count(self.num_micro_batches):
            raise ValueError(f"num_micro_batches: expected a positive integer, got {self.num_micro_batches!r}")
        if self.num_stages is not None and not self._is_count(self.num_stages):
            raise ValueError(f"num_stages: expected a positive integer (stage markers + 1) or None, "
                             f"got {self.num_stages!r}")
        check_weight_delay(self.weight_delay, self.schedule_kind)
        self._transfer_policies()
        get_balancer(self.balancer)
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
        if self.num_stages is not None:
            self.check_placement(self.num_stages, f"num_stages={self.num_stages}")
        if self.devices is not None:
            devices = self.devices
            if isinstance(devices, np.ndarray):
                devices = list(devices.flat)
            if (isinstance(devices, (str, bytes)) or not isinstance(devices, Sequence) or not devices
                    or not all(isinstance(d, jax.Device) for d in devices)):
                raise ValueError(f"devices: expected a non-empty list of jax devices (e.g. jax.devices()[:4]) "
                                 f"or None for all of them, got {self.devices!r}")
            if len({device_key(d) for d in devices}) != len(devices):
                raise ValueError(f"devices: devices {[device_name(d) for d in devices]} repeat; pass each device once")
            # Frozen: a normalised copy keeps the dataclass hashable and its devices flat.
            object.__setattr__(self, "devices", tuple(devices))
            # The devices are known without starting JAX's backend: check them now too.
            self.check_devices()

    def _transfer_policies(self) -> tuple[Executor, Strategy]:
        """``executor`` and ``resharding`` resolved: ``resharding="signal"`` is the signal executor
        (with the default strategy, which a signal move does not plan with).

        Raises:
          ValueError: naming ``executor`` or ``resharding`` (unknown, or ``"signal"`` asked for
            beside another executor).
        """
        executor = Executor.of(self.executor, "executor")
        if isinstance(self.resharding, str) and self.resharding == SIGNAL:  # the alias, at the API
            if executor not in (Executor.AUTO, Executor.SIGNAL):
                raise ValueError(f"resharding: 'signal' sends one byte per transfer (executor='signal'), but "
                                 f"executor={self.executor!r} asks for another executor; pass one of them")
            return Executor.SIGNAL, get_strategy("broadcast")
        return executor, get_strategy(self.resharding, "resharding")

    @staticmethod
    def _is_count(x: Any) -> bool:
        return isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 1

    def _check_accumulation_dtype(self) -> None:
        # jnp.dtype(None) is the default float; None here is a mistake, not a choice.
        try:
            dtype = None if self.accumulation_dtype is None else jnp.dtype(self.accumulation_dtype)
        except TypeError:
            dtype = None
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"accumulation_dtype: expected a floating dtype (e.g. jnp.float32), "
                             f"got {self.accumulation_dtype!r}")

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
        if self.num_stages is not None and self.num_stages % len(meshes):
            raise ValueError(f"stage_meshes: {len(meshes)} meshes, but num_stages={self.num_stages}; pass one "
                             f"mesh per stage, or a number of meshes dividing num_stages (each mesh then runs "
                             f"num_stages / meshes stages)")
        seen: dict[DeviceKey, int] = {}
        for i, mesh in enumerate(meshes):
            for d in mesh.devices.flat:
                if device_key(d) in seen:
                    raise ValueError(f"stage_meshes: meshes {seen[device_key(d)]} and {i} overlap on device "
                                     f"{device_name(d)}; pass disjoint meshes (each device in one stage)")
                seen[device_key(d)] = i
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

    def num_meshes(self, num_stages: int, counted: str = "stage markers + 1") -> int:
        """The meshes ``num_stages`` stages run on: the ``stage_meshes``, else as many cut meshes as
        ``stages_per_mesh`` (default 1) leaves (``count_meshes``, raising when they do not fit)."""
        return count_meshes(num_stages, None if self.stage_meshes is None else len(self.stage_meshes),
                            self.stages_per_mesh, counted)

    def check_placement(self, num_stages: int, counted: str) -> None:
        """Checks that ``num_stages`` stages (``counted`` says where the count comes from, for the
        message) fit the meshes (``count_meshes``), and with several stages per mesh that the
        schedule runs virtual stages over ``num_micro_batches`` (``check_stage_placement``), as
        the compiler's ``place_stages`` will.

        Raises:
          ValueError: naming ``stage_meshes``, ``stages_per_mesh``, ``schedule`` or
            ``num_micro_batches``, with a fix.
        """
        # Always: a V schedule (zb_v, dualpipev) rejects one stage per mesh too.
        check_stage_placement(self.schedule_kind, num_stages, self.num_meshes(num_stages, counted),
                              self.num_micro_batches)

    def pipeline_options(self, micro_batch_size: int) -> PipelineOptions:
        """These options grouped for the compiler, for micro-batches of ``micro_batch_size``.

        Each group field reads the field of the same name here, except the resolved policies
        (the schedule's ``kind`` from ``schedule``, the transfers' ``strategy`` from
        ``resharding``, and the executor, balancer and gradient reduction, each resolved from its
        name) and the bandwidths (``cluster``'s): a field added to a group and here reaches the
        compiler without another list to update.
        """
        cluster = self.cluster
        executor, strategy = self._transfer_policies()
        # Without a cluster the cost model prices transfers at Cluster.from_devices' defaults,
        # as the default cluster of one host per process would.
        renamed = {"kind": self.schedule_kind,
                   "executor": executor,
                   "strategy": strategy,
                   "balancer": get_balancer(self.balancer),
                   "gradient_reduction": GradientReduction.of(self.gradient_reduction, "gradient_reduction"),
                   "inter_host_bandwidth": cluster.inter_host_bandwidth if cluster else 1.25e9,
                   "intra_host_bandwidth": cluster.intra_host_bandwidth if cluster else 100e9,
                   "accumulation_dtype": jnp.dtype(self.accumulation_dtype)}

        def group(cls: type) -> Any:
            return cls(**{f.name: renamed[f.name] if f.name in renamed else getattr(self, f.name)
                          for f in dataclasses.fields(cls)})

        return PipelineOptions(group(ScheduleOptions), group(PlacementOptions), group(TransferOptions),
                               micro_batch_size, group(GradientOptions))

    def check_devices(self) -> None:
        """Checks the arguments the devices decide, against ``devices`` or else ``jax.devices()``
        (which starts JAX's backend: run when the step first compiles, before tracing, so an
        argument error is not reported as a tracing error).

        Raises:
          ValueError: a stage mesh using a device not in ``devices``; ``num_stages`` (over
            ``stages_per_mesh``: the meshes to cut) that do not divide the devices; a
            ``stage_mesh_shape`` that does not fit them.
        """
        if self.planned:
            return
        if self.stage_meshes is not None:
            if self.devices is None:
                return  # the meshes name their devices, on whichever platforms they are
            pool = {device_key(d) for d in self.devices}
            for i, mesh in enumerate(self.stage_meshes):
                outside = [d for d in mesh.devices.flat if device_key(d) not in pool]
                if outside:
                    raise ValueError(f"stage_meshes: mesh {i} uses device {device_name(outside[0])}, which is not "
                                     f"among the devices {[device_name(d) for d in self.devices]}; build the "
                                     f"meshes from those, or pass devices= including it")
            return
        devices = list(self.devices) if self.devices is not None else jax.devices()
        if self.num_stages is not None:
            meshes = self.num_meshes(self.num_stages)
            counted = f"num_stages={self.num_stages}" + (
                f" over stages_per_mesh={self.stages_per_mesh}: {meshes} meshes" if meshes != self.num_stages else "")
            check_stage_split(len(devices), meshes, self.stage_mesh_shape, counted)
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

