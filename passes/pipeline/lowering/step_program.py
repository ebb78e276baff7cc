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

Every kind subclasses ``StepInstruction``, which says what the verifier asks of it (the values it
reads and makes, on which mesh; what it combines or reduces; its own wiring check), so
``verify_step_program`` reads any kind through that interface, as ``verify_pipeline_program``
reads ``pipeline_program.Instruction``s. Each kind's ``__str__`` is one short line (never a
jaxpr): ``program_text`` prints a step with them.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

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
           "Located", "SplitStackedLeaves", "StageFeed", "StepInstruction", "StepProgram", "lower_step",
           "verify_step_program"]


# A value of the step on one mesh: what a step instruction reads there or makes there.
Located = tuple[OuterRef, int]


class StepInstruction(abc.ABC):
    """What an instruction of the step program says about itself, so that the verifier (and
    ``program_text``) reads every kind without a list of kinds: the values it reads and makes,
    each on its mesh, the loss or aux values it combines, the parameter gradients it reduces,
    and its own wiring against the stage graph and the pipeline program. Inputs and constants
    (``OuterKind.IN``, ``OuterKind.CONST``) are readable anywhere; every other value it reads on
    a mesh must have been made there by an earlier instruction. A new kind is this class's
    subclass and one handler in the runtime (``pipeline_executor``)."""

    @property
    @abc.abstractmethod
    def reads(self) -> tuple[Located, ...]:
        """``(value, mesh)`` of every value it reads, on the mesh it reads it on."""

    @property
    @abc.abstractmethod
    def writes(self) -> tuple[Located, ...]:
        """``(value, mesh)`` of every value it makes (a move: on its destination mesh)."""

    @property
    def combines(self) -> tuple[OuterRef, ...]:
        """The loss or aux values whose micro-batches it combines (each once per step)."""
        return ()

    @property
    def reduces(self) -> tuple[tuple[int, int], ...]:
        """``(stage, parameter)`` of each stage's accumulated gradient it reduces (each once)."""
        return ()

    def check(self, graph: StageGraph, program: PipelineProgram) -> str | None:
        """Why it is wired wrongly against ``graph`` and ``program`` (the mesh it runs on, the
        buffers it reads), or ``None``."""
        return None


def _names(refs: Iterable[Any], most: int = 4) -> str:
    """At most ``most`` of ``refs`` by name, then how many more: an instruction's line stays short."""
    refs = list(refs)
    shown = ", ".join(map(str, refs[:most]))
    return shown if len(refs) <= most else f"{shown} and {len(refs) - most} more"


@dataclasses.dataclass(frozen=True)
class SplitStackedLeaves(StepInstruction):
    """The user's stacked leaves as the per-stage pieces the rewritten step takes
    (``stacked_leaves``): each held leaf as views of its shards, each gathered one cut on its
    home mesh and moved by ``GatheredArray.into``."""

    pieces: LeafPieces
    held: tuple[tuple[int, StackedArray], ...]
    gathered: tuple[tuple[int, GatheredArray], ...]

    # The user's leaves in, the step's input leaves out: no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return f"split {len(self.held) + len(self.gathered)} stacked leaves into their pieces"


@dataclasses.dataclass(frozen=True)
class PlaceInputs(StepInstruction):
    """Every input leaf (of the rewritten step) where ``placements`` puts it; a leaf of
    ``global_batches`` (a global batch array read whole around the pipeline) by its planned
    moves, every process joining each, in this order."""

    placements: tuple[Placement, ...]
    global_batches: tuple[GlobalBatchPlacement, ...] = ()

    # Inputs are readable anywhere (``StepInstruction``): placing them makes no other value.
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def check(self, graph: StageGraph, program: PipelineProgram) -> str | None:
        if any(p.placement != self.placements[p.leaf] for p in self.global_batches):
            return "moves a global batch leaf elsewhere than its placement"
        return None

    def __str__(self) -> str:
        moved = f", {len(self.global_batches)} global batch leaves by their moves" if self.global_batches else ""
        return f"place {len(self.placements)} input leaves{moved}"


@dataclasses.dataclass(frozen=True)
class RunCompute(StepInstruction):
    """``compute`` on its mesh; output ``k`` constrained to ``output_shardings[k]`` (``None``: as
    XLA lays it out)."""

    compute: OuterCompute
    output_shardings: tuple[NamedSharding | None, ...]

    reads = property(lambda self: tuple((r, self.compute.mesh) for r in self.compute.inputs))
    writes = property(lambda self: tuple((r, self.compute.mesh) for r in self.compute.outputs))

    def __str__(self) -> str:
        # Never the compute's own repr: it prints the whole jaxpr.
        return f"compute of {_names(self.compute.outputs)} on mesh {self.compute.mesh}"


@dataclasses.dataclass(frozen=True)
class RunMove(StepInstruction):
    """``move``'s values cross meshes by ``via``; several values travel packed into one vector and
    are unpacked on the destination mesh, value ``k`` laid out as ``unpacked[k]``."""

    move: OuterMove
    via: ValueMove
    unpacked: tuple[NamedSharding, ...] = ()

    reads = property(lambda self: tuple((r, self.move.src) for r in self.move.values))
    writes = property(lambda self: tuple((r, self.move.dst) for r in self.move.values))

    def __str__(self) -> str:
        return f"move of {_names(self.move.values)} from mesh {self.move.src} to mesh {self.move.dst}"


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
class FeedStages(StepInstruction):
    """Each stage's operands: fetched parameters, constants, values computed before the
    pipeline, every per-micro-batch operand cut into ``num_micro_batches`` slices of
    ``micro_batch_size`` rows, and keys folded with each micro-batch's index."""

    stages: tuple[StageFeed, ...]
    micro_batch_size: int
    num_micro_batches: int
    # Operands read per micro-batch from a global batch array: moved from where each
    # micro-batch's rows lie (every process joins each move), not cut on the host.
    global_batches: tuple[GlobalBatchFeed, ...] = ()

    # What a stage reads before the pipeline, on its mesh (a fetched parameter: an input, moved).
    reads = property(lambda self: tuple((op.source, feed.mesh) for feed in self.stages for op in feed.operands
                                        if op.fetch is None))
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return (f"feed {len(self.stages)} stages: {self.num_micro_batches} micro-batches of "
                f"{self.micro_batch_size} rows")


@dataclasses.dataclass(frozen=True)
class RunPipeline(StepInstruction):
    # The pipeline program's buffers are its own (``verify_pipeline_program``).
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return "run the pipeline program"


@dataclasses.dataclass(frozen=True)
class CombineMicroBatches(StepInstruction):
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

    # It reads the pipeline program's result buffers, no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ((self.value, self.mesh),))
    combines = property(lambda self: (self.value,))

    def check(self, graph: StageGraph, program: PipelineProgram) -> str | None:
        stage = self.buffers[0].index
        if self.mesh != program.stage_mesh[stage] or any(b not in program.results for b in self.buffers):
            return f"does not combine the results of stage {stage} on its mesh"
        return None

    def __str__(self) -> str:
        return f"{self.how.value} of {self.value} over {len(self.buffers)} micro-batches on mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class ReduceGradient(StepInstruction):
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

    # It reads the stage's accumulator, which the pipeline program leaves, no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ((OuterRef(OuterKind.GRAD, self.param), self.mesh),))
    reduces = property(lambda self: ((self.stage, self.param),))

    def check(self, graph: StageGraph, program: PipelineProgram) -> str | None:
        if self.mesh != program.stage_mesh[graph.param_owner(self.param)]:
            return "is not on the mesh of the parameter's owner"
        return None

    def __str__(self) -> str:
        return f"gradient of parameter {self.param} from stage {self.stage} into mesh {self.mesh}"


@dataclasses.dataclass(frozen=True)
class AwaitArrivals(StepInstruction):
    reads = property(lambda self: ())
    writes = property(lambda self: ())

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
class AssembleOutputs(StepInstruction):
    """The step's outputs (of the rewritten step), each from its ``OutputSource``."""

    outputs: tuple[OutputSource, ...]

    reads = property(lambda self: tuple((o.ref, m) for o in self.outputs
                                        if o.ref.kind is not OuterKind.LITERAL for m in o.meshes))
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return f"assemble {len(self.outputs)} outputs"


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
class ShareOutputs(StepInstruction):
    """``outputs`` copied onto the step's output devices (``share_outputs``), so that every
    process reads them and they combine as under ``jax.jit``: point-to-point copies from their
    source device (no collective: a collective
    launched while a peer still waits for this process's sends can block the device those
    sends need), every process joining each copy in this order."""

    outputs: tuple[SharedOutput, ...]

    # It copies the assembled outputs, no value of the step.
    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return f"share {len(self.outputs)} small outputs on the step's output devices"


@dataclasses.dataclass(frozen=True)
class JoinStackedLeaves(StepInstruction):
    """The rewritten step's outputs in pieces joined as the user sees the leaves they replace:
    a held leaf as one array over its pieces' devices, a gathered one moved home by
    ``GatheredArray.out_of`` and concatenated."""

    pieces: LeafPieces
    held: tuple[tuple[int, StackedArray], ...]
    gathered: tuple[tuple[int, GatheredArray], ...]

    reads = property(lambda self: ())
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return f"join {len(self.held) + len(self.gathered)} stacked leaves from their pieces"


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
    home = program.stage_mesh
    M = program.num_micro_batches
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
    placement) and the stages fed; every value an instruction reads on a mesh was made there
    earlier (or is an input or constant); the loss and every aux value are combined once,
    on the mesh computing them; every stage's gradient of every parameter it reads is reduced
    once, on the parameter owner's mesh; the outputs come last. Every instruction is read
    through ``StepInstruction`` (what it reads, makes, combines and reduces, its own check),
    whatever its kind; only the order of the step's phases names kinds.

    Raises:
      PlanVerificationError: naming the instruction.
    """
    strangers = sorted({type(ins).__name__ for ins in step if not isinstance(ins, StepInstruction)})
    if strangers:
        raise PlanVerificationError(f"the step holds instructions of kinds {strangers}, which are not "
                                    f"StepInstructions")
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
    combined = [ref for ins in step for ref in ins.combines]
    want_combined = [OuterRef(OuterKind.LOSS)] + [OuterRef(OuterKind.AUX, k) for k in range(len(graph.aux))]
    if combined != want_combined:
        raise PlanVerificationError(f"combined {combined}, expected the loss and each aux value once: {want_combined}")
    reduced = [key for ins in step for key in ins.reduces]
    want_reduced = [(s.index, k) for s in graph.stages for k in s.param_inputs]
    if sorted(reduced) != sorted(want_reduced) or len(set(reduced)) != len(reduced):
        raise PlanVerificationError("a stage's parameter gradient is not reduced exactly once")
    made: set[Located] = set()
    for ins in step:
        wiring = ins.check(graph, program)
        if wiring:
            raise PlanVerificationError(f"{ins}: {wiring}")
        for ref, mesh in ins.reads:
            if ref.kind not in (OuterKind.IN, OuterKind.CONST) and (ref, mesh) not in made:
                raise PlanVerificationError(f"{ins} reads {ref} on mesh {mesh} before it is made there")
        made.update(ins.writes)
