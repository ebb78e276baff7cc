"""``mark_stage_boundary()``: where one pipeline stage ends and the next begins.

The marker is a primitive with no operands and no results
(``passes.step_primitives.stage_boundary_p``), kept in the traced program by
an effect, so it sits in the jaxpr exactly where the model called it. Outside
``meshpar.parallelize`` (and the planner) it binds nothing: the model runs, jits and
differentiates as plain JAX, at plain JAX's speed (a jitted program with an effect loses
JAX's C++ dispatch: about a millisecond a call for a small GPT on a CPU).
"""

from __future__ import annotations

from meshpar.autodiff import is_tracing_pipeline
from meshpar.passes.pipeline.step_primitives import stage_boundary_p

__all__ = ["mark_stage_boundary"]


def mark_stage_boundary() -> None:
    """Ends the current pipeline stage; call it between layers of the model.

    ``n - 1`` calls split the forward pass into ``n`` stages. Calls must sit in
    straight-line code (not inside ``lax.scan``, ``cond`` or ``while``
    bodies), where a cut is well defined.
    """
    if is_tracing_pipeline():
        stage_boundary_p.bind()
