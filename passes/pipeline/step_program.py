"""Pass: the whole step as one typed program, in the order every process runs it.

The pipeline program (``pipeline_program``) is the per-micro-batch middle of a
step. Around it a step places its inputs, computes and moves what the loss
reads, feeds each stage its operands, and afterwards combines each
micro-batch's loss and aux values, reduces each parameter's gradient on its
owner's mesh, runs the update and assembles the outputs. ``lower_step`` makes
all of that instructions, deciding every reduction and every sharding here, so
the runtime (``meshpar.runtime.pipeline_executor``) is one handler per
instruction kind:

- ``PlaceInputs``: every step input leaf where ``StepLayout.in_placements`` puts it;
- ``RunCompute`` / ``RunMove``: one computation around the pipeline on its mesh,
  or one move of values between two meshes (``step_split``);
- ``FeedStages``: each stage's operands (fetched parameters, constants, the
  micro-batch slices, folded keys);
- ``RunPipeline``: the pipeline program;
- ``CombineMicroBatches``: the loss or an aux value, its micro-batches combined as
  ``how`` says, decoded from its wire form and laid out as ``sharding``;
- ``ReduceGradient``: one stage's accumulated gradient of one parameter, moved to
  its owner's mesh and added to what other stages contributed;
- ``AwaitArrivals``: the bounded wait for values other processes send here;
- ``AssembleOutputs``: the step's outputs, each with its per-mesh shardings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Union

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import jax_ir
from ..verification import PlanVerificationError
from .data_replicas import DataReplicas
from .micro_batching import AuxReduction, MicroBatching
from .pipeline_program import BufferId, BufferKind, PipelineProgram
from .stage_graph import RefKind, StageGraph
from .step_layout import StepLayout, ValueMove
from .step_split import OuterCompute, OuterKind, OuterMove, OuterRef, StepSplit

__all__ = ["PlaceInputs", "RunCompute", "RunMove", "FeedStages", "RunPipeline", "CombineMicroBatches",
           "ReduceGradient", "AwaitArrivals", "AssembleOutputs", "StepInstruction", "StepProgram", "lower_step",
           "verify_step_program"]


@dataclasses.dataclass(frozen=True)
class PlaceInputs:
    def __str__(self) -> str:
        return "place the inputs"


@dataclasses.dataclass(frozen=True)
class RunCompute:
    compute: OuterCompute

    def __str__(self) -> str:
        return f"compute of {', '.join(map(str, self.compute.outputs))} on mesh {self.compute.mesh}"


@dataclasses.dataclass(frozen=True)
class RunMove:
    move: OuterMove

    def __str__(self) -> str:
        return f"move of {', '.join(map(str, self.move.values))} from mesh {self.move.src} to mesh {self.move.dst}"


@dataclasses.dataclass(frozen=True)
class FeedStages:
    def __str__(self) -> str:
        return "feed the stages"


@dataclasses.dataclass(frozen=True)
class RunPipeline:
    def __str__(self) -> str:
        return "run the pipeline program"


@dataclasses.dataclass(frozen=True)
class CombineMicroBatches:
    """``value`` (the loss or an aux value) on ``mesh``: the result buffers of every micro-batch
    combined as ``how`` says, then read as ``aval`` from its wire form and laid out as
    ``sharding`` (``None``: as combined). ``per_replica``: each buffer holds one value per
    data-parallel replica of its stage (``data_replicas``), led by the replica count, which
    combine first, as micro-batches do."""

    value: OuterRef
    buffers: tuple[BufferId, ...]
    mesh: int
    how: AuxReduction
    aval: jax_ir.AbstractValue
    sharding: NamedSharding | None
    per_replica: bool = False

    def __str__(self) -> str:
        return f"{self.how.value} of {self.value} over {len(self.buffers)} micro-batches on mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class ReduceGradient:
    """Stage ``stage``'s accumulated gradient of parameter ``param`` (its ``position``-th), moved
    by ``move`` (``None``: already on the owner's mesh) and added into ``GRAD param`` on ``mesh``;
    ``sharding`` is the stage's accumulator's (what another process names in its place)."""

    param: int
    stage: int
    position: int
    mesh: int
    move: ValueMove | None
    sharding: NamedSharding
    aval: jax_ir.AbstractValue

    def __str__(self) -> str:
        return f"gradient of parameter {self.param} from stage {self.stage} into mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class AwaitArrivals:
    def __str__(self) -> str:
        return "wait for values other processes send here"


@dataclasses.dataclass(frozen=True)
class AssembleOutputs:
    """Per step output, the sharding of its copy on each mesh holding it."""

    shardings: tuple[tuple[NamedSharding, ...], ...]

    def __str__(self) -> str:
        return "assemble the outputs"


StepInstruction = Union[PlaceInputs, RunCompute, RunMove, FeedStages, RunPipeline, CombineMicroBatches,
                        ReduceGradient, AwaitArrivals, AssembleOutputs]


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """The step's instructions, in the order every process runs them."""

    instructions: tuple[StepInstruction, ...]

    def __iter__(self):
        return iter(self.instructions)


def _outer(step: Any) -> StepInstruction:
    return RunCompute(step) if isinstance(step, OuterCompute) else RunMove(step)


def lower_step(graph: StageGraph, split: StepSplit, layout: StepLayout, program: PipelineProgram,
               micro_batching: MicroBatching, meshes: Sequence[Mesh], gradients: DataReplicas) -> StepProgram:
    """The step around ``program``: its reductions are ``micro_batching``'s (the loss by its
    ``reduction``, each aux value by its own, over micro-batches and the replicas of
    ``gradients``), every sharding is ``layout``'s (a value it leaves free replicated on its
    mesh)."""

    def per_replica(stage: int, slot: int) -> bool:
        replicas = gradients.stages[stage].replicas
        return replicas is not None and replicas.per_replica(slot)

    home = program.schedule.stage_mesh
    M = program.schedule.num_micro_batches
    ins: list[StepInstruction] = [PlaceInputs(), *map(_outer, split.before), FeedStages(), RunPipeline()]
    loss = graph.loss
    ins.append(CombineMicroBatches(
        OuterRef(OuterKind.LOSS), tuple(BufferId(BufferKind.RESULT, loss.index, m, loss.slot) for m in range(M)),
        home[loss.index], AuxReduction.MEAN if micro_batching.reduction == "mean" else AuxReduction.SUM,
        split.avals[OuterRef(OuterKind.LOSS)], None, per_replica(loss.index, loss.slot)))
    for k, (ref, how) in enumerate(zip(graph.aux, micro_batching.aux)):
        aux = OuterRef(OuterKind.AUX, k)
        ins.append(CombineMicroBatches(
            aux, tuple(BufferId(BufferKind.RESULT, ref.index, m, ref.slot) for m in range(M)), home[ref.index], how,
            split.avals[aux], layout.value_shardings.get((aux, home[ref.index])), per_replica(ref.index, ref.slot)))
    for stage, moves, shardings in zip(graph.stages, layout.gradient_moves, layout.grad_shardings):
        avals = [a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind is RefKind.PARAM]
        for n, k in enumerate(stage.param_inputs):
            ins.append(ReduceGradient(k, stage.index, n, home[graph.param_owner(k)], moves[n], shardings[n], avals[n]))
    ins += [*map(_outer, split.after), AwaitArrivals()]
    outputs = []
    for j, (ref, on) in enumerate(split.outputs):
        placement = layout.out_placements[j]
        outputs.append(tuple(placement.on(m) if placement is not None and m in placement.meshes
                             else NamedSharding(meshes[m], P()) for m in on))
    ins.append(AssembleOutputs(tuple(outputs)))
    return StepProgram(tuple(ins))


def verify_step_program(step: StepProgram, split: StepSplit, graph: StageGraph, program: PipelineProgram) -> None:
    """The pipeline runs once, after the inputs are placed and the stages fed; every value a
    computation or move reads on a mesh was made there earlier (or is an input or constant);
    the loss and every aux value are combined once, on the mesh computing them; every stage's
    gradient of every parameter it reads is reduced once, on the parameter owner's mesh; the
    outputs come last.

    Raises:
      PlanVerificationError: naming the instruction.
    """
    kinds = [type(i) for i in step]
    order = [PlaceInputs, FeedStages, RunPipeline, AwaitArrivals, AssembleOutputs]
    positions = [kinds.index(k) if kinds.count(k) == 1 else -1 for k in order]
    if -1 in positions or positions != sorted(positions) or positions[-1] != len(kinds) - 1:
        raise PlanVerificationError("the step does not place, feed, run the pipeline, wait and assemble once each, "
                                    "in that order, assembling last")
    home = program.schedule.stage_mesh
    made: set[tuple[OuterRef, int]] = set()
    combined, reduced = [], []
    for ins in step:
        if isinstance(ins, RunCompute):
            reads, mesh, writes = ins.compute.inputs, ins.compute.mesh, ins.compute.outputs
        elif isinstance(ins, RunMove):
            reads, mesh, writes = ins.move.values, ins.move.src, ins.move.values
        elif isinstance(ins, CombineMicroBatches):
            combined.append(ins.value)
            stage = ins.buffers[0].index
            if ins.mesh != home[stage] or any(b not in program.results for b in ins.buffers):
                raise PlanVerificationError(f"{ins}: not the results of stage {stage} on its mesh")
            made.add((ins.value, ins.mesh))
            continue
        elif isinstance(ins, ReduceGradient):
            reduced.append((ins.stage, ins.param))
            if ins.mesh != home[graph.param_owner(ins.param)]:
                raise PlanVerificationError(f"{ins}: not the mesh of the parameter's owner")
            made.add((OuterRef(OuterKind.GRAD, ins.param), ins.mesh))
            continue
        else:
            continue
        for ref in reads:
            if ref.kind not in (OuterKind.IN, OuterKind.CONST) and (ref, mesh) not in made:
                raise PlanVerificationError(f"{ins} reads {ref} on mesh {mesh} before it is made there")
        target = ins.move.dst if isinstance(ins, RunMove) else mesh
        made |= {(ref, target) for ref in writes}
    want_combined = [OuterRef(OuterKind.LOSS)] + [OuterRef(OuterKind.AUX, k) for k in range(len(graph.aux))]
    if combined != want_combined:
        raise PlanVerificationError(f"combined {combined}, expected the loss and each aux value once: {want_combined}")
    want_reduced = [(s.index, k) for s in graph.stages for k in s.param_inputs]
    if sorted(reduced) != sorted(want_reduced) or len(set(reduced)) != len(reduced):
        raise PlanVerificationError("a stage's parameter gradient is not reduced exactly once")
