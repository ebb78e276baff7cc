"""Pass: a stacked parameter split across stages lives as per-stage slices.

A scan over layers cut into stages (``split_scans``) leaves each stage reading the slice
``x[a:b]`` of a stacked parameter ``x`` ``[L, ...]``. Read whole, ``x`` would live on one
mesh and be fetched by every other: each mesh holding the whole stack, its gradient and its
optimizer state. Instead the step is rewritten over the slices:

- ``stacked_params``: the parameters of a cut loss read only as slices along axis 0 that
  partition ``[0, L)`` into two or more pieces;
- ``take_pieces``: the loss with each such parameter replaced by its pieces as separate
  parameters (a stage reads its own, and its gradient is that piece's);
- ``split_stacked_leaves``: the whole step rewritten over the pieces. The stacked leaves and the
  state leaves of their shape (optimizer moments) become one input per piece; every equation
  that works on them elementwise (an optimizer's update), or reduces them (a global norm), runs
  per piece; anything else reads the pieces concatenated. An output replacing a split input
  leaf that comes out in pieces is returned in pieces.

``LeafPieces`` records which of the user's leaves are split where, for the runtime, which
splits inputs and joins outputs (``runtime.stacked_leaves``). The rewritten step computes what
the original does: only the order of a reduction's additions changes (a sum of per-piece sums).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.extend.core import primitives as prims
from jax.extend.core.primitives import slice_p
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.stacked_leaves import STACK_AXIS, Bounds, GatheredArray, LeafPieces, StackedArray
from ...verification import PlanVerificationError
from ..step_primitives import pipeline_grad_p
from .edge_transfer import Executor
from .mesh_assignment import param_sharding
from .step_layout import value_move

__all__ = ["gathered_arrays", "split_stacked_leaves", "stacked_arrays", "stacked_params", "take_pieces",
           "verify_leaf_pieces"]


# Primitives computing each output element from the same element of every operand (operands
# of the output's shape, or scalars): run per piece on the pieces.
_ELEMENTWISE = frozenset((
    prims.add_p, prims.sub_p, prims.mul_p, prims.div_p, prims.neg_p, prims.square_p, prims.sqrt_p, prims.rsqrt_p,
    prims.integer_pow_p, prims.pow_p, prims.max_p, prims.min_p, prims.abs_p, prims.sign_p, prims.exp_p, prims.log_p,
    prims.tanh_p, prims.select_n_p, prims.convert_element_type_p, prims.eq_p, prims.ne_p, prims.lt_p, prims.le_p,
    prims.gt_p, prims.ge_p, prims.and_p, prims.or_p, prims.not_p, prims.is_finite_p, prims.logistic_p, prims.log1p_p,
    prims.expm1_p, prims.clamp_p, prims.rem_p, prims.atan2_p, prims.sin_p, prims.cos_p))
# Reductions whose result over all pieces is the same reduction of the per-piece results.
_COMBINE = {prims.reduce_sum_p: prims.add_p, prims.reduce_max_p: prims.max_p, prims.reduce_min_p: prims.min_p}


def stacked_params(loss: jax_ir.ClosedJaxpr, num_params: int) -> dict[int, Bounds]:
    """Per parameter of ``loss`` (its first ``num_params`` inputs) read only as whole-row
    slices along axis 0 whose ranges partition ``[0, L)`` into two or more pieces: the
    bounds ``(0, k_1, ..., L)``."""
    jaxpr = loss.jaxpr
    ranges: dict[jax_ir.Var, set[tuple[int, int]] | None] = {v: set() for v in jaxpr.invars[:num_params]}
    for e in jaxpr.eqns:
        for j, v in enumerate(e.invars):
            if not isinstance(v, jax_ir.Var) or v not in ranges or ranges[v] is None:
                continue
            span = _row_slice(e, j)
            if span is None:
                ranges[v] = None
            else:
                ranges[v].add(span)
    for v in jaxpr.outvars:
        if isinstance(v, jax_ir.Var) and v in ranges:
            ranges[v] = None
    found = {}
    for k, v in enumerate(jaxpr.invars[:num_params]):
        spans = ranges[v]
        if not spans or len(spans) < 2:
            continue
        ordered = sorted(spans)
        bounds = (ordered[0][0], *[b for _, b in ordered])
        if bounds[0] == 0 and bounds[-1] == v.aval.shape[0] and all(
                a == prev_b for (a, _), (_, prev_b) in zip(ordered[1:], ordered)):
            found[k] = bounds
    return found


def _row_slice(e: jax_ir.JaxprEqn, j: int) -> tuple[int, int] | None:
    """The rows ``[a, b)`` equation ``e`` slices out of its operand ``j`` whole, if it is such a slice."""
    if e.primitive is not slice_p or j != 0:
        return None
    shape = e.invars[0].aval.shape
    start, limit, strides = e.params["start_indices"], e.params["limit_indices"], e.params["strides"]
    if strides is not None and any(s != 1 for s in strides):
        return None
    if any(start[d] != 0 or limit[d] != shape[d] for d in range(1, len(shape))):
        return None
    return start[0], limit[0]


def _piece_avals(aval: jax_ir.ShapedArray, bounds: Bounds) -> list[jax_ir.ShapedArray]:
    return [aval.update(shape=(b - a, *aval.shape[1:])) for a, b in zip(bounds, bounds[1:])]


@compiler_pass
def take_pieces(loss: jax_ir.ClosedJaxpr, num_params: int, stacked: Mapping[int, Bounds]) -> jax_ir.ClosedJaxpr:
    """``loss`` with each parameter ``k`` of ``stacked`` replaced, in place, by one parameter per
    piece (``stacked_params``): its slices read the pieces. Parameters after ``num_params``
    (the other operands) are unchanged."""
    jaxpr = loss.jaxpr
    invars: list[jax_ir.Var] = []
    pieces: dict[jax_ir.Var, dict[tuple[int, int], jax_ir.Var]] = {}
    for k, v in enumerate(jaxpr.invars):
        if k < num_params and k in stacked:
            bounds = stacked[k]
            new = [jax_ir.Var(a) for a in _piece_avals(v.aval, bounds)]
            pieces[v] = dict(zip(zip(bounds, bounds[1:]), new))
            invars += new
        else:
            invars.append(v)
    env: dict[jax_ir.Var, jax_ir.Var] = {}
    eqns = []
    for e in jaxpr.eqns:
        if e.primitive is slice_p and isinstance(e.invars[0], jax_ir.Var) and e.invars[0] in pieces:
            env[e.outvars[0]] = pieces[e.invars[0]][_row_slice(e, 0)]
            continue
        eqns.append(e.replace(invars=[env.get(v, v) if isinstance(v, jax_ir.Var) else v for v in e.invars]))
    outvars = [env.get(v, v) if isinstance(v, jax_ir.Var) else v for v in jaxpr.outvars]
    return jax_ir.ClosedJaxpr(jaxpr.replace(invars=invars, eqns=eqns, outvars=outvars), loss.consts)


def _joined_loss(loss: jax_ir.ClosedJaxpr, num_params: int, stacked: Mapping[int, Bounds]) -> jax_ir.ClosedJaxpr:
    """``loss`` over the pieces of its stacked parameters, each rebuilt by concatenation first:
    the whole-batch loss the step's gradient equation carries (only its types are read)."""
    jaxpr = loss.jaxpr
    invars, eqns = [], []
    for k, v in enumerate(jaxpr.invars):
        if k < num_params and k in stacked:
            new = [jax_ir.Var(a) for a in _piece_avals(v.aval, stacked[k])]
            invars += new
            eqns.append(jax_ir.new_jaxpr_eqn(new, [v], prims.concatenate_p, {"dimension": 0}, jax_ir.no_effects))
        else:
            invars.append(v)
    return jax_ir.ClosedJaxpr(jaxpr.replace(invars=invars, eqns=[*eqns, *jaxpr.eqns]), loss.consts)


@dataclasses.dataclass
class _Pieces:
    """A value ``[L, ...]`` held as its pieces along axis 0."""

    bounds: Bounds
    vars: list[jax_ir.Atom]


class _Rewrite:
    """Builds the rewritten step's equations (module docstring); one per step."""

    def __init__(self) -> None:
        self.eqns: list[jax_ir.JaxprEqn] = []
        self.env: dict[jax_ir.Var, Any] = {}
        self.joined: dict[int, jax_ir.Var] = {}
        self.producer: dict[jax_ir.Var, jax_ir.JaxprEqn] = {}
        self.pieces: dict[tuple[jax_ir.Var, Bounds, int], jax_ir.Var] = {}

    def read(self, v: jax_ir.Atom) -> Any:
        return self.env.get(v, v) if isinstance(v, jax_ir.Var) else v

    def whole(self, v: jax_ir.Atom) -> jax_ir.Atom:
        """``v`` as one value: pieces concatenated (once)."""
        value = self.read(v)
        if not isinstance(value, _Pieces):
            return value
        if id(value) not in self.joined:
            out = jax_ir.Var(v.aval)
            self.emit(value.vars, [out], prims.concatenate_p, {"dimension": 0})
            self.joined[id(value)] = out
        return self.joined[id(value)]

    def emit(self, invars: Sequence[jax_ir.Atom], outvars: Sequence[jax_ir.Var], prim: jax_ir.Primitive,
             params: dict[str, Any], effects: Any = jax_ir.no_effects) -> None:
        self.append(jax_ir.new_jaxpr_eqn(list(invars), list(outvars), prim, params, effects))

    def append(self, e: jax_ir.JaxprEqn) -> None:
        self.eqns.append(e)
        self.producer.update((v, e) for v in e.outvars if not isinstance(v, jax_ir.DropVar))

    def piece_of(self, v: jax_ir.Atom, bounds: Bounds, p: int) -> jax_ir.Atom:
        """Piece ``p`` of operand ``v`` of an elementwise equation: its own piece, a scalar as it
        is; a whole value computed elementwise from broadcast scalars recomputed per piece (an
        optimizer's constants), any other sliced."""
        value = self.read(v)
        if isinstance(value, _Pieces):
            return value.vars[p]
        if not getattr(value.aval, "shape", ()):
            return value
        key = (value, bounds, p)
        if key not in self.pieces:
            self.pieces[key] = self._piece_of_whole(value, bounds, p)
        return self.pieces[key]

    def _piece_of_whole(self, value: jax_ir.Var, bounds: Bounds, p: int) -> jax_ir.Var:
        a, b = bounds[p], bounds[p + 1]
        out = jax_ir.Var(value.aval.update(shape=(b - a, *value.aval.shape[1:])))
        made = self.producer.get(value)
        if made is not None and made.primitive is prims.broadcast_in_dim_p and not made.invars[0].aval.shape:
            self.emit(made.invars, [out], made.primitive, dict(made.params, shape=out.aval.shape), made.effects)
        elif made is not None and made.primitive in _ELEMENTWISE and len(made.outvars) == 1 and all(
                not getattr(x.aval, "shape", ()) or x.aval.shape == value.aval.shape for x in made.invars):
            self.emit([self.piece_of(x, bounds, p) for x in made.invars], [out], made.primitive, made.params,
                      made.effects)
        else:
            self.emit([value], [out], slice_p, {"start_indices": (a, *[0] * (value.aval.ndim - 1)),
                                                "limit_indices": (b, *value.aval.shape[1:]), "strides": None})
        return out

    def equation(self, e: jax_ir.JaxprEqn, fresh: bool = False) -> None:
        """Appends ``e`` rewritten; with ``fresh`` (an inlined call's equations, whose jaxpr may
        be inlined again) its results get new variables."""
        ins = [self.read(v) for v in e.invars]
        split = [x for x in ins if isinstance(x, _Pieces)]
        if not split:
            self.keep(e, ins, fresh)
            return
        inner = jax_ir.call_body(e)
        if inner is not None and not e.effects:
            self.env.update(zip(inner.jaxpr.invars, ins))
            self.env.update(zip(inner.jaxpr.constvars, inner.consts))
            for inner_eqn in inner.jaxpr.eqns:
                self.equation(inner_eqn, fresh=True)
            self.env.update(zip(e.outvars, [self.read(v) for v in inner.jaxpr.outvars]))
            return
        bounds = split[0].bounds
        same = all(x.bounds == bounds for x in split)
        out = e.outvars[0].aval if e.outvars else None
        full = getattr(out, "shape", None)
        if same and e.primitive in _ELEMENTWISE and len(e.outvars) == 1 and full and full[0] == bounds[-1] and all(
                isinstance(x, _Pieces) or not getattr(getattr(x, "aval", None), "shape", ()) or x.aval.shape == full
                for x in ins):
            outs = []
            for p in range(len(bounds) - 1):
                piece = jax_ir.Var(out.update(shape=(bounds[p + 1] - bounds[p], *full[1:])))
                self.emit([self.piece_of(v, bounds, p) for v in e.invars], [piece], e.primitive, e.params, e.effects)
                outs.append(piece)
            self.env[e.outvars[0]] = _Pieces(bounds, outs)
            return
        if e.primitive in _COMBINE and isinstance(ins[0], _Pieces) and 0 in e.params["axes"]:
            parts = []
            for piece in ins[0].vars:
                part = jax_ir.Var(out)
                self.emit([piece], [part], e.primitive, e.params)
                parts.append(part)
            total = parts[0]
            for part in parts[1:]:
                combined = jax_ir.Var(out)
                self.emit([total, part], [combined], _COMBINE[e.primitive], {})
                total = combined
            self.env[e.outvars[0]] = total
            return
        self.keep(e, [self.whole(v) for v in e.invars], fresh)

    def keep(self, e: jax_ir.JaxprEqn, invars: list[jax_ir.Atom], fresh: bool) -> None:
        """``e`` itself over ``invars``."""
        if fresh:
            outvars = [jax_ir.DropVar(v.aval) if isinstance(v, jax_ir.DropVar) else jax_ir.Var(v.aval)
                       for v in e.outvars]
            self.env.update((v, o) for v, o in zip(e.outvars, outvars) if not isinstance(v, jax_ir.DropVar))
            e = e.replace(outvars=outvars)
        self.append(e.replace(invars=invars))


@compiler_pass
def split_stacked_leaves(step: jax_ir.ClosedJaxpr, stacked: Mapping[int, Bounds], counterparts: Sequence[int | None]
                         ) -> tuple[jax_ir.ClosedJaxpr, LeafPieces, dict[int, Bounds]]:
    """``step`` (the traced train step, one ``pipeline_grad`` equation) rewritten over pieces
    (module docstring).

    Args:
      step: the step; its gradient equation's parameter ``k`` of ``stacked`` (loss parameter
        numbering) is split at ``stacked[k]`` where that operand is an input leaf of the step.
      stacked: per loss parameter, its bounds (``stacked_params`` of the cut loss).
      counterparts: per output leaf, the input leaf it replaces in the state, or ``None``.

    Returns:
      The rewritten step, the ``LeafPieces`` saying which leaves it takes and returns in
      pieces, and the entries of ``stacked`` it split (the loss parameters then taken in
      pieces: ``take_pieces``). Input leaves split: the stacked parameters, and the state
      leaves of one's shape and dtype (an optimizer's moments), at its bounds.
    """
    jaxpr = step.jaxpr
    (grad,) = [e for e in jaxpr.eqns if e.primitive is pipeline_grad_p]
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    leaf_bounds: dict[int, Bounds] = {}
    for k, bounds in stacked.items():
        v = grad.invars[k]
        if isinstance(v, jax_ir.Var) and v in position:
            leaf_bounds[position[v]] = bounds
    by_type: dict[jax_ir.AbstractValue, Bounds] = {}
    for k, bounds in stacked.items():
        v = grad.invars[k]
        if isinstance(v, jax_ir.Var) and v in position:
            by_type.setdefault(v.aval, bounds)
    # Moments are state leaves the loss does not read (a parameter of the same shape is not one).
    read = {position[v] for v in grad.invars if isinstance(v, jax_ir.Var) and v in position}
    state = {i for i in counterparts if i is not None} - read
    for i in sorted(state):
        aval = jaxpr.invars[i].aval
        if i not in leaf_bounds and aval in by_type:
            leaf_bounds[i] = by_type[aval]
    moments = {i for i in leaf_bounds if i not in read}
    while True:
        rewritten, out_bounds, replaces, used = _rewrite_step(jaxpr, grad, stacked, leaf_bounds, counterparts)
        # A moment whose update does not come out in pieces, or not from a stacked parameter's
        # gradient, is no split parameter's (another parameter of the same shape): keep it whole.
        grown = _from_stacked_gradients(rewritten, used)
        outs = iter(rewritten.outvars)
        from_grads = set()
        for b, i in zip(out_bounds, replaces):
            own = [next(outs) for _ in range(1 if b is None else len(b) - 1)]
            if i is not None and all(isinstance(v, jax_ir.Var) and v in grown for v in own):
                from_grads.add(i)
        dropped = {i for i in moments if i not in from_grads}
        if not dropped:
            break
        moments -= dropped
        for i in dropped:
            del leaf_bounds[i]
    inputs = tuple(leaf_bounds.get(i) for i in range(len(jaxpr.invars)))
    return jax_ir.ClosedJaxpr(rewritten, step.consts), LeafPieces(inputs, out_bounds, replaces), used


def _from_stacked_gradients(jaxpr: jax_ir.Jaxpr, used: Mapping[int, Bounds]) -> set[jax_ir.Var]:
    """The values of ``jaxpr`` (rewritten) computed from the pieces of the split parameters'
    gradients through arrays (not through scalars: a global norm scales every gradient)."""
    (grad,) = [e for e in jaxpr.eqns if e.primitive is pipeline_grad_p]
    head = 1 + grad.params["num_aux"]
    # Parameter k's pieces sit where it sat, shifted by the pieces of the split ones before it.
    pieces_at, shift = set(), 0
    for k in sorted(used):
        count = len(used[k]) - 1
        pieces_at.update(range(k + shift, k + shift + count))
        shift += count - 1
    grown = {v for p, v in enumerate(grad.outvars[head:]) if p in pieces_at and isinstance(v, jax_ir.Var)}
    for e in jaxpr.eqns:
        if any(isinstance(v, jax_ir.Var) and v in grown and v.aval.ndim for v in e.invars):
            grown.update(v for v in e.outvars if not isinstance(v, jax_ir.DropVar) and v.aval.ndim)
    return grown


def _rewrite_step(jaxpr: jax_ir.Jaxpr, grad: jax_ir.JaxprEqn, stacked: Mapping[int, Bounds],
                  leaf_bounds: Mapping[int, Bounds], counterparts: Sequence[int | None]
                  ) -> tuple[jax_ir.Jaxpr, tuple[Bounds | None, ...], tuple[int | None, ...], dict[int, Bounds]]:
    """``jaxpr`` over the pieces of input leaves ``leaf_bounds``: the rewritten jaxpr, per output
    its bounds and the input it replaces when in pieces, and the entries of ``stacked`` split."""
    rewrite = _Rewrite()
    invars: list[jax_ir.Var] = []
    for i, v in enumerate(jaxpr.invars):
        if i in leaf_bounds:
            pieces = [jax_ir.Var(a) for a in _piece_avals(v.aval, leaf_bounds[i])]
            rewrite.env[v] = _Pieces(leaf_bounds[i], pieces)
            invars += pieces
        else:
            invars.append(v)
    used = {k: b for k, b in stacked.items() if isinstance(rewrite.read(grad.invars[k]), _Pieces)}
    for e in jaxpr.eqns:
        if e is grad:
            _rewrite_grad(rewrite, e, used)
        else:
            rewrite.equation(e)
    outvars: list[jax_ir.Atom] = []
    out_bounds: list[Bounds | None] = []
    replaces: list[int | None] = []
    for j, v in enumerate(jaxpr.outvars):
        value = rewrite.read(v)
        i = counterparts[j] if j < len(counterparts) else None
        if isinstance(value, _Pieces) and i is not None and leaf_bounds.get(i) == value.bounds:
            outvars += value.vars
            out_bounds.append(value.bounds)
            replaces.append(i)
        else:
            outvars.append(rewrite.whole(v))
            out_bounds.append(None)
            replaces.append(None)
    # Whole values only pieces were taken of (an optimizer's broadcast constants) are dropped.
    rewritten, _ = jax_ir.dce_jaxpr(jaxpr.replace(invars=invars, eqns=rewrite.eqns, outvars=outvars),
                                    [True] * len(outvars), instantiate=True)
    return rewritten, tuple(out_bounds), tuple(replaces), used


def verify_leaf_pieces(pieces: LeafPieces, num_inputs: int, num_outputs: int) -> None:
    """Checks ``pieces`` against the step: one entry per input and output leaf, every bounds
    increasing from 0 with two or more pieces, and an output split only like some input.

    Raises:
      PlanVerificationError: naming the leaf.
    """
    if len(pieces.inputs) != num_inputs or len(pieces.outputs) != num_outputs:
        raise PlanVerificationError(f"split_stacked_leaves: {len(pieces.inputs)} inputs and {len(pieces.outputs)} "
                                    f"outputs for a step of {num_inputs} and {num_outputs}")
    for what, all_bounds in (("input", pieces.inputs), ("output", pieces.outputs)):
        for i, b in enumerate(all_bounds):
            if b is not None and (len(b) < 3 or b[0] != 0 or list(b) != sorted(set(b))):
                raise PlanVerificationError(f"split_stacked_leaves: {what} leaf {i} split at {b}")
    for j, (b, i) in enumerate(zip(pieces.outputs, pieces.replaces)):
        if b is not None and (i is None or pieces.inputs[i] != b):
            raise PlanVerificationError(f"split_stacked_leaves: output leaf {j} split at {b}, but the input leaf it "
                                        f"replaces ({i}) is not")


def _rewrite_grad(rewrite: _Rewrite, e: jax_ir.JaxprEqn, stacked: Mapping[int, Bounds]) -> None:
    """The gradient equation over pieces: each split parameter's pieces as parameters, its
    gradient as pieces."""
    num_diff = e.params["num_diff"]
    invars: list[jax_ir.Atom] = []
    for k, v in enumerate(e.invars):
        value = rewrite.read(v)
        if k < num_diff and k in stacked:
            invars += value.vars
        else:
            invars.append(rewrite.whole(v))
    head = 1 + e.params["num_aux"]
    outvars = list(e.outvars[:head])
    for k, g in enumerate(e.outvars[head:]):
        if k in stacked:
            pieces = [jax_ir.Var(a) for a in _piece_avals(g.aval, stacked[k])]
            outvars += pieces
            rewrite.env[g] = _Pieces(stacked[k], pieces)
        else:
            outvars.append(g)
    extra = sum(len(b) - 2 for b in stacked.values())
    params = dict(e.params, num_diff=num_diff + extra,
                  loss_jaxpr=_joined_loss(e.params["loss_jaxpr"], num_diff, stacked))
    rewrite.append(e.replace(invars=invars, outvars=outvars, params=params))


@compiler_pass
def stacked_arrays(pieces: LeafPieces, piece_shardings: Mapping[int, Sequence[NamedSharding]]
                   ) -> dict[int, StackedArray]:
    """The split input leaves that can be returned to the user as one array without a copy:
    equal pieces, each on its own mesh (``piece_shardings``: per split leaf, per piece), meshes
    of one shape and axis names, laid out alike and not over axis 0."""
    found = {}
    for i, shardings in piece_shardings.items():
        bounds = pieces.inputs[i]
        sizes = {b - a for a, b in zip(bounds, bounds[1:])}
        meshes = [s.mesh for s in shardings]
        specs = {_trimmed(s.spec) for s in shardings}
        devices = [d for m in meshes for d in m.devices.flat]
        if (len(sizes) != 1 or len(set(devices)) != len(devices) or len(specs) != 1
                or len({(m.axis_names, m.devices.shape) for m in meshes}) != 1):
            continue
        spec = tuple(shardings[0].spec)
        if spec and spec[0] is not None:
            continue
        mesh = Mesh(np.stack([m.devices for m in meshes]), (STACK_AXIS, *meshes[0].axis_names))
        found[i] = StackedArray(NamedSharding(mesh, P(STACK_AXIS, *spec[1:])), tuple(shardings))
    return found


def _trimmed(spec: P) -> tuple[Any, ...]:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


@compiler_pass
def gathered_arrays(pieces: LeafPieces, piece_shardings: Mapping[int, Sequence[NamedSharding]],
                    shapes: Mapping[int, tuple[int, ...]], dtypes: Mapping[int, Any], specs: Mapping[int, Any],
                    axis_names: tuple[str, str], executor: Executor) -> dict[int, GatheredArray]:
    """A ``GatheredArray`` per split leaf of ``piece_shardings`` (per piece, where its stage
    reads it), of the whole ``shapes``, ``dtypes`` and flax partition ``specs``; moves by
    ``executor``."""
    found = {}
    for i, shardings in piece_shardings.items():
        bounds, home = pieces.inputs[i], shardings[0].mesh
        sharding = param_sharding(home, specs[i], shapes[i], axis_names)
        at_home, into, out_of = [], [], []
        for p, (a, b) in enumerate(zip(bounds, bounds[1:])):
            aval = jax_ir.ShapedArray((b - a, *shapes[i][1:]), dtypes[i])
            here = param_sharding(home, specs[i], aval.shape, axis_names)
            at_home.append(here)
            there = shardings[p]
            if there.mesh == home:
                into.append(None)
                out_of.append(None)
                continue
            what = f"piece {p} of stacked leaf {i}"
            into.append(value_move(what, aval, here, there, executor))
            out_of.append(value_move(what, aval, there, here, executor))
        found[i] = GatheredArray(sharding, tuple(shardings), tuple(at_home), tuple(into), tuple(out_of))
    return found
