"""What a compiled pipeline does, in words: read from its IRs, planning nothing.

``describe_pipeline`` is what ``ParallelizedStep.get_executable(...).describe()`` returns: the
schedule, each stage's mesh and parameter shardings, every boundary move with its executor
and plan (``MoveTable``), how micro-batches combine, how each stage's gradients accumulate and
reduce (``data_replicas``), and what runs around the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import jax_ir
from ..compiler_pass import compiler_pass
from ..program.moves import Direction
from ..program.step_values import OuterKind, RefKind
from .cutting.step_split import OuterCompute, OuterMove

__all__ = ["describe_pipeline"]


@compiler_pass
def describe_pipeline(compiled: Any) -> str:
    """``compiled`` (a ``CompiledPipeline``) described line by line."""
    schedule, graph = compiled.schedule, compiled.graph
    split = ("no backward (a step without a gradient, e.g. evaluation)" if schedule.forward_only else
             "whole backwards" if not schedule.split_backward else
             "backwards split into input (I) and weight (W) passes, "
             + (f"weight passes delayed by {list(schedule.weight_delays)} compute tasks per mesh"
                if schedule.weight_delays is not None else "stage s holding back s weight passes"))
    per_mesh = schedule.num_stages // schedule.num_meshes
    placement = ("one stage per mesh" if per_mesh == 1 else
                 f"{per_mesh} stages per mesh, " + ", ".join(
                     f"mesh {m}: stages {[s for s in range(schedule.num_stages) if schedule.stage_mesh[s] == m]}"
                     for m in range(schedule.num_meshes)))
    lines = [f"pipeline: {graph.num_stages} stages on {schedule.num_meshes} meshes ({placement}), "
             f"{schedule.num_micro_batches} micro-batches of {compiled.micro_batch_size}, schedule {schedule.name}, "
             f"{split}"]
    for stage in graph.stages:
        home = schedule.stage_mesh[stage.index]
        mesh = compiled.meshes[home]
        specs = [sh.spec for sh in compiled.layout.grad_shardings[stage.index]]
        # A spec naming a size-1 axis leaves its dimension whole on every device: not sharded.
        split_over = [{a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)
                       if mesh.shape[a] > 1} for spec in specs]
        sharded = sum(1 for axes in split_over if axes)
        placed = (f"{sharded} sharded over {', '.join(map(repr, sorted(set().union(*split_over))))}, the rest replicated"
                  if sharded else "all replicated")
        others = [str(r) for r in stage.inputs if r.kind is not RefKind.PARAM]
        reads = (f"reads {', '.join(others) or 'nothing'}" if graph.forward_only else
                 f"{len(specs)} parameter leaves ({placed}); also reads {', '.join(others) or 'nothing else'}")
        lines.append(f"  stage {stage.index}: mesh {home} {dict(mesh.shape)} devices {[d.id for d in mesh.devices.flat]}; "
                     f"{reads}")
    edges = graph.edges()
    for t in compiled.program.transfers:
        how = compiled.moves.of(t.move_key).summary()
        what = "activation" if t.direction is Direction.ACTIVATION else "gradient"
        value = jax_ir.ShapedArray(t.shape, t.dtype).str_short()
        lines.append(f"  {what} {edges[t.edge][2]} {value} stage {t.src_stage} -> {t.dst_stage}: {how}")
    lines.append("  launch order (KIND STAGE.MICRO_BATCH; F forward, B backward, I and W its input and weight "
                 "halves; A and G: an activation sent down edge STAGE, its gradient sent back): "
                 + " ".join(map(str, schedule.order)))
    mb = compiled.micro_batching
    aux = ", ".join(f"aux{k} {r.value}" for k, r in enumerate(mb.aux))
    hoisted = f"{mb.whole_batch_values} value(s) of the batch alone computed once on the whole batch"
    if graph.forward_only:
        # No loss: each output combines by its own rule (sums of shares are exact, as for a loss).
        combine = f"the step's outputs, each as its aux rule says ({hoisted})"
    else:
        how = (f"exactly (each micro-batch's share of the whole batch's loss, summed; {hoisted})" if mb.exact else
               f"by {mb.reduction} (per micro-batch: each micro-batch a batch of its own)")
        combine = f"loss and gradients {how}"
    lines.append(f"  micro-batches combine: {combine}" + (f"; {aux}" if aux else "")
                 + (f"; {len(mb.fold_keys)} PRNG key(s) folded with the micro-batch index" if mb.fold_keys else ""))
    lines += [f"  not exact: {finding}" for finding in mb.inexact]
    lines += _marker_lines(compiled)
    lines += _gradient_lines(compiled)
    lines += _stacked_lines(compiled)
    for phase, steps in (("before the pipeline", compiled.split.before), ("after it", compiled.split.after)):
        computes = [st for st in steps if isinstance(st, OuterCompute)]
        moves = [st for st in steps if isinstance(st, OuterMove)]
        if not steps:
            continue
        lines.append(f"  {phase}: {len(computes)} computations on meshes {sorted({c.mesh for c in computes})}"
                     + "".join(f"; {_values_str(compiled.split, mv.values)} move{'s' * (len(mv.values) == 1)} "
                               f"mesh {mv.src} -> {mv.dst}" + (" packed into one transfer" if len(mv.values) > 1 else "")
                               for mv in moves))
    return "\n".join(lines)


def _values_str(split: Any, values: Sequence[Any]) -> str:
    """``values`` for a description: each one named as the step's author knows it
    (``_value_str``), or a count when there are many, with where they were computed when that
    is one place."""
    if len(values) <= 3:
        return ", ".join(_value_str(split, v) for v in values)
    origins = {split.origins.get(v) for v in values}
    common = f"; each computed at {origins.pop()}" if len(origins) == 1 and None not in origins else ""
    return f"{len(values)} values ({split.avals[values[0]].str_short()}, ...{common})"


def _value_str(split: Any, ref: Any) -> str:
    """A moved ``OuterRef`` of the step (a computed one: step inputs are placed, not moved) and
    its type, named for the step's author: the loss, an aux value or a gradient by its position,
    any other value by where the step's code computed it (its number among the traced step's
    values means nothing to the author)."""
    aval = split.avals[ref].str_short()
    if ref.kind is OuterKind.VALUE:
        return f"the {aval} computed at {split.origins[ref]}"
    name = {OuterKind.LOSS: "the loss", OuterKind.AUX: f"aux{ref.index}",
            OuterKind.GRAD: f"the gradient of differentiated leaf {ref.index}"}[ref.kind]
    return f"{name} {aval}"


def _marker_lines(compiled: Any) -> list[str]:
    """Which of the model's stage markers cut, where the compiler chose them (``marker_grouping``)."""
    grouping = compiled.graph.marker_grouping
    return [] if grouping is None else [f"  {grouping.summary()}"]


def _gradient_lines(compiled: Any) -> list[str]:
    """Per stage with parameters, how its gradients accumulate and where they are reduced."""
    lines = []
    for stage, g in zip(compiled.graph.stages, compiled.gradients.stages):
        if not g.accumulators:
            continue
        dtypes = sorted({str(a.dtype) for a in g.accumulators})
        if g.replicas is not None:
            how = (f"{g.replicas.count} data-parallel replicas over {g.replicas.axis!r}, each accumulating its "
                   f"own examples' partial sums; reduced once per step")
        elif g.per_micro_batch:
            how = f"reduced in every micro-batch's backward ({g.per_micro_batch})"
        else:
            how = "nothing to reduce (one device on the data axis)"
        lines.append(f"  gradients of stage {stage.index}: {how}; accumulated in {', '.join(dtypes)}")
    return lines


def _stacked_lines(compiled: Any) -> list[str]:
    """One line per way the stacked leaves split across stages are held."""
    pieces = compiled.leaf_pieces
    if pieces is None:
        return []
    lines = []
    for what, chosen in (("one array over the pieces' devices, no copy", compiled.stacked_arrays),
                         ("gathered on the first piece's mesh each step (moves)", compiled.gathered_arrays)):
        by_bounds: dict[tuple[int, ...], int] = {}
        for i in chosen:
            by_bounds[pieces.inputs[i]] = by_bounds.get(pieces.inputs[i], 0) + 1
        for bounds, count in sorted(by_bounds.items()):
            sizes = " + ".join(str(b - a) for a, b in zip(bounds, bounds[1:]))
            lines.append(f"  stacked leaves: {count} split {sizes} along axis 0, one piece per stage; "
                         f"returned as {what}")
    return lines
