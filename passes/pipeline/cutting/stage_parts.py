"""Pass: derive one forward ``Stage``'s compute parts, with its backward split in two.

Output: a ``StageParts`` of closed jaxprs, each runnable as
``jax.jit(jax_ir.jaxpr_as_fun(part))``:

- ``forward``: the stage, also returning the residuals its backward reads
  (the leaves of its ``jax.vjp`` function);
- ``backward``: the whole VJP, from residuals and output cotangents to the
  cotangents of the differentiated inputs (``param`` and ``act`` refs);
- ``backward_input`` ("B") and ``backward_weight`` ("W"): the same backward
  cut for zero-bubble schedules (Qi et al., ICLR 2024), which run B as soon
  as the next stage's cotangents arrive (the previous stage waits on it) and
  delay W into pipeline bubbles. B computes only what the activation
  cotangents need and hands W, as ``weight_state``, every value W reads that
  B computed or received, so W recomputes nothing and needs no residual of
  its own: running B then W does exactly the equations of ``backward``,
  each once, in the same order (bit-identical results).

Equations of the backward's top level are the unit of the cut: a nested
``jit`` or the transposed ``scan`` is wholly in B (it yields act and param
cotangents at once) or wholly in W.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.stage_kernel import StageParts
from ...program.step_values import RefKind
from ...verification import PlanVerificationError, type_check
from .stage_graph import Stage, is_differentiable

__all__ = ["stage_parts", "stage_positions", "verify_stage_parts"]


def stage_positions(stage: Stage) -> tuple[tuple[int, ...], ...]:
    """``(diff_inputs, other_inputs, act_inputs, param_inputs)`` of ``stage``: its parts' input
    positions (``StageParts``), found without tracing them."""
    # An activation without a cotangent (an integer, a key) is read, not differentiated.
    diff = tuple(i for i, (r, a) in enumerate(zip(stage.inputs, stage.jaxpr.in_avals))
                 if r.kind is RefKind.PARAM or (r.kind is RefKind.ACT and is_differentiable(a)))
    return (diff, tuple(i for i in range(len(stage.inputs)) if i not in diff),
            tuple(i for i in diff if stage.inputs[i].kind is RefKind.ACT),
            tuple(i for i in diff if stage.inputs[i].kind is RefKind.PARAM))


def _spec(aval: jax_ir.AbstractValue) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=aval.weak_type)


def _part(whole: jax_ir.ClosedJaxpr, name: str, invars: Sequence[jax_ir.Var],
          eqns: Sequence[jax_ir.JaxprEqn], outvars: Sequence[jax_ir.Atom]) -> jax_ir.ClosedJaxpr:
    """A jaxpr made of some of ``whole``'s equations; it shares ``whole``'s constants (if any)."""
    jaxpr = jax_ir.Jaxpr(
        constvars=whole.jaxpr.constvars, invars=list(invars), outvars=list(outvars), eqns=list(eqns),
        debug_info=jax_ir.DebugInfo("meshpar stage part", name, tuple(f"in{k}" for k in range(len(invars))),
                                    tuple(f"out{k}" for k in range(len(outvars)))),
    )
    return jax_ir.ClosedJaxpr(jaxpr, whole.consts)


def _needs(eqns: Sequence[jax_ir.JaxprEqn], roots: Sequence[jax_ir.Atom], stop: set[int]
           ) -> tuple[list[jax_ir.JaxprEqn], set[jax_ir.Var]]:
    """The equations ``roots`` need, in order, but none in ``stop`` (eqn ids); and what they read from outside."""
    live = {v for v in roots if isinstance(v, jax_ir.Var)}
    kept: list[jax_ir.JaxprEqn] = []
    for e in reversed(eqns):
        if id(e) in stop or not any(v in live for v in e.outvars):
            continue
        kept.append(e)
        live.difference_update(e.outvars)
        live.update(v for v in e.invars if isinstance(v, jax_ir.Var))
    return kept[::-1], live


@compiler_pass
def stage_parts(stage: Stage, diff_outputs: Sequence[int] | None = None) -> StageParts:
    """Builds the forward, backward, B and W jaxprs of ``stage`` (see the module docstring);
    ``diff_outputs`` are the output slots that receive cotangents (default: every floating one).

    Raises:
      ValueError: the stage's backward has side effects (dead-code elimination
        would drop or duplicate them).
    """
    diff, other, acts, params = stage_positions(stage)
    if diff_outputs is None:
        diff_outputs = tuple(k for k, a in enumerate(stage.jaxpr.out_avals) if is_differentiable(a))
    fun = jax_ir.jaxpr_as_fun(stage.jaxpr)
    in_avals = stage.jaxpr.in_avals
    treedef = None

    def forward(diff_args, other_args):
        nonlocal treedef
        order = (*diff, *other)

        def f(*diff_args):
            args = dict(zip(order, (*diff_args, *other_args)))
            outs = tuple(fun(*(args[i] for i in range(len(order)))))
            return tuple(outs[k] for k in diff_outputs), outs

        # The residuals are the leaves of the VJP function (a Partial of the
        # linearized jaxpr); its treedef rebuilds that function in the backward.
        _, vjp, outs = jax.vjp(f, *diff_args, has_aux=True)
        residuals, treedef = jax.tree.flatten(vjp)
        return (*outs, *residuals)

    fwd = jax.make_jaxpr(forward)([_spec(in_avals[i]) for i in diff], [_spec(in_avals[i]) for i in other])
    n_out = len(stage.outputs)
    position = {i: k for k, i in enumerate(diff)}

    def backward(residuals, cotangents):
        grads = jax.tree.unflatten(treedef, residuals)(tuple(cotangents))
        return [grads[position[i]] for i in (*acts, *params)]

    bwd = jax.make_jaxpr(backward)([_spec(a) for a in fwd.out_avals[n_out:]],
                                   [_spec(fwd.out_avals[k].to_tangent_aval()) for k in diff_outputs])
    if bwd.effects:
        raise ValueError(f"stage {stage.index}: its backward has side effects {bwd.effects}; meshpar cannot split it")
    jaxpr = bwd.jaxpr
    act_cts, param_cts = jaxpr.outvars[:len(acts)], jaxpr.outvars[len(acts):]
    b_eqns, _ = _needs(jaxpr.eqns, act_cts, set())
    w_eqns, w_reads = _needs(jaxpr.eqns, param_cts, {id(e) for e in b_eqns})
    # Whatever W reads and does not compute was computed or received by B;
    # constants are available to both.
    defined_by_b = [v for e in b_eqns for v in e.outvars]
    weight_state = [v for v in (*jaxpr.invars, *defined_by_b) if v in w_reads]
    return StageParts(
        stage=stage.index,
        forward=fwd,
        backward=bwd,
        backward_input=_part(bwd, f"B of stage {stage.index}", jaxpr.invars, b_eqns, [*act_cts, *weight_state]),
        backward_weight=_part(bwd, f"W of stage {stage.index}", weight_state, w_eqns, param_cts),
        diff_inputs=diff,
        other_inputs=other,
        act_inputs=acts,
        param_inputs=params,
        diff_outputs=tuple(diff_outputs),
        num_outputs=n_out,
        num_residuals=len(fwd.out_avals) - n_out,
        num_weight_state=len(weight_state),
    )


def verify_stage_parts(stage: Stage, parts: StageParts) -> None:
    """Checks the parts' signatures against the stage, and that B and W share no backward equation.

    Every part type-checks; the forward maps the stage's inputs (diff first)
    to its outputs plus ``num_residuals`` residuals; the backward and B read
    those residuals and the output cotangents; the backward returns the act
    then param input cotangents, B the act ones then ``num_weight_state``
    values that are exactly W's inputs, W the param ones; every equation of
    B and W is one of the backward's, and none is in both or twice.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    def fail(what: str) -> None:
        raise PlanVerificationError(f"stage {stage.index} parts: {what}")

    def same(got: Sequence[jax_ir.AbstractValue], want: Sequence[jax_ir.AbstractValue], what: str) -> None:
        if len(got) != len(want) or not all(jax_ir.typematch(g, w) for g, w in zip(got, want)):
            fail(f"{what} are {list(got)}, expected {list(want)}")

    for name in ("forward", "backward", "backward_input", "backward_weight"):
        type_check(getattr(parts, name).jaxpr, f"stage {stage.index} parts: {name}")
    if (parts.stage, parts.diff_inputs, parts.other_inputs, parts.act_inputs, parts.param_inputs) != (
            stage.index, *stage_positions(stage)):
        fail("input positions do not match the stage's refs")
    in_avals = stage.jaxpr.in_avals
    same(parts.forward.in_avals, [in_avals[i] for i in (*parts.diff_inputs, *parts.other_inputs)], "forward inputs")
    same(parts.forward.out_avals[:parts.num_outputs], stage.jaxpr.out_avals, "forward outputs")
    if len(parts.forward.out_avals) != parts.num_outputs + parts.num_residuals:
        fail("forward output count is not num_outputs + num_residuals")
    residuals = parts.forward.out_avals[parts.num_outputs:]
    cotangents = [stage.jaxpr.out_avals[k].to_tangent_aval() for k in parts.diff_outputs]
    if not all(is_differentiable(stage.jaxpr.out_avals[k]) for k in parts.diff_outputs):
        fail("a differentiated output slot is not floating")
    grads = [in_avals[i].to_tangent_aval() for i in (*parts.act_inputs, *parts.param_inputs)]
    n_act = parts.num_act_cotangents
    same(parts.backward.in_avals, [*residuals, *cotangents], "backward inputs")
    same(parts.backward.out_avals, grads, "backward outputs")
    same(parts.backward_input.in_avals, [*residuals, *cotangents], "B inputs")
    same(parts.backward_input.out_avals[:n_act], grads[:n_act], "B activation cotangents")
    if len(parts.backward_input.out_avals) != n_act + parts.num_weight_state:
        fail("B output count is not num_act_cotangents + num_weight_state")
    same(parts.backward_weight.in_avals, parts.backward_input.out_avals[n_act:], "W inputs (B's weight state)")
    same(parts.backward_weight.out_avals, grads[n_act:], "W outputs")
    split = [id(e) for e in (*parts.backward_input.jaxpr.eqns, *parts.backward_weight.jaxpr.eqns)]
    if len(set(split)) != len(split) or not set(split) <= {id(e) for e in parts.backward.jaxpr.eqns}:
        fail("B and W must compute disjoint sets of the backward's equations, each once")
