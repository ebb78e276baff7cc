"""A one-stage, one-micro-batch step as one SPMD program: what ``jax.jit`` would run.

With a single stage and a single micro-batch there is nothing to pipeline: the
pipeline runtime would launch the forward, the backward, the gradient
reduction and the update as separate programs, where one program lets XLA fuse
across them. The compiled pipeline still decides where every value lives
(``passes.step_layout``); this runs the traced step under ``jax.jit`` with
those placements as its input and output shardings, so a step moves nothing
the pipeline path would not, and the next step's inputs are already placed.

Semantics equal the pipeline's with ``M = 1``: the gradient equation is
``value_and_grad`` of the loss, and each PRNG key the loss reads once per step
is ``fold_in(key, 0)`` when the step folds keys.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from meshpar.passes import jax_ir
from meshpar.passes.pipeline.step_primitives import pipeline_grad_p, stage_boundary_p
from meshpar.passes.pipeline.cutting.micro_batching import MicroBatching
from meshpar.runtime.placement import put

__all__ = ["SpmdStep"]


class SpmdStep:
    """The traced step ``jaxpr`` compiled as one program.

    Args:
      jaxpr: the step traced at the whole batch's shapes, with one gradient equation.
      micro_batching: the gradient equation's combination rules (``num_micro_batches == 1``).
      in_shardings: per flattened input leaf, where it is placed.
      out_shardings: per output leaf, where it goes (``None``: where XLA computes it).
      out_tree: the step's output treedef.
      leaf_shardings: per input leaf, where the step keeps it between calls (``None``: a batch
        leaf), as ``StepProgram.leaf_shardings`` says (what ``meshpar.checkpoint`` reads).
      carried: the input leaves an output of the step replaces (the state): the next step gets
        them back where this one put them.
    """

    def __init__(self, jaxpr: jax_ir.ClosedJaxpr, micro_batching: MicroBatching,
                 in_shardings: Sequence[NamedSharding], out_shardings: Sequence[NamedSharding | None],
                 out_tree: Any, leaf_shardings: Sequence[NamedSharding | None], description: str = "",
                 carried: Collection[int] = ()) -> None:
        if micro_batching.num_micro_batches != 1:
            raise ValueError(f"micro_batching: one SPMD program runs one micro-batch, got "
                             f"{micro_batching.num_micro_batches}")
        self.out_tree = out_tree
        self.leaf_shardings = tuple(leaf_shardings)
        self.description = description
        self.in_shardings = tuple(in_shardings)
        fold = micro_batching.fold_keys
        traced_as = [(v.aval.shape, v.aval.dtype) for v in jaxpr.jaxpr.invars]

        def step(*leaves: jax.Array) -> tuple[jax.Array, ...]:
            # jax.jit traces again for operands of other shapes (``run_as_given``): the jaxpr
            # holds only for the shapes it was traced at.
            if [(x.shape, x.dtype) for x in leaves] != traced_as:
                raise _OtherSignature
            return tuple(_evaluate(jaxpr.jaxpr, jaxpr.consts, leaves, fold))

        self._run = jax.jit(step, in_shardings=self.in_shardings, out_shardings=tuple(out_shardings))
        # Where every input lies in this process, jax.jit checks where the state's leaves lie
        # itself (in C++): a later step places only the leaves its caller gives anew.
        self.places_own_inputs = all(s.is_fully_addressable for s in self.in_shardings)
        carried = set(carried)
        self._given_anew = [i for i in range(len(self.in_shardings)) if i not in carried]

    def __call__(self, leaves: Sequence[Any]) -> list[jax.Array]:
        return list(self._run(*[put(x, s) for x, s in zip(leaves, self.in_shardings)]))

    def run_as_given(self, leaves: Sequence[Any]) -> list[jax.Array] | None:
        """The step on ``leaves``, the state's as they are and the others placed (``put``): a
        step after the first gets its state back where the last one left it, so jax.jit checks
        that in C++ where placing each leaf in Python costs about what jax.jit's whole dispatch
        does. (Passing every leaf as given would make jax.jit compile the step again for host
        data and uncommitted arrays.) ``None`` where the program cannot run them so (a leaf of
        another shape or dtype than traced, or state committed elsewhere): call the step
        instead, which places every leaf."""
        leaves = list(leaves)
        for i in self._given_anew:
            leaves[i] = put(leaves[i], self.in_shardings[i])
        try:
            return list(self._run(*leaves))
        except (_OtherSignature, ValueError):
            return None

    def lower(self, leaves: Sequence[Any]) -> jax.stages.Lowered:
        """The program lowered for inputs of ``leaves``' shapes and dtypes (nothing is placed or
        run): ``.compile().as_text()`` is the HLO a step executes."""
        return self._run.lower(*[jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x), sharding=s)
                                 for x, s in zip(leaves, self.in_shardings)])

    def describe(self) -> str:
        """What runs: one SPMD program on one mesh."""
        return self.description

    def compiled_count(self) -> int:
        """Executables compiled so far: one after the first step."""
        return jax_ir.compiled_count(self._run)


def _evaluate(jaxpr: jax_ir.Jaxpr, consts: Sequence[Any], args: Sequence[Any], fold_keys: frozenset[int]) -> list[Any]:
    """``jaxpr`` evaluated with its gradient equation as ``value_and_grad`` over one micro-batch."""
    env: dict[jax_ir.Var, Any] = {}

    def read(v: jax_ir.Atom) -> Any:
        return v.val if isinstance(v, jax_ir.Literal) else env[v]

    for var, value in zip((*jaxpr.constvars, *jaxpr.invars), (*consts, *args)):
        env[var] = value
    for eqn in jaxpr.eqns:
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
    """``loss`` without its stage markers: one program has no stages, and the markers' effect
    would cost every call JAX's C++ dispatch (the program then runs like ``jax.jit`` of the
    step, whose markers bind nothing)."""
    jaxpr = loss.jaxpr
    eqns = [e for e in jaxpr.eqns if e.primitive is not stage_boundary_p]
    effects = jaxpr.effects - set(stage_boundary_p.abstract_eval()[1])
    return jax_ir.ClosedJaxpr(jaxpr.replace(eqns=eqns, effects=effects), loss.consts)


class _OtherSignature(Exception):
    """Operands of other shapes or dtypes than the step was traced at."""
