"""How each value of a loss function depends on the batch rows: the analysis behind exact
micro-batching (``exact_micro_batching``).

The loss jaxpr is read twice, traced at a smaller batch (``micro``) and at the whole batch
(``whole``); the two traces have the same equations, and a value's row axis is the one axis
whose length scales with the batch between them. Every value gets a ``RowKind``:

- ``CONST``: no batch row reaches it (parameters, constants, values computed once on the whole
  batch): equal in every micro-batch.
- ``ROW``: one entry per batch row along its row axis; a micro-batch computes its own rows.
- ``PARTIAL``: a micro-batch's share of a sum over the rows, linear in it: the whole batch's
  value is the sum of the micro-batches' shares. A ``reduce_sum`` over the row axis makes one;
  adding, negating, scaling by a ``CONST``, reshaping and the like keep it.
- ``MIXED``: the rows combined in any other way (a max over rows, a product or a nonlinear
  function of a row sum, statistics normalising the rows they came from: BatchNorm). No
  combination of per-micro-batch values gives the whole batch's; each such place becomes an
  ``InexactReduction``.

A loss (and aux value) that is ``PARTIAL`` or ``CONST`` micro-batches exactly once the
per-micro-batch program is rewritten so its shares add up: scalars that differ between the
traces (a mean's divisor: the micro-batch's row count) take the whole batch's value, and a
``CONST`` term added to a share is split evenly over the shares (``Rewrites``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

import numpy as np
from jax.extend.core import primitives as prims

from ... import jax_ir
from .stage_graph import user_location

__all__ = ["InexactReduction", "LiteralEdit", "OperandPath", "RowKind", "RowKinds", "StructureMismatch",
           "analyze_row_kinds", "row_axis"]


class RowKind(enum.IntEnum):
    """How a value depends on the batch rows (module doc); ordered so ``max`` joins kinds."""

    CONST = 0
    ROW = 1
    PARTIAL = 2
    MIXED = 3


@dataclasses.dataclass(frozen=True)
class InexactReduction:
    """A place where a parameter-dependent value mixes batch rows so that micro-batches cannot
    reproduce the whole batch's value: the primitive, the user's source line, and why."""

    primitive: str
    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.primitive} at {self.where}: {self.why}"


class StructureMismatch(ValueError):
    """The loss traced at two batch sizes has different equations: no value can be paired."""


# A path to a nested jaxpr: per level, (equation index, parameter name, position in a tuple
# parameter or -1); the top level is the empty path.
OperandPath = tuple[tuple[int, str, int], ...]


@dataclasses.dataclass(frozen=True)
class LiteralEdit:
    """Operand ``operand`` of equation ``eqn`` (in the jaxpr at ``path``) is a scalar literal
    whose whole-batch value ``value`` replaces the micro-batch's."""

    path: OperandPath
    eqn: int
    operand: int
    value: float | int


@dataclasses.dataclass(frozen=True)
class RowKinds:
    """The analysis of one loss jaxpr (module doc).

    Attributes:
      outputs: per loss output (loss, then aux leaves), its kind.
      inexact: every place a parameter-dependent value mixes rows and reaches an output.
      literals: scalars to take from the whole batch's trace.
      split_terms: ``(path, eqn, operand)`` of ``CONST`` terms added to a ``PARTIAL`` value:
        each micro-batch adds ``1 / parts`` of it.
    """

    outputs: tuple[RowKind, ...]
    inexact: tuple[InexactReduction, ...]
    literals: tuple[LiteralEdit, ...]
    split_terms: tuple[tuple[OperandPath, int, int], ...]


def row_axis(micro: jax_ir.AbstractValue, whole: jax_ir.AbstractValue) -> int | None:
    """The axis along which ``whole`` (the whole batch's aval) has more entries than ``micro``,
    ``None`` when their shapes are equal, and ``-1`` when several axes differ (rows paired with
    rows: a batch-by-batch matrix)."""
    a, b = getattr(micro, "shape", ()), getattr(whole, "shape", ())
    if tuple(a) == tuple(b):
        return None
    if len(a) != len(b):
        return -1
    differing = [k for k, (x, y) in enumerate(zip(a, b)) if x != y]
    return differing[0] if len(differing) == 1 else -1


# Primitives linear in every operand at once (a sum of shares stays one).
_ADDITIVE = {prims.add_p, prims.sub_p, prims.add_jaxvals_p}
# Primitives linear in operand 0, whose other operands (indices, shapes) must be CONST.
_LINEAR_IN_FIRST = {
    prims.neg_p, prims.convert_element_type_p, prims.reshape_p, prims.broadcast_in_dim_p, prims.squeeze_p,
    prims.transpose_p, prims.slice_p, prims.reduce_sum_p, prims.copy_p, prims.real_p, prims.imag_p,
    prims.reduce_precision_p, prims.rev_p, prims.dynamic_slice_p, prims.stop_gradient_p, prims.cumsum_p,
    prims.sharding_constraint_p,
}
# Reductions that, over the row axis, give something other than a sum of shares.
_ROW_MIXING_REDUCTIONS = {
    prims.reduce_max_p: "a max over the batch rows", prims.reduce_min_p: "a min over the batch rows",
    prims.reduce_prod_p: "a product over the batch rows", prims.argmax_p: "an argmax over the batch rows",
    prims.argmin_p: "an argmin over the batch rows", prims.reduce_and_p: "an 'all' over the batch rows",
    prims.reduce_or_p: "an 'any' over the batch rows", prims.reduce_xor_p: "a xor over the batch rows",
}
_CUMULATIVE = {prims.cumsum_p, prims.cumprod_p, prims.cummax_p, prims.cummin_p, prims.cumlogsumexp_p}
# Arithmetic whose scalar literals may stand for the batch size (a mean's divisor).
_BATCH_SCALARS = {prims.div_p, prims.mul_p, prims.add_p, prims.sub_p, prims.max_p, prims.min_p}
_CALLS = {prims.jit_p, prims.closed_call_p, prims.call_p, prims.remat_p}
_CUSTOM_DERIVATIVES = {prims.custom_jvp_call_p, prims.custom_vjp_call_p}


def _scalar(value: object) -> float | int:
    return value.item() if hasattr(value, "item") else value


def _is_float(atom: object) -> bool:
    return np.issubdtype(np.dtype(atom.aval.dtype), np.inexact)


def _reduced_axes(eqn: jax_ir.JaxprEqn) -> tuple[int, ...]:
    params = eqn.params
    if "axes" in params:
        return tuple(params["axes"])
    if "axis" in params:
        return (params["axis"],)
    if "dimension" in params:
        return (params["dimension"],)
    return ()


class _Analysis:
    """One walk over paired jaxprs, collecting kinds, findings and edits."""

    def __init__(self) -> None:
        # Off while a loop body's kinds settle: its edits are recorded once, on the last walk.
        self.recording = True
        self.inexact: dict[int, InexactReduction] = {}
        self.literals: list[LiteralEdit] = []
        self.split_terms: list[tuple[OperandPath, int, int]] = []
        self.origins: dict[object, frozenset[int]] = {}

    def finding(self, eqn: jax_ir.JaxprEqn, why: str) -> frozenset[int]:
        key = len(self.inexact)
        self.inexact[key] = InexactReduction(eqn.primitive.name, user_location(eqn), why)
        return frozenset({key})

    def jaxpr(self, micro: jax_ir.Jaxpr, whole: jax_ir.Jaxpr, in_kinds: Sequence[RowKind],
              in_origins: Sequence[frozenset[int]], path: OperandPath, editable: bool
              ) -> tuple[list[RowKind], list[frozenset[int]]]:
        """Kinds (and the findings each ``MIXED`` one came from) of ``micro``'s outputs, given its
        inputs'. ``editable``: literal and term edits can be made here (not inside a custom
        derivative, whose rules would keep the micro-batch's)."""
        if len(micro.eqns) != len(whole.eqns) or len(micro.invars) != len(whole.invars):
            raise StructureMismatch(f"{len(micro.eqns)} equations at one batch size, {len(whole.eqns)} at another")
        kind: dict[object, RowKind] = {}
        origin: dict[object, frozenset[int]] = {}
        for v, k, o in zip(micro.invars, in_kinds, in_origins):
            kind[v], origin[v] = k, o
        for v in micro.constvars:
            kind[v], origin[v] = RowKind.CONST, frozenset()

        def of(atom: object) -> tuple[RowKind, frozenset[int]]:
            if isinstance(atom, jax_ir.Literal):
                return RowKind.CONST, frozenset()
            return kind[atom], origin[atom]

        for n, (e, w) in enumerate(zip(micro.eqns, whole.eqns)):
            if e.primitive is not w.primitive or len(e.invars) != len(w.invars) or len(e.outvars) != len(w.outvars):
                raise StructureMismatch(f"equation {n}: {e.primitive} at one batch size, {w.primitive} at another")
            ins = [of(a) for a in e.invars]
            differ = [k for k, (a, b) in enumerate(zip(e.invars, w.invars))
                      if isinstance(a, jax_ir.Literal) and isinstance(b, jax_ir.Literal) and np.shape(a.val) == ()
                      and np.shape(b.val) == () and a.val != b.val]
            if differ and (not editable or e.primitive not in _BATCH_SCALARS):
                # A constant that depends on the batch size where the whole batch's cannot be put.
                where = "inside a custom derivative" if not editable else f"in {e.primitive.name}"
                outs = [(RowKind.MIXED, self.finding(e, f"uses a constant that depends on the batch size {where}"))
                        ] * len(e.outvars)
            else:
                if self.recording:
                    self.literals.extend(LiteralEdit(path, n, k, _scalar(w.invars[k].val)) for k in differ)
                outs = self.equation(n, e, w, [k for k, _ in ins], [o for _, o in ins], path, editable)
            for v, (k, o) in zip(e.outvars, outs):
                kind[v], origin[v] = k, o
        results = [of(a) for a in micro.outvars]
        return [k for k, _ in results], [o for _, o in results]

    def equation(self, n: int, e: jax_ir.JaxprEqn, w: jax_ir.JaxprEqn, kinds: list[RowKind],
                 origins: list[frozenset[int]], path: OperandPath, editable: bool
                 ) -> list[tuple[RowKind, frozenset[int]]]:
        joined = frozenset().union(*origins) if origins else frozenset()
        axes_out = [row_axis(a.aval, b.aval) for a, b in zip(e.outvars, w.outvars)]
        if RowKind.MIXED in kinds:
            return [(RowKind.MIXED, joined)] * len(e.outvars)
        nested = self.nested(n, e, w, kinds, origins, path, editable)
        if nested is not None:
            return nested
        if RowKind.PARTIAL in kinds:
            return [self.partial(n, e, kinds, path, editable, joined)] * len(e.outvars)
        if all(k is RowKind.CONST for k in kinds):
            return [(RowKind.ROW, frozenset()) if a is not None and a >= 0 else
                    (RowKind.MIXED, self.finding(e, "pairs batch rows with batch rows")) if a == -1 else
                    (RowKind.CONST, frozenset()) for a in axes_out]
        # Some operand is ROW.
        axes_in = [row_axis(a.aval, b.aval) if not isinstance(a, jax_ir.Literal) else None
                   for a, b in zip(e.invars, w.invars)]
        rows_reduced = any(k is RowKind.ROW and ax is not None and ax in _reduced_axes(e)
                           for k, ax in zip(kinds, axes_in))
        if e.primitive is prims.reduce_sum_p and rows_reduced:
            return [(RowKind.PARTIAL, frozenset())]
        if e.primitive in _ROW_MIXING_REDUCTIONS and rows_reduced:
            return [(RowKind.MIXED, self.finding(e, _ROW_MIXING_REDUCTIONS[e.primitive]))] * len(e.outvars)
        if e.primitive in _CUMULATIVE and rows_reduced:
            return [(RowKind.MIXED, self.finding(e, "a running total along the batch rows"))] * len(e.outvars)
        if e.primitive is prims.dot_general_p:
            return [self.dot(e, kinds, axes_in, axes_out[0])]
        results = []
        for a in axes_out:
            if a is not None and a >= 0:
                results.append((RowKind.ROW, frozenset()))
            elif a == -1:
                results.append((RowKind.MIXED, self.finding(e, "pairs batch rows with batch rows")))
            else:
                results.append((RowKind.MIXED, self.finding(e, "reduces over the batch rows other than by a sum")))
        return results

    def dot(self, e: jax_ir.JaxprEqn, kinds: list[RowKind], axes_in: list[int | None],
            out_axis: int | None) -> tuple[RowKind, frozenset[int]]:
        (contract_l, contract_r), _ = e.params["dimension_numbers"]
        rows = [ax if k is RowKind.ROW else None for k, ax in zip(kinds, axes_in)]
        if rows[0] is not None and rows[1] is not None and rows[0] in contract_l and rows[1] in contract_r \
                and list(contract_l).index(rows[0]) == list(contract_r).index(rows[1]):
            return RowKind.PARTIAL, frozenset()
        if out_axis is not None and out_axis >= 0 and not any(
                r is not None and r in c for r, c in zip(rows, (contract_l, contract_r))):
            return RowKind.ROW, frozenset()
        return RowKind.MIXED, self.finding(e, "contracts batch rows with values of other rows")

    def partial(self, n: int, e: jax_ir.JaxprEqn, kinds: list[RowKind], path: OperandPath, editable: bool,
                joined: frozenset[int]) -> tuple[RowKind, frozenset[int]]:
        """The kind of ``e``'s outputs when some operand is ``PARTIAL`` (none ``MIXED``)."""
        p = e.primitive
        partial = [k is RowKind.PARTIAL for k in kinds]
        if RowKind.ROW in kinds:
            return RowKind.MIXED, self.finding(e, "combines each batch row with a sum over the batch rows")
        if p in _ADDITIVE or (p is prims.select_n_p and not partial[0]):
            # Affine: a batch-independent term (an added constant, the other branch of a
            # select) is split evenly over the shares, which then sum to it.
            terms = [k for k, is_partial in enumerate(partial) if not is_partial and (p is not prims.select_n_p or k)]
            if any(not _is_float(e.invars[k]) for k in terms):
                return RowKind.MIXED, self.finding(e, "adds an integer constant to a count over the batch rows")
            if terms and not editable:
                return RowKind.MIXED, self.finding(e, "adds a batch-independent term to a sum over the batch rows "
                                                      "inside a custom derivative")
            if self.recording:
                self.split_terms.extend((path, n, k) for k in terms)
            return RowKind.PARTIAL, frozenset()
        if p is prims.convert_element_type_p and not _is_float(e.outvars[0]) and _is_float(e.invars[0]):
            return RowKind.MIXED, self.finding(e, "rounds a sum over the batch rows to an integer")
        if p in _LINEAR_IN_FIRST and partial[0] and not any(partial[1:]):
            return RowKind.PARTIAL, frozenset()
        if p in (prims.mul_p, prims.dot_general_p) and sum(partial) == 1:
            return RowKind.PARTIAL, frozenset()
        if p is prims.div_p and partial == [True, False]:
            return RowKind.PARTIAL, frozenset()
        if p is prims.concatenate_p and all(partial):
            return RowKind.PARTIAL, frozenset()
        return RowKind.MIXED, self.finding(e, f"is not linear in a sum over the batch rows")

    def nested(self, n: int, e: jax_ir.JaxprEqn, w: jax_ir.JaxprEqn, kinds: list[RowKind],
               origins: list[frozenset[int]], path: OperandPath, editable: bool
               ) -> list[tuple[RowKind, frozenset[int]]] | None:
        """Kinds of a call, custom derivative, scan, cond or while equation's outputs from its
        bodies; ``None`` for an equation with no body."""
        p = e.primitive
        bodies = _bodies(e)
        if not bodies:
            return None
        bodies_by_name = {name: body for name, _, body in bodies}
        whole = {(name, k): body for name, k, body in _bodies(w)}
        if any((name, k) not in whole for name, k, _ in bodies):
            raise StructureMismatch(f"equation {n}: {p} has other bodies at another batch size")
        if all(k is RowKind.CONST for k in kinds) and all(
                row_axis(a.aval, b.aval) is None for a, b in zip(e.outvars, w.outvars)):
            return [(RowKind.CONST, frozenset())] * len(e.outvars)

        def run(name: str, k: int, body: jax_ir.Jaxpr, in_kinds: list[RowKind], in_origins: list[frozenset[int]],
                edits: bool) -> tuple[list[RowKind], list[frozenset[int]]]:
            return self.jaxpr(body, whole[(name, k)], in_kinds, in_origins, (*path, (n, name, k)), edits)

        if p in _CALLS or p in _CUSTOM_DERIVATIVES:
            name, k, body = bodies[0]
            out_kinds, out_origins = run(name, k, body, kinds, origins, editable and p not in _CUSTOM_DERIVATIVES)
            return list(zip(out_kinds, out_origins))
        if p is prims.scan_p:
            num_consts, num_carry = jax_ir.scan_operand_counts(e)
            name, k, body = bodies[0]
            outs = self.loop(lambda ks, os, edits: run(name, k, body, ks, os, edits), kinds, origins,
                             num_consts, num_carry, editable)
            self.split_initial_carry(n, e, path, kinds, outs, num_consts, num_carry, editable)
            return outs
        if p is prims.while_p:
            cond_consts, body_consts = e.params["cond_nconsts"], e.params["body_nconsts"]
            carry_kinds = kinds[cond_consts + body_consts:]
            carry_origins = origins[cond_consts + body_consts:]
            body_kinds = kinds[cond_consts:cond_consts + body_consts]
            body_origins = origins[cond_consts:cond_consts + body_consts]
            outs = self.loop(lambda ks, os, edits: run("body_jaxpr", -1, bodies_by_name["body_jaxpr"], ks, os, edits),
                             [*body_kinds, *carry_kinds], [*body_origins, *carry_origins], body_consts,
                             len(carry_kinds), editable)
            self.split_initial_carry(n, e, path, kinds, outs, cond_consts + body_consts, len(carry_kinds), editable)
            settled = [k for k, _ in outs]
            (predicate,), _ = run("cond_jaxpr", -1, bodies_by_name["cond_jaxpr"], [*kinds[:cond_consts], *settled],
                                  [*origins[:cond_consts], *(o for _, o in outs)], False)
            if predicate is not RowKind.CONST:
                return [(RowKind.MIXED, self.finding(e, "loops until a condition on the batch rows"))] * len(e.outvars)
            return outs
        if p is prims.cond_p:
            if kinds[0] is not RowKind.CONST:
                return [(RowKind.MIXED, self.finding(e, "branches on a value of the batch rows"))] * len(e.outvars)
            results: list[tuple[RowKind, frozenset[int]]] = []
            for name, k, body in bodies:
                out_kinds, out_origins = run(name, k, body, kinds[1:], origins[1:], editable)
                branch = list(zip(out_kinds, out_origins))
                results = branch if not results else [(max(a[0], b[0]), a[1] | b[1]) for a, b in zip(results, branch)]
            return results
        return [(RowKind.MIXED, frozenset().union(*origins) | self.finding(e, "is a primitive with a body meshpar "
                                                                           "does not analyse"))] * len(e.outvars)

    def split_initial_carry(self, n: int, e: jax_ir.JaxprEqn, path: OperandPath, kinds: list[RowKind],
                            outs: list[tuple[RowKind, frozenset[int]]], first: int, num_carry: int,
                            editable: bool) -> None:
        """A loop's ``CONST`` initial carry that the loop turns into a sum over rows is added once
        per share: each micro-batch starts from its share of it."""
        for c in range(num_carry):
            if kinds[first + c] is RowKind.CONST and outs[c][0] is RowKind.PARTIAL and editable and self.recording:
                self.split_terms.append((path, n, first + c))

    def loop(self, run: Callable[[list[RowKind], list[frozenset[int]], bool], tuple[list[RowKind], list[frozenset[int]]]],
             kinds: list[RowKind], origins: list[frozenset[int]], num_consts: int, num_carry: int, editable: bool
             ) -> list[tuple[RowKind, frozenset[int]]]:
        """A loop body's output kinds once its carried kinds settle (each walk can only raise
        them), the edits recorded on the last walk, which applies to every iteration."""
        carry = list(kinds[num_consts:num_consts + num_carry])
        carry_origins = list(origins[num_consts:num_consts + num_carry])

        def walk(edits: bool) -> tuple[list[RowKind], list[frozenset[int]]]:
            return run([*kinds[:num_consts], *carry, *kinds[num_consts + num_carry:]],
                       [*origins[:num_consts], *carry_origins, *origins[num_consts + num_carry:]], edits)

        recording, self.recording = self.recording, False
        try:
            for _ in range(len(RowKind)):
                out_kinds, out_origins = walk(editable)
                joined = [max(a, b) for a, b in zip(carry, out_kinds[:num_carry])]
                carry_origins = [a | b for a, b in zip(carry_origins, out_origins[:num_carry])]
                if joined == carry:
                    break
                carry = joined
        finally:
            self.recording = recording
        out_kinds, out_origins = walk(editable)
        return list(zip(out_kinds, out_origins))


def _bodies(eqn: jax_ir.JaxprEqn) -> list[tuple[str, int, jax_ir.Jaxpr]]:
    """``(parameter, position or -1, open jaxpr)`` of every body nested in ``eqn``."""
    found = []
    for name, value in eqn.params.items():
        items = list(enumerate(value)) if isinstance(value, (tuple, list)) else [(-1, value)]
        for k, v in items:
            if isinstance(v, jax_ir.ClosedJaxpr):
                found.append((name, k, v.jaxpr))
            elif isinstance(v, jax_ir.Jaxpr):
                found.append((name, k, v))
    return found


def analyze_row_kinds(micro: jax_ir.ClosedJaxpr, whole: jax_ir.ClosedJaxpr, in_kinds: Sequence[RowKind],
                      relevant: Callable[[int], bool] = lambda k: True) -> RowKinds:
    """The ``RowKinds`` of loss jaxpr ``micro`` (traced at a smaller batch) against ``whole``
    (the same function at the whole batch), given each operand's kind; ``relevant(k)``: whether
    output ``k``'s findings count (an aux leaf the user combines as they chose does not).

    Raises:
      StructureMismatch: the two traces have different equations.
    """
    analysis = _Analysis()
    kinds, origins = analysis.jaxpr(micro.jaxpr, whole.jaxpr, list(in_kinds), [frozenset()] * len(in_kinds), (), True)
    reached = sorted(frozenset().union(*(o for k, o in enumerate(origins) if relevant(k) and kinds[k] is RowKind.MIXED)))
    return RowKinds(tuple(kinds), tuple(dict.fromkeys(analysis.inexact[i] for i in reached)),
                    tuple(analysis.literals), tuple(analysis.split_terms))
