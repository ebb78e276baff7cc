"""Tracing and compiling one step of ``meshpar.parallelize`` for one input structure.

``compile_step`` traces the step (abstract evaluation only) at micro-batch and whole-batch
shapes, hands the traced step to the pass pipeline (``passes.pipeline_driver``) and
wraps the compiled pipeline in its executable. Nothing here plans: a planned
``PipeshardParallel`` arrives with its ``"auto"`` arguments already chosen.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.autodiff import LossTraced, stop_at_loss, tracing_pipeline
from meshpar.batch_arguments import batch_size as check_batch
from meshpar.batch_arguments import check_same_host_batch, describe_arguments
from meshpar.grad_call import GradCall, pipeline_call
from meshpar.nnx_state import (
    NnxStateError, StateUpdates, check_distinct_variables, has_variables, partition_specs, returning_updates,
)
from meshpar.passes.pipeline.cutting.exact_micro_batching import micro_batch_step
from meshpar.passes.pipeline.cutting.micro_batching import resolve_micro_batching
from meshpar.passes.pipeline.cutting.stage_graph import StageGraph, StageMarkerError, user_location
from meshpar.passes.pipeline.cutting.step_split import GradCallError
from meshpar.passes.pipeline.describe_pipeline import describe_pipeline
from meshpar.passes.pipeline.lowering.spmd_program import lower_spmd_step, verify_spmd_step
from meshpar.passes.pipeline_driver import CompiledPipeline, compile_pipeline, state_counterparts
from meshpar.passes.program.step_values import OuterKind
from meshpar.passes.program.wire_format import leaf_dtype
from meshpar.pipeshard_parallel import PipeshardParallel
from meshpar.runtime.coordination import agree
from meshpar.runtime.early_programs import EarlyPrograms
from meshpar.runtime.pipeline_executor import PipelineExecutable
from meshpar.runtime.spmd_step import SpmdStep

__all__ = ["CompiledStep", "compile_step"]


class CompiledStep(NamedTuple):
    """A compiled step: its executable, for a step over NNX objects which argument leaves its
    trailing outputs update (``None`` otherwise), and the compiler's IRs it was built from;
    ``run_as_given``: the executable on leaves as the caller gave them (``None`` when it cannot
    run them so), for a step whose program places its own inputs (``SpmdStep.run_as_given``),
    else ``None``; ``in_tree``: the arguments' structure it was compiled for."""

    executable: PipelineExecutable | SpmdStep
    updates: StateUpdates | None
    pipeline: CompiledPipeline
    run_as_given: Callable[[list], list | None] | None = None
    in_tree: Any = None


def _trace_mesh(method: PipeshardParallel) -> Any:
    """A mesh context for tracing, so ``with_sharding_constraint(x, PartitionSpec(...))`` in the
    step means "on my stage's mesh": every stage mesh has the same shape, and the constraint is
    recorded against that abstract shape, then lowered on each stage's own mesh."""
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


def _trace(fun: Callable, method: PipeshardParallel, traced: Callable[..., Any], abstract: list,
           args: tuple) -> tuple[Any, Any]:
    """The jaxpr and output shapes of ``traced`` (the step ``fun`` as a function of its argument
    leaves) for leaves shaped ``abstract``; ``args`` are the step's arguments (for messages)."""
    try:
        with tracing_pipeline(), _trace_mesh(method):
            return jax.make_jaxpr(traced, return_shape=True)(*abstract)
    except (StageMarkerError, GradCallError, NnxStateError, LossTraced):
        raise
    except Exception as e:
        # A step that fails on micro-batch shapes often has its batch elsewhere: say which
        # arguments were cut.
        raise TypeError(f"{getattr(fun, '__name__', 'step')}: cannot be traced by meshpar.parallelize: {e}\n"
                        f"(batch_argnums={method.batch_argnums} cut arguments {list(method.batch_argnums)} "
                        f"into micro-batches; the step's arguments: {describe_arguments(args)})") from e


def compile_step(fun: Callable, method: PipeshardParallel, args: tuple, leaves: list, in_tree: Any) -> CompiledStep:
    """``fun`` compiled under ``method`` for arguments ``args`` (flattened: ``leaves`` with
    structure ``in_tree``): a ``PipelineExecutable``, or one ``SpmdStep`` for a single stage and
    micro-batch (``PipeshardParallel.single_program``). ``method`` has no ``"auto"`` left and
    its devices are checked (``PipeshardParallel.check_devices``).

    Raises:
      ValueError, StageMarkerError: an argument that does not fit the traced step, naming it.
      TypeError: the step cannot be traced at micro-batch shapes.
    """
    # 1. Trace to a jaxpr (abstract evaluation only) at micro-batch shapes,
    # so every stage computes on one micro-batch.
    arg_of_leaf = [i for i, a in enumerate(args) for _ in jax.tree.leaves(a)]
    batch_leaves = {i for i, a in enumerate(arg_of_leaf) if a in method.batch_argnums}
    batch_size = check_batch(args, method.batch_argnums)
    check_same_host_batch(args, method.batch_argnums, method.timeout_s)
    M = method.num_micro_batches
    if batch_size % M:
        divisors = ", ".join(str(d) for d in range(1, batch_size + 1) if batch_size % d == 0)
        raise ValueError(f"num_micro_batches: {M} does not divide the batch size {batch_size}; pass one of "
                         f"{divisors}, or a batch whose size {M} divides")
    micro_batch_size = batch_size // M
    # Traced twice: per micro-batch for the stages, and at the whole batch's shapes for what
    # runs once per step around the pipeline (a count over the whole batch, the update).
    name = getattr(fun, '__name__', 'step')
    nnx_arguments = has_variables(args)
    updates: list[StateUpdates] = []
    if nnx_arguments:
        check_distinct_variables(args, name)
        traced = returning_updates(fun, in_tree, name, updates)
    else:
        def traced(*ls: Any) -> Any:
            return fun(*jax.tree.unflatten(in_tree, ls))

    def trace_at(examples: int) -> tuple[Any, Any]:
        """The step's jaxpr and output shapes with its batch leaves cut to ``examples``."""
        return _trace(fun, method, traced, [
            jax.ShapeDtypeStruct((examples, *np.shape(x)[1:]) if i in batch_leaves else np.shape(x), leaf_dtype(x))
            for i, x in enumerate(leaves)], args)

    def grad_call_at(examples: int) -> GradCall:
        """The step's gradient call traced with its batch leaves cut to ``examples``: the trace
        stops there (``stop_at_loss``), except for a step over NNX objects, whose updates every
        trace records, and a step without a gradient (an evaluation step: one forward-only
        equation)."""
        try:
            with contextlib.nullcontext() if nnx_arguments else stop_at_loss():
                jaxpr, _ = trace_at(examples)
        except LossTraced as traced_loss:
            return traced_loss.call
        return GradCall.of(pipeline_call(name, jaxpr, nnx_arguments, batch_leaves)[1])

    grad_micro = grad_call_at(micro_batch_size)
    outer, out_shapes = trace_at(batch_size)
    # 2. Everything else is the pass pipeline's: stages, meshes, layout,
    # stage parts, transfers, schedule and program, each verified.
    # A step without a gradient (an evaluation step) becomes one forward-only equation.
    outer, grad_whole = pipeline_call(name, outer, nnx_arguments, batch_leaves)
    params = grad_micro.params
    num_diff, num_aux = params["num_diff"], params["num_aux"]
    if len(grad_micro.in_avals) != len(grad_whole.invars) or num_aux != grad_whole.params["num_aux"]:
        raise ValueError(f"{name}: traced per micro-batch and for the whole batch, the loss function reads "
                         f"different values; its structure must not depend on the batch size")
    # Which loss operands follow the batch shows in how their shapes change with it. One
    # micro-batch changes nothing, so a third trace at a smaller batch tells (without it a
    # batch would be read whole, replicated over the data axis: every device computing it).
    probe = M if M > 1 or batch_size == 1 else _smallest_factor(batch_size)
    grad_probe = grad_call_at(batch_size // probe) if probe != M else grad_micro
    micro_batching = resolve_micro_batching(
        grad_probe.params, list(grad_probe.in_avals[num_diff:]),
        [v.aval for v in grad_whole.invars[num_diff:]], [v.aval for v in grad_whole.outvars[1:1 + num_aux]],
        probe, user_location(grad_whole))
    micro_batching = dataclasses.replace(micro_batching, num_micro_batches=M)
    # Exact where the loss allows: values of the batch alone hoisted into the step, the loss
    # rewritten so its micro-batches' shares sum to the whole batch's.
    stepped = micro_batch_step(outer, grad_micro.params, grad_whole.params, grad_probe.params if probe > 1 else None,
                               micro_batching, name, user_location(grad_whole))
    outer, params, micro_batching = stepped.outer, stepped.grad_params, stepped.micro_batching
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

    def replica_loss(count: int) -> Any:
        # A stage run as ``count`` data-parallel replicas computes each on its share of a micro-batch.
        if micro_batch_size % count:
            raise ValueError(f"micro-batches of {micro_batch_size} examples do not split into {count} replicas")
        return stepped.share_loss(grad_call_at(micro_batch_size // count).params["loss_jaxpr"], M * count)

    # The work around the pipeline starts compiling once the compiler has lowered the step
    # program (its last pass before those tracing the stages), while those passes run
    # (``runtime.early_programs``). A step that may run as one program (``single_program``)
    # compiles only that.
    early = None if method.single_program and M == 1 else EarlyPrograms(leaves, method.timeout_s)
    observers = {} if early is None else {
        "free_step_values": lambda st: early.start(st.step, st.placed.meshes, st.home)}
    compiled = compile_pipeline(
        outer, params, micro_batching, leaves, partition_specs(args), frozenset(batch_leaves), replaced,
        devices, method.pipeline_options(micro_batch_size), functools.partial(_check_num_stages, method),
        replica_loss, observers,
    )
    # A forward-only step leaves the inputs it does not read unplaced (a train state's optimizer
    # state stays where the train step keeps it), which one jitted program cannot express.
    if method.single_program and compiled.graph.num_stages == 1 and M == 1 and not compiled.graph.forward_only:
        step = _single_program(compiled, outer, out_tree, method, replaced)
        return CompiledStep(step, state_updates, compiled, step.run_as_given if step.places_own_inputs else None,
                            in_tree)
    executable = PipelineExecutable(compiled.step, compiled.program, compiled.moves, compiled.kernels, out_tree,
                                    jax.tree.leaves(out_shapes), timeout_s=method.timeout_s,
                                    description=describe_pipeline(compiled), early=early)
    if jax.process_count() > 1:
        # One agreement for the whole pipeline: every process compiled the
        # same stages, schedule and moves, or all of them fail here.
        agree(
            f"pipeline/{getattr(fun, '__name__', 'step')}",
            {"schedule": [str(t) for t in compiled.schedule.order], "moves": compiled.moves.fingerprints},
            list(range(jax.process_count())),
            timeout_s=method.timeout_s,
            what=f"meshpar.parallelize({getattr(fun, '__name__', 'step')})",
        )
    return CompiledStep(executable, state_updates, compiled)


def _single_program(compiled: Any, outer: Any, out_tree: Any, method: PipeshardParallel,
                    replaced: list[int | None]) -> SpmdStep:
    """The one-stage, one-micro-batch step as one program, its leaves placed as the pipeline
    would place them (a batch leaf as its stage reads it: the micro-batch is the batch)."""
    layout, mesh = compiled.layout, compiled.meshes[0]
    read_as = {op.source.index: op.sharding for op in layout.stage_operands[0] if op.source.kind is OuterKind.IN}
    ins = [p.on(0) if p.meshes else read_as.get(i, NamedSharding(mesh, P(method.data_axis)))
           for i, p in enumerate(layout.in_placements)]
    outs = [p.on(0) if p is not None and p.meshes else None for p in layout.out_placements]
    lowered = lower_spmd_step(outer, compiled.micro_batching)
    verify_spmd_step(outer, lowered)
    step = SpmdStep(lowered, ins, outs, out_tree, compiled.step.leaf_shardings,
                    carried=[i for i in replaced if i is not None],
                    description=f"one stage, one micro-batch on mesh {dict(mesh.shape)}: one SPMD program "
                                f"(PipeshardParallel.single_program)")
    return step


def _smallest_factor(n: int) -> int:
    """The smallest divisor of ``n > 1`` above 1."""
    return next(k for k in range(2, n + 1) if n % k == 0)


def _check_num_stages(method: PipeshardParallel, graph: StageGraph) -> None:
    """Checks the model's stages against ``num_stages`` and the stage placement, which
    ``PipeshardParallel`` could check only for a stage count it was given. Markers are candidate
    cuts: the compiler groups more than ``num_stages - 1`` of them (``marker_grouping``), so only
    too few of them, or ``auto_layers`` making another count, remain to report."""
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
            f"num_stages: {method.num_stages} stages asked for, but the model's {S - 1} stage markers make "
            f"{S} stages; pass num_stages={S} (or None) or fewer (markers are candidate cuts: the compiler "
            f"groups more than num_stages - 1 of them, but adds none), or call meshpar.mark_stage_boundary() "
            f"where more stages should end"
        )
    if method.num_stages is None:
        method.check_placement(S, "stage markers + 1")
