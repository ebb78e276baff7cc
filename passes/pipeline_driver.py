"""The pipeline compiler: one declared list of passes, each followed by its IR's verifier.

A pass is a name, a function over the typed ``CompileState`` and its verifier (``Pass``);
``PIPELINE_PASSES`` lists them in the order ``run_passes`` runs them, and ``compile_pipeline``
is that run. Passes that do not apply to a step (``Pass.when``) are skipped. The state after
every pass is kept: ``CompiledPipeline.ir_after(name)`` shows what a pass made, like MLIR's
print-after-all. In order:

- ``forward_operands`` (a step without a gradient, ``forward_step``: an evaluation step): its
  parameters made plain operands, and the schedule the forward-only one with the user's
  schedule's placement; the stage graph is then ``forward_only`` (no value has a cotangent,
  no backward runs, no cotangent moves);
- ``split_layer_scans``: markers the options add (``auto_layers``; a stage count for a loss
  without markers), a scan over layers split where a cut falls inside it (verified equal to
  the original on random inputs);
- ``split_stacked_leaves``: stacked parameters that several stages read in slices become
  their pieces -> ``LeafPieces``;
- ``group_markers`` (more markers than stages): which markers to cut at -> ``MarkerGrouping``;
- ``split_stages``: the loss jaxpr cut at stage markers, checked against the user's options
  -> ``StageGraph``;
- ``place_stages``: the device meshes, and each stage placed on one as the schedule places
  them (a mesh may host several: virtual stages) -> ``StageMeshMap``;
- ``split_step``: the rest of the step (values the loss reads, the update) per mesh, with the
  moves between meshes -> ``StepSplit``;
- ``layout_step``: where every value lives -> ``StepLayout``;
- ``stacked_arrays`` (with pieces): how the user sees each split leaf, held in pieces or
  gathered -> ``StackedArray``s, ``GatheredArray``s;
- ``plan_edge_transfers``: how each boundary value moves, both ways -> ``EdgeTransfer``s
  (``LOCAL`` between stages on one mesh);
- ``global_batch_feeds`` and ``global_batch_placements``: how a batch laid out over processes
  reaches the stages and the work around the pipeline;
- ``lower_step``: the whole step around the pipeline (inputs placed, the work before and
  after it, the stages' feeds, micro-batches combined, gradients reduced on their owners'
  meshes, outputs assembled) -> ``StepProgram``; ``fuse_packing``: a packed move's packing
  and unpacking into the programs making and reading its values; ``free_step_values``: each
  value of the step dropped right after its last use (a ``FreeValues``). These need nothing
  of the pipeline's plan, so they run before the passes that trace the stages: the caller's
  observer (``meshpar.step_compiler``) starts compiling the step's programs after
  ``free_step_values``, and XLA compiles them on other threads while the passes below run;
- ``plan_data_replicas``: how each stage's parameter gradients accumulate and reduce (once per
  step: the stage run as data-parallel replicas, each replica's parts traced) -> ``DataReplicas``;
- ``stage_parts``: each stage's forward, backward and split backward jaxprs, as it runs them
  (a stage run as replicas: its replicas') -> ``StageParts``;
- ``plan_moves``: every value crossing meshes (boundary values, parameter fetches, gradients,
  the moves around the pipeline) planned, lowered by its executor and verified -> ``MoveTable``;
- ``estimate_durations``: task durations from the cost model (each stage's gradient reduction
  priced as ``plan_data_replicas`` runs it), and each mesh's weight-pass delay chosen by
  simulating the schedule with them (``schedule_simulator``) -> ``TaskDurations``;
- ``make_schedule``: the typed tasks per mesh and the networkx dependency graph (checked
  acyclic) -> ``PipelineSchedule``;
- ``lower_to_program``: per-mesh instructions over typed buffers, each mesh's gradient
  reduction among them -> ``PipelineProgram``; ``fuse_compute_runs`` (``fuse_compute`` other
  than 1): back-to-back compute on a mesh as one program;
- ``combine_replicas``: the loss and aux values a stage run as replicas leaves one per replica
  combined over them too; the step is then checked against the pipeline program;
- ``launch_sequences``: per process, the programs it launches on each mesh and the
  cross-process transfers it numbers -> ``LaunchSequences``, whose verifier refuses a step
  whose processes would launch a mesh's programs, or number a transfer, differently (a
  deadlock);
- ``stage_kernels``: what the runtime compiles per stage -> ``StageKernel``s.

Like XLA's ``HloPassPipeline``, a verifier failure names the pass whose output broke the
invariant.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jax.extend.core.primitives import scan_p
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from . import jax_ir
from .compiler_pass import compiler_pass
from .pipeline.cutting.degenerate_stages import degenerate_stages
from .pipeline.cutting.forward_step import forward_operands, verify_forward_operands
from .pipeline.cutting.layer_clustering import even_layer_markers, insert_layer_markers
from .pipeline.cutting.marker_grouping import MarkerGrouping, group_markers, verify_marker_grouping
from .pipeline.cutting.micro_batching import MicroBatching
from .pipeline.cutting.split_scans import verify_split_scans
from .pipeline.cutting.stage_graph import Ref, StageGraph, split_stages, verify_stage_graph
from .pipeline.cutting.stage_parts import stage_parts, verify_stage_parts
from .pipeline.cutting.step_split import StepSplit, split_step, verify_step_split
from .pipeline.lowering.fused_runs import fuse_compute_runs
from .pipeline.lowering.launch_sequences import LaunchSequences, launch_sequences, verify_launch_sequences
from .pipeline.lowering.packed_moves import fuse_packing, verify_fused_packing
from .pipeline.lowering.pipeline_program import lower_to_program, stage_io, verify_pipeline_program
from .pipeline.lowering.program_text import program_text
from .pipeline.lowering.stage_kernels import stage_kernels, verify_stage_kernels
from .pipeline.lowering.step_frees import free_step_values, verify_step_frees
from .pipeline.lowering.step_program import combine_replicas, lower_step, verify_step_program
from .pipeline.pipeline_options import PipelineOptions
from .pipeline.placing.batch_rows import (
    global_batch_feeds, global_batch_placements, verify_global_batch_feeds, verify_global_batch_placements,
)
from .pipeline.placing.data_replicas import DataReplicas, plan_data_replicas, verify_data_replicas
from .pipeline.placing.drop_mesh_axis import drop_mesh_axis
from .pipeline.placing.edge_transfer import plan_edge_transfers, verify_edge_transfers
from .pipeline.placing.mesh_assignment import StageMeshMap, place_stages, verify_stage_mesh_map
from .pipeline.placing.plan_moves import MoveOptions, plan_moves, verify_move_table
from .pipeline.placing.stacked_leaves import (
    gathered_arrays, split_stacked_leaves, stacked_arrays, stacked_params, take_pieces, verify_leaf_pieces,
)
from .pipeline.placing.step_layout import StepLayout, layout_step, verify_step_layout
from .pipeline.scheduling.pipeline_schedule import (
    PipelineSchedule, forward_only_schedule, make_schedule, verify_schedule,
)
from .pipeline.step_primitives import pipeline_grad_p, stage_boundary_p
from .program.batch_rows import GlobalBatchFeed, GlobalBatchPlacement
from .program.moves import EdgeTransfer, MoveKey, MoveTable, TransferKind
from .program.pipeline_instructions import PipelineProgram
from .program.stacked_leaves import GatheredArray, LeafPieces, StackedArray
from .program.stage_kernel import StageKernel, StageParts
from .program.step_instructions import StepProgram
from .program.step_values import RefKind
from .program.wire_format import wire_aval
from .simulation.cost_model import estimate_durations, stage_gradients
from .simulation.schedule_simulator import TaskDurations
from .simulation.weight_delay import weight_delays
from .verification import PlanVerificationError

__all__ = ["PIPELINE_PASSES", "CompileState", "CompiledPipeline", "Pass", "PipelineOptions", "compile_pipeline",
           "run_passes", "state_counterparts"]

@dataclasses.dataclass(frozen=True)
class CompileState:
    """What the passes have made of one step so far: the driver's inputs (the traced step, its
    leaves and the options), then each IR as the pass that makes it sets it (``None`` before).

    Each pass is a function ``CompileState -> CompileState`` that sets the fields it names in
    ``Pass.makes`` and reads only fields earlier passes set; its verifier checks the state it
    returned. The state is frozen: a pass returns a new one, so the state after any pass can be
    kept and shown (``CompiledPipeline.ir_after``)."""

    # The driver's inputs (``compile_pipeline``'s arguments); a pass may rewrite the step's
    # leaves (``split_stacked_leaves``: stacked parameters become their pieces).
    outer: jax_ir.ClosedJaxpr
    grad_params: dict[str, Any]
    micro_batching: MicroBatching
    leaves: tuple[Any, ...]
    specs: tuple[P | None, ...]
    batch_leaves: frozenset[int]
    counterparts: tuple[int | None, ...]
    devices: tuple[Any, ...]
    options: PipelineOptions
    check_stages: Callable[[StageGraph], None]
    replica_loss: Callable[[int], jax_ir.ClosedJaxpr] | None
    # The user's leaves as traced (before any is split into pieces), and the step's output leaves.
    user_specs: tuple[P | None, ...]
    leaf_avals: tuple[Any, ...]
    num_user_outputs: int
    # Made by the passes, in order.
    loss: jax_ir.ClosedJaxpr | None = None
    stacked: dict[int, Any] | None = None
    pieces: LeafPieces | None = None
    grouping: MarkerGrouping | None = None
    graph: StageGraph | None = None
    placed: StageMeshMap | None = None
    split: StepSplit | None = None
    layout: StepLayout | None = None
    held: dict[int, StackedArray] = dataclasses.field(default_factory=dict)
    gathered: dict[int, GatheredArray] = dataclasses.field(default_factory=dict)
    parts: tuple[StageParts, ...] | None = None
    gradients: DataReplicas | None = None
    transfers: tuple[EdgeTransfer, ...] | None = None
    feeds: tuple[GlobalBatchFeed, ...] | None = None
    batch_placements: tuple[GlobalBatchPlacement, ...] | None = None
    moves: MoveTable | None = None
    durations: TaskDurations | None = None
    delays: tuple[int, ...] | None = None
    schedule: PipelineSchedule | None = None
    program: PipelineProgram | None = None
    step: StepProgram | None = None
    launches: LaunchSequences | None = None
    kernels: tuple[StageKernel, ...] | None = None

    @property
    def forward_only(self) -> bool:
        """A step without a gradient (``forward_step``: an evaluation step)."""
        return bool(self.grad_params.get("forward_only"))

    @property
    def num_diff(self) -> int:
        """The loss's differentiated inputs (its parameters as the user passed them)."""
        return self.grad_params["num_diff"]

    @property
    def cut_points(self) -> tuple[int, ...] | None:
        """The stage markers cut at: the user's, or those ``group_markers`` chose; ``None``: every
        marker (with automatic layers, the options' cut points chose which cuts were made)."""
        if self.grouping is not None:
            return self.grouping.cut_points
        return None if self.options.placement.auto_layers is not None else self.options.placement.cut_points

    @property
    def axis_names(self) -> tuple[str, str]:
        return self.options.placement.data_axis, self.options.placement.model_axis

    @property
    def home(self) -> tuple[int, ...]:
        """Per stage, the index of its mesh."""
        return self.placed.stage_mesh

    @property
    def edges(self) -> list[tuple[int, int, Ref]]:
        return self.graph.edges()

    @property
    def reduced(self) -> frozenset[int]:
        """The stages whose gradients reduce once per step (not inside each backward)."""
        return self.gradients.reduced_stages()


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass of the compiler: ``run`` makes the fields ``makes`` names from the state, and
    ``verify`` checks the state it returned (raising ``PlanVerificationError``); where ``when``
    says no, the pass does not apply to this step and the state goes on unchanged."""

    name: str
    run: Callable[[CompileState], CompileState]
    verify: Callable[[CompileState], None]
    makes: tuple[str, ...]
    when: Callable[[CompileState], bool] = lambda state: True


def _forward_operands(st: CompileState) -> CompileState:
    outer, grad_params, micro_batching = forward_operands(st.outer, st.grad_params, st.micro_batching)
    # Each stage runs on the mesh the train schedule gives it, so its parameters are where a
    # train step keeps them.
    options = dataclasses.replace(st.options, schedule=dataclasses.replace(
        st.options.schedule, kind=forward_only_schedule(st.options.schedule.kind), weight_delay=False))
    return dataclasses.replace(st, outer=outer, grad_params=grad_params, micro_batching=micro_batching,
                               options=options)


def _split_layer_scans(st: CompileState) -> CompileState:
    return dataclasses.replace(st, loss=layered_loss(st.grad_params["loss_jaxpr"], st.num_diff, st.options))


def _split_stacked_leaves(st: CompileState) -> CompileState:
    # Stacked parameters read in slices by several stages live as those slices.
    stacked = stacked_params(st.loss, st.num_diff)
    if not stacked:
        return dataclasses.replace(st, stacked=stacked)
    outer, pieces, stacked = split_stacked_leaves(st.outer, stacked, st.counterparts)
    leaves, specs, batch_leaves, counterparts = pieces.piece_leaves(
        st.leaves, st.leaf_avals, st.specs, st.batch_leaves, st.counterparts)
    return dataclasses.replace(st, outer=outer, pieces=pieces, stacked=stacked, leaves=tuple(leaves),
                               specs=tuple(specs), batch_leaves=batch_leaves, counterparts=tuple(counterparts))


def _verify_stacked_leaves(st: CompileState) -> None:
    if st.pieces is not None:
        verify_leaf_pieces(st.pieces, len(st.leaf_avals), st.num_user_outputs)


def _cut(st: CompileState, loss: jax_ir.ClosedJaxpr) -> StageGraph:
    num_params = st.num_diff + sum(len(b) - 2 for b in st.stacked.values())
    graph = split_stages(take_pieces(loss, st.num_diff, st.stacked), num_params, st.cut_points)
    return dataclasses.replace(graph, marker_grouping=st.grouping, forward_only=st.forward_only)


def _split_stages(st: CompileState) -> CompileState:
    graph = _cut(st, st.loss)
    st.check_stages(graph)
    degenerate = degenerate_stages(graph)
    if degenerate and st.options.placement.num_stages is not None:
        raise ValueError(f"num_stages: {st.options.placement.num_stages} stages asked for, but "
                         + "; ".join(map(str, degenerate)))
    for stage in degenerate:
        warnings.warn(f"meshpar: {stage}", stacklevel=4)
    return dataclasses.replace(st, graph=graph)


def _place_stages(st: CompileState) -> CompileState:
    schedule, placement = st.options.schedule, st.options.placement
    placed = place_stages(list(st.devices), st.graph.num_stages, schedule.kind, schedule.num_micro_batches,
                          placement.stage_meshes, placement.stage_mesh_shape, placement.stages_per_mesh,
                          st.axis_names)
    for mesh in placed.meshes:
        data = mesh.shape.get(placement.data_axis, 1)
        if st.options.micro_batch_size % data:
            raise ValueError(
                f"num_micro_batches: micro-batches of {st.options.micro_batch_size} examples do not split over "
                f"the {data}-way {placement.data_axis!r} axis (data_axis) of the stage meshes; pass "
                f"num_micro_batches so that batch / num_micro_batches is a multiple of {data}"
            )
    return dataclasses.replace(st, placed=placed)


def _split_step(st: CompileState) -> CompileState:
    graph, home = st.graph, st.home
    # Around the pipeline values live on meshes: the stages' indices mapped through the map.
    readers = [sorted({home[s] for s in graph.consumers(Ref(RefKind.INPUT, k))}) for k in range(graph.num_inputs)]
    split = split_step(
        st.outer, lambda k: home[graph.param_owner(k)], home[graph.loss.index], [home[r.index] for r in graph.aux],
        len(st.placed.meshes),
        [() if per_mb and _is_batch_leaf(st.outer, k, graph, st.batch_leaves) else r
         for k, (r, per_mb) in enumerate(zip(readers, st.micro_batching.per_micro_batch))],
        list(st.counterparts))
    return dataclasses.replace(st, split=split)


def _layout_step(st: CompileState) -> CompileState:
    return dataclasses.replace(st, layout=layout_step(
        st.graph, st.split, st.placed.meshes, st.home, list(st.leaves), list(st.specs), st.batch_leaves,
        st.options.micro_batch_size, list(st.counterparts), st.options.transfers.executor,
        st.micro_batching.per_micro_batch, st.micro_batching.fold_keys, axis_names=st.axis_names))


def _stacked_arrays(st: CompileState) -> CompileState:
    # How the user sees each split leaf, from where the layout put its pieces.
    pieces = st.pieces
    at = {key: n for n, key in enumerate(pieces.piece_inputs())}
    piece_shardings = {i: [st.layout.in_placements[at[(i, p)]].shardings[0] for p in range(len(bounds) - 1)]
                       for i, bounds in enumerate(pieces.inputs) if bounds is not None}
    held = stacked_arrays(pieces, piece_shardings)
    rest = {i: s for i, s in piece_shardings.items() if i not in held}
    avals = st.leaf_avals
    gathered = gathered_arrays(pieces, rest, {i: avals[i].shape for i in rest}, {i: avals[i].dtype for i in rest},
                               {i: st.user_specs[i] for i in rest}, st.axis_names, st.options.transfers.executor)
    return dataclasses.replace(st, held=held, gathered=gathered)


def _verify_stacked_arrays(st: CompileState) -> None:
    split = {i for i, bounds in enumerate(st.pieces.inputs) if bounds is not None}
    if set(st.held) & set(st.gathered) or set(st.held) | set(st.gathered) != split:
        raise PlanVerificationError(f"the split leaves {sorted(split)} are not each held in pieces "
                                    f"({sorted(st.held)}) or gathered ({sorted(st.gathered)}), once")


def _stage_parts(st: CompileState) -> CompileState:
    # A stage run as replicas runs only its replicas' parts, traced by plan_data_replicas: its
    # parts at the micro-batch's size would be traced (a linearization of the stage) for nothing.
    return dataclasses.replace(st, parts=tuple(
        g.replicas.parts if g.replicas is not None else stage_parts(s, st.graph.differentiated_slots(s.index))
        for s, g in zip(st.graph.stages, st.gradients.stages, strict=True)))


def _verify_stage_parts(st: CompileState) -> None:
    for stage, parts, g in zip(st.graph.stages, st.parts, st.gradients.stages, strict=True):
        if g.replicas is not None:
            # Checked against the stage traced per replica when plan_data_replicas traced them.
            if parts is not g.replicas.parts:
                raise PlanVerificationError(f"stage {stage.index}: runs as replicas, but its parts are not theirs")
            continue
        try:
            verify_stage_parts(stage, parts)
        except PlanVerificationError as e:
            raise PlanVerificationError(f"stage {stage.index}: {e}") from e


def _plan_data_replicas(st: CompileState) -> CompileState:
    def replica_graph(count: int) -> StageGraph:
        if st.replica_loss is None:
            raise ValueError("the step was not traced per replica")
        replica = layered_loss(drop_mesh_axis(st.replica_loss(count), st.options.placement.data_axis),
                               st.num_diff, st.options)
        found = stacked_params(replica, st.num_diff)
        if any(found.get(k) != b for k, b in st.stacked.items()):
            raise ValueError("traced per replica, its scans over layers are cut elsewhere")
        return _cut(st, replica)

    return dataclasses.replace(st, gradients=plan_data_replicas(
        st.graph, st.layout, st.placed.meshes, st.home, st.micro_batching, st.options.gradients,
        st.options.placement.data_axis, replica_graph))


def _edge_triples(st: CompileState) -> list[tuple[int, int, int]]:
    return [(p, c, ref.slot) for p, c, ref in st.edges]


def _plan_edge_transfers(st: CompileState) -> CompileState:
    return dataclasses.replace(st, transfers=tuple(plan_edge_transfers(
        _edge_triples(st), [wire_aval(st.graph.stages[p].jaxpr.out_avals[ref.slot]) for p, _, ref in st.edges],
        st.placed.stage_meshes, st.options.micro_batch_size, st.options.transfers.executor,
        st.options.placement.data_axis, st.graph.forward_only)))


def _global_batch_feeds(st: CompileState) -> CompileState:
    return dataclasses.replace(st, feeds=tuple(global_batch_feeds(st.layout, list(st.leaves),
                                                                  st.options.schedule.num_micro_batches)))


def _global_batch_placements(st: CompileState) -> CompileState:
    # A global batch leaf the work around the pipeline reads whole: moved there, never fetched.
    return dataclasses.replace(st, batch_placements=tuple(global_batch_placements(st.layout, list(st.leaves),
                                                                                  st.batch_leaves)))


def _move_keys(st: CompileState) -> list[MoveKey]:
    return (step_moves(st.transfers, st.layout) + [mv.move_key for g in st.gathered.values() for mv in g.moves()]
            + [key for feed in st.feeds for key in feed.moves] + [key for p in st.batch_placements for key in p.moves])


def _plan_moves(st: CompileState) -> CompileState:
    transfers = st.options.transfers
    return dataclasses.replace(st, moves=plan_moves(_move_keys(st), MoveOptions(transfers.strategy, transfers.balancer,
                                                                                 transfers.cluster)))


def _estimate_durations(st: CompileState) -> CompileState:
    inter, intra = st.options.transfers.inter_host_bandwidth, st.options.transfers.intra_host_bandwidth
    meshes = st.placed.meshes
    reductions = stage_gradients(st.gradients.stages, meshes, st.home, st.options.placement.data_axis, inter, intra)
    durations = estimate_durations(st.parts, st.placed.stage_meshes, st.transfers, len(st.edges), inter, intra,
                                   gradients=reductions, copies=[g.copies for g in st.gradients.stages])
    # A collective program holds both meshes; any other move runs beside their compute.
    overlap = not all(t.kind is TransferKind.COLLECTIVE for t in st.transfers)
    schedule = st.options.schedule
    delays = weight_delays(schedule.weight_delay, schedule.kind, schedule.num_micro_batches,
                           [(p, c) for p, c, _ in st.edges], durations, overlap, len(meshes))
    return dataclasses.replace(st, durations=durations, delays=delays)


def _verify_durations(st: CompileState) -> None:
    d = st.durations
    if len(d.stages) != st.graph.num_stages or len(d.activation) != len(st.edges) or len(d.gradient) != len(st.edges):
        raise PlanVerificationError(f"durations for {len(d.stages)} stages and {len(d.activation)} / "
                                    f"{len(d.gradient)} edges, for a graph of {st.graph.num_stages} stages and "
                                    f"{len(st.edges)} edges")
    if st.delays is not None and (len(st.delays) != len(st.placed.meshes) or min(st.delays) < 0):
        raise PlanVerificationError(f"weight delays {st.delays}: expected one non-negative delay per mesh "
                                    f"({len(st.placed.meshes)})")


def _make_schedule(st: CompileState) -> CompileState:
    schedule = st.options.schedule
    return dataclasses.replace(st, schedule=make_schedule(schedule.kind, st.graph.num_stages, schedule.num_micro_batches,
                                                          [(p, c) for p, c, _ in st.edges], st.delays,
                                                          len(st.placed.meshes)))


def _verify_schedule(st: CompileState) -> None:
    verify_schedule(st.schedule)
    if st.schedule.stage_mesh != st.placed.stage_mesh:
        raise PlanVerificationError(f"the schedule places stages on meshes {st.schedule.stage_mesh}, the mesh "
                                    f"map on {st.placed.stage_mesh}")


def _lower_to_program(st: CompileState) -> CompileState:
    graph, edges = st.graph, st.edges
    ios = stage_io(
        graph.num_stages,
        [(p, c, ref.slot, [r for r in graph.stages[c].inputs if r.kind is RefKind.ACT].index(ref)) for p, c, ref in edges],
        (graph.loss.index, graph.loss.slot),
        [len(s.outputs) for s in graph.stages],
        [(r.index, r.slot) for r in graph.aux],
        frozenset(e for e, (p, _, ref) in enumerate(edges) if ref.slot not in graph.differentiated_slots(p)),
    )
    return dataclasses.replace(st, program=lower_to_program(st.schedule, ios, st.transfers, st.reduced))


def _fuse_compute_runs(st: CompileState) -> CompileState:
    return dataclasses.replace(st, program=fuse_compute_runs(st.program, st.options.schedule.fuse_compute))


def _lower_step(st: CompileState) -> CompileState:
    return dataclasses.replace(st, step=lower_step(
        st.graph, st.split, st.layout, st.home, st.micro_batching, st.placed.meshes, st.options.micro_batch_size,
        st.pieces, st.held, st.gathered, list(st.feeds), list(st.batch_placements)))


def _launch_sequences(st: CompileState) -> CompileState:
    # Every process's launches, computed alike on every process: checked before the first step.
    return dataclasses.replace(st, launches=launch_sequences(st.step, st.program, st.moves, st.placed.meshes))


def _stage_kernels(st: CompileState) -> CompileState:
    return dataclasses.replace(st, kernels=stage_kernels(st.graph, st.parts, st.program, st.layout, st.placed.meshes,
                                                          st.micro_batching.loss_seed, st.gradients))


PIPELINE_PASSES: tuple[Pass, ...] = (
    Pass("forward_operands", _forward_operands,
         lambda st: verify_forward_operands(st.outer, st.grad_params, st.micro_batching),
         ("outer", "grad_params", "micro_batching", "options"), when=lambda st: st.forward_only),
    Pass("split_layer_scans", _split_layer_scans, lambda st: _verify_layered(st.grad_params["loss_jaxpr"], st.loss),
         ("loss",)),
    Pass("split_stacked_leaves", _split_stacked_leaves, _verify_stacked_leaves,
         ("stacked", "pieces", "outer", "leaves", "specs", "batch_leaves", "counterparts")),
    # More markers than num_stages - 1: the compiler chooses which cut.
    Pass("group_markers", lambda st: dataclasses.replace(st, grouping=group_markers(
        st.loss, st.options.placement.num_stages)),
         lambda st: verify_marker_grouping(st.grouping, st.loss, st.options.placement.num_stages), ("grouping",),
         when=lambda st: st.cut_points is None and st.options.placement.auto_layers is None),
    Pass("split_stages", _split_stages, lambda st: verify_stage_graph(st.graph), ("graph",)),
    Pass("place_stages", _place_stages, lambda st: verify_stage_mesh_map(st.placed, st.graph.num_stages),
         ("placed",)),
    Pass("split_step", _split_step, lambda st: verify_step_split(st.split, len(st.placed.meshes)), ("split",)),
    Pass("layout_step", _layout_step, lambda st: verify_step_layout(st.layout, st.split, st.placed.meshes, st.home),
         ("layout",)),
    Pass("stacked_arrays", _stacked_arrays, _verify_stacked_arrays, ("held", "gathered"),
         when=lambda st: st.pieces is not None),
    Pass("plan_edge_transfers", _plan_edge_transfers,
         lambda st: verify_edge_transfers(st.transfers, _edge_triples(st), st.placed.stage_meshes), ("transfers",)),
    Pass("global_batch_feeds", _global_batch_feeds,
         lambda st: verify_global_batch_feeds(st.feeds, st.layout, st.options.schedule.num_micro_batches),
         ("feeds",)),
    Pass("global_batch_placements", _global_batch_placements,
         lambda st: verify_global_batch_placements(st.batch_placements, st.layout, list(st.leaves), st.batch_leaves),
         ("batch_placements",)),
    # The step around the pipeline, before the passes that trace the stages (replicas, parts):
    # it needs only the layout, and the caller's observer compiles its programs meanwhile.
    Pass("lower_step", _lower_step, lambda st: verify_step_program(st.step, st.split, st.graph), ("step",)),
    Pass("fuse_packing", lambda st: dataclasses.replace(st, step=fuse_packing(st.step)),
         lambda st: (verify_step_program(st.step, st.split, st.graph), verify_fused_packing(st.step)),
         ("step",)),
    Pass("free_step_values", lambda st: dataclasses.replace(st, step=free_step_values(st.step)),
         lambda st: (verify_step_program(st.step, st.split, st.graph), verify_step_frees(st.step)),
         ("step",)),
    Pass("plan_data_replicas", _plan_data_replicas,
         lambda st: verify_data_replicas(st.gradients, st.graph, st.placed.meshes, st.home), ("gradients",)),
    Pass("stage_parts", _stage_parts, _verify_stage_parts, ("parts",)),
    Pass("plan_moves", _plan_moves, lambda st: verify_move_table(st.moves, _move_keys(st)), ("moves",)),
    Pass("estimate_durations", _estimate_durations, _verify_durations, ("durations", "delays")),
    Pass("make_schedule", _make_schedule, _verify_schedule, ("schedule",)),
    Pass("lower_to_program", _lower_to_program, lambda st: verify_pipeline_program(st.program, st.reduced),
         ("program",)),
    Pass("fuse_compute_runs", _fuse_compute_runs, lambda st: verify_pipeline_program(st.program, st.reduced),
         ("program",), when=lambda st: st.options.schedule.fuse_compute != 1),
    Pass("combine_replicas", lambda st: dataclasses.replace(st, step=combine_replicas(st.step, st.gradients)),
         lambda st: verify_step_program(st.step, st.split, st.graph, st.program), ("step",)),
    Pass("launch_sequences", _launch_sequences, lambda st: verify_launch_sequences(st.launches), ("launches",)),
    Pass("stage_kernels", _stage_kernels, lambda st: verify_stage_kernels(st.kernels, st.program), ("kernels",)),
)
"""The compiler's passes, in the order they run (module doc)."""


@dataclasses.dataclass(frozen=True)
class CompiledPipeline:
    """Every IR the passes made, for the runtime and for ``describe()``; ``meshes`` are the
    pipeline's meshes (``schedule.stage_mesh`` places each stage on one); ``durations`` are the
    cost model's task estimates the weight delays were chosen with (``simulate`` the schedule
    with them, or with measured ones, to predict a step). ``parts`` are each stage's parts as
    it runs them: traced at the micro-batch's size, or per replica for a stage run as replicas
    (``gradients.stages[s].replicas``). ``passes`` are the passes that ran, each with the state
    it returned (``ir_after``)."""

    graph: StageGraph
    split: StepSplit
    meshes: tuple[Mesh, ...]
    layout: StepLayout
    parts: tuple[StageParts, ...]
    schedule: PipelineSchedule
    program: PipelineProgram
    durations: TaskDurations
    micro_batching: MicroBatching
    moves: MoveTable
    micro_batch_size: int
    step: StepProgram
    kernels: tuple[StageKernel, ...]
    gradients: DataReplicas
    leaf_pieces: LeafPieces | None = None
    stacked_arrays: dict[int, StackedArray] = dataclasses.field(default_factory=dict)
    gathered_arrays: dict[int, GatheredArray] = dataclasses.field(default_factory=dict)
    launches: LaunchSequences | None = None
    passes: tuple[tuple[str, CompileState], ...] = dataclasses.field(default=(), repr=False, compare=False)

    @property
    def stage_meshes(self) -> tuple[Mesh, ...]:
        """Per stage, the mesh running it."""
        return tuple(self.meshes[m] for m in self.schedule.stage_mesh)

    def __str__(self) -> str:
        """The step program and each mesh's pipeline program, one line per instruction."""
        return program_text(self.step, self.program)

    @property
    def pass_names(self) -> tuple[str, ...]:
        """The passes that ran for this step, in order (``PIPELINE_PASSES`` less those that did not apply)."""
        return tuple(name for name, _ in self.passes)

    def ir_after(self, name: str) -> str:
        """The IR pass ``name`` made, as text: each field it sets (``Pass.makes``), as it stood
        right after the pass (like MLIR's ``--mlir-print-ir-after``).

        Raises:
          ValueError: ``name`` is not a pass that ran for this step (listing those that did).
        """
        found = [state for ran, state in self.passes if ran == name]
        if not found:
            raise ValueError(f"name: expected a pass that ran for this step, one of {list(self.pass_names)}; "
                             f"got {name!r}")
        (made,) = [p.makes for p in PIPELINE_PASSES if p.name == name]
        return "\n".join(f"// -----// IR after {name}: {field} //----- //\n{getattr(found[0], field)}"
                         for field in made)


def run_passes(state: CompileState, passes: Sequence[Pass] = PIPELINE_PASSES,
               observers: Mapping[str, Callable[[CompileState], None]] | None = None
               ) -> tuple[CompileState, tuple[tuple[str, CompileState], ...]]:
    """Runs each of ``passes`` that applies to ``state`` in order, each followed by its verifier;
    returns the last state and, per pass run, its name and the state it returned.
    ``observers`` maps a pass's name to a callback given the state that pass returned, once its
    verifier passed (as MLIR's pass instrumentation sees each pass's output): the caller starts
    work on an IR while the later passes still run.

    Raises:
      PlanVerificationError: naming the pass whose output a verifier refused.
      ValueError: an observer named for no pass of ``passes``, or not callable.
    """
    observers = observers or {}
    names = [p.name for p in passes]
    for name, observer in observers.items():
        if name not in names or not callable(observer):
            raise ValueError(f"observers: {name!r} -> {observer!r}: expected a callable for one of the passes "
                             f"{names}")
    ran = []
    for p in passes:
        if not p.when(state):
            continue
        state = p.run(state)
        try:
            p.verify(state)
        except PlanVerificationError as e:
            raise PlanVerificationError(f"after pass {p.name}: {e}") from e
        ran.append((p.name, state))
        if p.name in observers:
            observers[p.name](state)
    return state, tuple(ran)


@compiler_pass
def compile_pipeline(
    outer: jax_ir.ClosedJaxpr,
    grad_params: dict[str, Any],
    micro_batching: MicroBatching,
    leaves: Sequence[Any],
    specs: Sequence[P | None],
    batch_leaves: frozenset[int],
    counterparts: Sequence[int | None],
    devices: Sequence[Any],
    options: PipelineOptions,
    check_stages: Callable[[StageGraph], None] = lambda graph: None,
    replica_loss: Callable[[int], jax_ir.ClosedJaxpr] | None = None,
    observers: Mapping[str, Callable[[CompileState], None]] | None = None,
) -> CompiledPipeline:
    """Runs ``PIPELINE_PASSES`` (module doc) on a traced step ``outer`` (at the whole batch's
    shapes) whose gradient equation, traced per micro-batch, has ``grad_params``, combining
    micro-batches as ``micro_batching`` says; ``counterparts`` gives per step output leaf the
    input leaf it replaces in the state (``state_counterparts``), placed where that input lives;
    ``check_stages`` validates the stage graph against the user's options. ``replica_loss(D)``
    is the loss jaxpr traced at ``1 / D`` of a micro-batch (it may raise), for stages run as
    ``D`` data-parallel replicas (``data_replicas``); ``None``: every stage reduces per micro-batch."""
    start = CompileState(outer, grad_params, micro_batching, tuple(leaves), tuple(specs), batch_leaves,
                         tuple(counterparts), tuple(devices), options, check_stages, replica_loss,
                         user_specs=tuple(specs), leaf_avals=tuple(v.aval for v in outer.jaxpr.invars),
                         num_user_outputs=len(counterparts))
    st, ran = run_passes(start, observers=observers)
    return CompiledPipeline(st.graph, st.split, st.placed.meshes, st.layout, st.parts, st.schedule, st.program,
                            st.durations, st.micro_batching, st.moves, st.options.micro_batch_size, st.step,
                            st.kernels, st.gradients, st.pieces, st.held, st.gathered, st.launches, ran)


@compiler_pass
def layered_loss(loss: jax_ir.ClosedJaxpr, num_params: int, options: PipelineOptions) -> jax_ir.ClosedJaxpr:
    """``loss`` (whose first ``num_params`` inputs are parameters) with the stage markers the
    options add: ``auto_layers`` layers cut automatically (only at ``cut_points`` if given);
    or, for a stage count asked of a loss without markers, its layer scans cut into runs of
    equal length (``even_layer_markers``).
    Either splits a scan over layers where a cut falls inside it."""
    placement = options.placement
    if placement.auto_layers is not None:
        return insert_layer_markers(loss, placement.auto_layers, num_params, placement.cut_points)
    if (placement.num_stages or 1) > 1 and placement.cut_points is None and not any(
            e.primitive is stage_boundary_p for e in loss.jaxpr.eqns):
        return even_layer_markers(loss, placement.num_stages, num_params) or loss
    return loss


def _verify_layered(loss: jax_ir.ClosedJaxpr, layered: jax_ir.ClosedJaxpr) -> None:
    """``verify_split_scans`` where ``layered_loss`` split a scan (evaluating both is not free)."""
    def scans(jaxpr: jax_ir.ClosedJaxpr) -> int:
        return sum(e.primitive is scan_p for e in jaxpr.jaxpr.eqns)

    if scans(layered) != scans(loss):
        verify_split_scans(loss, layered)


def step_moves(transfers: Sequence[EdgeTransfer], layout: StepLayout) -> list[MoveKey]:
    """Every move of a step, in the order the runtime prepares them: the program's transfers,
    then parameter fetches, gradient moves and the moves around the pipeline."""
    value_moves = [op.fetch for ops in layout.stage_operands for op in ops if op.fetch]
    value_moves += [mv for moves in layout.gradient_moves for mv in moves if mv]
    value_moves += list(layout.outer_moves.values())
    return [t.move_key for t in transfers] + [v.move_key for v in value_moves]


def _is_batch_leaf(outer: jax_ir.ClosedJaxpr, k: int, graph: StageGraph, batch_leaves: frozenset[int]) -> bool:
    """Whether non-differentiated loss operand ``k`` is a batch input leaf itself (sliced on the
    host per micro-batch, never placed whole)."""
    (grad_eqn,) = [e for e in outer.jaxpr.eqns if e.primitive is pipeline_grad_p]
    v = grad_eqn.invars[graph.num_params + k]
    return v in outer.jaxpr.invars and outer.jaxpr.invars.index(v) in batch_leaves


def state_counterparts(in_tree: Any, out_tree: Any) -> list[int | None]:
    """Per step output leaf, the input leaf it replaces: the leaf at the same position of the
    state when the step's first argument and first output share a structure, else ``None``."""
    outs: list[int | None] = [None] * out_tree.num_leaves
    in_children, out_children = in_tree.children(), out_tree.children()
    if in_children and out_children and in_children[0] == out_children[0]:
        outs[:in_children[0].num_leaves] = range(in_children[0].num_leaves)
    return outs
