"""Pass: how each stage's parameter gradients accumulate over a step and reduce over its mesh's
data axis, once per step where it can.

A stage's programs are SPMD over its mesh. Compiled over the whole micro-batch, every backward
ends in an all-reduce of the full parameter gradients over the data axis: a parameter read by
examples on every device has a gradient that is a sum over devices, and each backward is its
own program, so no compiler ever sees two of them to merge (JaxPP's
``docs/unreduced_gradients.md`` describes the same problem). Instead, a stage whose mesh has
``D > 1`` devices on the data axis runs as ``D`` *replicas* side by side: its forward and
backward run inside a ``shard_map`` manual over the data axis, each device computing its
replica on its ``micro_batch / D`` examples (the mesh's other axes stay automatic, so
tensor parallelism inside a replica is partitioned as before). A replica's
parameter cotangent is then its own partial sum, held by its own devices; they accumulate
unreduced over the micro-batches in a ``(D, *param)`` accumulator, and the mesh reduces them
once per step (``program.pipeline_instructions.ReduceGradients``), right after its last weight gradient.

Replicas are micro-batches computed side by side, so a stage runs as replicas when the step
splits over them as it splits over micro-batches: traced at ``micro_batch / D`` examples
(``replica_graph``), its structure is the same, every value it reads or makes either follows
the batch along one dimension or does not depend on it, and no reduction over the examples
feeds back into a value that follows the batch (batch statistics: each replica would
normalise by its own examples; ``_batch_reductions``). The loss of a replica is combined like
a micro-batch's (its cotangent seed is the micro-batch's over ``D`` for a mean), as are aux
values. Keys folded per micro-batch are folded again with the replica index: replica ``r``
of micro-batch ``m`` draws from ``fold_in(fold_in(key, m), r)``, so each device draws its own
dropout masks, as in any data-parallel program (the draws depend on ``D``). A stage that
does not split so keeps the per-micro-batch reduction, and ``describe()`` says why.

Every stage's accumulator is in ``accumulation_dtype`` for narrower floating parameters
(bfloat16, float16); the reduction, or a cast where there is nothing to reduce, gives the
gradient the parameter's dtype again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.stage_kernel import Accumulator, StageAccumulation, StageReplicas
from ...program.step_values import AuxReduction, RefKind
from ...verification import PlanVerificationError
from ..cutting.micro_batching import MicroBatching
from ..cutting.stage_graph import StageGraph
from ..cutting.stage_parts import stage_parts, stage_positions, verify_stage_parts
from ..pipeline_options import GradientOptions
from .drop_mesh_axis import manual_mesh_axis, spec_without
from .step_layout import StepLayout

__all__ = ["DataReplicas", "plan_data_replicas", "verify_data_replicas"]


@dataclasses.dataclass(frozen=True)
class DataReplicas:
    """Per stage, its ``StageAccumulation``."""

    stages: tuple[StageAccumulation, ...]

    def reduced_stages(self) -> frozenset[int]:
        """The stages whose accumulators a ``ReduceGradients`` instruction reduces."""
        return frozenset(s for s, g in enumerate(self.stages) if g.needs_reduction)


class _NoSplit(Exception):
    """A stage that does not split into replicas; the message says why."""


def _split_dim(micro: jax_ir.AbstractValue, replica: jax_ir.AbstractValue, count: int, what: str) -> int | None:
    """The one dimension ``micro`` splits along into ``count`` values shaped ``replica``; ``None``
    when they are alike (the value does not follow the batch)."""
    if micro.dtype != replica.dtype or len(micro.shape) != len(replica.shape):
        raise _NoSplit(f"{what} is {micro.str_short()} per micro-batch but {replica.str_short()} per replica")
    differ = [d for d, (a, b) in enumerate(zip(micro.shape, replica.shape)) if a != b]
    if not differ:
        return None
    if len(differ) == 1 and micro.shape[differ[0]] == count * replica.shape[differ[0]]:
        return differ[0]
    raise _NoSplit(f"{what} is {micro.str_short()} per micro-batch but {replica.str_short()} per replica, "
                   f"not a split into {count}")


def _follows(micro: jax_ir.Atom, replica: jax_ir.Atom) -> bool:
    """Whether a value's shape changes with the examples it is computed on."""
    return (not isinstance(micro, jax_ir.Literal)
            and getattr(micro.aval, "shape", ()) != getattr(replica.aval, "shape", ()))


def _batch_reductions(micro: jax_ir.Jaxpr, replica: jax_ir.Jaxpr) -> set[jax_ir.Var]:
    """The values of ``micro`` (the stage traced per micro-batch; ``replica`` the same traced per
    replica) that reduce over its examples, and what is computed from them.

    An equation reading a value that follows the batch and making one that does not reduces
    over the examples (a mean, a batch statistic). Such a value may only reach outputs combined
    like micro-batches' (the loss); were it to reach a value that follows the batch again, the
    examples would be coupled (batch normalisation) and each replica, normalising by its own
    examples, would compute something else than the micro-batch.

    Raises:
      _NoSplit: the traces differ in structure, or examples are coupled (naming the primitive).
    """
    if len(micro.eqns) != len(replica.eqns):
        raise _NoSplit("traced per replica, its equations differ from the micro-batch's")
    reduced: set[jax_ir.Var] = set()
    for em, er in zip(micro.eqns, replica.eqns):
        if em.primitive is not er.primitive or len(em.outvars) != len(er.outvars):
            raise _NoSplit("traced per replica, its equations differ from the micro-batch's")
        for jm, jr in zip(jax_ir.nested_jaxprs(em), jax_ir.nested_jaxprs(er)):
            _batch_reductions(jm, jr)
        outs = [_follows(a, b) for a, b in zip(em.outvars, er.outvars)]
        if any(isinstance(v, jax_ir.Var) and v in reduced for v in em.invars):
            if any(outs):
                raise _NoSplit(f"its examples are coupled: {em.primitive} makes a value that follows the batch "
                               f"from a reduction over it (batch statistics)")
            reduced.update(em.outvars)
        elif any(_follows(a, b) for a, b in zip(em.invars, er.invars)):
            reduced.update(v for v, follows in zip(em.outvars, outs) if not follows)
    return reduced


def accumulation_dtype(param: np.dtype, options: GradientOptions) -> np.dtype:
    """The accumulator dtype of a parameter of dtype ``param``."""
    wider = jnp.issubdtype(param, jnp.floating) and np.dtype(param).itemsize < np.dtype(options.accumulation_dtype).itemsize
    return np.dtype(options.accumulation_dtype) if wider else np.dtype(param)


def _stage_replicas(s: int, graph: StageGraph, replica: StageGraph, layout: StepLayout,
                    micro_batching: MicroBatching, count: int, axis: str) -> StageReplicas:
    stage, other = graph.stages[s], replica.stages[s]
    if other.inputs != stage.inputs or len(other.outputs) != len(stage.outputs):
        raise _NoSplit("traced per replica, its inputs or outputs differ from the micro-batch's")
    # Both differentiate the micro-batch's output slots.
    if stage_positions(other) != stage_positions(stage):
        raise _NoSplit("traced per replica, its differentiated inputs differ from the micro-batch's")
    operands = {op.position: op for op in layout.stage_operands[s]}
    input_dims, folded = [], set()
    for k, (ref, mi, re) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals, other.jaxpr.in_avals)):
        dim = _split_dim(mi, re, count, f"input {k} ({ref})")
        op = operands.get(k)
        if op is not None and op.fold_key:
            folded.add(k)
        follows = ref.kind is RefKind.ACT or (op is not None and op.per_micro_batch and not op.fold_key)
        if follows != (dim is not None):
            raise _NoSplit(f"input {k} ({ref}) {'does not follow' if follows else 'follows'} the batch per replica")
        input_dims.append(dim)
    reduced = _batch_reductions(stage.jaxpr.jaxpr, other.jaxpr.jaxpr)
    consumed = {ref.slot for p, _, ref in graph.edges() if p == s}
    aux = {ref.slot: how for ref, how in zip(graph.aux, micro_batching.aux) if ref.index == s}
    output_dims = []
    for k, (mi, re) in enumerate(zip(stage.jaxpr.out_avals, other.jaxpr.out_avals)):
        dim = _split_dim(mi, re, count, f"output {k}")
        if dim is None:
            if k in consumed:
                raise _NoSplit(f"output {k}, which a later stage reads, does not follow the batch")
            how = aux.get(k)
            if how is AuxReduction.CONCAT:
                raise _NoSplit(f"output {k}, an aux value concatenated over micro-batches, does not follow the "
                               f"batch")
            out = stage.jaxpr.jaxpr.outvars[k]
            if how is AuxReduction.LAST and isinstance(out, jax_ir.Var) and out in reduced:
                raise _NoSplit(f"output {k}, an aux value taken from the last micro-batch, reduces over the "
                               f"examples")
        output_dims.append(dim)
    # Traced (a linearization of the stage) only once the stage is known to split: it then
    # runs these parts, and no parts at the micro-batch's size are traced for it (stage_parts).
    replica_parts = stage_parts(other, graph.differentiated_slots(s))
    verify_stage_parts(other, replica_parts)
    replica_parts = dataclasses.replace(replica_parts, **{
        f: manual_mesh_axis(getattr(replica_parts, f), axis)
        for f in ("forward", "backward", "backward_input", "backward_weight")})
    # A replica's loss is one term of the micro-batch's mean over D replicas (or of its sum).
    seed = micro_batching.reduction.share(micro_batching.loss_seed, count)
    return StageReplicas(count, axis, replica_parts, tuple(input_dims), frozenset(folded), tuple(output_dims), seed)


@compiler_pass
def plan_data_replicas(graph: StageGraph, layout: StepLayout, meshes: Sequence[Mesh], home: Sequence[int],
                       micro_batching: MicroBatching, options: GradientOptions, axis: str,
                       replica_graph: Callable[[int], StageGraph]) -> DataReplicas:
    """Each stage's ``StageAccumulation`` (module doc). ``replica_graph(D)`` is the stage graph of the
    step traced at ``micro_batch / D`` examples, its sharding annotations without ``axis``; it
    may raise (a step that does not trace at that size), and those stages then reduce per
    micro-batch."""
    graphs: dict[int, StageGraph | str] = {}
    out = []
    for stage, shardings in zip(graph.stages, layout.grad_shardings):
        mesh = meshes[home[stage.index]]
        count = dict(mesh.shape).get(axis, 1)
        avals = [a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind is RefKind.PARAM]
        reduced = tuple((sh, np.dtype(a.dtype)) for a, sh in zip(avals, shardings))
        replicas, why = None, ""
        if not avals or count == 1:
            pass  # nothing to reduce over the data axis
        elif options.gradient_reduction.in_backward:
            why = f"gradient_reduction={options.gradient_reduction.value!r}"
        else:
            if count not in graphs:
                try:
                    graphs[count] = replica_graph(count)
                except Exception as e:  # the step does not trace at that size; the stage stays whole
                    graphs[count] = f"the step does not trace at {count} replicas: {e}"
            traced = graphs[count]
            try:
                if isinstance(traced, str):
                    raise _NoSplit(traced)
                if traced.num_stages != graph.num_stages:
                    raise _NoSplit(f"traced per replica it has {traced.num_stages} stages, not {graph.num_stages}")
                replicas = _stage_replicas(stage.index, graph, traced, layout, micro_batching, count, axis)
            except _NoSplit as e:
                why = str(e)
        accumulators = []
        for a, sh in zip(avals, shardings):
            dtype = accumulation_dtype(np.dtype(a.dtype), options)
            if replicas is None:
                accumulators.append(Accumulator(tuple(a.shape), dtype, sh))
            else:
                # Replica r's partial sums on replica r's devices; the other axes as the parameter's.
                spec = tuple(spec_without(sh.spec, axis)) + (None,) * (len(a.shape) - len(sh.spec))
                accumulators.append(Accumulator((count, *a.shape), dtype, NamedSharding(sh.mesh, P(axis, *spec))))
        out.append(StageAccumulation(replicas, tuple(accumulators), reduced, why))
    return DataReplicas(tuple(out))


def verify_data_replicas(plan: DataReplicas, graph: StageGraph, meshes: Sequence[Mesh], home: Sequence[int]) -> None:
    """One ``StageAccumulation`` per stage, one accumulator per parameter input; a stage run as
    replicas has one per device of its mesh's data axis, a dimension or none per input and
    output, and its accumulators led by that count and sharded over that axis.

    Raises:
      PlanVerificationError: naming the stage.
    """
    if len(plan.stages) != graph.num_stages:
        raise PlanVerificationError(f"{len(plan.stages)} stages planned, the graph has {graph.num_stages}")
    for stage, g in zip(graph.stages, plan.stages):
        params = [a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind is RefKind.PARAM]
        if len(g.accumulators) != len(params) or len(g.reduced) != len(params):
            raise PlanVerificationError(f"stage {stage.index}: not one accumulator per parameter input")
        r = g.replicas
        if r is None:
            if any(a.shape != tuple(p.shape) for a, p in zip(g.accumulators, params)):
                raise PlanVerificationError(f"stage {stage.index}: an accumulator is not shaped as its parameter")
            continue
        mesh = meshes[home[stage.index]]
        if dict(mesh.shape).get(r.axis) != r.count:
            raise PlanVerificationError(f"stage {stage.index}: {r.count} replicas on a mesh of {dict(mesh.shape)}")
        if len(r.input_dims) != len(stage.inputs) or len(r.output_dims) != len(stage.outputs):
            raise PlanVerificationError(f"stage {stage.index}: replica dimensions do not match its inputs and outputs")
        for a, p in zip(g.accumulators, params):
            if a.shape != (r.count, *p.shape) or a.sharding.spec[0] != r.axis:
                raise PlanVerificationError(f"stage {stage.index}: an accumulator is not one per replica over {r.axis!r}")
