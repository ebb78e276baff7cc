"""Pass: exact micro-batching. The loss a user wrote for the whole batch, rewritten so that its
micro-batches add up to exactly the whole batch's loss, gradients and aux values.

Input: the loss jaxpr traced at a smaller batch and at the whole batch, and which of its
operands carry the batch rows. Output: an ``ExactMicroBatching`` plan, then (``rewrite_loss``,
``hoist_into_step``) the rewritten per-micro-batch loss and the step computing the values
hoisted out of it.

1. **Values of the batch alone** (no parameter, no PRNG key reaches them) that reduce over the
   rows (a token count, a mask's sum, a normaliser) are computed once, on the whole batch,
   before the pipeline (``hoisted``), and every micro-batch reads them as they are.
2. **The rest** is classified by ``row_kinds``. A loss that is a sum over the rows, scaled by
   anything batch-independent (``PARTIAL``), micro-batches exactly: each micro-batch computes
   its share with the whole batch's scalars (a mean's divisor becomes the whole batch's row
   count), a batch-independent term added to it (weight decay) is split evenly over the
   shares, and the shares are summed: loss, gradients and aux equal ``jax.jit``'s.
3. **Anything that mixes rows after parameters enter** (BatchNorm statistics, a max or
   softmax over the batch, a nonlinear function of a row sum) cannot be micro-batched
   exactly; the plan names each place (``InexactReduction``) and the step keeps the
   per-micro-batch semantics (each micro-batch its own batch, losses and gradients averaged).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.extend.core import primitives as prims

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.step_values import AuxReduction
from ...verification import PlanVerificationError, type_check
from ..step_primitives import pipeline_grad_p
from .micro_batching import LossReduction, MicroBatching, default_aux_reduction
from .row_kinds import (
    InexactReduction, LiteralEdit, OperandPath, RowKind, RowKinds, StructureMismatch, analyze_row_kinds, row_axis,
)

__all__ = ["ExactMicroBatching", "MicroBatchedStep", "MicroBatchingWarning", "hoist_into_step", "micro_batch_step",
           "plan_exact_micro_batching", "rewrite_loss", "verify_rewritten_loss"]


@dataclasses.dataclass(frozen=True)
class ExactMicroBatching:
    """How a loss micro-batches (module doc).

    Attributes:
      exact: the loss (and gradients) micro-batch exactly: shares rewritten and summed.
      hoisted: ``(equation, output)`` of each top-level loss value computed once on the whole
        batch (in equation order); the rewritten loss reads them as extra operands, appended.
      kinds: the analysis of the loss with those values hoisted.
      aux: per aux leaf, how its micro-batches combine.
      inexact: every place a parameter-dependent value mixes rows, reaching the loss or an aux
        leaf combined by default; empty when ``exact`` and every aux leaf combines exactly.
      scale_loss: the loss does not depend on the rows at all: each micro-batch adds its share.
    """

    exact: bool
    hoisted: tuple[tuple[int, int], ...]
    kinds: RowKinds | None
    aux: tuple[AuxReduction, ...]
    inexact: tuple[InexactReduction, ...]
    scale_loss: bool = False


def _hoistable(loss: jax_ir.ClosedJaxpr, num_diff: int, per_micro_batch: Sequence[bool],
               varying: frozenset[int], whole: jax_ir.ClosedJaxpr) -> tuple[tuple[int, int], ...]:
    """The top-level values of ``loss`` computed from batch rows alone whose shape does not
    follow the batch (row reductions), read by an equation that is not itself such a value or
    returned: ``(equation, output)`` pairs. ``varying``: operands whose value changes per
    micro-batch besides the rows (folded PRNG keys)."""
    jaxpr = loss.jaxpr
    rows: set[object] = set()
    blocked: set[object] = set(jaxpr.invars[:num_diff]) | set(jaxpr.constvars)
    for k, v in enumerate(jaxpr.invars[num_diff:]):
        if per_micro_batch[k]:
            rows.add(v)
        if k in varying:
            blocked.add(v)
    candidate: dict[object, tuple[int, int]] = {}
    for n, (e, w) in enumerate(zip(jaxpr.eqns, whole.jaxpr.eqns)):
        ins = [a for a in e.invars if not isinstance(a, jax_ir.Literal)]
        if e.effects or any(a in blocked for a in ins):
            blocked.update(e.outvars)
            continue
        if any(a in rows for a in ins):
            rows.update(e.outvars)
            for k, (v, u) in enumerate(zip(e.outvars, w.outvars)):
                if not isinstance(v, jax_ir.DropVar) and row_axis(v.aval, u.aval) is None:
                    candidate[v] = (n, k)
    # The frontier: candidates read by an equation that is not itself computing candidates only
    # (those run in the prologue too), or returned.
    read: set[object] = {a for a in jaxpr.outvars if a in candidate}
    for e in jaxpr.eqns:
        outs = [v for v in e.outvars if not isinstance(v, jax_ir.DropVar)]
        if not outs or not all(v in candidate for v in outs):
            read.update(a for a in e.invars if not isinstance(a, jax_ir.Literal) and a in candidate)
    return tuple(sorted(candidate[v] for v in read))


def _hoist(loss: jax_ir.ClosedJaxpr, hoisted: Sequence[tuple[int, int]]) -> jax_ir.ClosedJaxpr:
    """``loss`` reading each hoisted value as an appended operand instead of computing it; the
    equations left computing only values nothing reads are dropped."""
    jaxpr = loss.jaxpr
    fresh = {jaxpr.eqns[n].outvars[k]: jax_ir.Var(jaxpr.eqns[n].outvars[k].aval) for n, k in hoisted}

    def sub(a: object) -> object:
        return fresh.get(a, a) if not isinstance(a, jax_ir.Literal) else a

    eqns = [e.replace(invars=[sub(a) for a in e.invars]) for e in jaxpr.eqns]
    outvars = []
    for a in jaxpr.outvars:
        if a in fresh:
            # An output the loss returns as computed (an aux count): copied, so a stage owns it.
            own = jax_ir.Var(a.aval)
            eqns.append(jax_ir.new_jaxpr_eqn([fresh[a]], [own], prims.copy_p, {}, jax_ir.no_effects))
            a = own
        outvars.append(a)
    used = {a for a in outvars if not isinstance(a, jax_ir.Literal)}
    kept = []
    for e in reversed(eqns):
        if e.effects or any(v in used for v in e.outvars):
            kept.append(e)
            used.update(a for a in e.invars if not isinstance(a, jax_ir.Literal))
    new = jax_ir.Jaxpr(jaxpr.constvars, [*jaxpr.invars, *fresh.values()], outvars, kept[::-1], jaxpr.effects,
                       jaxpr.debug_info)
    return jax_ir.ClosedJaxpr(new, loss.consts)


def _aux_reduction(kind: RowKind, micro: jax_ir.AbstractValue, whole: jax_ir.AbstractValue) -> AuxReduction | None:
    """An aux leaf's exact combination from its kind, or ``None`` when it has none."""
    if kind is RowKind.PARTIAL:
        return AuxReduction.SUM
    if kind is RowKind.CONST:
        return AuxReduction.LAST
    if kind is RowKind.ROW and row_axis(micro, whole) == 0:
        return AuxReduction.CONCAT
    return None


@compiler_pass
def plan_exact_micro_batching(
    micro: jax_ir.ClosedJaxpr,
    whole: jax_ir.ClosedJaxpr,
    num_diff: int,
    per_micro_batch: Sequence[bool],
    varying: frozenset[int],
    chosen_aux: Sequence[AuxReduction | None],
) -> ExactMicroBatching:
    """The ``ExactMicroBatching`` of a loss jaxpr traced at a smaller batch (``micro``) and at
    the whole batch (``whole``), whose first ``num_diff`` operands are differentiated and whose
    other operands carry the rows where ``per_micro_batch`` says; ``varying``: those that vary
    per micro-batch otherwise (folded keys); ``chosen_aux``: the user's aux reductions
    (``None``: by default).

    Raises:
      ValueError: an aux reduction the user chose for a leaf that combines exactly otherwise,
        naming the leaf and both reductions.
    """
    num_aux = len(micro.out_avals) - 1
    try:
        # Checked first: the hoisting walks both traces' equations side by side.
        if [e.primitive for e in micro.jaxpr.eqns] != [e.primitive for e in whole.jaxpr.eqns]:
            raise StructureMismatch("the two traces' equations differ")
        hoisted = _hoistable(micro, num_diff, per_micro_batch, varying, whole)
        micro_h, whole_h = _hoist(micro, hoisted), _hoist(whole, hoisted)
        in_kinds = [RowKind.CONST] * num_diff + [RowKind.ROW if p else RowKind.CONST for p in per_micro_batch] \
            + [RowKind.CONST] * len(hoisted)
        kinds = analyze_row_kinds(micro_h, whole_h, in_kinds, lambda k: k == 0 or chosen_aux[k - 1] is None)
    except StructureMismatch as e:
        finding = InexactReduction("trace", "the loss function", f"traces differently at another batch size ({e})")
        return ExactMicroBatching(False, (), None, tuple(chosen_aux), (finding,))
    loss_kind = kinds.outputs[0]
    exact = loss_kind in (RowKind.PARTIAL, RowKind.CONST)
    aux = []
    for k in range(num_aux):
        found = _aux_reduction(kinds.outputs[1 + k], micro.out_avals[1 + k], whole.out_avals[1 + k])
        chosen = chosen_aux[k]
        if exact and chosen is not None and found is not None and chosen is not found and not (
                found is AuxReduction.LAST and chosen in (AuxReduction.MEAN, AuxReduction.LAST)):
            raise ValueError(
                f"aux_reduction: aux leaf {k} combines exactly by {found.value!r} (each micro-batch computes its "
                f"share with the whole batch's normalisers), not {chosen.value!r}; leave it unset, or pass "
                f"reduction='mean' (or 'sum') to meshpar.value_and_grad for per-micro-batch values")
        aux.append(chosen if chosen is not None else found)
    if not exact:
        # Per-micro-batch semantics throughout: each micro-batch its own batch, normalisers included.
        return ExactMicroBatching(False, (), kinds, tuple(chosen_aux), kinds.inexact)
    aux = [a if a is not None else default_aux_reduction(micro.out_avals[1 + k], whole.out_avals[1 + k])
           for k, a in enumerate(aux)]
    return ExactMicroBatching(True, hoisted, kinds, tuple(aux), kinds.inexact,
                              scale_loss=loss_kind is RowKind.CONST)


def _scaled(atom: object, parts: int) -> tuple[list[jax_ir.JaxprEqn], object]:
    """Equations computing ``atom / parts`` (``atom`` a float value), and the result: traced by
    JAX, so each equation carries the parameters the running version's rules expect."""
    aval = atom.aval
    traced = jax.make_jaxpr(lambda x: x * np.asarray(1.0 / parts, dtype=aval.dtype))(
        jax.ShapeDtypeStruct(aval.shape, aval.dtype))
    (inner,) = traced.jaxpr.invars
    eqns = [e.replace(invars=[atom if a is inner else a for a in e.invars]) for e in traced.jaxpr.eqns]
    return eqns, traced.jaxpr.outvars[0]


def _edit(jaxpr: jax_ir.Jaxpr, literals: dict[OperandPath, list[LiteralEdit]],
          terms: dict[OperandPath, list[tuple[int, int]]], parts: int, path: OperandPath) -> jax_ir.Jaxpr:
    """``jaxpr`` (at ``path``) with its literal and term edits made, nested bodies included."""
    mine_literals = {(x.eqn, x.operand): x.value for x in literals.get(path, ())}
    mine_terms = {(n, k) for n, k in terms.get(path, ())}
    below = {p[len(path)][0] for p in (*literals, *terms) if len(p) > len(path) and p[:len(path)] == path}
    eqns: list[jax_ir.JaxprEqn] = []
    for n, e in enumerate(jaxpr.eqns):
        invars = list(e.invars)
        for k, a in enumerate(invars):
            if (n, k) in mine_literals:
                invars[k] = jax_ir.Literal(np.array(mine_literals[(n, k)], dtype=a.aval.dtype), a.aval)
            if (n, k) in mine_terms:
                made, invars[k] = _scaled(invars[k], parts)
                eqns.extend(made)
        params = e.params
        if n in below:
            params = dict(params)
            for name, value in e.params.items():
                items = list(enumerate(value)) if isinstance(value, (tuple, list)) else [(-1, value)]
                edited = []
                for k, v in items:
                    sub_path = (*path, (n, name, k))
                    if isinstance(v, (jax_ir.ClosedJaxpr, jax_ir.Jaxpr)):
                        open_ = v.jaxpr if isinstance(v, jax_ir.ClosedJaxpr) else v
                        body = _edit(open_, literals, terms, parts, sub_path)
                        v = jax_ir.ClosedJaxpr(body, v.consts) if isinstance(v, jax_ir.ClosedJaxpr) else body
                    edited.append(v)
                params[name] = type(value)(edited) if isinstance(value, (tuple, list)) else edited[0]
        eqns.append(e.replace(invars=invars, params=params))
    return jax_ir.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects, jaxpr.debug_info)


@compiler_pass
def rewrite_loss(loss: jax_ir.ClosedJaxpr, plan: ExactMicroBatching, parts: int) -> jax_ir.ClosedJaxpr:
    """``loss`` (traced at the size of one of ``parts`` equal shares of the batch: a micro-batch,
    or a replica's share of one) rewritten by ``plan``: hoisted values read as appended
    operands and, when ``plan.exact``, each share computed so that the ``parts`` shares sum to
    the whole batch's loss and aux."""
    if not plan.exact or plan.kinds is None:
        return loss
    # Hoisted (and its dead equations dropped) as the analysis saw it: the edits' indices are its.
    hoisted = _hoist(loss, plan.hoisted)
    literals: dict[OperandPath, list[LiteralEdit]] = {}
    for edit in plan.kinds.literals:
        literals.setdefault(edit.path, []).append(edit)
    terms: dict[OperandPath, list[tuple[int, int]]] = {}
    for path, n, k in plan.kinds.split_terms:
        terms.setdefault(path, []).append((n, k))
    jaxpr = _edit(hoisted.jaxpr, literals, terms, parts, ())
    if plan.scale_loss and parts > 1:
        made, share = _scaled(jaxpr.outvars[0], parts)
        jaxpr = jax_ir.Jaxpr(jaxpr.constvars, jaxpr.invars, [share, *jaxpr.outvars[1:]], [*jaxpr.eqns, *made],
                             jaxpr.effects, jaxpr.debug_info)
    return jax_ir.ClosedJaxpr(jaxpr, hoisted.consts)


def verify_rewritten_loss(original: jax_ir.ClosedJaxpr, rewritten: jax_ir.ClosedJaxpr, plan: ExactMicroBatching) -> None:
    """Raises ``PlanVerificationError`` unless ``rewritten`` type-checks, reads ``original``'s
    operands followed by one per hoisted value, and returns what ``original`` returns."""
    type_check(rewritten.jaxpr, "the rewritten loss")
    n = len(original.jaxpr.invars)
    if [v.aval for v in rewritten.jaxpr.invars[:n]] != [v.aval for v in original.jaxpr.invars]:
        raise PlanVerificationError("the rewritten loss reads other operands than the loss")
    if len(rewritten.jaxpr.invars) != n + len(plan.hoisted):
        raise PlanVerificationError(f"the rewritten loss reads {len(rewritten.jaxpr.invars) - n} hoisted values, "
                                    f"the plan has {len(plan.hoisted)}")
    if [(a.shape, a.dtype) for a in rewritten.out_avals] != [(a.shape, a.dtype) for a in original.out_avals]:
        raise PlanVerificationError("the rewritten loss returns other values than the loss")


@compiler_pass
def hoist_into_step(outer: jax_ir.ClosedJaxpr, whole: jax_ir.ClosedJaxpr, plan: ExactMicroBatching,
                    params: dict) -> jax_ir.ClosedJaxpr:
    """The step ``outer`` (at the whole batch's shapes) computing the plan's hoisted values from
    the gradient equation's operands right before it, and passing them to it as appended
    operands; its equation's ``loss_jaxpr`` is ``whole`` hoisted alike and its other parameters
    ``params``' (the reduction the plan resolved)."""
    jaxpr = outer.jaxpr
    (at,) = [n for n, e in enumerate(jaxpr.eqns) if e.primitive is pipeline_grad_p]
    grad = jaxpr.eqns[at]
    loss = whole.jaxpr
    env: dict[object, object] = dict(zip(loss.invars, grad.invars))
    for v, c in zip(loss.constvars, whole.consts):
        env[v] = jax_ir.Literal(c, v.aval)
    needed = {loss.eqns[n].outvars[k] for n, k in plan.hoisted}
    slice_: set[int] = set()
    for n in range(len(loss.eqns) - 1, -1, -1):
        e = loss.eqns[n]
        if any(v in needed for v in e.outvars):
            slice_.add(n)
            needed.update(a for a in e.invars if not isinstance(a, jax_ir.Literal))
    prologue = []
    for n in sorted(slice_):
        e = loss.eqns[n]
        outvars = [jax_ir.DropVar(v.aval) if isinstance(v, jax_ir.DropVar) else jax_ir.Var(v.aval) for v in e.outvars]
        env.update(zip(e.outvars, outvars))
        prologue.append(e.replace(invars=[env.get(a, a) if not isinstance(a, jax_ir.Literal) else a
                                          for a in e.invars], outvars=outvars))
    extra = [env[loss.eqns[n].outvars[k]] for n, k in plan.hoisted]
    new_grad = grad.replace(invars=[*grad.invars, *extra],
                            params={**grad.params, **params, "loss_jaxpr": _hoist(whole, plan.hoisted)})
    eqns = [*jaxpr.eqns[:at], *prologue, new_grad, *jaxpr.eqns[at + 1:]]
    return jax_ir.ClosedJaxpr(jax_ir.Jaxpr(jaxpr.constvars, jaxpr.invars, jaxpr.outvars, eqns, jaxpr.effects,
                                           jaxpr.debug_info), outer.consts)


class MicroBatchingWarning(UserWarning):
    """A step whose micro-batches cannot reproduce the whole batch's loss and gradients."""


@dataclasses.dataclass(frozen=True)
class MicroBatchedStep:
    """A traced step as its micro-batches run it: ``outer`` computing the hoisted values,
    ``grad_params`` the gradient equation's parameters with the per-micro-batch loss, and how
    micro-batches combine; ``plan`` is ``None`` where no second batch size was traced."""

    outer: jax_ir.ClosedJaxpr
    grad_params: dict
    micro_batching: MicroBatching
    plan: ExactMicroBatching | None

    def share_loss(self, loss: jax_ir.ClosedJaxpr, parts: int) -> jax_ir.ClosedJaxpr:
        """``loss`` traced at ``1 / parts`` of the batch (a data-parallel replica's share of a
        micro-batch), rewritten as the micro-batches' loss is."""
        return loss if self.plan is None else _verified_share(loss, self.plan, parts)


def _verified_share(loss: jax_ir.ClosedJaxpr, plan: ExactMicroBatching, parts: int) -> jax_ir.ClosedJaxpr:
    """``rewrite_loss``, checked by ``verify_rewritten_loss``."""
    rewritten = rewrite_loss(loss, plan, parts)
    verify_rewritten_loss(loss, rewritten, plan)
    return rewritten


@compiler_pass
def micro_batch_step(outer: jax_ir.ClosedJaxpr, micro: dict, whole: dict, probe: dict | None,
                     micro_batching: MicroBatching, name: str, where: str) -> MicroBatchedStep:
    """Resolves how the step ``outer`` (traced at the whole batch) micro-batches: its gradient
    equation's parameters traced per micro-batch (``micro``), at the whole batch (``whole``) and
    at a smaller batch (``probe``; ``None``: the batch has one row). With the default
    ``reduction`` the loss is rewritten exactly (``plan_exact_micro_batching``) or, where it
    cannot be, the step warns and averages per micro-batch; an explicit ``reduction`` keeps
    per-micro-batch semantics and warns where they differ from the whole batch's.

    Raises:
      ValueError: ``exact=True`` and the loss mixes rows, naming each place.
    """
    M = micro_batching.num_micro_batches
    if micro.get("forward_only"):
        where = "its outputs, computed without a gradient"
    else:
        where = f"meshpar.value_and_grad at {where}"
    if probe is None:
        return MicroBatchedStep(outer, micro, micro_batching, None)
    # Per-micro-batch semantics asked for: the plan only checks them, the user's aux reductions apply.
    chosen = micro["aux_reductions"] if micro["reduction"] is None else (None,) * len(micro["aux_reductions"])
    plan = plan_exact_micro_batching(probe["loss_jaxpr"], whole["loss_jaxpr"], micro["num_diff"],
                                     micro_batching.per_micro_batch, micro_batching.fold_keys, chosen)
    inexact = "; ".join(map(str, plan.inexact))
    if micro["reduction"] is not None:
        if plan.exact and plan.hoisted:
            warnings.warn(f"meshpar: {name}: reduction={micro['reduction'].value!r} ({where}) combines per "
                          f"micro-batch, but the loss reduces values of the batch over its rows (a token count or "
                          f"normaliser), which each micro-batch then computes over its own rows only: the step "
                          f"differs from jax.jit's. Leave reduction unset for the exact combination",
                          MicroBatchingWarning, stacklevel=2)
        return MicroBatchedStep(outer, micro, dataclasses.replace(micro_batching, inexact=plan.inexact), None)
    if not plan.exact:
        if micro.get("exact"):
            raise ValueError(f"exact: {name}'s micro-batches cannot reproduce the whole batch's loss and gradients "
                             f"({where}): {inexact}. Each micro-batch would be a batch of "
                             f"its own; to accept that, drop exact=True (or pass reduction='mean')")
        warnings.warn(f"meshpar: {name}: micro-batching is not exact ({where}): {inexact}. "
                      f"Each micro-batch runs as a batch of its own and the step averages their losses and "
                      f"gradients; pass exact=True to make this an error, or num_micro_batches=1",
                      MicroBatchingWarning, stacklevel=2)
        return MicroBatchedStep(outer, micro, dataclasses.replace(micro_batching, reduction=LossReduction.MEAN,
                                                                  inexact=plan.inexact), plan=None)
    if plan.inexact:
        warnings.warn(f"meshpar: {name}: values that micro-batches cannot reproduce ({where}): {inexact}; they "
                      f"combine by their default reductions (floats averaged), the loss and gradients exactly",
                      MicroBatchingWarning, stacklevel=2)
    loss = _verified_share(micro["loss_jaxpr"], plan, M)
    resolved = {"reduction": LossReduction.SUM, "aux_reductions": plan.aux}
    stepped = hoist_into_step(outer, whole["loss_jaxpr"], plan, resolved)
    combined = dataclasses.replace(
        micro_batching, reduction=LossReduction.SUM, aux=plan.aux, exact=True, whole_batch_values=len(plan.hoisted),
        per_micro_batch=(*micro_batching.per_micro_batch, *[False] * len(plan.hoisted)), inexact=plan.inexact)
    return MicroBatchedStep(stepped, {**micro, **resolved, "loss_jaxpr": loss}, combined, plan)
