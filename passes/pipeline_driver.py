"""The pipeline compiler: one visible list of passes, each followed by its IR's verifier.

``compile_pipeline`` runs, in order (each IR checked by its verifier right after the
pass that made it):

0. for a step without a gradient (``forward_step``: an evaluation step), ``forward_operands``:
   its parameters made plain operands, and the schedule the forward-only one with the user's
   schedule's placement; the stage graph is then ``forward_only`` (no value has a cotangent,
   no backward runs, no cotangent moves);

1. ``split_layer_scans`` and ``split_stages``: markers the options add (``auto_layers``; a
   stage count for a loss without markers), a scan over layers split where a cut falls
   inside it (verified equal to the original on random inputs), then the loss jaxpr cut at
   stage markers -> ``StageGraph``;
2. ``place_stages``: the device meshes, and each stage placed on one as the
   schedule places them (a mesh may host several: virtual stages) ->
   ``StageMeshMap``;
3. ``split_step``: the rest of the step (values the loss reads, the update) per
   mesh, with the moves between meshes -> ``StepSplit``;
4. ``layout_step``: where every value lives -> ``StepLayout``;
5. ``stage_parts``: each stage's forward, backward and split backward jaxprs;
   ``plan_data_replicas``: how each stage's parameter gradients accumulate and reduce
   (once per step: the stage run as data-parallel replicas) -> ``DataReplicas``;
6. ``plan_edge_transfers``: how each boundary value moves, both ways ->
   ``EdgeTransfer``s (``LOCAL`` between stages on one mesh);
7. ``plan_moves``: every value crossing meshes (boundary values, parameter
   fetches, gradients, the moves around the pipeline) planned, lowered by its
   executor and verified -> ``MoveTable``;
8. ``estimate_durations`` and ``weight_delays``: task durations from the cost
   model (each stage's gradient reduction priced as ``plan_data_replicas`` runs it),
   and each mesh's weight-pass delay chosen by simulating the schedule with them
   (``schedule_simulator``);
9. ``make_schedule``: the typed tasks per mesh and the networkx dependency
   graph (checked acyclic) -> ``PipelineSchedule``;
10. ``lower_to_program``: per-mesh instructions over typed buffers, each mesh's
    gradient reduction among them -> ``PipelineProgram``;
11. ``lower_step``: the whole step around it (inputs placed, the work before and
    after the pipeline, micro-batches combined, gradients reduced on their
    owners' meshes, outputs assembled) -> ``StepProgram``;
12. ``launch_sequences``: per process, the programs it launches on each mesh and the
    cross-process transfers it numbers -> ``LaunchSequences``, whose verifier refuses a
    step whose processes would launch a mesh's programs, or number a transfer, differently
    (a deadlock).

Like XLA's ``HloPassPipeline``, a verifier failure names the pass whose
output broke the invariant.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jax.extend.core.primitives import scan_p
from jax.sharding import Mesh, PartitionSpec as P

from .compiler_pass import compiler_pass
from . import jax_ir
from .simulation.cost_model import estimate_durations, stage_gradients
from .pipeline.placing.batch_rows import (global_batch_feeds, global_batch_placements, verify_global_batch_feeds,
                                         verify_global_batch_placements)
from .pipeline.placing.edge_transfer import EdgeTransfer, TransferKind, plan_edge_transfers, verify_edge_transfers
from .pipeline.placing.mesh_assignment import place_stages
from .pipeline.pipeline_options import PipelineOptions
from .pipeline.placing.plan_moves import MoveKey, MoveOptions, MoveTable, plan_moves, verify_move_table
from .pipeline.lowering.pipeline_program import PipelineProgram, lower_to_program, stage_io, verify_pipeline_program
from .pipeline.scheduling.pipeline_schedule import (PipelineSchedule, forward_only_schedule, make_schedule,
                                                     verify_schedule)
from .simulation.schedule_simulator import TaskDurations
from .pipeline.cutting.layer_clustering import even_layer_markers, insert_layer_markers
from .pipeline.cutting.marker_grouping import group_markers, verify_marker_grouping
from .pipeline.cutting.stage_graph import Ref, RefKind, StageGraph, split_stages, verify_stage_graph
from .pipeline.cutting.degenerate_stages import degenerate_stages
from .pipeline.cutting.forward_step import forward_operands, verify_forward_operands
from .pipeline.placing.data_replicas import DataReplicas, plan_data_replicas, verify_data_replicas
from .pipeline.placing.drop_mesh_axis import drop_mesh_axis
from .pipeline.cutting.micro_batching import MicroBatching
from .pipeline.lowering.stage_kernels import StageKernel, stage_kernels, verify_stage_kernels
from .pipeline.cutting.stage_parts import StageParts, stage_parts, verify_stage_parts
from .pipeline.lowering.fused_runs import fuse_compute_runs
from .pipeline.placing.step_layout import StepLayout, layout_step, verify_step_layout
from .pipeline.step_primitives import pipeline_grad_p, stage_boundary_p
from .pipeline.lowering.step_program import StepProgram, lower_step, verify_step_program
from .pipeline.lowering.launch_sequences import LaunchSequences, launch_sequences, verify_launch_sequences
from .pipeline.cutting.split_scans import verify_split_scans
from .pipeline.placing.stacked_leaves import (GatheredArray, LeafPieces, StackedArray, gathered_arrays,
                                              split_stacked_leaves, stacked_arrays, stacked_params, take_pieces,
                                              verify_leaf_pieces)
from .pipeline.cutting.step_split import StepSplit, split_step, verify_step_split
from .pipeline.placing.wire_format import wire_aval
from .verification import PlanVerificationError
from .simulation.weight_delay import weight_delays

__all__ = ["PipelineOptions", "CompiledPipeline", "compile_pipeline", "state_counterparts"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class CompiledPipeline:
    """Every IR the passes made, for the runtime and for ``describe()``; ``meshes`` are the
    pipeline's meshes (``schedule.stage_mesh`` places each stage on one); ``durations`` are the
    cost model's task estimates the weight delays were chosen with (``simulate`` the schedule
    with them, or with measured ones, to predict a step)."""

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

    @property
    def stage_meshes(self) -> tuple[Mesh, ...]:
        """Per stage, the mesh running it."""
        return tuple(self.meshes[m] for m in self.schedule.stage_mesh)


def _run(name: str, make: Callable[[], T], verify: Callable[[T], None]) -> T:
    result = make()
    try:
        verify(result)
    except PlanVerificationError as e:
        raise PlanVerificationError(f"after pass {name}: {e}") from e
    return result


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
) -> CompiledPipeline:
    """Runs the passes (module doc) on a traced step ``outer`` (at the whole batch's shapes) whose
    gradient equation, traced per micro-batch, has ``grad_params``, combining micro-batches as
    ``micro_batching`` says; ``counterparts`` gives per step output leaf the input leaf it replaces
    in the state (``state_counterparts``), placed where that input lives; ``check_stages``
    validates the stage graph against the user's options. ``replica_loss(D)`` is the loss jaxpr
    traced at ``1 / D`` of a micro-batch (it may raise), for stages run as ``D`` data-parallel
    replicas (``data_replicas``); ``None``: every stage reduces per micro-batch."""

    # A step without a gradient (forward_step) runs forwards only, each stage on the mesh the
    # train schedule gives it, so its parameters are where a train step keeps them.
    forward_only = bool(grad_params.get("forward_only"))
    if forward_only:
        outer, grad_params, micro_batching = _run(
            "forward_operands", lambda: forward_operands(outer, grad_params, micro_batching),
            lambda result: verify_forward_operands(*result))
        options = dataclasses.replace(options, schedule=dataclasses.replace(
            options.schedule, kind=forward_only_schedule(options.schedule.kind), weight_delay=False))
    num_diff = grad_params["num_diff"]

    def layered(loss: jax_ir.ClosedJaxpr) -> jax_ir.ClosedJaxpr:
        return _run("split_layer_scans", lambda: layered_loss(loss, num_diff, options),
                    lambda result: _verify_layered(loss, result))

    loss = layered(grad_params["loss_jaxpr"])
    # Stacked parameters read in slices by several stages live as those slices.
    stacked = stacked_params(loss, num_diff)
    pieces, leaf_avals = None, [v.aval for v in outer.jaxpr.invars]
    if stacked:
        outer, pieces, stacked = _run("split_stacked_leaves", lambda: split_stacked_leaves(outer, stacked, counterparts),
                                      lambda result: verify_leaf_pieces(result[1], len(leaves), len(counterparts)))
    num_params = num_diff + sum(len(b) - 2 for b in stacked.values())

    # With automatic layers, cut_points chose which of their cuts were made.
    cut_points = None if options.placement.auto_layers is not None else options.placement.cut_points
    grouping = None
    if cut_points is None and options.placement.auto_layers is None:
        # More markers than num_stages - 1: the compiler chooses which cut.
        grouping = _run("group_markers", lambda: group_markers(loss, options.placement.num_stages),
                        lambda g: verify_marker_grouping(g, loss, options.placement.num_stages))
        cut_points = None if grouping is None else grouping.cut_points

    def cut(loss: jax_ir.ClosedJaxpr) -> StageGraph:
        graph = split_stages(take_pieces(loss, num_diff, stacked), num_params, cut_points)
        return dataclasses.replace(graph, marker_grouping=grouping, forward_only=forward_only)

    def replica_graph(count: int) -> StageGraph:
        if replica_loss is None:
            raise ValueError("the step was not traced per replica")
        replica = layered(drop_mesh_axis(replica_loss(count), options.placement.data_axis))
        found = stacked_params(replica, num_diff)
        if any(found.get(k) != b for k, b in stacked.items()):
            raise ValueError("traced per replica, its scans over layers are cut elsewhere")
        return cut(replica)

    graph = _run("split_stages", lambda: cut(loss), verify_stage_graph)
    check_stages(graph)
    degenerate = degenerate_stages(graph)
    if degenerate and options.placement.num_stages is not None:
        raise ValueError(f"num_stages: {options.placement.num_stages} stages asked for, but "
                         + "; ".join(map(str, degenerate)))
    for stage in degenerate:
        warnings.warn(f"meshpar: {stage}", stacklevel=2)
    S = graph.num_stages
    axis_names = (options.placement.data_axis, options.placement.model_axis)
    placed = place_stages(list(devices), S, options.schedule.kind, options.schedule.num_micro_batches,
                          options.placement.stage_meshes, options.placement.stage_mesh_shape,
                          options.placement.stages_per_mesh, axis_names)
    meshes, home, num_meshes = placed.meshes, placed.stage_mesh, len(placed.meshes)
    user_specs = specs
    if pieces is not None:
        leaves, specs, batch_leaves, counterparts = pieces.piece_leaves(leaves, leaf_avals, specs, batch_leaves,
                                                                        counterparts)
    for mesh in meshes:
        data = mesh.shape.get(options.placement.data_axis, 1)
        if options.micro_batch_size % data:
            raise ValueError(
                f"num_micro_batches: micro-batches of {options.micro_batch_size} examples do not split over "
                f"the {data}-way {options.placement.data_axis!r} axis (data_axis) of the stage meshes; pass "
                f"num_micro_batches so that batch / num_micro_batches is a multiple of {data}"
            )
    # Around the pipeline values live on meshes: the stages' indices mapped through the map.
    readers = [sorted({home[s] for s in graph.consumers(Ref(RefKind.INPUT, k))}) for k in range(graph.num_inputs)]
    split = _run("split_step", lambda: split_step(
        outer, lambda k: home[graph.param_owner(k)], home[graph.loss.index], [home[r.index] for r in graph.aux], num_meshes,
        [() if per_mb and _is_batch_leaf(outer, k, graph, batch_leaves) else r
         for k, (r, per_mb) in enumerate(zip(readers, micro_batching.per_micro_batch))],
        counterparts), lambda sp: verify_step_split(sp, num_meshes))
    layout = _run("layout_step", lambda: layout_step(
        graph, split, meshes, home, leaves, specs, batch_leaves, options.micro_batch_size, counterparts,
        options.transfers.executor, micro_batching.per_micro_batch,
        micro_batching.fold_keys, axis_names=axis_names), lambda lay: verify_step_layout(lay, split, meshes, home))
    held: dict[int, StackedArray] = {}
    gathered: dict[int, GatheredArray] = {}
    if pieces is not None:
        # How the user sees each split leaf, from where the layout put its pieces.
        at = {key: n for n, key in enumerate(pieces.piece_inputs())}
        piece_shardings = {i: [layout.in_placements[at[(i, p)]].shardings[0] for p in range(len(bounds) - 1)]
                           for i, bounds in enumerate(pieces.inputs) if bounds is not None}
        held = stacked_arrays(pieces, piece_shardings)
        rest = {i: s for i, s in piece_shardings.items() if i not in held}
        gathered = gathered_arrays(pieces, rest, {i: leaf_avals[i].shape for i in rest},
                                   {i: leaf_avals[i].dtype for i in rest}, {i: user_specs[i] for i in rest}, axis_names,
                                   options.transfers.executor)
    parts = tuple(
        _run(f"stage_parts (stage {s.index})", lambda s=s: stage_parts(s, graph.differentiated_slots(s.index)), lambda p, s=s: verify_stage_parts(s, p))
        for s in graph.stages
    )
    gradients = _run("plan_data_replicas", lambda: plan_data_replicas(
        graph, parts, layout, meshes, home, micro_batching, options.gradients, options.placement.data_axis,
        replica_graph), lambda plan: verify_data_replicas(plan, graph, meshes, home))
    edges = graph.edges()
    triples = [(p, c, ref.slot) for p, c, ref in edges]
    transfers = _run("plan_edge_transfers", lambda: plan_edge_transfers(
        triples, [wire_aval(graph.stages[p].jaxpr.out_avals[ref.slot]) for p, _, ref in edges],
        placed.stage_meshes, options.micro_batch_size, options.transfers.executor, options.placement.data_axis,
        graph.forward_only),
        lambda ts: verify_edge_transfers(ts, triples, placed.stage_meshes))
    M = options.schedule.num_micro_batches
    feeds = _run("global_batch_feeds", lambda: global_batch_feeds(layout, leaves, M),
                 lambda fs: verify_global_batch_feeds(fs, layout, M))
    # A global batch leaf the work around the pipeline reads whole: moved there, never fetched.
    batch_placements = _run("global_batch_placements", lambda: global_batch_placements(layout, leaves, batch_leaves),
                            lambda ps: verify_global_batch_placements(ps, layout, leaves, batch_leaves))
    keys = (step_moves(transfers, layout) + [mv.move_key for g in gathered.values() for mv in g.moves()]
            + [key for feed in feeds for key in feed.moves] + [key for p in batch_placements for key in p.moves])
    transfer_options = options.transfers
    moves = _run("plan_moves", lambda: plan_moves(keys, MoveOptions(
        transfer_options.strategy, transfer_options.balancer, transfer_options.cluster)),
        lambda table: verify_move_table(table, keys))
    schedule_edges = [(p, c) for p, c, _ in edges]
    inter, intra = options.transfers.inter_host_bandwidth, options.transfers.intra_host_bandwidth
    reductions = stage_gradients(gradients.stages, meshes, home, options.placement.data_axis, inter, intra)
    durations = estimate_durations(parts, placed.stage_meshes, transfers, len(edges), inter, intra,
                                   gradients=reductions)
    # A collective program holds both meshes; any other move runs beside their compute.
    overlap = not all(t.kind is TransferKind.COLLECTIVE for t in transfers)
    delays = weight_delays(options.schedule.weight_delay, options.schedule.kind, options.schedule.num_micro_batches,
                           schedule_edges, durations, overlap, num_meshes)
    schedule = _run("make_schedule", lambda: make_schedule(
        options.schedule.kind, S, options.schedule.num_micro_batches, schedule_edges, delays, num_meshes),
        verify_schedule)
    if schedule.stage_mesh != placed.stage_mesh:
        raise PlanVerificationError(f"after pass make_schedule: the schedule places stages on meshes "
                                    f"{schedule.stage_mesh}, the mesh map on {placed.stage_mesh}")
    ios = stage_io(
        S,
        [(p, c, ref.slot, [r for r in graph.stages[c].inputs if r.kind is RefKind.ACT].index(ref)) for p, c, ref in edges],
        (graph.loss.index, graph.loss.slot),
        [len(s.outputs) for s in graph.stages],
        [(r.index, r.slot) for r in graph.aux],
        frozenset(e for e, (p, _, ref) in enumerate(edges)
                  if ref.slot not in graph.differentiated_slots(p)),
    )
    reduced = gradients.reduced_stages()
    program = _run("lower_to_program", lambda: lower_to_program(schedule, ios, transfers, reduced),
                   lambda p: verify_pipeline_program(p, reduced))
    if options.schedule.fuse_compute != 1:
        unfused = program
        program = _run("fuse_compute_runs", lambda: fuse_compute_runs(unfused, options.schedule.fuse_compute),
                       lambda p: verify_pipeline_program(p, reduced))
    step = _run("lower_step", lambda: lower_step(graph, split, layout, program, micro_batching, meshes, gradients,
                                                 options.micro_batch_size, pieces, held, gathered, feeds,
                                                 batch_placements),
                lambda sp: verify_step_program(sp, split, graph, program))
    # Every process's launches, computed alike on every process: checked before the first step.
    launches = _run("launch_sequences", lambda: launch_sequences(step, program, moves, meshes),
                    verify_launch_sequences)
    kernels = _run("stage_kernels", lambda: stage_kernels(graph, parts, program, layout, meshes,
                                                          micro_batching.loss_seed, gradients),
                   lambda ks: verify_stage_kernels(ks, program))
    return CompiledPipeline(graph, split, meshes, layout, parts, schedule, program, durations, micro_batching, moves,
                            options.micro_batch_size, step, kernels, gradients, pieces, held, gathered,
                            launches)


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
