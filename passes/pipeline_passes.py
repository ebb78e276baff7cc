"""The pipeline compiler: one visible list of passes, each followed by its IR's verifier.

``compile_pipeline`` runs, in order:

1. ``split_stages``: the loss jaxpr cut at stage markers -> ``StageGraph``;
2. ``split_step``: the rest of the step (values the loss reads, the update) per
   mesh, with the moves between meshes -> ``StepSplit``;
3. ``assign_stage_meshes``: one device mesh per stage;
4. ``layout_step``: where every value lives -> ``StepLayout``;
5. ``stage_parts``: each stage's forward, backward and split backward jaxprs;
6. ``plan_edge_transfers``: how each boundary value moves, both ways;
7. ``estimate_durations`` and ``weight_delays``: task durations from the cost
   model, and each stage's weight-pass delay chosen by simulating the
   schedule with them (``schedule_simulator``);
8. ``make_schedule``: the typed tasks and the networkx dependency graph
   (checked acyclic) -> ``PipelineSchedule``;
9. ``lower_to_program``: per-mesh instructions over typed buffers ->
   ``PipelineProgram``.

Like XLA's ``HloPassPipeline``, a verifier failure names the pass whose
output broke the invariant.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from jax._src import core
from jax.sharding import Mesh, PartitionSpec as P

from .cost_model import estimate_durations
from .edge_transfer import TransferKind, plan_edge_transfers
from .mesh_assignment import assign_stage_meshes
from .pipeline_program import PipelineProgram, lower_to_program, stage_io, verify_pipeline_program
from .pipeline_schedule import PipelineSchedule, make_schedule, verify_schedule
from .schedule_simulator import TaskDurations
from .layer_clustering import insert_layer_markers
from .stage_graph import Ref, RefKind, StageGraph, split_stages, verify_stage_graph
from .micro_batching import MicroBatching
from .stage_parts import StageParts, stage_parts, verify_stage_parts
from .step_layout import StepLayout, layout_step
from .step_primitives import pipeline_grad_p
from .step_split import StepSplit, split_step, verify_step_split
from .wire_format import wire_aval
from .unit_tasks import PlanVerificationError
from .weight_delay import weight_delays

__all__ = ["PipelineOptions", "CompiledPipeline", "compile_pipeline", "state_counterparts"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """What the user chose (``meshpar.PipeshardParallel``), as the passes need it."""

    num_micro_batches: int
    micro_batch_size: int
    schedule: str
    weight_delay: bool | str
    executor: str
    resharding: str
    stage_meshes: Sequence[Mesh] | None
    stage_mesh_shape: tuple[int, int] | None
    inter_host_bandwidth: float
    intra_host_bandwidth: float
    data_axis: str
    model_axis: str
    cut_points: tuple[int, ...] | None = None
    auto_layers: int | None = None


@dataclasses.dataclass(frozen=True)
class CompiledPipeline:
    """Every IR the passes made, for the runtime and for ``describe()``; ``durations`` are the
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


def _run(name: str, make: Callable[[], T], verify: Callable[[T], None]) -> T:
    result = make()
    try:
        verify(result)
    except PlanVerificationError as e:
        raise PlanVerificationError(f"after pass {name}: {e}") from e
    return result


def compile_pipeline(
    outer: core.ClosedJaxpr,
    grad_params: dict[str, Any],
    micro_batching: MicroBatching,
    leaves: Sequence[Any],
    specs: Sequence[P | None],
    batch_leaves: frozenset[int],
    counterparts: Sequence[int | None],
    devices: Sequence[Any],
    options: PipelineOptions,
    check_stages: Callable[[StageGraph], None] = lambda graph: None,
) -> CompiledPipeline:
    """Runs the passes (module doc) on a traced step ``outer`` (at the whole batch's shapes) whose
    gradient equation, traced per micro-batch, has ``grad_params``, combining micro-batches as
    ``micro_batching`` says; ``counterparts`` gives per step output leaf the input leaf it replaces
    in the state (``state_counterparts``), placed where that input lives; ``check_stages``
    validates the stage graph against the user's options."""
    loss = grad_params["loss_jaxpr"]
    if options.auto_layers is not None:
        loss = insert_layer_markers(loss, options.auto_layers)
    graph = _run("split_stages", lambda: split_stages(loss, grad_params["num_diff"], options.cut_points), verify_stage_graph)
    check_stages(graph)
    S = graph.num_stages
    axis_names = (options.data_axis, options.model_axis)
    meshes = tuple(assign_stage_meshes(list(devices), S, options.stage_meshes, options.stage_mesh_shape, axis_names))
    for mesh in meshes:
        data = mesh.shape.get(options.data_axis, 1)
        if options.micro_batch_size % data:
            raise ValueError(
                f"num_micro_batches: micro-batches of {options.micro_batch_size} examples do not split over "
                f"the {data}-way {options.data_axis!r} axis (data_axis) of the stage meshes; pass "
                f"num_micro_batches so that batch / num_micro_batches is a multiple of {data}"
            )
    readers = [graph.consumers(Ref(RefKind.INPUT, k)) for k in range(graph.num_inputs)]
    split = _run("split_step", lambda: split_step(
        outer, graph.param_owner, graph.loss.index, [r.index for r in graph.aux], S,
        [() if per_mb and _is_batch_leaf(outer, k, graph, batch_leaves) else r
         for k, (r, per_mb) in enumerate(zip(readers, micro_batching.per_micro_batch))],
        counterparts), lambda sp: verify_step_split(sp, S))
    layout = layout_step(graph, split, meshes, leaves, specs, batch_leaves, options.micro_batch_size,
                         counterparts, options.executor, options.resharding,
                         micro_batching.per_micro_batch, micro_batching.fold_keys, axis_names=axis_names)
    parts = tuple(
        _run(f"stage_parts (stage {s.index})", lambda s=s: stage_parts(s, graph.differentiated_slots(s.index)), lambda p, s=s: verify_stage_parts(s, p))
        for s in graph.stages
    )
    edges = graph.edges()
    transfers = plan_edge_transfers(
        [(p, c, ref.slot) for p, c, ref in edges],
        [wire_aval(graph.stages[p].jaxpr.out_avals[ref.slot]) for p, _, ref in edges],
        meshes, options.micro_batch_size, options.executor, options.resharding, options.data_axis,
    )
    schedule_edges = [(p, c) for p, c, _ in edges]
    durations = estimate_durations(parts, meshes, transfers, len(edges), options.inter_host_bandwidth,
                                   options.intra_host_bandwidth)
    # A collective program holds both meshes; any other move runs beside their compute.
    overlap = not all(t.kind is TransferKind.COLLECTIVE for t in transfers)
    delays = weight_delays(options.weight_delay, options.schedule, options.num_micro_batches, schedule_edges,
                           durations, overlap)
    schedule = _run("make_schedule", lambda: make_schedule(
        options.schedule, S, options.num_micro_batches, schedule_edges, delays), verify_schedule)
    ios = stage_io(
        S,
        [(p, c, ref.slot, [r for r in graph.stages[c].inputs if r.kind is RefKind.ACT].index(ref)) for p, c, ref in edges],
        (graph.loss.index, graph.loss.slot),
        [len(s.outputs) for s in graph.stages],
        [(r.index, r.slot) for r in graph.aux],
        frozenset(e for e, (p, _, ref) in enumerate(edges)
                  if ref.slot not in graph.differentiated_slots(p)),
    )
    program = _run("lower_to_program", lambda: lower_to_program(schedule, ios, transfers), verify_pipeline_program)
    return CompiledPipeline(graph, split, meshes, layout, parts, schedule, program, durations, micro_batching)


def _is_batch_leaf(outer: core.ClosedJaxpr, k: int, graph: StageGraph, batch_leaves: frozenset[int]) -> bool:
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
