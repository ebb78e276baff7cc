"""Pass: the whole step as one typed program, in the order every process runs it.

The pipeline program (``pipeline_program``) is the per-micro-batch middle of a
step. Around it a step places its inputs, computes and moves what the loss
reads, feeds each stage its operands, and afterwards combines each
micro-batch's loss and aux values, reduces each parameter's gradient on its
owner's mesh, runs the update and assembles the outputs. ``lower_step`` makes
all of that instructions before the pipeline itself is planned (it needs only the
layout), so the programs around the pipeline compile while it is; ``lower_step``
decides every reduction and every sharding here, each
instruction carrying what it needs (the runtime reads no layout), so the runtime
(``meshpar.runtime.step_handlers``) is one handler per instruction kind:

- ``SplitStackedLeaves`` / ``JoinStackedLeaves`` (first and last, with stacked leaves): the
  user's stacked leaves into the per-stage pieces the step takes, and back;
- ``PlaceInputs``: every step input leaf where its ``PlaceLeaf`` puts it (a global batch leaf by
  its planned moves, ``batch_rows.global_batch_placements``);
- ``RunCompute`` / ``RunMove``: one computation around the pipeline on its mesh,
  or one move of values between two meshes (``step_split``);
- the feeds (``FeedInstruction``s), one per stage operand, chosen here (``_feed``) so the runtime
  re-derives nothing: ``FetchParameter`` (a parameter moved from its owner's mesh),
  ``FeedValue`` (a value placed or computed before the pipeline), ``FeedConstant``,
  ``FoldKey`` (a key folded with each micro-batch's index), ``SliceMicroBatches`` (a batch
  value cut into micro-batches) and ``MoveMicroBatches`` (a global batch's micro-batches moved
  from where their rows lie);
- ``RunPipeline``: the pipeline program;
- ``CombineMicroBatches``: the loss or an aux value, its micro-batches combined as
  ``how`` says, decoded from its wire form and laid out as ``sharding`` (over a stage's
  replicas too: ``combine_replicas``, once the replicas are planned);
- ``ReduceGradient``: one stage's accumulated gradient of one parameter, moved to
  its owner's mesh and added to what other stages contributed;
- ``AwaitArrivals``: the bounded wait for values other processes send here;
- ``AssembleOutputs``: the step's outputs, each with its per-mesh shardings;
- ``ShareOutputs`` (several processes): small outputs held on some processes only (the loss,
  aux metrics, a gradient norm) copied onto every process, as ``jax.jit`` leaves them.

The instruction types live in the program format (``program.step_instructions``). Every kind
subclasses ``StepInstruction``, which says what the verifier asks of it (the values it reads and
makes, on which mesh; what it combines, reduces or feeds; its own wiring check), so
``verify_step_program`` reads any kind through that interface, as ``verify_pipeline_program``
reads ``program.pipeline_instructions.Instruction``s. Each kind's ``__str__`` is one short line (never a
jaxpr): ``program_text`` prints a step with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.batch_rows import GlobalBatchFeed, GlobalBatchPlacement
from ...program.pipeline_instructions import BufferId, BufferKind, PipelineProgram
from ...program.shardings import PlaceLeaf, joined_sharding
from ...program.stacked_leaves import GatheredArray, LeafPieces, StackedArray
from ...program.step_instructions import (
    SHARE_MAX_BYTES, AssembleOutputs, AwaitArrivals, CombineMicroBatches, FeedConstant, FeedInstruction, FeedValue,
    FetchParameter, FoldKey, JoinStackedLeaves, Located, MoveMicroBatches, OutputSource, PlaceInputs, ReduceGradient,
    RunCompute, RunMove, RunPipeline, SharedOutput, ShareOutputs, SliceMicroBatches, SplitStackedLeaves,
    StepInstruction, StepProgram,
)
from ...program.step_values import OuterKind, OuterRef, RefKind
from ...verification import PlanVerificationError
from ..cutting.micro_batching import MicroBatching
from ..cutting.stage_graph import StageGraph
from ..cutting.step_split import OuterCompute, StepSplit
from ..placing.data_replicas import DataReplicas
from ..placing.step_layout import StageOperand, StepLayout

__all__ = ["combine_replicas", "lower_step", "verify_step_program"]


def _outer(step: Any, layout: StepLayout, split: StepSplit) -> StepInstruction:
    if isinstance(step, OuterCompute):
        return RunCompute(step.mesh, step.jaxpr, step.inputs, step.outputs,
                          tuple(layout.value_shardings.get((ref, step.mesh)) for ref in step.outputs))
    unpacked = () if len(step.values) == 1 else tuple(layout.value_shardings[(r, step.dst)] for r in step.values)
    return RunMove(step.values, step.src, step.dst, layout.outer_moves[step], unpacked)


def _feed(stage: int, mesh: int, op: StageOperand, layout: StepLayout, M: int, micro_batch_size: int,
          global_batch: GlobalBatchFeed | None) -> FeedInstruction:
    """How operand ``op`` of ``stage`` (on ``mesh``) is fed: the one place a feeding is chosen."""
    if global_batch is not None:
        return MoveMicroBatches(global_batch, micro_batch_size)
    if op.fetch is not None:
        return FetchParameter(stage, op.position, op.source.index, layout.in_placements[op.source.index].meshes[0],
                              op.fetch)
    if op.fold_key:
        return FoldKey(stage, op.position, op.source, mesh, M)
    if op.per_micro_batch:
        unplaced = op.source.kind is OuterKind.IN and not layout.in_placements[op.source.index].meshes
        stacked = NamedSharding(op.sharding.mesh, P(None, *op.sharding.spec))
        return SliceMicroBatches(stage, op.position, op.source, mesh, op.sharding, stacked, M, micro_batch_size,
                                 unplaced)
    if op.source.kind is OuterKind.CONST:
        return FeedConstant(stage, op.position, op.source.index, op.sharding)
    return FeedValue(stage, op.position, op.source, mesh)


def _leaf_shardings(layout: StepLayout, pieces: LeafPieces | None, held: Mapping[int, StackedArray],
                    gathered: Mapping[int, GatheredArray]) -> tuple[NamedSharding | None, ...]:
    """Per user input leaf, where the step keeps it (``StepProgram.leaf_shardings``)."""
    def kept(placement: PlaceLeaf) -> NamedSharding | None:
        return placement.targets[0] if placement.meshes else None

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
def lower_step(graph: StageGraph, split: StepSplit, layout: StepLayout, home: Sequence[int],
               micro_batching: MicroBatching, meshes: Sequence[Mesh], micro_batch_size: int,
               pieces: LeafPieces | None = None,
               held: Mapping[int, StackedArray] | None = None,
               gathered: Mapping[int, GatheredArray] | None = None,
               global_batches: Sequence[GlobalBatchFeed] = (),
               batch_placements: Sequence[GlobalBatchPlacement] = ()) -> StepProgram:
    """The step around the pipeline of ``micro_batching.num_micro_batches`` micro-batches, its
    stages on meshes ``home``: its reductions are ``micro_batching``'s (the loss by its
    ``reduction``, each aux value by its own, over micro-batches; over a stage's replicas too
    once ``combine_replicas`` has marked them), every sharding is ``layout``'s (a value it
    leaves free replicated on its mesh); with ``pieces``, the user's stacked leaves split before
    and joined after, as ``held`` and ``gathered`` say; ``global_batches`` feed stages per
    micro-batch from a global batch, ``batch_placements`` place such a batch's leaves whole.
    Nothing here reads the pipeline's plan: the step is lowered before it, so the programs
    around the pipeline can compile while the pipeline is planned."""
    held, gathered = dict(held or {}), dict(gathered or {})
    M = micro_batching.num_micro_batches
    by_operand = {(f.stage, f.position): f for f in global_batches}
    feeds = [_feed(s, home[s], op, layout, M, micro_batch_size, by_operand.get((s, op.position)))
             for s, ops in enumerate(layout.stage_operands) for op in ops]
    ins: list[StepInstruction] = []
    stacked = (pieces, tuple(sorted(held.items())), tuple(sorted(gathered.items())))
    if pieces is not None:
        ins.append(SplitStackedLeaves(*stacked))
    ins += [PlaceInputs(layout.in_placements, tuple(batch_placements)),
            *(_outer(st, layout, split) for st in split.before),
            *feeds, RunPipeline()]
    loss = graph.loss
    ins.append(CombineMicroBatches(
        OuterRef(OuterKind.LOSS), tuple(BufferId(BufferKind.RESULT, loss.index, m, loss.slot) for m in range(M)),
        home[loss.index], micro_batching.reduction.aux, split.avals[OuterRef(OuterKind.LOSS)], None))
    for k, (ref, how) in enumerate(zip(graph.aux, micro_batching.aux)):
        aux = OuterRef(OuterKind.AUX, k)
        ins.append(CombineMicroBatches(
            aux, tuple(BufferId(BufferKind.RESULT, ref.index, m, ref.slot) for m in range(M)), home[ref.index], how,
            split.avals[aux], layout.value_shardings.get((aux, home[ref.index]))))
    reduced: set[tuple[int, int]] = set()
    for stage, moves, shardings in zip(graph.stages, layout.gradient_moves, layout.grad_shardings):
        avals = [a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind is RefKind.PARAM]
        for n, k in enumerate(stage.param_inputs):
            owner = home[graph.param_owner(k)]
            ins.append(ReduceGradient(k, stage.index, n, owner, moves[n], shardings[n], avals[n],
                                      adds=(k, owner) in reduced))
            reduced.add((k, owner))
    ins += [*(_outer(st, layout, split) for st in split.after), AwaitArrivals()]
    outputs = []
    for j, (ref, on) in enumerate(split.outputs):
        placement = layout.out_placements[j]
        shardings = tuple(placement.on(m) if placement is not None and m in placement.meshes
                          else NamedSharding(meshes[m], P()) for m in on)
        outputs.append(OutputSource(ref, tuple(on), shardings, split.literals.get(j),
                                    layout.in_placements[ref.index] if ref.kind is OuterKind.IN else None,
                                    joined_sharding(shardings)))
    ins.append(AssembleOutputs(tuple(outputs)))
    shared = share_outputs(outputs, split.avals, meshes, [p is not None for p in layout.out_placements])
    if shared is not None:
        ins.append(shared)
    if pieces is not None:
        ins.append(JoinStackedLeaves(*stacked))
    return StepProgram(tuple(ins), tuple(split.consts), dict(split.avals),
                       _leaf_shardings(layout, pieces, held, gathered))


@compiler_pass
def combine_replicas(step: StepProgram, gradients: DataReplicas) -> StepProgram:
    """``step`` with each ``CombineMicroBatches`` of a value its stage leaves one per replica
    (``gradients``: the stage runs as data-parallel replicas) combining over the replicas too."""

    def marked(ins: StepInstruction) -> StepInstruction:
        if not isinstance(ins, CombineMicroBatches):
            return ins
        buffer = ins.buffers[0]
        replicas = gradients.stages[buffer.index].replicas
        per_replica = replicas is not None and replicas.per_replica(buffer.slot)
        return dataclasses.replace(ins, per_replica=per_replica) if per_replica != ins.per_replica else ins

    return dataclasses.replace(step, instructions=tuple(marked(ins) for ins in step))


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
        shared.append(SharedOutput(j, src, targets, tuple(aval.shape), aval.dtype, frozenset(sharding.device_set)))
    return ShareOutputs(tuple(shared)) if shared else None


def verify_step_program(step: StepProgram, split: StepSplit, graph: StageGraph,
                        program: PipelineProgram | None = None) -> None:
    """The pipeline runs once, after the inputs are placed (a global batch leaf moved to its own
    placement) and every stage operand fed once; every value an instruction reads on a mesh was made there
    earlier (or is an input or constant); the loss and every aux value are combined once,
    on the mesh computing them; every stage's gradient of every parameter it reads is reduced
    once, on the parameter owner's mesh; a value made again on a mesh is read by what remakes it
    (a gradient's second contribution adds to the first); nothing uses a value after it is
    freed, and each is freed once, after it was made; the outputs come last. Every instruction is read
    through ``StepInstruction`` (what it reads, makes, frees, combines and reduces, its own check),
    whatever its kind; only the order of the step's phases names kinds. Each instruction's wiring
    against the pipeline ``program`` is checked once it is planned (``None``: not yet).

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
    order = [PlaceInputs, RunPipeline, AwaitArrivals, AssembleOutputs]
    positions = [body.index(k) if body.count(k) == 1 else -1 for k in order]
    if -1 in positions or positions != sorted(positions) or positions[-1] != len(body) - 1:
        raise PlanVerificationError("the step does not place, run the pipeline, wait and assemble once each, "
                                    "in that order, assembling last")
    pipeline = next(k for k, ins in enumerate(step) if isinstance(ins, RunPipeline))
    fed = [(k, key) for k, ins in enumerate(step) for key in ins.feeds]
    late = [step.instructions[k] for k, _ in fed if k > pipeline]
    if late:
        raise PlanVerificationError(f"{late[0]} feeds a stage after the pipeline runs")
    want_fed = sorted((s.index, k) for s in graph.stages for k, r in enumerate(s.inputs) if r.kind is not RefKind.ACT)
    if sorted(key for _, key in fed) != want_fed:
        raise PlanVerificationError("a stage operand is not fed exactly once before the pipeline runs")
    combined = [ref for ins in step for ref in ins.combines]
    want_combined = [OuterRef(OuterKind.LOSS)] + [OuterRef(OuterKind.AUX, k) for k in range(len(graph.aux))]
    if combined != want_combined:
        raise PlanVerificationError(f"combined {combined}, expected the loss and each aux value once: {want_combined}")
    reduced = [key for ins in step for key in ins.reduces]
    want_reduced = [(s.index, k) for s in graph.stages for k in s.param_inputs]
    if sorted(reduced) != sorted(want_reduced) or len(set(reduced)) != len(reduced):
        raise PlanVerificationError("a stage's parameter gradient is not reduced exactly once")
    param_owner = [graph.param_owner(k) for k in range(graph.num_params)]
    made: set[Located] = set()
    freed: set[Located] = set()
    for ins in step:
        wiring = ins.check(program, param_owner) if program is not None else None
        if wiring:
            raise PlanVerificationError(f"{ins}: {wiring}")
        for ref, mesh in (*ins.reads, *ins.writes):
            if (ref, mesh) in freed:
                raise PlanVerificationError(f"{ins} uses {ref} on mesh {mesh} after it was freed")
        for ref, mesh in ins.reads:
            if ref.kind not in (OuterKind.IN, OuterKind.CONST) and (ref, mesh) not in made:
                raise PlanVerificationError(f"{ins} reads {ref} on mesh {mesh} before it is made there")
        again = [w for w in ins.writes if w in made and w not in ins.reads]
        if again:
            raise PlanVerificationError(f"{ins} makes {again[0][0]} on mesh {again[0][1]} again without reading "
                                        f"it (a second contribution adds to the first)")
        made.update(ins.writes)
        for ref, mesh in ins.frees:
            if (ref, mesh) not in made or (ref, mesh) in freed:
                raise PlanVerificationError(f"{ins} frees {ref} on mesh {mesh}, which is "
                                            f"{'already freed' if (ref, mesh) in freed else 'not made before it'}")
            freed.add((ref, mesh))
