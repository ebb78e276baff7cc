"""A one-stage, one-micro-batch step as one SPMD program: what ``jax.jit`` would run.

With a single stage and a single micro-batch there is nothing to pipeline: the
pipeline runtime would launch the forward, the backward, the gradient
reduction and the update as separate programs, where one program lets XLA fuse
across them. The compiler lowers the step to one plain jaxpr
(``passes.pipeline.lowering.spmd_program``: the gradient equation as
``value_and_grad`` over the one micro-batch, keys folded as the pipeline folds
them, no stage markers) and decides where every value lives
(``passes.pipeline.placing.step_layout``); this runs that jaxpr under ``jax.jit`` with those
placements as its input and output shardings, so a step moves nothing the
pipeline path would not, and the next step's inputs are already placed. It
decides nothing about what the step computes.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding

from meshpar.passes import jax_ir
from meshpar.runtime.placement import put

__all__ = ["SpmdStep"]


class SpmdStep:
    """The lowered step ``jaxpr`` compiled as one program.

    Args:
      jaxpr: the step lowered to JAX primitives only (``lower_spmd_step``), at the shapes and
        dtypes of the whole batch it was traced at; one input per flattened input leaf, one
        output per output leaf.
      in_shardings: per flattened input leaf, where it is placed.
      out_shardings: per output leaf, where it goes (``None``: where XLA computes it).
      out_tree: the step's output treedef.
      leaf_shardings: per input leaf, where the step keeps it between calls (``None``: a batch
        leaf), as ``StepProgram.leaf_shardings`` says (what ``meshpar.checkpoint`` reads).
      carried: the input leaves an output of the step replaces (the state): the next step gets
        them back where this one put them.
    """

    def __init__(self, jaxpr: jax_ir.ClosedJaxpr, in_shardings: Sequence[NamedSharding],
                 out_shardings: Sequence[NamedSharding | None], out_tree: Any,
                 leaf_shardings: Sequence[NamedSharding | None], description: str = "",
                 carried: Collection[int] = ()) -> None:
        self.out_tree = out_tree
        self.leaf_shardings = tuple(leaf_shardings)
        self.description = description
        self.in_shardings = tuple(in_shardings)
        traced_as = [(v.aval.shape, v.aval.dtype) for v in jaxpr.jaxpr.invars]
        run = jax_ir.staged_fun(jaxpr)

        def step(*leaves: jax.Array) -> tuple[jax.Array, ...]:
            # jax.jit traces again for operands of other shapes (``run_as_given``): the jaxpr
            # holds only for the shapes it was traced at.
            if [(x.shape, x.dtype) for x in leaves] != traced_as:
                raise _OtherSignature
            return tuple(run(*leaves))

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


class _OtherSignature(Exception):
    """Operands of other shapes or dtypes than the step was traced at."""
