"""``mark_stage_boundary()``: where one pipeline stage ends and the next begins.

The marker is a primitive with no operands and no results, kept in the traced
program by an effect, so it sits in the jaxpr exactly where the model called
it. Outside ``meshpar.parallelize`` it does nothing: the model runs, jits and
differentiates as plain JAX.
"""

from __future__ import annotations

from jax._src import core, effects
from jax._src.interpreters import ad, batching, mlir

__all__ = ["mark_stage_boundary", "stage_boundary_p", "StageBoundaryEffect"]


class StageBoundaryEffect(effects.Effect):
    """Keeps the marker in jaxprs although it computes nothing."""

    __str__ = lambda self: "StageBoundary"  # noqa: E731


_EFFECT = StageBoundaryEffect()
for _set in (
    effects.lowerable_effects,
    effects.control_flow_allowed_effects,  # so meshpar, not JAX, reports a marker inside scan/cond
    effects.remat_allowed_effects,
    effects.custom_derivatives_allowed_effects,
    effects.partial_eval_kept_effects,
):
    _set.add_type(StageBoundaryEffect)

stage_boundary_p = core.Primitive("meshpar_stage_boundary")
stage_boundary_p.multiple_results = True


@stage_boundary_p.def_impl
def _impl():
    return []


@stage_boundary_p.def_effectful_abstract_eval
def _abstract_eval():
    return [], {_EFFECT}


def _jvp(primals, tangents):
    return stage_boundary_p.bind(), []


def _batch(args, dims):
    return stage_boundary_p.bind(), []


ad.primitive_jvps[stage_boundary_p] = _jvp
batching.primitive_batchers[stage_boundary_p] = _batch
mlir.register_lowering(stage_boundary_p, lambda ctx: [])


def mark_stage_boundary() -> None:
    """Ends the current pipeline stage; call it between layers of the model.

    ``n - 1`` calls split the forward pass into ``n`` stages. Calls must sit in
    straight-line code (not inside ``lax.scan``, ``cond`` or ``while``
    bodies), where a cut is well defined.
    """
    stage_boundary_p.bind()
