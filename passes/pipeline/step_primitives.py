"""The two primitives a traced train step holds for the compiler, defined below every pass.

- ``stage_boundary_p``: ``meshpar.mark_stage_boundary()``, no operands and no results, kept in
  the jaxpr by an effect exactly where the model called it; outside a pipeline it does nothing.
- ``pipeline_grad_p``: ``meshpar.value_and_grad`` while ``parallelize`` traces: "loss, aux and
  gradients of ``loss_jaxpr`` here"; evaluated directly it is plain ``jax.value_and_grad``.

The compiler and runtime match equations by these objects (``eqn.primitive is ...``), never by
name; the API package binds them.
"""

from __future__ import annotations

from typing import Any

import jax

from .. import jax_ir

__all__ = ["StageBoundaryEffect", "pipeline_grad_p", "stage_boundary_p"]


class StageBoundaryEffect(jax_ir.Effect):
    """Keeps the marker in jaxprs although it computes nothing."""

    __str__ = lambda self: "StageBoundary"  # noqa: E731


_EFFECT = StageBoundaryEffect()
# Lowerable, and allowed inside scan/cond so meshpar, not JAX, reports a marker there.
jax_ir.register_effect_type(StageBoundaryEffect)

stage_boundary_p = jax_ir.Primitive("meshpar_stage_boundary")
stage_boundary_p.multiple_results = True


@stage_boundary_p.def_impl
def _marker_impl():
    return []


@stage_boundary_p.def_effectful_abstract_eval
def _marker_abstract_eval():
    return [], {_EFFECT}


def _marker_jvp(primals, tangents):
    return stage_boundary_p.bind(), []


def _marker_batch(args, dims):
    return stage_boundary_p.bind(), []


jax_ir.register_primitive_rules(stage_boundary_p, _marker_jvp, _marker_batch, lambda ctx: [])


pipeline_grad_p = jax_ir.Primitive("meshpar_pipeline_grad")
pipeline_grad_p.multiple_results = True


@pipeline_grad_p.def_abstract_eval
def _grad_abstract_eval(*avals: jax_ir.AbstractValue, loss_jaxpr: jax_ir.ClosedJaxpr, num_diff: int, num_aux: int,
                        **params: Any) -> list:
    # At the whole batch's shapes (the trace the update is taken from), the loss function's
    # aux avals are what combining the micro-batches' gives: concatenated leaves have the
    # whole batch's leading dimension, the others keep their shape.
    return [*loss_jaxpr.out_avals[:1 + num_aux], *avals[:num_diff]]


@pipeline_grad_p.def_impl
def _grad_impl(*args: Any, loss_jaxpr: jax_ir.ClosedJaxpr, num_diff: int, num_aux: int, **params: Any) -> list:
    # Evaluating the traced step directly (no pipeline): plain value_and_grad.
    def loss(diff, rest):
        value, *aux = jax_ir.jaxpr_as_fun(loss_jaxpr)(*diff, *rest)
        return value, aux

    (value, aux), grads = jax.value_and_grad(loss, has_aux=True)(list(args[:num_diff]), list(args[num_diff:]))
    return [value, *aux, *grads]
