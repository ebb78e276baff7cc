"""Pass: a scan over layers split at chosen iterations, so stages can be cut inside it.

Models stack their blocks in one ``scan`` (``nn.scan``, ``nnx.scan``, a ``lax.scan`` over
stacked parameters): one equation of the loss, which no stage marker can cut. A *layer scan*
is a top-level scan of the loss that reads a parameter through a scanned (stacked) operand.
``split_layer_scans`` turns one over iterations ``[0, L)`` into consecutive scans over
``[0, k_1), [k_1, k_2), ...``:

- each scanned operand is sliced along axis 0 to the piece's iterations (a ``slice`` right
  before the piece, so a stage reads its own slice of a stacked parameter);
- the carry is chained: piece ``i``'s final carry is piece ``i + 1``'s initial one (a reversed
  scan runs its pieces from the last iterations to the first);
- each per-iteration output is the concatenation of the pieces' (after the last piece); one
  that nothing reads is no output of the pieces at all (JAX's dead-code rule for scans prunes
  it from the body). ``nnx.scan`` returns the stacked state it scans over (the blocks'
  parameters) as such outputs, which the loss drops: concatenated, they would pull every
  stage's slice of every stacked parameter onto the last stage.

The body is the scan's own, less what only unread outputs needed: ``remat`` inside it, its
effects and its unrolling stay. Every piece runs the body on the same values in the same
order, so the split loss equals the original; ``verify_split_scans`` checks that on random
inputs, and that no concatenation it added goes unread. With ``marked`` a stage marker sits
between consecutive pieces, so ``split_stages`` cuts there as between any layers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core.primitives import concatenate_p, scan_p, sharding_constraint_p, slice_p

from ...compiler_pass import compiler_pass
from ... import jax_ir
from ...verification import PlanVerificationError
from ..step_primitives import stage_boundary_p

__all__ = ["LayerScan", "Provenance", "layer_scans", "split_layer_scans", "verify_split_scans"]


@dataclasses.dataclass(frozen=True)
class LayerScan:
    """The top-level equation ``index`` of a loss: a scan of ``length`` iterations reading a
    parameter through a scanned operand."""

    index: int
    length: int


@dataclasses.dataclass(frozen=True)
class Provenance:
    """Where an equation of a split loss comes from: equation ``index`` of the original. For a
    piece's slices and scan, ``boundary`` is the iteration it shares with the piece run before
    it (``0`` or the scan's length for the first piece); ``tail`` marks the concatenations
    after a split scan's last piece."""

    index: int
    boundary: int | None = None
    tail: bool = False


def layer_scans(loss: jax_ir.ClosedJaxpr, num_params: int) -> tuple[LayerScan, ...]:
    """The layer scans of ``loss`` (module docstring), in program order: top-level scans of more
    than one iteration with a scanned operand computed from the first ``num_params`` inputs."""
    jaxpr = loss.jaxpr
    from_params: set[jax_ir.Var] = set(jaxpr.invars[:num_params])
    found = []
    for k, e in enumerate(jaxpr.eqns):
        reads = [v for v in e.invars if isinstance(v, jax_ir.Var) and v in from_params]
        if e.primitive is scan_p and e.params["length"] > 1:
            if any(isinstance(v, jax_ir.Var) and v in from_params for v in _scanned(e)):
                found.append(LayerScan(k, e.params["length"]))
        if reads:
            from_params.update(v for v in e.outvars if not isinstance(v, jax_ir.DropVar))
    return tuple(found)


def _scanned(e: jax_ir.JaxprEqn) -> list[jax_ir.Atom]:
    return e.invars[sum(jax_ir.scan_operand_counts(e)):]


@compiler_pass
def split_layer_scans(loss: jax_ir.ClosedJaxpr, cuts: Mapping[int, Sequence[int]], marked: bool,
                      markers_before: frozenset[int] = frozenset()
                      ) -> tuple[jax_ir.ClosedJaxpr, tuple[Provenance, ...]]:
    """``loss`` with each scan equation ``k`` of ``cuts`` split at iterations ``cuts[k]``
    (increasing, each in ``(0, length)``), and a stage marker before each equation of
    ``markers_before``; with ``marked``, one between consecutive pieces too.

    Returns:
      The split loss (same inputs and outputs) and, per equation of it other than the markers
      it added, its ``Provenance``.

    Raises:
      ValueError: ``cuts`` names an equation that is no scan, or an iteration out of range.
    """
    jaxpr = loss.jaxpr
    read = _read_values(jaxpr)
    marker_effects = stage_boundary_p.abstract_eval()[1]
    eqns: list[jax_ir.JaxprEqn] = []
    provenance: list[Provenance] = []

    def marker() -> None:
        eqns.append(jax_ir.new_jaxpr_eqn([], [], stage_boundary_p, {}, marker_effects,
                                         jax_ir.new_source_info()))

    for k, e in enumerate(jaxpr.eqns):
        if k in markers_before:
            marker()
        if k not in cuts or not cuts[k]:
            eqns.append(e)
            provenance.append(Provenance(k))
            continue
        if e.primitive is not scan_p:
            raise ValueError(f"cuts: equation {k} of the loss is {e.primitive.name}, not a scan")
        pieces, tail = _split_scan(_without_unread_outputs(e, read), tuple(cuts[k]))
        for p, (boundary, piece) in enumerate(pieces):
            if p and marked:
                marker()
            eqns.extend(piece)
            provenance.extend(Provenance(k, boundary) for _ in piece)
        eqns.extend(tail)
        provenance.extend(Provenance(k, tail=True) for _ in tail)
    effects = jaxpr.effects | marker_effects if len(eqns) > len(provenance) else jaxpr.effects
    return jax_ir.ClosedJaxpr(jaxpr.replace(eqns=eqns, effects=effects), loss.consts), tuple(provenance)


def _read_values(jaxpr: jax_ir.Jaxpr) -> set[jax_ir.Var]:
    """The variables ``jaxpr``'s equations read or it returns."""
    return {v for v in (*(v for e in jaxpr.eqns for v in e.invars), *jaxpr.outvars) if isinstance(v, jax_ir.Var)}


def _without_unread_outputs(e: jax_ir.JaxprEqn, read: set[jax_ir.Var]) -> jax_ir.JaxprEqn:
    """Scan equation ``e`` without the results nothing of ``read`` is (JAX's dead-code rule:
    its body no longer computes them, nor the operands only they needed)."""
    used = [not isinstance(v, jax_ir.DropVar) and v in read for v in e.outvars]
    if all(used):
        return e
    _, pruned = jax_ir.dce_rule(scan_p)(used, e)
    return e if pruned is None else pruned


def _split_scan(e: jax_ir.JaxprEqn, cuts: tuple[int, ...]
                ) -> tuple[list[tuple[int, list[jax_ir.JaxprEqn]]], list[jax_ir.JaxprEqn]]:
    """Scan equation ``e`` as its pieces (in execution order: the iteration each shares with the
    piece before it, and its slices and scan) and the concatenations of its per-iteration
    outputs."""
    length = e.params["length"]
    num_consts, num_carry = jax_ir.scan_operand_counts(e)
    if list(cuts) != sorted(set(cuts)) or cuts[0] <= 0 or cuts[-1] >= length:
        raise ValueError(f"cuts: iterations to cut a scan of {length} at must increase within (0, {length}), "
                         f"got {list(cuts)}")
    bounds = [0, *cuts, length]
    ranges = list(zip(bounds, bounds[1:]))
    if e.params["reverse"]:
        ranges.reverse()
    consts, carry = e.invars[:num_consts], list(e.invars[num_consts:num_consts + num_carry])
    scanned = _scanned(e)
    carry_out, ys = e.outvars[:num_carry], e.outvars[num_carry:]
    ys_pieces: list[list[jax_ir.Atom]] = [[] for _ in ys]
    pieces = []
    source = e.source_info
    for p, (start, stop) in enumerate(ranges):
        piece: list[jax_ir.JaxprEqn] = []
        sliced = []
        for x in scanned:
            shape = x.aval.shape
            out = jax_ir.Var(jax_ir.ShapedArray((stop - start, *shape[1:]), x.aval.dtype, weak_type=x.aval.weak_type))
            piece.append(jax_ir.new_jaxpr_eqn(
                [x], [out], slice_p, {"start_indices": (start, *[0] * (len(shape) - 1)),
                                      "limit_indices": (stop, *shape[1:]), "strides": None},
                jax_ir.no_effects, source))
            sliced.append(out)
        last = p == len(ranges) - 1
        carry_next = list(carry_out) if last else [jax_ir.Var(v.aval) for v in carry_out]
        ys_out = []
        for j, y in enumerate(ys):
            if len(ranges) == 1:
                ys_out.append(y)
                continue
            piece_aval = y.aval.update(shape=(stop - start, *y.aval.shape[1:]))
            v = jax_ir.DropVar(piece_aval) if isinstance(y, jax_ir.DropVar) else jax_ir.Var(piece_aval)
            ys_out.append(v)
            ys_pieces[j].append((start, v))
        piece.append(jax_ir.new_jaxpr_eqn(
            [*consts, *carry, *sliced], [*carry_next, *ys_out], scan_p, dict(e.params, length=stop - start),
            e.effects, source))
        carry = carry_next
        pieces.append((stop if e.params["reverse"] else start, piece))
    tail = []
    for y, parts in zip(ys, ys_pieces):
        if isinstance(y, jax_ir.DropVar):
            continue
        ordered = [v for _, v in sorted(parts, key=lambda sv: sv[0])]
        tail.append(jax_ir.new_jaxpr_eqn(ordered, [y], concatenate_p, {"dimension": 0}, jax_ir.no_effects, source))
    return pieces, tail


def verify_split_scans(original: jax_ir.ClosedJaxpr, split: jax_ir.ClosedJaxpr, seed: int = 0) -> None:
    """Checks that ``split`` computes what ``original`` does: the same input and output types,
    every concatenation of pieces' outputs it added read, and equal outputs on random inputs
    (floats standard normal, integers 0 or 1, keys from ``seed``), to float32 rounding.

    Raises:
      PlanVerificationError: a type or a value differs, naming the output, or a concatenation
        nothing reads was added (it would move every piece to the last one's stage).
    """
    if [v.aval for v in original.jaxpr.invars] != [v.aval for v in split.jaxpr.invars]:
        raise PlanVerificationError("split_layer_scans changed the loss's input types")
    if [v.aval for v in original.jaxpr.outvars] != [v.aval for v in split.jaxpr.outvars]:
        raise PlanVerificationError("split_layer_scans changed the loss's output types")
    kept, read = {id(e) for e in original.jaxpr.eqns}, _read_values(split.jaxpr)
    for e in split.jaxpr.eqns:
        if e.primitive is concatenate_p and id(e) not in kept and not any(v in read for v in e.outvars):
            raise PlanVerificationError(
                f"split_layer_scans: a split scan's per-iteration output {e.outvars[0].aval.str_short()} is "
                f"concatenated from its pieces though nothing reads it")
    rng = np.random.default_rng(seed)
    # Evaluated on one local device: the stage meshes the loss's sharding annotations name may
    # span other processes.
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices()[0]):
        args = [_random(v.aval, rng, seed) for v in original.jaxpr.invars]
        want = jax_ir.eval_jaxpr(_local(original.jaxpr), original.consts, *args)
        got = jax_ir.eval_jaxpr(_local(split.jaxpr), split.consts, *args)
    for k, (w, g) in enumerate(zip(want, got)):
        if jax.dtypes.issubdtype(w.dtype, jax.dtypes.extended):
            w, g = jax.random.key_data(w), jax.random.key_data(g)
        if not np.allclose(np.asarray(w), np.asarray(g), rtol=1e-5, atol=1e-6, equal_nan=True):
            raise PlanVerificationError(f"split_layer_scans: output {k} of the split loss differs from the "
                                        f"original's on random inputs")


def _local(jaxpr: jax_ir.Jaxpr) -> jax_ir.Jaxpr:
    """``jaxpr`` without stage markers (only ``parallelize``'s tracing gives them a meaning) and
    without sharding annotations or the meshes calls were traced under, in it and in the jaxprs
    its equations hold."""
    env: dict[jax_ir.Var, jax_ir.Atom] = {}
    eqns = []
    for e in jaxpr.eqns:
        invars = [env.get(v, v) if isinstance(v, jax_ir.Var) else v for v in e.invars]
        if e.primitive is stage_boundary_p:
            continue
        if e.primitive is sharding_constraint_p:
            env[e.outvars[0]] = invars[0]
            continue
        params = {k: None if k in ("sharding", "out_sharding") else _local_param(v) for k, v in e.params.items()}
        if "ctx_mesh" in params:
            params["ctx_mesh"] = jax_ir.concrete_mesh()
        eqns.append(e.replace(invars=invars, params=params))
    outvars = [env.get(v, v) if isinstance(v, jax_ir.Var) else v for v in jaxpr.outvars]
    return jaxpr.replace(eqns=eqns, outvars=outvars, effects=jaxpr.effects - set(stage_boundary_p.abstract_eval()[1]))


def _local_param(value: Any) -> Any:
    if isinstance(value, jax_ir.ClosedJaxpr):
        return jax_ir.ClosedJaxpr(_local(value.jaxpr), value.consts)
    if isinstance(value, jax_ir.Jaxpr):
        return _local(value)
    if isinstance(value, tuple) and any(isinstance(v, (jax_ir.Jaxpr, jax_ir.ClosedJaxpr)) for v in value):
        return tuple(_local_param(v) for v in value)
    return value


def _random(aval: jax_ir.AbstractValue, rng: np.random.Generator, seed: int) -> jax.Array | np.ndarray:
    dtype = aval.dtype
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        keys = jax.random.split(jax.random.key(seed), int(np.prod(aval.shape, dtype=np.int64)) or 1)
        return keys[:int(np.prod(aval.shape, dtype=np.int64))].reshape(aval.shape)
    if np.issubdtype(dtype, np.floating) or dtype == jax.numpy.bfloat16:
        return rng.standard_normal(aval.shape).astype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, aval.shape).astype(bool)
    return rng.integers(0, 2, aval.shape).astype(dtype)
