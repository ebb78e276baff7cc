"""``@meshpar.parallelize``: run a train step as an MPMD pipeline over stage meshes."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.autodiff import tracing_pipeline
from meshpar.cluster import Cluster
from meshpar.passes.apply_split import split_apply
from meshpar.passes.balancers import get_balancer
from meshpar.passes.mesh_assignment import DEFAULT_AXES, assign_stage_meshes, param_sharding
from meshpar.passes.pipeline_schedule import SCHEDULES, make_schedule
from meshpar.passes.stage_graph import Ref, StageMarkerError, split_stages
from meshpar.passes.strategies import get_strategy
from meshpar.passes.edge_transfer import EXECUTORS, SIGNAL, TransferKind, choose_transfer
from meshpar.reshard import plan_between, prepare_reshard
from meshpar.runtime.coordination import agree
from meshpar.runtime.pipeline_executor import PipelineExecutable, Placement
from meshpar.runtime.remote import absent
from meshpar.runtime.signal_move import SignalMove

__all__ = ["PipeshardParallel", "parallelize", "ParallelizedStep"]


@dataclasses.dataclass(frozen=True)
class PipeshardParallel:
    """Inter-op (pipeline) plus intra-op (sharded) parallelism.

    Attributes:
      num_micro_batches: micro-batches per step; must divide the batch.
      stage_meshes: one ``jax.sharding.Mesh`` per stage, disjoint; by default
        the devices are cut evenly, host-major.
      num_stages: expected number of stages (stage markers + 1); checked.
      stage_mesh_shape: ``(data, model)`` shape of each cut mesh; default all
        devices of a stage on ``data``.
      schedule: ``gpipe``, ``1f1b`` or ``eager_1f1b``.
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
        compiled pipeline, values other processes send it) before raising.
      batch_argnums: positional arguments holding the batch (cut into
        micro-batches along dimension 0).
      devices: devices to use; default ``jax.devices()``.
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

    def __post_init__(self) -> None:
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches: expected a positive integer, got {self.num_micro_batches!r}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages: expected a positive integer, got {self.num_stages!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule: unknown {self.schedule!r}; expected one of {sorted(SCHEDULES)}")
        if self.resharding != SIGNAL:
            get_strategy(self.resharding)
        get_balancer(self.balancer)
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor: expected one of {EXECUTORS}, got {self.executor!r}")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"timeout_s: expected a positive number of seconds, got {self.timeout_s!r}")


def parallelize(fun: Callable | None = None, *, method: PipeshardParallel = PipeshardParallel()) -> Any:
    """Decorates a train step ``(state, batch, ...) -> outputs`` to run as a pipeline.

    The step calls ``meshpar.value_and_grad`` (or ``meshpar.grad``) once on a
    loss whose model calls ``meshpar.mark_stage_boundary()`` between stages.
    Returns a callable taking and returning the same pytrees; state arrays
    stay sharded on their stage meshes between calls.
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
        return jax.set_mesh(Mesh(np.array(devices[:n]).reshape(method.stage_mesh_shape), DEFAULT_AXES))
    return contextlib.nullcontext()


def _dtype(x: Any) -> np.dtype:
    """The dtype JAX gives ``x`` (Python scalars and int64 numpy data canonicalised)."""
    return jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))


def _flax_specs(args: Any) -> list[P | None]:
    try:
        import flax.linen as nn
    except ImportError:  # flax is a dependency, but the specs are optional
        return [None] * len(jax.tree.leaves(args))
    specs = nn.get_partition_spec(args)
    return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P) or x is None)


class ParallelizedStep:
    """The decorated step: compiles on first call per input structure, then runs."""

    def __init__(self, fun: Callable, method: PipeshardParallel) -> None:
        self.fun = fun
        self.method = method
        self._cache: dict[Any, PipelineExecutable] = {}
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any) -> Any:
        leaves, in_tree = jax.tree.flatten(args)
        executable = self.get_executable(*args)
        return jax.tree.unflatten(executable.out_tree, executable(leaves))

    def get_executable(self, *args: Any) -> PipelineExecutable:
        """The compiled pipeline for these arguments (compiling it if needed)."""
        leaves, in_tree = jax.tree.flatten(args)
        key = (in_tree, tuple((np.shape(x), _dtype(x)) for x in leaves))
        if key not in self._cache:
            self._cache[key] = self._compile(args, leaves, in_tree)
        return self._cache[key]

    def _compile(self, args: tuple, leaves: list, in_tree: Any) -> PipelineExecutable:
        method = self.method
        # 1. Trace to a jaxpr (abstract evaluation only) at micro-batch shapes,
        # so every stage computes on one micro-batch.
        arg_of_leaf = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
        batch_leaves = {i for i, a in enumerate(arg_of_leaf) if a in method.batch_argnums}
        sizes = {np.shape(leaves[i])[:1] for i in batch_leaves}
        if len(sizes) != 1 or sizes == {()}:
            raise ValueError(
                f"batch_argnums: the batch arguments {method.batch_argnums} have leaves with leading "
                f"dimensions {sorted(sizes)}; expected one shared batch dimension"
            )
        ((batch_size,),) = sizes
        M = method.num_micro_batches
        if batch_size % M:
            raise ValueError(f"num_micro_batches: {M} does not divide the batch size {batch_size}")
        micro_batch_size = batch_size // M
        abstract = [
            jax.ShapeDtypeStruct(
                (micro_batch_size, *np.shape(x)[1:]) if i in batch_leaves else np.shape(x), _dtype(x)
            )
            for i, x in enumerate(leaves)
        ]
        try:
            with tracing_pipeline(), _trace_mesh(method):
                outer, out_shapes = jax.make_jaxpr(
                    lambda *ls: self.fun(*jax.tree.unflatten(in_tree, ls)), return_shape=True
                )(*abstract)
        except StageMarkerError:
            raise
        except Exception as e:
            raise TypeError(f"{getattr(self.fun, '__name__', 'step')}: cannot be traced by meshpar.parallelize: {e}") from e
        out_tree = jax.tree.structure(out_shapes)
        # 2. Cut the loss into stages.
        grad_eqns = [e for e in outer.jaxpr.eqns if e.primitive.name == "meshpar_pipeline_grad"]
        if len(grad_eqns) != 1:
            raise ValueError(
                f"{getattr(self.fun, '__name__', 'step')}: must call meshpar.value_and_grad or meshpar.grad "
                f"exactly once, found {len(grad_eqns)}"
            )
        (grad_eqn,) = grad_eqns
        graph = split_stages(grad_eqn.params["loss_jaxpr"], grad_eqn.params["num_diff"])
        S = graph.num_stages
        if method.num_stages is not None and method.num_stages != S:
            if S == 1:
                raise StageMarkerError(
                    f"num_stages: {method.num_stages} stages asked for, but the model calls "
                    f"meshpar.mark_stage_boundary() nowhere; mark where each stage ends"
                )
            raise StageMarkerError(
                f"num_stages: {method.num_stages} stages asked for, but the model's "
                f"{S - 1} stage markers make {S} stages"
            )
        # 3. Meshes, and where every leaf lives.
        devices = list(method.devices) if method.devices is not None else jax.devices()
        meshes = assign_stage_meshes(devices, S, method.stage_meshes, method.stage_mesh_shape)
        _, split = split_apply(outer, graph.param_owner, graph.loss.index, S)
        batch_inputs = frozenset(
            k for k, r in enumerate(split.loss_inputs) if r.kind == "in" and r.index in batch_leaves
        )
        for mesh in meshes:
            data = mesh.shape.get("data", 1)
            if micro_batch_size % data:
                raise ValueError(
                    f"num_micro_batches: micro-batches of {micro_batch_size} examples do not split over "
                    f"the {data}-way 'data' axis of the stage meshes"
                )

        in_placements = _input_placements(graph, split, meshes, leaves, _flax_specs(args), batch_leaves)
        out_placements = _output_placements(in_tree, out_tree, in_placements, len(leaves))
        schedule = make_schedule(method.schedule, S, M, [(p, c) for p, c, _ in graph.edges()])
        fingerprints: list[str] = []

        def prepare_move(kind: TransferKind, shape: tuple, dtype: Any, src: NamedSharding, dst: NamedSharding):
            if kind is TransferKind.DEVICE_PUT:
                return functools.partial(jax.device_put, device=dst)
            if kind is TransferKind.SIGNAL:
                # The byte moves as any 0-d value between the two meshes would.
                one = (NamedSharding(src.mesh, P()), NamedSharding(dst.mesh, P()))
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
            return executable

        executable = PipelineExecutable(
            graph, split, schedule, meshes, in_placements, out_placements, batch_inputs, M,
            micro_batch_size, prepare_move, method.executor, out_tree, jax.tree.leaves(out_shapes),
            timeout_s=method.timeout_s, strategy=method.resharding,
        )
        if jax.process_count() > 1:
            # One agreement for the whole pipeline: every process compiled the
            # same stages, schedule and moves, or all of them fail here.
            agree(
                f"pipeline/{getattr(self.fun, '__name__', 'step')}",
                {"schedule": [str(t) for t in schedule.order], "moves": fingerprints},
                list(range(jax.process_count())),
                timeout_s=method.timeout_s,
                what=f"meshpar.parallelize({getattr(self.fun, '__name__', 'step')})",
            )
        executable.describe = functools.partial(_describe, executable, method)  # type: ignore[attr-defined]
        return executable


def _input_placements(graph, split, meshes, leaves, specs, batch_leaves) -> list[Placement]:
    needs: list[set[int]] = [set() for _ in leaves]
    for k, leaf in enumerate(split.param_inputs):
        needs[leaf].add(graph.param_owner(k))
    for stage in graph.stages:
        for r in stage.inputs:
            if r.kind == "input":
                ref = split.loss_inputs[r.index]
                if ref.kind == "in" and ref.index not in batch_leaves:
                    needs[ref.index].add(stage.index)
    for apply in split.stages:
        for r in apply.inputs:
            if r.kind == "in":
                needs[r.index].add(apply.mesh)
    placements = []
    for i, (x, spec) in enumerate(zip(leaves, specs)):
        if i in batch_leaves and not needs[i]:
            # Read only per micro-batch, each going straight to its stage.
            placements.append(Placement((), ()))
            continue
        where = tuple(sorted(needs[i])) or (0,)
        shape = tuple(np.shape(x))
        if len(where) == 1:
            shardings = (param_sharding(meshes[where[0]], spec, shape),)
        else:
            shardings = tuple(NamedSharding(meshes[m], P()) for m in where)
        placements.append(Placement(shardings, where))
    return placements


def _output_placements(in_tree, out_tree, in_placements, num_in) -> list[Placement | None]:
    """The step's new state lives where its old state did, so the next step moves nothing."""
    outs: list[Placement | None] = [None] * out_tree.num_leaves
    in_children, out_children = in_tree.children(), out_tree.children()
    if in_children and out_children and in_children[0] == out_children[0]:
        for j in range(in_children[0].num_leaves):
            outs[j] = in_placements[j]
    return outs


def _describe(executable: PipelineExecutable, method: PipeshardParallel) -> str:
    """Stages, meshes, shardings, each cross-mesh transfer's plan, and the schedule."""
    lines = [f"pipeline: {executable.graph.num_stages} stages, {executable.num_micro_batches} micro-batches "
             f"of {executable.micro_batch_size}, schedule {executable.schedule.name}"]
    for stage in executable.graph.stages:
        mesh = executable.meshes[stage.index]
        specs = [executable.input_sharding(Ref("param", k), stage.index).spec for k in stage.param_inputs]
        sharded = sum(1 for spec in specs if any(e is not None for e in spec))
        others = [str(r) for r in stage.inputs if r.kind != "param"]
        lines.append(
            f"  stage {stage.index}: mesh {dict(mesh.shape)} devices {[d.id for d in mesh.devices.flat]}; "
            f"{len(specs)} parameter leaves ({sharded} sharded over 'model', the rest replicated); "
            f"also reads {', '.join(others) or 'nothing else'}"
        )
    for p, c, ref in executable.edges:
        aval = executable.graph.stages[p].jaxpr.out_avals[ref.slot]
        for direction, (a, b) in (("activation", (p, c)), ("gradient", (c, p))):
            src, dst = executable.act_sharding(ref, a), executable.act_sharding(ref, b)
            kind = executable.move_kinds[(tuple(aval.shape), np.dtype(aval.dtype), src, dst)]
            if kind is TransferKind.DEVICE_PUT:
                how = "jax.device_put (one process owns both meshes)"
            elif kind is TransferKind.SIGNAL:
                how = "signal: one byte with the same dependencies, zeros delivered (upper-bound run)"
            elif not aval.shape:
                how = f"{kind.value}: a scalar, replicated to every device"
            else:
                plan = plan_between(aval.shape, aval.dtype, src, dst, strategy=method.resharding,
                                    balancer=method.balancer, cluster=method.cluster)
                how = f"{kind.value}: {plan.summary()}"
            lines.append(f"  {direction} {ref} {aval.str_short()} stage {a} -> {b}: {how}")
    lines.append("  launch order: " + " ".join(map(str, executable.schedule.order)))
    return "\n".join(lines)
