"""One stage's compute as the runtime compiles it: its parts (jaxprs), wiring, operand shardings
and how its gradients accumulate."""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh, NamedSharding

from .. import jax_ir
from .pipeline_instructions import StageIO

__all__ = ["Accumulator", "KernelOperand", "StageAccumulation", "StageKernel", "StageParts", "StageReplicas"]


@dataclasses.dataclass(frozen=True)
class StageReplicas:
    """A stage run as ``count`` replicas over mesh axis ``axis``.

    Attributes:
      parts: the stage's compute parts traced per replica (``micro_batch / count`` examples).
      input_dims: per stage input (``Stage.inputs`` order), the dimension its micro-batch value
        splits along into the replicas' (contiguous blocks, replica ``r`` the ``r``-th); ``None``:
        every replica reads the whole value.
      folded_keys: input positions that are keys folded per micro-batch; replica ``r`` reads
        ``fold_in(key, r)``.
      output_dims: per output slot, the dimension the replicas' values concatenate along;
        ``None``: each replica makes one whole value (the loss, an aux value), which the step
        combines as it combines micro-batches' (``per_replica``).
      loss_seed: the cotangent seed of a replica's loss.
    """

    count: int
    axis: str
    parts: StageParts
    input_dims: tuple[int | None, ...]
    folded_keys: frozenset[int]
    output_dims: tuple[int | None, ...]
    loss_seed: float

    def per_replica(self, slot: int) -> bool:
        """Whether output ``slot`` leaves one value per replica, led by the replica count."""
        return self.output_dims[slot] is None


@dataclasses.dataclass(frozen=True)
class Accumulator:
    """A parameter gradient's accumulator over a step's micro-batches: ``shape`` is the
    parameter's, led by the replica count for a stage run as replicas."""

    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: NamedSharding


@dataclasses.dataclass(frozen=True)
class StageAccumulation:
    """How one stage's parameter gradients accumulate and reduce.

    Attributes:
      replicas: how the stage runs as replicas; ``None``: over the whole micro-batch, each
        backward reducing its own gradients (``per_micro_batch`` says why).
      accumulators: per parameter input (``Stage.param_inputs`` order).
      reduced: per parameter input, the reduced gradient's sharding and dtype (the layout's
        ``grad_shardings``, the parameter's dtype).
      per_micro_batch: why the stage reduces per micro-batch ("" when it does not, or has no
        parameters).
    """

    replicas: StageReplicas | None
    accumulators: tuple[Accumulator, ...]
    reduced: tuple[tuple[NamedSharding, np.dtype], ...]
    per_micro_batch: str = ""

    @property
    def copies(self) -> int:
        """How many copies of the stage's parts make one micro-batch's work: the replica
        count, or 1 for a stage run over the whole micro-batch."""
        return self.replicas.count if self.replicas is not None else 1

    @property
    def needs_reduction(self) -> bool:
        """Whether the accumulators need a program at the end of the step (a replica sum or a cast)."""
        return self.replicas is not None or any(
            a.dtype != dtype for a, (_, dtype) in zip(self.accumulators, self.reduced))


@dataclasses.dataclass(frozen=True)
class StageParts:
    """Compute parts of forward stage ``stage``; R residuals, S weight-state values.

    Attributes:
      forward: ``(*diff_inputs, *other_inputs) -> (*outputs, *residuals)``.
      backward: ``(*residuals, *output_cotangents) -> (*act_cotangents, *param_cotangents)``;
        output cotangents are those of the ``diff_outputs`` slots, in order.
      backward_input: B, ``(*residuals, *output_cotangents) -> (*act_cotangents, *weight_state)``.
      backward_weight: W, ``(*weight_state) -> (*param_cotangents)``.
      diff_inputs: positions in ``stage.inputs`` of the ``param`` refs and the floating
        ``act`` refs, in order.
      other_inputs: positions of the rest (integer, bool and key activations included), in order.
      act_inputs, param_inputs: positions of the differentiated ``act`` resp. ``param`` refs;
        the cotangents come in this order, activations first.
      diff_outputs: output slots with a cotangent (``StageGraph.differentiated_slots``);
        the others (aux-only values, integer, bool and key values) have none, so no
        ``float0`` value is ever built, let alone moved.
    """

    stage: int
    forward: jax_ir.ClosedJaxpr
    backward: jax_ir.ClosedJaxpr
    backward_input: jax_ir.ClosedJaxpr
    backward_weight: jax_ir.ClosedJaxpr
    diff_inputs: tuple[int, ...]
    other_inputs: tuple[int, ...]
    act_inputs: tuple[int, ...]
    param_inputs: tuple[int, ...]
    diff_outputs: tuple[int, ...]
    num_outputs: int
    num_residuals: int
    num_weight_state: int

    @property
    def num_act_cotangents(self) -> int:
        return len(self.act_inputs)

    @property
    def num_param_cotangents(self) -> int:
        return len(self.param_inputs)

    @property
    def forwarded_state(self) -> tuple[int | None, ...]:
        """Per weight-state value, the B input it merely forwards, else None.

        A jitted B copies an input it returns (JAX 0.10 does not alias them),
        so a runtime may hand W those inputs itself and skip the copy.
        """
        jaxpr = self.backward_input.jaxpr
        where = {v: k for k, v in enumerate(jaxpr.invars)}
        return tuple(where.get(v) for v in jaxpr.outvars[self.num_act_cotangents:])


@dataclasses.dataclass(frozen=True)
class KernelOperand:
    """A non-activation input of a stage's forward: input ``position``, laid out as ``sharding`` on
    the stage's mesh; a ``per_micro_batch`` one takes one value per micro-batch, the others one
    value every micro-batch reads (how the step feeds it: ``step_instructions``'s feeds)."""

    position: int
    sharding: NamedSharding
    per_micro_batch: bool


@dataclasses.dataclass(frozen=True)
class StageKernel:
    """One stage's compute on its mesh (module doc).

    Attributes:
      stage: the stage's index.
      in_avals, out_avals: the forward's input and output types (activations in their own type:
        a key, not its wire form).
      act_inputs: positions of the inputs received from other stages, in input order.
      parts: its forward, backward, input and weight passes; a replica's
        (``accumulation.replicas.parts``) for a stage run as replicas.
      io: how its passes meet the program's buffers.
      operands: its non-activation inputs, in input order; with ``act_inputs`` they cover every
        input position once.
      output_shardings: per output slot, the sharding it leaves with (its first move's source,
        else replicated on the mesh).
      input_cotangent_shardings: per activation input with a cotangent (``StageIO.cotangent_in_edges``),
        the sharding that cotangent leaves with.
      mesh: the mesh running it.
      loss_seed: the loss's cotangent (the reduction's weight: ``1 / M`` for a mean).
      accumulation: how its gradients accumulate and reduce.
    """

    stage: int
    in_avals: tuple[jax_ir.AbstractValue, ...]
    out_avals: tuple[jax_ir.AbstractValue, ...]
    act_inputs: tuple[int, ...]
    parts: StageParts
    io: StageIO
    operands: tuple[KernelOperand, ...]
    output_shardings: tuple[NamedSharding, ...]
    input_cotangent_shardings: tuple[NamedSharding, ...]
    mesh: Mesh
    loss_seed: float
    accumulation: StageAccumulation

    @property
    def fixed_operands(self) -> tuple[KernelOperand, ...]:
        """The operands every micro-batch reads, in input order."""
        return tuple(o for o in self.operands if not o.per_micro_batch)

    @property
    def batch_operands(self) -> tuple[KernelOperand, ...]:
        """The operands read one per micro-batch, in input order."""
        return tuple(o for o in self.operands if o.per_micro_batch)
