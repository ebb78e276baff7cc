"""Stages that hold no parameters and almost no compute: a cut that pipelines nothing.

A model that stacks its blocks in one ``scan`` (``nn.scan``, ``nnx.scan``, ``lax.scan``) is one
equation to the stage graph, so automatic cuts (``auto_layers``, ``num_stages="auto"``) can
only fall around it: one stage gets the whole stack and the others pass a few scalars on
(issue 23). Such a run is correct but no faster than one stage, so it is named, not hidden.
"""

from __future__ import annotations

import dataclasses

from ..simulation.cost_model import jaxpr_flops
from .stage_graph import StageGraph

__all__ = ["DEGENERATE_FLOPS_SHARE", "DegenerateStage", "degenerate_stages"]

# A stage below this share of the step's forward FLOPs, holding no parameter, does no work
# worth a mesh.
DEGENERATE_FLOPS_SHARE = 0.05


@dataclasses.dataclass(frozen=True)
class DegenerateStage:
    """Stage ``stage`` holds no parameter and ``flops_share`` (in [0, 1)) of the forward FLOPs."""

    stage: int
    flops_share: float

    def __str__(self) -> str:
        return (f"stage {self.stage} holds no parameters and {self.flops_share:.1%} of the forward FLOPs: "
                f"its mesh has nearly nothing to do (a stack of layers in one scan, nn.scan or lax.scan, "
                f"cannot be cut inside; cut between scans with meshpar.mark_stage_boundary(), or unroll it)")


def degenerate_stages(graph: StageGraph) -> tuple[DegenerateStage, ...]:
    """The stages of ``graph`` with no parameter input and under ``DEGENERATE_FLOPS_SHARE`` of the
    forward FLOPs (``jaxpr_flops`` of each stage's jaxpr); none for a one-stage graph."""
    if graph.num_stages == 1:
        return ()
    flops = [jaxpr_flops(s.jaxpr) for s in graph.stages]
    total = sum(flops)
    return tuple(DegenerateStage(s.index, f / total if total else 0.0) for s, f in zip(graph.stages, flops)
                 if not s.param_inputs and (f / total if total else 0.0) < DEGENERATE_FLOPS_SHARE)
