"""``mark_stage_boundary()``: where one pipeline stage ends and the next begins.

The marker is a primitive with no operands and no results
(``passes.step_primitives.stage_boundary_p``), kept in the traced program by
an effect, so it sits in the jaxpr exactly where the model called it. Outside ``meshpar.parallelize`` it does nothing: the model runs, jits and
differentiates as plain JAX.
"""

from __future__ import annotations

from meshpar.passes.pipeline.step_primitives import stage_boundary_p

__all__ = ["mark_stage_boundary"]


def mark_stage_boundary() -> None:
    """Ends the current pipeline stage; call it between layers of the model.

    ``n - 1`` calls split the forward pass into ``n`` stages. Calls must sit in
    straight-line code (not inside ``lax.scan``, ``cond`` or ``while``
    bodies), where a cut is well defined.
    """
    stage_boundary_p.bind()
