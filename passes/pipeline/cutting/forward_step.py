"""Pass: a step without a gradient (an evaluation or inference step) as a pipelined step.

Input: a traced step holding no ``pipeline_grad_p`` equation (``meshpar.value_and_grad`` was not
called) but the model's stage markers. Output (``forward_step``): the same step as ONE
``pipeline_grad_p`` equation marked ``forward_only``: its ``loss_jaxpr`` is the step's whole
computation, from the inputs it reads (then its constants) to a constant zero "loss" followed
by every output the step computes, as aux leaves. The passes that cut a loss into stages,
resolve how micro-batches combine (exactly where the outputs allow: a mean over the batch as
``SUM`` of shares, per-example values ``CONCAT``, batch-independent values ``LAST``) and place
values then apply unchanged; ``forward_only`` tells ``compile_pipeline`` to run a
forward-only schedule and build no backward.

The step's floating inputs outside the batch (the parameters) are the equation's leading
``num_diff`` operands while micro-batching is resolved, as a train step's parameters are: so
no value they reach is taken for a value of the batch alone and computed once on the whole
batch outside the pipeline (``exact_micro_batching``'s hoisting). Nothing is differentiated,
so ``forward_operands`` then makes them plain operands (``num_diff=0``): each is placed, with
its flax partitioning, on the mesh of the stage reading it, where a train step's owner stage
keeps it.

Inputs and constants a step returns unchanged, and literals, stay outside the equation: the
step returns them as they are, so no stage copies them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend.core import primitives as prims

from ...compiler_pass import compiler_pass
from ... import jax_ir
from ...verification import PlanVerificationError, type_check
from ..step_primitives import pipeline_grad_p
from .micro_batching import MicroBatching
from .stage_graph import is_differentiable

__all__ = ["forward_operands", "forward_step", "verify_forward_operands", "verify_forward_step"]


@compiler_pass
def forward_step(step: jax_ir.ClosedJaxpr, batch_leaves: frozenset[int]) -> jax_ir.ClosedJaxpr:
    """``step`` (no gradient equation; ``batch_leaves``: its inputs cut into micro-batches) as one
    forward-only ``pipeline_grad_p`` equation (module doc).

    The equation reads the step inputs its computation reads: first the floating ones outside
    the batch (its ``num_diff`` parameters), then the others, each group in input order, then
    the step's constants. Its outputs are the zero loss (unused), per output the step computes
    (in output order, once each) that value, then the parameters' (unused) gradients.
    """
    jaxpr = step.jaxpr
    read = {a for e in jaxpr.eqns for a in e.invars if isinstance(a, jax_ir.Var)}
    params = [v for i, v in enumerate(jaxpr.invars)
              if v in read and i not in batch_leaves and is_differentiable(v.aval)]
    operands = [*params, *(v for v in jaxpr.invars if v in read and v not in params)]
    computed = {v for e in jaxpr.eqns for v in e.outvars}
    aux: list[jax_ir.Var] = []
    for v in jaxpr.outvars:
        if isinstance(v, jax_ir.Var) and v in computed and v not in aux:
            aux.append(v)
    # The loss is computed (a stage must own it) after every other equation: by the last stage.
    zero = jax_ir.Var(jax_ir.ShapedArray((), np.dtype(np.float32)))
    zero_eqn = jax_ir.new_jaxpr_eqn([jax_ir.Literal(np.float32(0.0), zero.aval)], [zero], prims.copy_p, {},
                                    jax_ir.no_effects)
    loss = jax_ir.Jaxpr(
        constvars=(),
        invars=[*operands, *jaxpr.constvars],
        outvars=[zero, *aux],
        eqns=[*jaxpr.eqns, zero_eqn],
        effects=jaxpr.effects,
        debug_info=jax_ir.DebugInfo("meshpar forward step", "step", tuple(f"arg{i}" for i in range(
            len(operands) + len(jaxpr.constvars))), ("loss", *(f"aux{k}" for k in range(len(aux))))),
    )
    outs = [jax_ir.Var(zero.aval), *(jax_ir.Var(v.aval) for v in aux), *(jax_ir.Var(v.aval) for v in params)]
    grad_params = dict(loss_jaxpr=jax_ir.ClosedJaxpr(loss, ()), num_diff=len(params), num_aux=len(aux),
                       aux_reductions=(None,) * len(aux), reduction=None, fold_rng=True, exact=False,
                       forward_only=True)
    # Where the user's step begins: warnings about how its outputs micro-batch point there.
    where = jaxpr.eqns[0].source_info if jaxpr.eqns else jax_ir.new_source_info()
    eqn = jax_ir.new_jaxpr_eqn([*operands, *jaxpr.constvars], outs, pipeline_grad_p, grad_params,
                               jax_ir.no_effects, where)
    returned = dict(zip(aux, outs[1:1 + len(aux)]))
    outvars = [returned.get(v, v) if isinstance(v, jax_ir.Var) else v for v in jaxpr.outvars]
    wrapped = jax_ir.Jaxpr(jaxpr.constvars, jaxpr.invars, outvars, [eqn], jax_ir.no_effects, jaxpr.debug_info)
    result = jax_ir.ClosedJaxpr(wrapped, step.consts)
    verify_forward_step(step, result)
    return result


def verify_forward_step(step: jax_ir.ClosedJaxpr, wrapped: jax_ir.ClosedJaxpr) -> None:
    """``wrapped`` has ``step``'s signature and is one forward-only gradient equation whose loss
    jaxpr type-checks and returns a scalar loss, then one aux leaf per value it returns.

    Raises:
      PlanVerificationError: naming the broken invariant.
    """
    if [v.aval for v in wrapped.jaxpr.invars] != [v.aval for v in step.jaxpr.invars] or \
            [a.aval for a in wrapped.jaxpr.outvars] != [a.aval for a in step.jaxpr.outvars]:
        raise PlanVerificationError("the forward step's signature differs from the step's")
    if len(wrapped.jaxpr.eqns) != 1 or wrapped.jaxpr.eqns[0].primitive is not pipeline_grad_p:
        raise PlanVerificationError("the forward step is not one gradient equation")
    (eqn,) = wrapped.jaxpr.eqns
    params = eqn.params
    if not params.get("forward_only"):
        raise PlanVerificationError("the forward step's equation is not marked forward-only")
    loss = params["loss_jaxpr"]
    type_check(loss.jaxpr, "the forward step's loss jaxpr")
    if loss.out_avals[0].shape != () or len(loss.out_avals) != 1 + params["num_aux"] or \
            len(eqn.outvars) != 1 + params["num_aux"] + params["num_diff"]:
        raise PlanVerificationError("the forward step's equation does not return a scalar loss, its aux leaves "
                                    "and its parameters' gradients")
    if not all(is_differentiable(v.aval) for v in loss.jaxpr.invars[:params["num_diff"]]):
        raise PlanVerificationError("a parameter of the forward step is not floating")


@compiler_pass
def forward_operands(outer: jax_ir.ClosedJaxpr, grad_params: dict, micro_batching: MicroBatching
                     ) -> tuple[jax_ir.ClosedJaxpr, dict, MicroBatching]:
    """A forward step whose micro-batching is resolved (``outer`` at the whole batch, its
    equation's per-micro-batch ``grad_params``, ``micro_batching``) with its parameters made
    plain operands: ``num_diff=0``, the equation's gradient outputs dropped, and the
    per-operand micro-batching entries extended over them (never per micro-batch, never keys)."""
    n = grad_params["num_diff"]
    jaxpr = outer.jaxpr
    (at,) = [k for k, e in enumerate(jaxpr.eqns) if e.primitive is pipeline_grad_p]
    eqn = jaxpr.eqns[at]
    kept = eqn.outvars[:len(eqn.outvars) - n]
    flat = eqn.replace(outvars=kept, params={**eqn.params, "num_diff": 0})
    stepped = jax_ir.ClosedJaxpr(jax_ir.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars,
                                              [*jaxpr.eqns[:at], flat, *jaxpr.eqns[at + 1:]], jaxpr.effects,
                                              jaxpr.debug_info), outer.consts)
    operands = dataclasses.replace(micro_batching, per_micro_batch=(False,) * n + micro_batching.per_micro_batch,
                                   fold_keys=frozenset(k + n for k in micro_batching.fold_keys))
    return stepped, {**grad_params, "num_diff": 0}, operands


def verify_forward_operands(outer: jax_ir.ClosedJaxpr, grad_params: dict, micro_batching: MicroBatching) -> None:
    """The forward step's equation differentiates nothing and returns no gradient, and
    ``micro_batching`` has an entry per operand.

    Raises:
      PlanVerificationError: naming the broken invariant.
    """
    (eqn,) = [e for e in outer.jaxpr.eqns if e.primitive is pipeline_grad_p]
    if grad_params["num_diff"] or eqn.params["num_diff"] or len(eqn.outvars) != 1 + eqn.params["num_aux"]:
        raise PlanVerificationError("the forward step still differentiates its parameters")
    if len(micro_batching.per_micro_batch) != len(eqn.invars):
        raise PlanVerificationError(f"{len(micro_batching.per_micro_batch)} micro-batching entries for the forward "
                                    f"step's {len(eqn.invars)} operands")
