"""The step's one ``meshpar.value_and_grad`` call, found in its traced jaxpr, or an error that
says what the step differentiated with instead and shows the form that pipelines. A step that
differentiates nothing (an evaluation step) is pipelined forward-only (``pipeline_call``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from meshpar.passes import jax_ir
from meshpar.passes.pipeline.cutting.forward_step import forward_step
from meshpar.passes.pipeline.cutting.stage_graph import first_user_frame, user_location
from meshpar.passes.pipeline.step_primitives import pipeline_grad_p

__all__ = ["GradCall", "find_grad_call", "pipeline_call"]


@dataclasses.dataclass(frozen=True)
class GradCall:
    """What a trace at another batch size tells of the step's gradient call: its equation's
    parameters (the loss jaxpr, ``num_diff``, ``num_aux``, the reductions) and its operands' types,
    the differentiated leaves first."""

    params: Mapping[str, Any]
    in_avals: tuple[Any, ...]

    @classmethod
    def of(cls, eqn: jax_ir.JaxprEqn) -> GradCall:
        return cls(eqn.params, tuple(v.aval for v in eqn.invars))


# (file path suffix, function name prefix) of the frames JAX's and flax's own differentiation
# leave on every equation they trace, and the API a user called to get there.
_DIFFERENTIATORS = (
    (os.path.join("flax", "nnx", "transforms", "autodiff.py"), "", "nnx.value_and_grad / nnx.grad"),
    (os.path.join("jax", "_src", "api.py"), "grad", "jax.grad"),
    (os.path.join("jax", "_src", "api.py"), "value_and_grad", "jax.value_and_grad"),
    (os.path.join("jax", "_src", "api.py"), "vjp", "jax.vjp"),
)

_NNX_FORM = """    def loss_fn(model):
        return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)
    loss, grads = meshpar.value_and_grad(loss_fn)(model)   # grads: an nnx.State of the nnx.Params
    optimizer.update(model, grads)                          # in place, as under nnx.jit"""

_LINEN_FORM = """    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)
    loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=grads)"""


def _differentiated_by(jaxpr: jax_ir.Jaxpr) -> tuple[str, str] | None:
    """The differentiation API the first differentiated equation of ``jaxpr`` came from, and
    the user's line that called it; ``None`` when no equation was differentiated."""
    for eqn in jaxpr.eqns:
        traceback = eqn.source_info.traceback
        frames = traceback.frames if traceback is not None else ()
        # The outermost API wins: jax.grad's equations also carry value_and_grad's and vjp's frames,
        # and nnx's carry jax's.
        for suffix, function, api in _DIFFERENTIATORS:
            calls = [k for k, f in enumerate(frames) if f.file_name.endswith(suffix)
                     and f.function_name.startswith(function)]
            if calls:
                # The user's line is the first frame outside the libraries past the API's own.
                return api, first_user_frame((f.file_name, f.line_num, f.function_name)
                                             for f in frames[calls[-1] + 1:])
    return None


def find_grad_call(name: str, traced: jax_ir.ClosedJaxpr, nnx_arguments: bool) -> jax_ir.JaxprEqn:
    """The step's one ``meshpar.value_and_grad`` / ``meshpar.grad`` equation.

    Args:
      name: the step's name, for messages.
      traced: the step traced under ``meshpar.parallelize``.
      nnx_arguments: whether the step takes NNX objects (the message then shows the NNX form).

    Raises:
      ValueError: none or several such calls; with none, the message names what the step
        differentiated with instead (``nnx.value_and_grad``, ``jax.grad``, ...) and where.
    """
    found = [e for e in traced.jaxpr.eqns if e.primitive is pipeline_grad_p]
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(f"{name}: must call meshpar.value_and_grad or meshpar.grad exactly once, found "
                         f"{len(found)} (at {', '.join(user_location(e) for e in found)}); compute one loss "
                         f"and differentiate it once per step")
    other = _differentiated_by(traced.jaxpr)
    instead = (f"it differentiates with {other[0]} at {other[1]}, which JAX differentiates while tracing, "
               f"leaving no loss function for meshpar to cut into stages" if other else
               "it differentiates nothing")
    form = _NNX_FORM if nnx_arguments else _LINEN_FORM
    raise ValueError(f"{name}: must call meshpar.value_and_grad or meshpar.grad exactly once, found none: "
                     f"{instead}. Call meshpar's, with the same arguments:\n{form}")


def pipeline_call(name: str, traced: jax_ir.ClosedJaxpr, nnx_arguments: bool, batch_leaves: frozenset[int]
                  ) -> tuple[jax_ir.ClosedJaxpr, jax_ir.JaxprEqn]:
    """``traced`` as the compiler pipelines it, and its one gradient equation: the step as
    traced when it calls ``meshpar.value_and_grad`` once; a step that differentiates nothing
    (an evaluation step) as one forward-only equation (``forward_step``; ``batch_leaves``: its
    inputs cut into micro-batches).

    Raises:
      ValueError: several gradient calls, or a differentiation JAX or flax traced
        (``find_grad_call``'s messages).
    """
    if any(e.primitive is pipeline_grad_p for e in traced.jaxpr.eqns) or _differentiated_by(traced.jaxpr):
        return traced, find_grad_call(name, traced, nnx_arguments)
    forward = forward_step(traced, batch_leaves)
    return forward, forward.jaxpr.eqns[0]
