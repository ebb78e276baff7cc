"""A stage's compute parts (``passes.stage_parts``) as jitted functions on its mesh.

The functions take operands grouped as the program's buffers hold them:

- ``forward(fixed, batch, acts) -> (outputs, residuals)``: ``fixed`` are the
  stage's per-step operands (``StepLayout.stage_operands`` that are not per
  micro-batch), ``batch`` its micro-batch slices, ``acts`` its received
  activations in ``StageIO.in_edges`` order;
- ``backward(residuals, cotangents, grads) -> (input_cotangents, grads)``:
  ``cotangents`` as ``StageIO.cotangent_edges`` lists them; each output's are
  summed, and the loss output's seeded with the loss reduction's weight
  (``1 / num_micro_batches`` for a mean, 1 for a sum); ``input_cotangents``
  as ``StageIO.cotangent_in_edges`` lists them;
  ``grads`` (donated) gain this micro-batch's parameter cotangents;
- ``backward_input(residuals, cotangents) -> (input_cotangents, computed)``:
  the weight pass's state is ``weight_state(residuals, computed)``: residuals
  it reads are passed on as they are, since a jitted function that returns
  an input copies it (JAX 0.10);
- ``backward_weight(weight_state, grads) -> grads``.

Activations and outputs are in wire format (``passes.wire_format``: keys as key data).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax._src import core
from jax.sharding import Mesh, NamedSharding

from meshpar.passes.pipeline.pipeline_program import StageIO
from meshpar.passes.pipeline.stage_graph import RefKind, Stage
from meshpar.passes.pipeline.stage_parts import StageParts
from meshpar.passes.pipeline.step_layout import StageOperand
from meshpar.passes.pipeline.wire_format import from_wire, to_wire

__all__ = ["StageExecutables", "compile_stage", "on_mesh"]


def on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` traced with ``mesh`` in context: bare ``PartitionSpec`` constraints in the user's
    step resolve to the stage's own mesh."""

    def run(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    run._cache_size = fn._cache_size  # type: ignore[attr-defined]
    return run


@dataclasses.dataclass(frozen=True)
class StageExecutables:
    forward: Callable
    backward: Callable
    backward_input: Callable
    backward_weight: Callable
    state_from_residual: tuple[int | None, ...]  # per weight-state value, the residual it is, or None

    def weight_state(self, residuals: Sequence[jax.Array], computed: Sequence[jax.Array]) -> list[jax.Array]:
        """The weight pass's operands: passed-on residuals and what the input pass computed."""
        rest = iter(computed)
        return [next(rest) if k is None else residuals[k] for k in self.state_from_residual]

    def compiled_count(self) -> int:
        """Executables compiled so far (constant across steps once the first has run)."""
        return sum(f._cache_size() for f in (self.forward, self.backward, self.backward_input, self.backward_weight))


def compile_stage(
    stage: Stage,
    parts: StageParts,
    io: StageIO,
    operands: Sequence[StageOperand],
    output_shardings: Sequence[NamedSharding],
    input_cotangent_shardings: Sequence[NamedSharding],
    mesh: Mesh,
    loss_seed: float,
) -> StageExecutables:
    """Jits ``parts`` for ``stage`` on ``mesh``; outputs and input cotangents are constrained to
    the shardings their transfers expect."""
    fixed_pos = [o.position for o in operands if not o.per_micro_batch]
    batch_pos = [o.position for o in operands if o.per_micro_batch]
    act_pos = [k for k, r in enumerate(stage.inputs) if r.kind is RefKind.ACT]
    out_avals = stage.jaxpr.out_avals
    forward_fn = core.jaxpr_as_fun(parts.forward)
    backward_fn = core.jaxpr_as_fun(parts.backward)
    input_fn = core.jaxpr_as_fun(parts.backward_input)
    weight_fn = core.jaxpr_as_fun(parts.backward_weight)
    num_acts = parts.num_act_cotangents
    in_avals = stage.jaxpr.in_avals
    state_from_residual = tuple(
        k if k is not None and k < parts.num_residuals else None for k in parts.forwarded_state)

    def forward(fixed, batch, acts):
        args = [None] * len(stage.inputs)
        for group, positions in ((fixed, fixed_pos), (batch, batch_pos), (acts, act_pos)):
            for value, k in zip(group, positions):
                args[k] = value
        for k in act_pos:
            args[k] = from_wire(args[k], in_avals[k])
        outs = forward_fn(*[args[k] for k in parts.diff_inputs], *[args[k] for k in parts.other_inputs])
        results = [jax.lax.with_sharding_constraint(to_wire(o), s)
                   for o, s in zip(outs[: parts.num_outputs], output_shardings)]
        return results, list(outs[parts.num_outputs :])

    def output_cotangents(cotangents):
        flat = iter(cotangents)
        out = []
        for slot in parts.diff_outputs:
            terms = [next(flat) for _ in io.out_edges[slot]]
            if slot == io.loss_slot:
                terms.append(jnp.full((), loss_seed, out_avals[slot].dtype))
            total = terms[0]
            for t in terms[1:]:
                total = total + t
            out.append(total)
        return out

    def constrain(input_cts):
        return [jax.lax.with_sharding_constraint(c, s) for c, s in zip(input_cts, input_cotangent_shardings)]

    def backward(residuals, cotangents, grads):
        cts = backward_fn(*residuals, *output_cotangents(cotangents))
        return constrain(cts[:num_acts]), [g + c for g, c in zip(grads, cts[num_acts:])]

    def backward_input(residuals, cotangents):
        outs = input_fn(*residuals, *output_cotangents(cotangents))
        state = outs[num_acts:]
        return constrain(outs[:num_acts]), [v for v, k in zip(state, state_from_residual) if k is None]

    def backward_weight(weight_state, grads):
        return [g + c for g, c in zip(grads, weight_fn(*weight_state))]

    return StageExecutables(
        on_mesh(jax.jit(forward), mesh),
        on_mesh(jax.jit(backward, donate_argnums=(2,)), mesh),
        on_mesh(jax.jit(backward_input), mesh),
        on_mesh(jax.jit(backward_weight, donate_argnums=(1,)), mesh),
        state_from_residual,
    )
