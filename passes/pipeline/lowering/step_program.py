"""Pass: the whole step as one typed program, in the order every process runs it.

The pipeline program (``pipeline_program``) is the per-micro-batch middle of a
step. Around it a step places its inputs, computes and moves what the loss
reads, feeds each stage its operands, and afterwards combines each
micro-batch's loss and aux values, reduces each parameter's gradient on its
owner's mesh, runs the update and assembles the outputs. ``lower_step`` makes
all of that instructions, deciding every reduction and every sharding here, each
instruction carrying what it needs (the runtime reads no layout), so the runtime
(``meshpar.runtime.pipeline_executor``) is one handler per instruction kind:

- ``SplitStackedLeaves`` / ``JoinStackedLeaves`` (first and last, with stacked leaves): the
  user's stacked leaves into the per-stage pieces the step takes, and back;
- ``PlaceInputs``: every step input leaf where its ``Placement`` puts it (a global batch leaf by
  its planned moves, ``batch_rows.global_batch_placements``);
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
- ``AssembleOutputs``: the step's outputs, each with its per-mesh shardings;
- ``ShareOutputs`` (several processes): small outputs held on some processes only (the loss,
  aux metrics, a gradient norm) copied onto every process, as ``jax.jit`` leaves them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ...compiler_pass import compiler_pass
from ... import jax_ir
from ...verification import PlanVerificationError
from ..placing.data_replicas import DataReplicas
from ..cutting.micro_batching import AuxReduction, MicroBatching
from .pipeline_program import BufferId, BufferKind, PipelineProgram
from ..placing.batch_rows import GlobalBatchFeed, GlobalBatchPlacement
from ..placing.stacked_leaves import GatheredArray, LeafPieces, StackedArray
from ..cutting.stage_graph import RefKind, StageGraph
from ..placing.step_layout import Placement, StageOperand, StepLayout, ValueMove, spans_platforms, union_sharding
from ..cutting.step_split import OuterCompute, OuterKind, OuterMove, OuterRef, StepSplit

__all__ = ["SHARE_MAX_BYTES", "SharedOutput", "ShareOutputs", "AssembleOutputs", "AwaitArrivals", "CombineMicroBatches", "FeedStages", "JoinStackedLeaves",
           "OutputSource", "PlaceInputs", "ReduceGradient", "RunCompute", "RunMove", "RunPipeline",
           "SplitStackedLeaves", "StageFeed", "StepInstruction", "StepProgram", "lower_step", "verify_step_program"]


@dataclasses.dataclass(frozen=True)
class SplitStackedLeaves:
    """The user's stacked leaves as the per-stage pieces the rewritten step takes
    (``stacked_leaves``): each held leaf as views of its shards, each gathered one cut on its
    home mesh and moved by ``GatheredArray.into``."""

    pieces: LeafPieces
    held: tuple[tuple[int, StackedArray], ...]
    gathered: tuple[tuple[int, GatheredArray], ...]

    def __str__(self) -> str:
        return f"split {len(self.held) + len(self.gathered)} stacked leaves into their pieces"


@dataclasses.dataclass(frozen=True)
class PlaceInputs:
    """Every input leaf (of the rewritten step) where ``placements`` puts it; a leaf of
    ``global_batches`` (a global batch array read whole around the pipeline) by its planned
    moves, every process joining each, in this order."""

    placements: tuple[Placement, ...]
    global_batches: tuple[GlobalBatchPlacement, ...] = ()

    def __str__(self) -> str:
        return "place the inputs"


@dataclasses.dataclass(frozen=True)
class RunCompute:
    """``compute`` on its mesh; output ``k`` constrained to ``output_shardings[k]`` (``None``: as
    XLA lays it out)."""

    compute: OuterCompute
    output_shardings: tuple[NamedSharding | None, ...]

    def __str__(self) -> str:
        return f"compute of {', '.join(map(str, self.compute.outputs))} on mesh {self.compute.mesh}"


@dataclasses.dataclass(frozen=True)
class RunMove:
    """``move``'s values cross meshes by ``via``; several values travel packed into one vector and
    are unpacked on the destination mesh, value ``k`` laid out as ``unpacked[k]``."""

    move: OuterMove
    via: ValueMove
    unpacked: tuple[NamedSharding, ...] = ()

    def __str__(self) -> str:
        return f"move of {', '.join(map(str, self.move.values))} from mesh {self.move.src} to mesh {self.move.dst}"


@dataclasses.dataclass(frozen=True)
class StageFeed:
    """Stage ``stage``'s operands for one step, on mesh ``mesh``: per operand (``StageOperand``:
    its source, sharding, whether it is cut per micro-batch or folded, its fetch), and for a
    fetched one the mesh its leaf is placed on."""

    stage: int
    mesh: int
    operands: tuple[StageOperand, ...]
    fetched_from: tuple[int | None, ...]


@dataclasses.dataclass(frozen=True)
class FeedStages:
    """Each stage's operands: fetched parameters, constants, values computed before the
    pipeline, every per-micro-batch operand cut into ``num_micro_batches`` slices of
    ``micro_batch_size`` rows, and keys folded with each micro-batch's index."""

    stages: tuple[StageFeed, ...]
    micro_batch_size: int
    num_micro_batches: int
    # Operands read per micro-batch from a global batch array: moved from where each
    # micro-batch's rows lie (every process joins each move), not cut on the host.
    global_batches: tuple[GlobalBatchFeed, ...] = ()

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
class OutputSource:
    """Where a step output comes from: ``ref`` held on ``meshes``, the copy on mesh
    ``meshes[k]`` laid out as ``shardings[k]``. A literal output is ``literal``; an input
    returned as it came is placed by ``placement`` (no meshes: a batch leaf, returned as given)."""

    ref: OuterRef
    meshes: tuple[int, ...]
    shardings: tuple[NamedSharding, ...]
    literal: Any = None
    placement: Placement | None = None


@dataclasses.dataclass(frozen=True)
class AssembleOutputs:
    """The step's outputs (of the rewritten step), each from its ``OutputSource``."""

    outputs: tuple[OutputSource, ...]

    def __str__(self) -> str:
        return "assemble the outputs"


# Outputs at most this large (per copy), replicated on their mesh, that some process holds no
# copy of are copied onto every process: a loss, an aux metric, a gradient norm. Larger outputs
# (parameters, optimizer state) stay where their stage keeps them.
SHARE_MAX_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class SharedOutput:
    """Output ``output`` (of ``AssembleOutputs``), shaped ``shape`` of ``dtype``: its copy on
    ``source`` (a device of its mesh) copied onto ``devices``, the step's output devices (one per
    process, or the first mesh's in one process), where each process reads it."""

    output: int
    source: Any
    devices: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: Any


@dataclasses.dataclass(frozen=True)
class ShareOutputs:
    """``outputs`` copied onto the step's output devices (``share_outputs``), so that every
    process reads them and they combine as under ``jax.jit``: point-to-point copies from their
    source device (no collective: a collective
    launched while a peer still waits for this process's sends can block the device those
    sends need), every process joining each copy in this order."""

    outputs: tuple[SharedOutput, ...]

    def __str__(self) -> str:
        return f"share {len(self.outputs)} small outputs on the step's output devices"


@dataclasses.dataclass(frozen=True)
class JoinStackedLeaves:
    """The rewritten step's outputs in pieces joined as the user sees the leaves they replace:
    a held leaf as one array over its pieces' devices, a gathered one moved home by
    ``GatheredArray.out_of`` and concatenated."""

    pieces: LeafPieces
    held: tuple[tuple[int, StackedArray], ...]
    gathered: tuple[tuple[int, GatheredArray], ...]

    def __str__(self) -> str:
        return f"join {len(self.held) + len(self.gathered)} stacked leaves from their pieces"


StepInstruction = Union[SplitStackedLeaves, PlaceInputs, RunCompute, RunMove, FeedStages, RunPipeline,
                        CombineMicroBatches, ReduceGradient, AwaitArrivals, AssembleOutputs, ShareOutputs,
                        JoinStackedLeaves]


@dataclasses.dataclass(frozen=True)
class StepProgram:
    """The step's instructions, in the order every process runs them, and what they name.

    Attributes:
      instructions: the program.
      consts: the step's closed-over constants (``OuterKind.CONST`` refs index them).
      avals: the type of every value the instructions name (computed, moved, combined).
      leaf_shardings: per input leaf of the user's step, where the step keeps it between calls
        (a state leaf on its stage mesh, replicated over several meshes as one array, a
        stacked leaf as the user sees it); ``None``: a batch leaf, read per micro-batch.
    """

    instructions: tuple[StepInstruction, ...]
    consts: tuple = ()
    avals: Mapping[OuterRef, jax_ir.AbstractValue] = dataclasses.field(default_factory=dict)
    leaf_shardings: tuple[NamedSharding | None, ...] = ()

    def __iter__(self):
        return iter(self.instructions)


def _outer(step: Any, layout: StepLayout, split: StepSplit) -> StepInstruction:
    if isinstance(step, OuterCompute):
        return RunCompute(step, tuple(layout.value_shardings.get((ref, step.mesh)) for ref in step.outputs))
    unpacked = () if len(step.values) == 1 else tuple(layout.value_shardings[(r, step.dst)] for r in step.values)
    return RunMove(step, layout.outer_moves[step], unpacked)


def _leaf_shardings(layout: StepLayout, pieces: LeafPieces | None, held: Mapping[int, StackedArray],
                    gathered: Mapping[int, GatheredArray]) -> tuple[NamedSharding | None, ...]:
    """Per user input leaf, where the step keeps it (``StepProgram.leaf_shardings``)."""
    def kept(placement: Placement) -> NamedSharding | None:
        if not placement.meshes:
            return None
        if len(placement.meshes) == 1 or spans_platforms(placement.shardings):
            return placement.shardings[0]
        return union_sharding(placement.shardings)

    if pieces is None:
        return tuple(kept(p) for p in layout.in_placements)
    at = {key: n for n, key in enumerate(pieces.piece_inputs())}
    out = []
    for i, bounds in enumerate(pieces.inputs):
        if bounds is None:
            out.append(kept(layout.in_placements[at[(i, None)]]))
        else:
            out.append(held[i].sharding if i in held else gathered[i].sharding)
    return tuple(out)


@compiler_pass
def lower_step(graph: StageGraph, split: StepSplit, layout: StepLayout, program: PipelineProgram,
               micro_batching: MicroBatching, meshes: Sequence[Mesh], gradients: DataReplicas,
               micro_batch_size: int, pieces: LeafPieces | None = None,
               held: Mapping[int, StackedArray] | None = None,
               gathered: Mapping[int, GatheredArray] | None = None,
               global_batches: Sequence[GlobalBatchFeed] = (),
               batch_placements: Sequence[GlobalBatchPlacement] = ()) -> StepProgram:
    """The step around ``program``: its reductions are ``micro_batching``'s (the loss by its
    ``reduction``, each aux value by its own, over micro-batches and the replicas of
    ``gradients``), every sharding is ``layout``'s (a value it leaves free replicated on its
    mesh); with ``pieces``, the user's stacked leaves split before and joined after, as
    ``held`` and ``gathered`` say; ``global_batches`` feed stages per micro-batch from a global
    batch, ``batch_placements`` place such a batch's leaves whole."""

    def per_replica(stage: int, slot: int) -> bool:
        replicas = gradients.stages[stage].replicas
        return replicas is not None and replicas.per_replica(slot)

    held, gathered = dict(held or {}), dict(gathered or {})
    home = program.schedule.stage_mesh
    M = program.schedule.num_micro_batches
    feeds = tuple(
        StageFeed(s, home[s], ops, tuple(layout.in_placements[op.source.index].meshes[0] if op.fetch else None
                                         for op in ops))
        for s, ops in enumerate(layout.stage_operands))
    ins: list[StepInstruction] = []
    stacked = (pieces, tuple(sorted(held.items())), tuple(sorted(gathered.items())))
    if pieces is not None:
        ins.append(SplitStackedLeaves(*stacked))
    ins += [PlaceInputs(layout.in_placements, tuple(batch_placements)),
            *(_outer(st, layout, split) for st in split.before),
            FeedStages(feeds, micro_batch_size, M, tuple(global_batches)), RunPipeline()]
    loss = graph.loss
    ins.append(CombineMicroBatches(
        OuterRef(OuterKind.LOSS), tuple(BufferId(BufferKind.RESULT, loss.index, m, loss.slot) for m in range(M)),
        home[loss.index], micro_batching.reduction.aux,
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
    ins += [*(_outer(st, layout, split) for st in split.after), AwaitArrivals()]
    outputs = []
    for j, (ref, on) in enumerate(split.outputs):
        placement = layout.out_placements[j]
        shardings = tuple(placement.on(m) if placement is not None and m in placement.meshes
                          else NamedSharding(meshes[m], P()) for m in on)
        outputs.append(OutputSource(ref, tuple(on), shardings, split.literals.get(j),
                                    layout.in_placements[ref.index] if ref.kind is OuterKind.IN else None))
    ins.append(AssembleOutputs(tuple(outputs)))
    shared = share_outputs(outputs, split.avals, meshes, [p is not None for p in layout.out_placements])
    if shared is not None:
        ins.append(shared)
    if pieces is not None:
        ins.append(JoinStackedLeaves(*stacked))
    return StepProgram(tuple(ins), tuple(split.consts), dict(split.avals),
                       _leaf_shardings(layout, pieces, held, gathered))


def share_outputs(outputs: Sequence[OutputSource], avals: Mapping[OuterRef, jax_ir.AbstractValue],
                  meshes: Sequence[Mesh], kept: Sequence[bool]) -> ShareOutputs | None:
    """What ``ShareOutputs`` copies onto the step's output devices, the first device of each
    process (in process order; in one process, the first mesh's devices): each computed output held on one mesh, replicated there, of at
    most ``SHARE_MAX_BYTES``, and that is not state the step keeps where it lives (``kept``: the
    new step counter stays with the state, where the next step reads it). Every such output
    then lies on the same devices, so outputs of different meshes combine as ``jax.jit``'s do
    (``metrics["loss"] / metrics["count"]``), and every process reads them. ``None`` when there
    is none, or the step runs on one mesh of one process (its outputs already lie together)."""
    devices = sorted({d for mesh in meshes for d in mesh.devices.flat}, key=lambda d: (d.process_index, d.id))
    first = {}
    for d in devices:
        first.setdefault(d.process_index, d)
    if (len(first) < 2 and len(meshes) < 2) or len({d.platform for d in devices}) > 1:
        return None
    # One device per process; in one process the first mesh's devices, so that no device of a
    # mesh holds what its neighbours do not (the memory model prices a mesh's devices alike).
    targets = tuple(d for _, d in sorted(first.items())) if len(first) > 1 else tuple(meshes[0].devices.flat)
    shared = []
    for j, source in enumerate(outputs):
        if (kept[j] or source.ref.kind in (OuterKind.IN, OuterKind.CONST, OuterKind.LITERAL)
                or len(source.meshes) != 1):
            continue
        aval, sharding = avals[source.ref], source.shardings[0]
        if (jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) or any(axis is not None for axis in sharding.spec)
                or aval.size * aval.dtype.itemsize > SHARE_MAX_BYTES):
            continue
        mesh_devices = list(sharding.mesh.devices.flat)
        # The copy to send: the output's own copy on a target where it has one (no move there).
        src = next((d for d in targets if d in mesh_devices), mesh_devices[0])
        shared.append(SharedOutput(j, src, targets, tuple(aval.shape), aval.dtype))
    return ShareOutputs(tuple(shared)) if shared else None


def verify_step_program(step: StepProgram, split: StepSplit, graph: StageGraph, program: PipelineProgram) -> None:
    """The pipeline runs once, after the inputs are placed (a global batch leaf moved to its own
    placement) and the stages fed; every value a computation or move reads on a mesh was made
    there earlier (or is an input or constant); the loss and every aux value are combined once,
    on the mesh computing them; every stage's gradient of every parameter it reads is reduced
    once, on the parameter owner's mesh; the outputs come last.

    Raises:
      PlanVerificationError: naming the instruction.
    """
    kinds = [type(i) for i in step]
    stacked = kinds.count(SplitStackedLeaves)
    if stacked != kinds.count(JoinStackedLeaves) or stacked > 1 or (stacked and (
            kinds[0] is not SplitStackedLeaves or kinds[-1] is not JoinStackedLeaves)):
        raise PlanVerificationError("the step does not split its stacked leaves first and join them last, once each")
    body = kinds[1:-1] if stacked else kinds
    if ShareOutputs in body:
        if body.count(ShareOutputs) > 1 or body[-1] is not ShareOutputs:
            raise PlanVerificationError("the step shares its outputs more than once, or not right after assembling them")
        body = body[:-1]
    order = [PlaceInputs, FeedStages, RunPipeline, AwaitArrivals, AssembleOutputs]
    positions = [body.index(k) if body.count(k) == 1 else -1 for k in order]
    if -1 in positions or positions != sorted(positions) or positions[-1] != len(body) - 1:
        raise PlanVerificationError("the step does not place, feed, run the pipeline, wait and assemble once each, "
                                    "in that order, assembling last")
    (placing,) = [ins for ins in step if isinstance(ins, PlaceInputs)]
    if any(p.placement != placing.placements[p.leaf] for p in placing.global_batches):
        raise PlanVerificationError(f"{placing}: a global batch leaf moved elsewhere than its placement")
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
