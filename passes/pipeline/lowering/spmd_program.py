"""Pass: a one-stage, one-micro-batch step lowered to one plain jaxpr, the program ``jax.jit`` runs.

With a single stage and a single micro-batch there is nothing to pipeline, and the runtime runs
the step as one SPMD program (``runtime.spmd_step``). What that program computes is decided
here, so the runtime only evaluates a jaxpr: ``lower_spmd_step`` traces the step at its own
input avals with

- the gradient equation (``pipeline_grad_p``) as ``value_and_grad`` of its loss over the one
  micro-batch, which is the whole batch (``pipeline_grad_p``'s own evaluation rule), each PRNG
  key the loss reads once per step (``MicroBatching.fold_keys``) replaced by
  ``fold_in(key, 0)``, as the pipeline folds micro-batch 0's;
- no stage markers (``stage_boundary_p``): one program has no stages, and a marker's effect
  would cost every call JAX's C++ dispatch (the program then runs like ``jax.jit`` of the step,
  whose markers bind nothing).

Every other equation is bound again as traced. ``verify_spmd_step`` checks that no meshpar
primitive is left, at any depth, and that the lowered step takes and gives what the traced one does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...verification import PlanVerificationError
from ..cutting.micro_batching import MicroBatching
from ..step_primitives import pipeline_grad_p, stage_boundary_p

__all__ = ["lower_spmd_step", "verify_spmd_step"]

_MESHPAR_PRIMITIVES = (pipeline_grad_p, stage_boundary_p)


@compiler_pass
def lower_spmd_step(jaxpr: jax_ir.ClosedJaxpr, micro_batching: MicroBatching) -> jax_ir.ClosedJaxpr:
    """``jaxpr`` (the step traced at the whole batch's shapes, holding one gradient equation
    combined as ``micro_batching`` says) as one jaxpr of JAX primitives only (module doc), with
    the same input and output avals.

    Raises:
      ValueError: ``micro_batching.num_micro_batches`` is not 1.
    """
    if micro_batching.num_micro_batches != 1:
        raise ValueError(f"micro_batching: one SPMD program runs one micro-batch, got "
                         f"{micro_batching.num_micro_batches}")
    fold = micro_batching.fold_keys

    def step(*leaves: jax.Array) -> list[jax.Array]:
        return _evaluate(jaxpr.jaxpr, jaxpr.consts, leaves, fold)

    # make_jaxpr takes the avals themselves (JAX 0.10.2 to 0.12): weak types and shardings
    # stay what the traced step's inputs have.
    return jax.make_jaxpr(step)(*(v.aval for v in jaxpr.jaxpr.invars))


def verify_spmd_step(traced: jax_ir.ClosedJaxpr, lowered: jax_ir.ClosedJaxpr) -> None:
    """Checks ``lowered = lower_spmd_step(traced, ...)``: no equation of it, nor of any jaxpr
    nested in one, binds a meshpar primitive, it has no stage marker's effect, and its inputs
    and outputs type-match ``traced``'s one for one.

    Raises:
      PlanVerificationError: naming the primitive or effect left, or the first input or output
        that differs.
    """
    left = _meshpar_primitives(lowered.jaxpr)
    if left:
        raise PlanVerificationError(f"lower_spmd_step left meshpar primitives {sorted(left)} in the step")
    marker_effects = lowered.jaxpr.effects & set(stage_boundary_p.abstract_eval()[1])
    if marker_effects:
        raise PlanVerificationError(f"lower_spmd_step left the stage markers' effect {sorted(map(str, marker_effects))} "
                                    f"in the step")
    for what, want, got in (("input", traced.in_avals, lowered.in_avals),
                            ("output", traced.out_avals, lowered.out_avals)):
        if len(want) != len(got):
            raise PlanVerificationError(f"lower_spmd_step: the lowered step has {len(got)} {what}s, the traced "
                                        f"step {len(want)}")
        for k, (w, g) in enumerate(zip(want, got)):
            if not jax_ir.typematch(w, g):
                raise PlanVerificationError(f"lower_spmd_step: {what} {k} is {g.str_short()} in the lowered step, "
                                            f"{w.str_short()} in the traced step")


def _meshpar_primitives(jaxpr: jax_ir.Jaxpr) -> set[str]:
    """Names of the meshpar primitives ``jaxpr``'s equations bind, at any depth."""
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive in _MESHPAR_PRIMITIVES:
            found.add(eqn.primitive.name)
        for sub in jax_ir.nested_jaxprs(eqn):
            found |= _meshpar_primitives(sub)
    return found


def _evaluate(jaxpr: jax_ir.Jaxpr, consts: Sequence[Any], args: Sequence[Any], fold_keys: frozenset[int]) -> list[Any]:
    """``jaxpr`` evaluated on ``args`` with its gradient equation as ``value_and_grad`` over one
    micro-batch, the loss operands numbered ``fold_keys`` (among the non-differentiated ones)
    folded with 0, and its stage markers skipped."""
    env: dict[jax_ir.Var, Any] = {}

    def read(v: jax_ir.Atom) -> Any:
        return v.val if isinstance(v, jax_ir.Literal) else env[v]

    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
        env[var] = value
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_boundary_p:
            continue
        invals = [read(v) for v in eqn.invars]
        if eqn.primitive is pipeline_grad_p:
            n = eqn.params["num_diff"]
            invals = [*invals[:n], *(jax.random.fold_in(x, 0) if k in fold_keys else x
                                     for k, x in enumerate(invals[n:]))]
            outs = pipeline_grad_p.impl(*invals, **{**eqn.params,
                                                    "loss_jaxpr": _without_markers(eqn.params["loss_jaxpr"])})
        else:
            outs = jax_ir.bind_equation(eqn, invals)
        outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _without_markers(loss: jax_ir.ClosedJaxpr) -> jax_ir.ClosedJaxpr:
    """``loss`` without its stage markers (only top-level ones: ``split_stages`` refuses a
    marker nested in a body)."""
    jaxpr = loss.jaxpr
    eqns = [e for e in jaxpr.eqns if e.primitive is not stage_boundary_p]
    effects = jaxpr.effects - set(stage_boundary_p.abstract_eval()[1])
    return jax_ir.ClosedJaxpr(jaxpr.replace(eqns=eqns, effects=effects), loss.consts)
