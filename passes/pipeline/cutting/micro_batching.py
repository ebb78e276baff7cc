"""How a step's micro-batches combine: loss reduction, aux reductions, and which loss operands
are PRNG keys to fold with the micro-batch index.

The user-facing contract is in ``meshpar.value_and_grad``'s module docstring; this module
holds the rules the compiler applies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...policies import Policy
from ...program.step_values import AuxReduction
from ...program.wire_format import is_key

__all__ = ["REDUCTIONS", "LossReduction", "MicroBatching", "default_aux_reduction", "key_operands",
           "resolve_micro_batching"]


class LossReduction(Policy):
    """How the micro-batches' losses and gradients combine into the step's
    (``meshpar.value_and_grad(reduction=...)``; ``None`` there: inferred)."""

    MEAN = "mean"
    SUM = "sum"

    def share(self, weight: float, parts: int) -> float:
        """Each part's weight when a term of ``weight`` is split into ``parts`` combined this way:
        ``weight / parts`` for the mean, ``weight`` for the sum."""
        return weight / parts if self is LossReduction.MEAN else weight

    def weight(self, num_micro_batches: int) -> float:
        """The weight of each micro-batch's loss in the step's."""
        return self.share(1.0, num_micro_batches)

    @property
    def aux(self) -> AuxReduction:
        """The same combination, as the step program combines a value."""
        return AuxReduction(self.value)


# What the user may pass as ``reduction`` (besides ``None``).
REDUCTIONS = LossReduction.names()


def default_aux_reduction(micro: jax_ir.AbstractValue, whole: jax_ir.AbstractValue) -> AuxReduction:
    """An aux leaf's reduction when the user chose none: ``micro`` is its aval per
    micro-batch, ``whole`` at the whole batch's shapes; a leaf whose shape follows the batch
    is concatenated, else floating leaves are averaged, integer ones summed (counts add up),
    and the rest (bools, keys) taken from the last micro-batch."""
    if micro.shape != whole.shape:
        return AuxReduction.CONCAT
    if is_key(micro):
        return AuxReduction.LAST
    dtype = np.dtype(micro.dtype)
    if jnp.issubdtype(dtype, jnp.inexact):
        return AuxReduction.MEAN
    if jnp.issubdtype(dtype, jnp.integer):
        return AuxReduction.SUM
    return AuxReduction.LAST


def _wrapped_vars(jaxpr: jax_ir.Jaxpr) -> set[jax_ir.Var]:
    """Invars of ``jaxpr`` that reach ``random_wrap`` (raw keys), looking into nested jaxprs
    whose inputs are the equation's operands one to one (jit, remat, custom derivatives)."""
    found: set[jax_ir.Var] = set()
    for e in jaxpr.eqns:
        if e.primitive is jax_ir.random_wrap_p:
            found.update(v for v in e.invars if isinstance(v, jax_ir.Var))
            continue
        for sub in _operand_aligned(e):
            inner = _wrapped_vars(sub)
            found.update(v for v, w in zip(e.invars, sub.invars) if w in inner and isinstance(v, jax_ir.Var))
    return found


def _operand_aligned(eqn: jax_ir.JaxprEqn) -> Iterator[jax_ir.Jaxpr]:
    for sub in jax_ir.nested_jaxprs(eqn):
        if len(sub.invars) == len(eqn.invars):
            yield sub


def key_operands(loss_jaxpr: jax_ir.ClosedJaxpr, num_diff: int) -> frozenset[int]:
    """Indices (among the non-differentiated operands) of the loss operands that are PRNG keys:
    typed key arrays, and raw ``uint32`` keys the loss turns into keys."""
    jaxpr = loss_jaxpr.jaxpr
    raw = _wrapped_vars(jaxpr)
    return frozenset(k for k, v in enumerate(jaxpr.invars[num_diff:]) if is_key(v.aval) or v in raw)


@dataclasses.dataclass(frozen=True)
class MicroBatching:
    """How one traced step combines its micro-batches.

    Attributes:
      reduction: mean or sum of the micro-batches' losses and gradients.
      aux: per aux leaf, its reduction.
      per_micro_batch: per non-differentiated loss operand, whether each micro-batch reads
        its own slice of it (it has the batch dimension) rather than the whole value.
      fold_keys: the operands (same indexing) that are PRNG keys folded with the
        micro-batch index.
      num_micro_batches: M.
      exact: the loss was rewritten so that its micro-batches' shares sum to the whole batch's
        (``exact_micro_batching``): ``reduction`` is then ``LossReduction.SUM``.
      whole_batch_values: how many values of the loss are computed once on the whole batch
        (its last operands, each read whole by every micro-batch).
      inexact: where parameter-dependent values mix batch rows, so that micro-batches cannot
        reproduce the whole batch (the loss then combines per micro-batch, by ``reduction``).
    """

    reduction: LossReduction
    aux: tuple[AuxReduction, ...]
    per_micro_batch: tuple[bool, ...]
    fold_keys: frozenset[int]
    num_micro_batches: int
    exact: bool = False
    whole_batch_values: int = 0
    inexact: tuple[Any, ...] = ()

    @property
    def loss_seed(self) -> float:
        """The weight of each micro-batch's loss in the step's."""
        return self.reduction.weight(self.num_micro_batches)


def _follows_batch(micro: jax_ir.AbstractValue, whole: jax_ir.AbstractValue, m: int) -> bool:
    return (len(micro.shape) == len(whole.shape) >= 1 and whole.shape[0] == m * micro.shape[0]
            and micro.shape[1:] == whole.shape[1:])


@compiler_pass
def resolve_micro_batching(
    params: dict[str, Any],
    micro_operands: Sequence[jax_ir.AbstractValue],
    whole_operands: Sequence[jax_ir.AbstractValue],
    whole_aux: Sequence[jax_ir.AbstractValue],
    num_micro_batches: int,
    where: str = "unknown location",
) -> MicroBatching:
    """The ``MicroBatching`` of a gradient equation traced at micro-batch shapes (``params``,
    ``micro_operands``: its non-differentiated operands) and at the whole batch's
    (``whole_operands``, ``whole_aux``); ``where`` is the user's ``value_and_grad`` call, for errors.

    Raises:
      ValueError: a value whose shape differs between the traces other than by the batch
        dimension, or an aux reduction that does not fit its leaf, naming it.
    """
    m = num_micro_batches
    per_mb = []
    for k, (mi, wh) in enumerate(zip(micro_operands, whole_operands)):
        if mi.shape == wh.shape:
            per_mb.append(False)
        elif _follows_batch(mi, wh, m):
            per_mb.append(True)
        else:
            raise ValueError(f"loss operand {k}: shaped {wh.str_short()} for the whole batch but {mi.str_short()} "
                             f"per micro-batch; a value the loss function reads must either not depend on the "
                             f"batch size or have the batch as its leading dimension (meshpar.value_and_grad at {where})")
    micro_aux = params["loss_jaxpr"].out_avals[1:]
    chosen = params["aux_reductions"]
    aux = []
    for k, (mi, wh, c) in enumerate(zip(micro_aux, whole_aux, chosen)):
        r = c if c is not None else default_aux_reduction(mi, wh)
        follows = _follows_batch(mi, wh, m)
        if r is AuxReduction.CONCAT and not follows:
            raise ValueError(f"aux_reduction: aux leaf {k} ({mi.str_short()} per micro-batch, {wh.str_short()} for "
                             f"the whole batch) has no batch dimension to concatenate along (at {where})")
        if r is not AuxReduction.CONCAT and mi.shape != wh.shape:
            raise ValueError(f"aux_reduction: aux leaf {k} has the batch as its leading dimension "
                             f"({mi.str_short()} per micro-batch); combine it with 'concat', not {r.value!r} (at {where})")
        needs = {AuxReduction.MEAN: jnp.inexact, AuxReduction.SUM: jnp.number}.get(r)
        if needs is not None and (is_key(mi) or not jnp.issubdtype(mi.dtype, needs)):
            raise ValueError(f"aux_reduction: aux leaf {k} is {mi.str_short()}; {r.value!r} needs "
                             f"{'floating values' if r is AuxReduction.MEAN else 'numbers'} (at {where})")
        aux.append(r)
    keys = key_operands(params["loss_jaxpr"], params["num_diff"]) if params["fold_rng"] else frozenset()
    # ``None`` (inferred) combines by the mean until ``exact_micro_batching`` resolves it.
    return MicroBatching(params["reduction"] or LossReduction.MEAN, tuple(aux), tuple(per_mb),
                         frozenset(k for k in keys if not per_mb[k]), m)
