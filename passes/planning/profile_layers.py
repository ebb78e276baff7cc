"""Pass: profile a traced loss layer by layer, where layers are the spans between its stage
markers (every marker a candidate cut point), for the automatic planners.

Per layer, from the jaxprs alone (nothing runs): forward FLOPs and operations
(``cost_model.jaxpr_flops``, ``jaxpr_ops``),
the bytes of the parameters it owns (the first layer reading a parameter owns it), the bytes
its backward keeps alive (the residuals of ``stage_parts``' forward), the values crossing to
later layers, and the bytes a Megatron-style tensor-parallel layer all-reduces (two of its
output per forward, for layers whose parameters are partitioned over the model axis). Figures
that scale with the batch are divided by the traced micro-batch size: per example.

``profile_loss`` is what the planners read of a step: its traced loss cut into layers (at its
markers, or automatically where it has none) and profiled so.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import jax_ir
from ..pipeline.cutting.jaxpr_flops import jaxpr_flops, jaxpr_ops
from ..pipeline.cutting.layer_clustering import insert_layer_markers, max_layers
from ..pipeline.cutting.stage_graph import StageGraph, count_markers, split_stages
from ..pipeline.cutting.stage_parts import stage_parts
from ..program.step_values import RefKind
from .layer_profile import CrossingValue, LayerProfile, ModelProfile

__all__ = ["AUTO_LAYERS", "profile_layers", "profile_loss"]

# Layers a loss without stage markers is cut into for planning.
AUTO_LAYERS = 8


def _bytes(aval: jax_ir.AbstractValue) -> float:
    return float(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize


def profile_layers(
    graph: StageGraph,
    micro_batch_size: int,
    batch_size: int,
    model_sharded: Sequence[bool],
    optimizer_factor: float = 2.0,
    name: str = "model",
    auto_layers: int | None = None,
) -> ModelProfile:
    """The ``ModelProfile`` of a loss cut at every marker (``graph``: one stage per layer).

    Args:
      graph: ``split_stages`` of the loss traced at ``micro_batch_size`` examples.
      batch_size: the step's whole batch.
      model_sharded: per parameter leaf, whether its flax partitioning names the model axis.
      optimizer_factor: optimizer-state bytes per parameter byte (Adam's two moments: 2).
      name: for reports.
      auto_layers: set when ``graph``'s markers were inserted by ``passes.layer_clustering``.
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size: expected a positive integer, got {micro_batch_size!r}")
    owners: dict[int, int] = {}
    for stage in graph.stages:
        for k in stage.param_inputs:
            owners.setdefault(k, stage.index)
    layers = []
    for stage in graph.stages:
        parts = stage_parts(stage, graph.differentiated_slots(stage.index))
        params = [a for r, a in zip(stage.inputs, stage.jaxpr.in_avals)
                  if r.kind is RefKind.PARAM and owners[r.index] == stage.index]
        param_bytes = sum(map(_bytes, params))
        residuals = parts.forward.out_avals[parts.num_outputs:]
        outputs = [a for r, a in zip(stage.outputs, stage.jaxpr.out_avals) if graph.consumers(r)]
        out_bytes = sum(map(_bytes, outputs)) / micro_batch_size
        sharded = any(model_sharded[r.index] for r in stage.inputs if r.kind is RefKind.PARAM)
        layers.append(LayerProfile(
            flops=jaxpr_flops(stage.jaxpr) / micro_batch_size,
            param_bytes=param_bytes,
            optimizer_bytes=optimizer_factor * param_bytes,
            activation_bytes=sum(map(_bytes, residuals)) / micro_batch_size,
            boundary_bytes=_crossing_bytes(graph, stage.index) / micro_batch_size,
            tp_bytes=2.0 * out_bytes if sharded else 0.0,
            num_ops=jaxpr_ops(stage.jaxpr),
            splits_over_model=sharded,
        ))
    values = tuple(
        CrossingValue(stage.index, graph.consumers(ref), _bytes(aval) / micro_batch_size)
        for stage in graph.stages for ref, aval in zip(stage.outputs, stage.jaxpr.out_avals) if graph.consumers(ref)
    )
    return ModelProfile(tuple(layers), batch_size, name, values, auto_layers)


def _crossing_bytes(graph: StageGraph, cut_after: int) -> float:
    """Bytes of every value computed at or before layer ``cut_after`` and read after it."""
    total = 0.0
    for stage in graph.stages[:cut_after + 1]:
        for ref, aval in zip(stage.outputs, stage.jaxpr.out_avals):
            if any(c > cut_after for c in graph.consumers(ref)):
                total += _bytes(aval)
    return total


def profile_loss(loss: jax_ir.ClosedJaxpr, num_params: int, batch_size: int, model_sharded: Sequence[bool],
                 name: str = "model", num_layers: int = AUTO_LAYERS) -> ModelProfile:
    """The ``ModelProfile`` of a step's ``loss`` traced at its whole batch of ``batch_size``
    examples (its first ``num_params`` inputs the parameters, ``model_sharded`` as for
    ``profile_layers``): its layers between its stage markers, or, when it has none,
    ``num_layers`` layers cut automatically (``layer_clustering``; fewer if the loss has fewer
    equations with FLOPs)."""
    auto = None
    if count_markers(loss) == 0:
        auto = min(num_layers, max_layers(loss, num_params))
        loss = insert_layer_markers(loss, auto, num_params)
    graph = split_stages(loss, num_params)
    return profile_layers(graph, batch_size, batch_size, model_sharded, name=name, auto_layers=auto)
