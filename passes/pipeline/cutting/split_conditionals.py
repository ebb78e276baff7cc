"""Pass: conditionals over values of several meshes become conditionals of one mesh each.

Optimizer wrappers put the whole update under one ``lax.cond``: ``optax.apply_if_finite``
chooses between the update and keeping the state, ``optax.MultiSteps`` wraps its accumulation
in a cond whose predicate is a constant. Placed as one equation, such a cond would gather every
gradient and optimizer-state leaf onto one mesh. Three rewrites keep each leaf's work on its mesh:

- ``inline_fixed_calls``: a cond whose index is a literal is replaced by the equations of
  the branch it takes, which are then placed one by one like any other equation; so is a
  ``jax.jit`` call its author asked to inline (optax's tree utilities: JAX 0.10 inlined them
  while tracing, 0.11+ keeps the call until lowering), whose body may span several meshes.
- ``split_cond``: a cond's outputs are grouped by the meshes of the operands they depend on,
  through any branch; each group becomes a cond with the same index over the branches cut down
  to its outputs. Operands with at most one element (the index, step counts, flags, scalar
  parameters) and operands of no mesh are *free*: every group may read them, so they are what
  crosses meshes. Outputs depending on no larger operand of a mesh are grouped by the mesh of
  the one-element ones they depend on (a scalar parameter's update stays with it); a value
  combined from several meshes' scalars, such as the index, belongs to none.
- ``cut_cond``: where a branch combines one-element values of several meshes (a global norm
  adding per-parameter sums, as ``optax.clip_by_global_norm`` inside ``apply_if_finite`` does),
  no grouping of outputs separates the meshes. The cond becomes two with its index: the first
  computes those one-element values, the second the rest, reading them as free operands; each
  then splits. The second recomputes what both need (none of a global norm's work).

All three keep the jaxpr's meaning: a cond's branches are pure (conds with effects are left
whole), so evaluating a branch's outputs in several conds with one index equals evaluating them
in one."""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
from jax.extend.core.primitives import cond_p

from ...compiler_pass import compiler_pass
from ... import jax_ir

__all__ = ["cut_cond", "inline_fixed_calls", "split_cond"]

# A set of meshes whose values a value depends on.
Label = frozenset[int]
_FREE: Label = frozenset()
# Which operands of a cond a value depends on: bit j for operand j.
Deps = int


@compiler_pass
def inline_fixed_calls(jaxpr: jax_ir.Jaxpr) -> jax_ir.Jaxpr:
    """``jaxpr`` with every top-level cond whose index is a literal replaced by its taken
    branch's equations, and every jit call asking to be inlined by its body's, renamed,
    recursively (such a call inside an inlined body is inlined too). Equations and variables
    not inside an inlined body are kept as they are (the same objects, unless an operand was
    an inlined call's output); a body with constants stays a call.
    """
    env: dict[jax_ir.Var, jax_ir.Atom] = {}
    eqns: list[jax_ir.JaxprEqn] = []
    _inline_into(eqns, jaxpr, env, fresh=False)
    outvars = [_read(env, v) for v in jaxpr.outvars]
    if len(eqns) == len(jaxpr.eqns) and all(a is b for a, b in zip(eqns, jaxpr.eqns)):
        return jaxpr
    return jaxpr.replace(eqns=eqns, outvars=outvars)


def _read(env: dict[jax_ir.Var, jax_ir.Atom], v: jax_ir.Atom) -> jax_ir.Atom:
    return env.get(v, v) if isinstance(v, jax_ir.Var) else v


def _fixed_body(e: jax_ir.JaxprEqn) -> tuple[jax_ir.ClosedJaxpr, list[jax_ir.Atom]] | None:
    """The body ``e`` runs and its operands, if ``e`` is a cond with a literal index (the branch
    it takes) or a jit asking to be inlined, without constants; else None."""
    if e.primitive is cond_p and isinstance(e.invars[0], jax_ir.Literal):
        branches = e.params["branches"]
        # lax.switch clamps its index into range; a literal index is clamped the same way.
        body, operands = branches[int(np.clip(int(e.invars[0].val), 0, len(branches) - 1))], e.invars[1:]
    elif jax_ir.inline_requested(e):
        body, operands = e.params["jaxpr"], e.invars
    else:
        return None
    return None if body.consts else (body, list(operands))


def _inline_into(out: list[jax_ir.JaxprEqn], jaxpr: jax_ir.Jaxpr, env: dict[jax_ir.Var, jax_ir.Atom],
                 fresh: bool) -> None:
    """Appends ``jaxpr``'s equations to ``out``, each operand read through ``env``; with ``fresh``
    every equation's results get new variables (a branch may be inlined more than once)."""
    for e in jaxpr.eqns:
        invars = [_read(env, v) for v in e.invars]
        e = e if all(a is b for a, b in zip(invars, e.invars)) else e.replace(invars=invars)
        fixed = _fixed_body(e)
        if fixed is not None:
            body, operands = fixed
            inner = dict(zip(body.jaxpr.invars, operands))
            _inline_into(out, body.jaxpr, inner, fresh=True)
            env.update((o, _read(inner, r)) for o, r in zip(e.outvars, body.jaxpr.outvars))
            continue
        if fresh:
            outvars = [jax_ir.DropVar(v.aval) if isinstance(v, jax_ir.DropVar) else jax_ir.Var(v.aval)
                       for v in e.outvars]
            env.update(zip(e.outvars, outvars))
            e = e.replace(outvars=outvars)
        out.append(e)


@compiler_pass
def split_cond(eqn: jax_ir.JaxprEqn, owners: Sequence[int | None]) -> list[tuple[jax_ir.JaxprEqn, Label]] | None:
    """``eqn`` as conds that together compute its outputs, each with the meshes its outputs
    depend on; None if ``eqn`` is not a cond without effects.

    Args:
      eqn: any equation.
      owners: per operand of ``eqn``, the mesh it belongs to, or None.

    Returns:
      ``(cond, label)`` pairs: every output of ``eqn`` is an output of exactly one cond (the
      same variable), and each cond reads the same index. Apart from free operands (module
      docstring), a cond reads only operands of the meshes in its label. If it reads none, its
      label is the mesh of the one-element operands its outputs depend on, if they have one
      (values combined from several meshes' scalars, such as the index, belong to none); an
      empty label means it reads no operand of a mesh but those. A single pair when nothing
      splits (then ``eqn`` itself).
    """
    if eqn.primitive is not cond_p or eqn.effects:
        return None
    large = _large_operands(eqn, owners)
    deps = _eqn_flow(eqn, [1 << j for j in range(len(eqn.invars))], _any_of)
    small = [_FREE if j == 0 or m is None or isinstance(v, jax_ir.Literal) or not _is_free(v) else frozenset((m,))
             for j, (v, m) in enumerate(zip(eqn.invars, owners))]
    labels = [_meshes(d, large) or s for d, s in zip(deps, _eqn_flow(eqn, small, _one_mesh))]
    groups: dict[Label, list[bool]] = {}
    for k, label in enumerate(labels):
        groups.setdefault(label, [False] * len(labels))[k] = True
    if len(groups) <= 1:
        return [(eqn, labels[0] if labels else _FREE)]
    # The cond's own dead-code rule cuts the branches down to a group's outputs.
    dce = jax_ir.dce_rule(cond_p)
    return [(dce(used, eqn)[1], label) for label, used in sorted(groups.items(), key=lambda g: sorted(g[0]))]


@compiler_pass
def cut_cond(eqn: jax_ir.JaxprEqn, owners: Sequence[int | None]) -> tuple[jax_ir.JaxprEqn, jax_ir.JaxprEqn] | None:
    """``eqn`` as two conds with its index, the first cut at the one-element values of one mesh
    its branches combine with other meshes' values (module docstring); None if no branch
    combines such values, or ``eqn`` is not a cond without effects.

    Args:
      eqn: any equation.
      owners: per operand of ``eqn``, the mesh it belongs to, or None.

    Returns:
      ``(first, second)``: ``first`` reads some of ``eqn``'s operands and returns, in branch
      ``k``, branch ``k``'s cut values (one element each, depending on one mesh's larger
      operands) and zeros for the other branches' ones; ``second`` reads ``eqn``'s operands and
      ``first``'s results and returns ``eqn``'s outputs (the same variables).
    """
    if eqn.primitive is not cond_p or eqn.effects:
        return None
    branches = eqn.params["branches"]
    large = _large_operands(eqn, owners)
    cuts = [_cut_values(b.jaxpr, [1 << j for j in range(1, len(eqn.invars))], large) for b in branches]
    if not any(cuts):
        return None
    slots = [(k, v) for k, vs in enumerate(cuts) for v in vs]
    values = [jax_ir.Var(v.aval) for _, v in slots]
    first = [_cut_branch(b, k, cuts[k], slots) for k, b in enumerate(branches)]
    second = [_rest_branch(b, k, slots) for k, b in enumerate(branches)]
    dce = jax_ir.dce_rule(cond_p)
    return (dce([True] * len(values), eqn.replace(outvars=values, params=dict(eqn.params, branches=tuple(first))))[1],
            dce([True] * len(eqn.outvars), eqn.replace(invars=[*eqn.invars, *values],
                                                        params=dict(eqn.params, branches=tuple(second))))[1])


def _large_operands(eqn: jax_ir.JaxprEqn, owners: Sequence[int | None]) -> dict[int, Deps]:
    """Per mesh, its operands of ``eqn`` that are not free."""
    masks: dict[int, Deps] = {}
    for j, (v, m) in enumerate(zip(eqn.invars, owners)):
        if m is not None and not _is_free(v):
            masks[m] = masks.get(m, 0) | 1 << j
    return masks


def _meshes(deps: Deps, masks: dict[int, Deps]) -> Label:
    return frozenset(m for m, mask in masks.items() if deps & mask)


def _any_of(deps: Sequence[Deps]) -> Deps:
    return functools.reduce(operator.or_, deps, 0)


def _one_mesh(labels: Sequence[Label]) -> Label:
    """The mesh of a value computed from ``labels``' values; none where meshes combine."""
    union = frozenset().union(*labels)
    return union if len(union) <= 1 else _FREE


Flow = TypeVar("Flow", Deps, Label)


def _eqn_flow(e: jax_ir.JaxprEqn, ins: Sequence[Flow], join: Callable[[Sequence[Flow]], Flow]) -> list[Flow]:
    """Per output of ``e``, ``join`` of what flows in from the operands it depends on: per output
    through cond branches and calls (jit, eval_jaxpr), from every operand for other primitives."""
    if e.primitive is cond_p:
        per_branch = [_jaxpr_flow(b.jaxpr, ins[1:], join) for b in e.params["branches"]]
        return [join([ins[0], *outs]) for outs in zip(*per_branch)]
    body = jax_ir.call_body(e)
    if body is not None:
        return _jaxpr_flow(body.jaxpr, ins, join)
    return [join(ins)] * len(e.outvars)


def _jaxpr_flow(jaxpr: jax_ir.Jaxpr, ins: Sequence[Flow], join: Callable[[Sequence[Flow]], Flow]) -> list[Flow]:
    env: dict[jax_ir.Var, Flow] = dict(zip(jaxpr.invars, ins))
    for e in jaxpr.eqns:
        env.update(zip(e.outvars, _eqn_flow(e, _flows(env, e.invars, join), join)))
    return _flows(env, jaxpr.outvars, join)


def _flows(env: dict[jax_ir.Var, Flow], atoms: Sequence[jax_ir.Atom],
           join: Callable[[Sequence[Flow]], Flow]) -> list[Flow]:
    """What flows out of ``atoms``: nothing (``join`` of none) out of literals and constants."""
    nothing = join([])
    return [env.get(v, nothing) if isinstance(v, jax_ir.Var) else nothing for v in atoms]


def _cut_values(jaxpr: jax_ir.Jaxpr, in_deps: Sequence[Deps], large: dict[int, Deps]) -> list[jax_ir.Var]:
    """The one-element values of one mesh that ``jaxpr``'s equations combine with other meshes'
    values (not PRNG keys, which have no zero)."""
    env: dict[jax_ir.Var, Deps] = dict(zip(jaxpr.invars, in_deps))
    cuts: dict[jax_ir.Var, None] = {}
    for e in jaxpr.eqns:
        ins = _flows(env, e.invars, _any_of)
        outs = _eqn_flow(e, ins, _any_of)
        env.update(zip(e.outvars, outs))
        if len(_meshes(_any_of(outs), large)) < 2:
            continue
        # Which of e's operands each of its results depends on: cut only what meets another mesh.
        reads = _eqn_flow(e, [1 << i for i in range(len(e.invars))], _any_of)
        for out, read in zip(outs, reads):
            if len(_meshes(out, large)) > 1:
                cuts.update((v, None) for i, (v, d) in enumerate(zip(e.invars, ins))
                            if read >> i & 1 and len(_meshes(d, large)) == 1 and _is_free(v)
                            and isinstance(v.aval.dtype, np.dtype))
    return list(cuts)


def _cut_branch(branch: jax_ir.ClosedJaxpr, k: int, mine: Sequence[jax_ir.Var],
                slots: Sequence[tuple[int, jax_ir.Var]]) -> jax_ir.ClosedJaxpr:
    """Branch ``k`` of the first cond: its cut values ``mine``, zeros in the other branches' slots."""
    sliced, _ = jax_ir.dce_jaxpr(branch.jaxpr.replace(outvars=list(mine)), True, instantiate=True)
    out = iter(sliced.outvars)
    outvars = [next(out) if j == k else jax_ir.Literal(np.zeros(v.aval.shape, v.aval.dtype), v.aval) for j, v in slots]
    return jax_ir.ClosedJaxpr(sliced.replace(outvars=outvars), branch.consts)


def _rest_branch(branch: jax_ir.ClosedJaxpr, k: int, slots: Sequence[tuple[int, jax_ir.Var]]) -> jax_ir.ClosedJaxpr:
    """Branch ``k`` of the second cond: ``branch`` reading its cut values from the first's results."""
    read = [jax_ir.Var(v.aval) for _, v in slots]
    env = {v: r for (j, v), r in zip(slots, read) if j == k}
    jaxpr = branch.jaxpr
    eqns = [e.replace(invars=[_read(env, v) for v in e.invars]) for e in jaxpr.eqns]
    rest = jaxpr.replace(invars=[*jaxpr.invars, *read], eqns=eqns, outvars=[_read(env, v) for v in jaxpr.outvars])
    rest, _ = jax_ir.dce_jaxpr(rest, True, instantiate=True)
    return jax_ir.ClosedJaxpr(rest, branch.consts)


def _is_free(v: jax_ir.Atom) -> bool:
    """At most one element (or a literal): a value any mesh may read, moved if need be."""
    return isinstance(v, jax_ir.Literal) or int(np.prod(getattr(v.aval, "shape", ()), dtype=np.int64)) <= 1
