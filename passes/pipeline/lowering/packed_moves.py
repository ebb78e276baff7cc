"""Pass: a packed move's packing runs inside the program making its values, its unpacking inside
the programs reading them.

``step_split`` packs several values of one dtype crossing the same two meshes at the same time
into one vector (a global norm's per-parameter partial sums cross once, not once each), and
``lower_step`` makes that a ``RunMove`` with ``unpacked`` set: the runtime then launches a
program concatenating the values on the source mesh and one slicing them apart on the
destination. Each is a program to compile and launch every step, and the slicing one compiles
one kernel per value on XLA:CPU (96 for the main job's norm: 0.36 s of its first step).

``fuse_packing`` rewrites each packed move whose values one ``RunCompute`` makes on the source
mesh and only ``RunCompute``s read on the destination mesh:

- the producer also returns the packed vector (``OuterKind.PACKED``), laid out as the move
  sends it, and no longer returns the values nothing else reads on its mesh;
- the move carries that one vector, as any single value;
- each reader takes the vector in place of the values and slices them out itself, where
  XLA fuses the slices into what reads them.

Moves it cannot rewrite (values made by the pipeline or by several programs, or read by a
feed, a move or the outputs) keep their packing programs. The values are exactly the
packing programs' (a concatenation and slices), so results are unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.flat_values import flatten, unflatten
from ...program.step_instructions import RunCompute, RunMove, StepInstruction, StepProgram
from ...program.step_values import OuterKind, OuterRef
from ...verification import PlanVerificationError

__all__ = ["fuse_packing", "verify_fused_packing"]


def _writer(instructions: Sequence[StepInstruction], before: int, located: tuple[OuterRef, int]) -> int | None:
    """The position of the last instruction before ``before`` that makes ``located``."""
    return next((k for k in range(before - 1, -1, -1) if located in instructions[k].writes), None)


def _readers(instructions: Sequence[StepInstruction], start: int, located: set[tuple[OuterRef, int]],
             skip: int) -> list[int]:
    """The positions from ``start`` on (less ``skip``) of the instructions reading any of ``located``."""
    return [k for k in range(start, len(instructions))
            if k != skip and any(r in located for r in instructions[k].reads)]


def _fusable(instructions: Sequence[StepInstruction], k: int) -> tuple[int, list[int]] | None:
    """For the packed move at ``k``: its producer's position and its readers', or ``None`` when
    the move is not one ``fuse_packing`` rewrites (module doc)."""
    move = instructions[k]
    writers = {_writer(instructions, k, (v, move.src)) for v in move.values}
    if len(writers) != 1 or None in writers:
        return None
    (producer,) = writers
    if not isinstance(instructions[producer], RunCompute):
        return None
    readers = _readers(instructions, k + 1, {(v, move.dst) for v in move.values}, k)
    if not readers or not all(isinstance(instructions[r], RunCompute) and instructions[r].mesh == move.dst
                              for r in readers):
        return None
    return producer, readers


def _with_packed_output(producer: RunCompute, values: Sequence[OuterRef], kept: set[OuterRef], packed: OuterRef,
                        move: RunMove) -> RunCompute:
    """``producer`` also returning ``values`` packed as ``packed`` (laid out as ``move`` sends it),
    and of ``values`` only those in ``kept``."""
    at = {ref: j for j, ref in enumerate(producer.outputs)}
    packed_values = set(values)
    keep = [j for j, ref in enumerate(producer.outputs) if ref not in packed_values or ref in kept]
    fn = jax_ir.jaxpr_as_fun(producer.jaxpr)

    def body(*args):
        outs = fn(*args)
        return [outs[j] for j in keep] + [flatten([outs[at[v]] for v in values])]

    jaxpr = jax.make_jaxpr(body)(*producer.jaxpr.in_avals)
    return RunCompute(producer.mesh, jaxpr, producer.inputs,
                      (*(producer.outputs[j] for j in keep), packed),
                      (*(producer.output_shardings[j] for j in keep), move.via.src))


def _reading_packed(reader: RunCompute, values: Sequence[OuterRef], packed: OuterRef,
                    avals: Mapping[OuterRef, jax_ir.AbstractValue]) -> RunCompute:
    """``reader`` taking ``packed`` first, in place of ``values``, and slicing them out itself."""
    moved = set(values)
    rest = [j for j, ref in enumerate(reader.inputs) if ref not in moved]
    fn = jax_ir.jaxpr_as_fun(reader.jaxpr)
    value_avals = [avals[v] for v in values]

    def body(vector, *others):
        unpacked = dict(zip(values, unflatten(vector, value_avals)))
        given = dict(zip(rest, others))
        return fn(*(unpacked[ref] if ref in moved else given[j] for j, ref in enumerate(reader.inputs)))

    jaxpr = jax.make_jaxpr(body)(avals[packed], *(reader.jaxpr.in_avals[j] for j in rest))
    return RunCompute(reader.mesh, jaxpr, (packed, *(reader.inputs[j] for j in rest)), reader.outputs,
                      reader.output_shardings)


@compiler_pass
def fuse_packing(step: StepProgram) -> StepProgram:
    """``step`` with each packed move it can rewrite made one vector's move (module doc)."""
    instructions = list(step.instructions)
    avals = dict(step.avals)
    packed_count = sum(1 for ref in avals if ref.kind is OuterKind.PACKED)
    for k, move in enumerate(instructions):
        if not isinstance(move, RunMove) or not move.unpacked:
            continue
        found = _fusable(instructions, k)
        if found is None:
            continue
        producer, readers = found
        packed = OuterRef(OuterKind.PACKED, packed_count)
        packed_count += 1
        avals[packed] = jax_ir.ShapedArray(move.via.shape, move.via.dtype)
        kept = {v for v in move.values
                if _readers(instructions, producer + 1, {(v, move.src)}, k)}
        instructions[producer] = _with_packed_output(instructions[producer], move.values, kept, packed, move)
        instructions[k] = RunMove((packed,), move.src, move.dst, move.via)
        for r in readers:
            instructions[r] = _reading_packed(instructions[r], move.values, packed, avals)
    return dataclasses.replace(step, instructions=tuple(instructions), avals=avals)


def verify_fused_packing(step: StepProgram) -> None:
    """No packed move is left that ``fuse_packing`` rewrites; every packed vector has its aval
    (the move's shape and dtype), one program making it and one move carrying it.

    Raises:
      PlanVerificationError: naming the move or the vector.
    """
    instructions = step.instructions
    for k, ins in enumerate(instructions):
        if isinstance(ins, RunMove) and ins.unpacked and _fusable(instructions, k) is not None:
            raise PlanVerificationError(f"{ins}: still packed by programs of its own")
    for ref in (r for r in step.avals if r.kind is OuterKind.PACKED):
        makers = [ins for ins in instructions if isinstance(ins, RunCompute) and ref in ins.outputs]
        carriers = [ins for ins in instructions if isinstance(ins, RunMove) and ref in ins.values]
        if len(makers) != 1 or len(carriers) != 1 or carriers[0].values != (ref,):
            raise PlanVerificationError(f"{ref}: not made by one program and carried by one move")
        aval, via = step.avals[ref], carriers[0].via
        if tuple(aval.shape) != tuple(via.shape) or aval.dtype != via.dtype:
            raise PlanVerificationError(f"{ref} is {aval.str_short()}, but its move carries {via.shape} {via.dtype}")
