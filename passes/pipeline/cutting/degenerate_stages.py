"""Stages that hold no parameters and almost no compute: a cut that pipelines nothing.

A model that loops over its blocks in a way meshpar cannot cut inside (a ``fori_loop`` or
``while`` over layers; a scan that indexes the stacked parameters itself instead of scanning
over them, which ``split_scans`` would split) is one equation to the stage graph, so cuts can
only fall around it: one stage gets the whole stack and the others pass a few scalars on.
Such a run is correct but no faster than one stage: the compiler names it with a warning, or
an error where the user asked for that stage count (``num_stages``).
"""

from __future__ import annotations

import dataclasses

from .jaxpr_flops import jaxpr_flops
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
                f"its mesh has nearly nothing to do. The likely cause: a stack of layers meshpar cannot cut "
                f"inside, a loop over layers that is no scan over their stacked parameters (a fori_loop or "
                f"while loop, or a scan indexing the stack itself); scan over the stacked parameters (nn.scan, "
                f"nnx.scan, lax.scan), mark where stages end with meshpar.mark_stage_boundary(), or ask for "
                f"fewer stages")


def degenerate_stages(graph: StageGraph) -> tuple[DegenerateStage, ...]:
    """The stages of ``graph`` with no parameter input and under ``DEGENERATE_FLOPS_SHARE`` of the
    forward FLOPs (``jaxpr_flops`` of each stage's jaxpr); none for a one-stage graph."""
    if graph.num_stages == 1:
        return ()
    flops = [jaxpr_flops(s.jaxpr) for s in graph.stages]
    total = sum(flops)
    return tuple(DegenerateStage(s.index, f / total if total else 0.0) for s, f in zip(graph.stages, flops)
                 if not s.param_inputs and (f / total if total else 0.0) < DEGENERATE_FLOPS_SHARE)
