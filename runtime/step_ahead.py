"""The programs around the pipeline, compiled ahead with its stages (``PipelineExecutable.compile_ahead``).

A step launches programs besides the stages' passes: the work before and after the pipeline
(``RunCompute``: the optimizer update, a global norm's parts), the per-micro-batch slicing of a
batch operand, the zero gradient accumulators, the combining of the micro-batches' losses, the
packing of values moved together. Unless compiled ahead, each compiles when the first step
reaches it, one after another. ``compile_step_ahead`` walks the step program as the executor's
handlers run it, with shapes for values (``compile_ahead.AheadOfTime``): each kind's handler
says how (``StepHandler.ahead``, beside its ``run``, in its own module), on ``StepShapes``.
Each instruction's operands' types follow from where the step places its inputs (the step's own leaves give
their shapes, dtypes and weak types), from the compiled programs' results and from the moves'
destinations; each program whose operands are all known is queued, and compiles side by side
with the stages' passes. A value whose type the walk cannot tell (after a stacked leaf's split,
a key's fold, a value on another process's mesh) is unknown, and the programs reading it
compile in the first step as before: the walk only saves compile time, it changes nothing
the step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.runtime.compile_ahead import AheadOfTime, NotCompiledAhead
from meshpar.runtime.program_interpreter import ProgramRun, StageInputs
from meshpar.runtime.step_handlers import STEP_HANDLERS

__all__ = ["StepShapes", "compile_step_ahead", "queue_program", "shaped_value"]


def compile_step_ahead(executable: Any, compiler: AheadOfTime, leaves: Sequence[Any] | None,
                       inputs: list[StageInputs | None], grads: list[list[Any] | None]) -> ProgramRun:
    """Queues on ``compiler`` the pipeline's programs (``ProgramInterpreter.compile_ahead`` with
    the stages' ``inputs`` and ``grads`` as shapes) and, given the step's flattened arguments
    ``leaves``, every program around it whose operands' types the walk can tell, each
    instruction by its handler's ``ahead``. Returns the pipeline's run as shapes."""
    if leaves is None:
        return executable.interpreter.compile_ahead(inputs, grads, compiler)
    walk = StepShapes(executable, compiler, leaves, inputs, grads)
    for ins in executable.step_program:
        ahead = STEP_HANDLERS[type(ins)].ahead
        if ahead is not None:
            ahead(walk, ins, executable.ready(ins))
    return walk.run


class StepShapes:
    """The step program's values as shapes, as the handlers' ``ahead`` walk them (a
    ``step_state.AheadWalk``):
    ``values[(ref, mesh)]`` and ``placed[leaf][mesh]`` (``jax.ShapeDtypeStruct`` or
    ``compile_ahead.Pending``; absent or ``None``: unknown); ``leaves`` the step's flattened
    arguments (``None`` once they are no longer followed); ``run`` the pipeline's run as shapes
    once it is walked, from the stages' ``inputs`` and ``grads``."""

    def __init__(self, executable: Any, compiler: AheadOfTime, leaves: Sequence[Any] | None,
                 inputs: list[StageInputs | None], grads: list[list[Any] | None]) -> None:
        self.ex, self.compiler, self.leaves = executable, compiler, leaves
        self.inputs, self.grads = inputs, grads
        self.values: dict[tuple[OuterRef, int], Any] = {}
        self.placed: list[dict[int, Any]] = []
        self.run: ProgramRun | None = None

    def program(self, fn: Any, *args: Any) -> Any:
        """``fn``'s results for ``args`` (``None``: unknown, or not compiled ahead); ``fn`` made
        by ``on_mesh``, or a plain ``jax.jit``."""
        return queue_program(self.compiler, fn, *args)

    def value(self, ref: OuterRef, mesh: int) -> Any:
        """``ref`` on ``mesh`` as ``StepState.value`` reads it; ``None``: unknown."""
        return shaped_value(ref, mesh, self.placed, self.ex.step_program.consts, self.values)


def queue_program(compiler: AheadOfTime, fn: Any, *args: Any) -> Any:
    """``fn``'s results for ``args`` as ``compiler`` queues it (``None``: an operand unknown, or
    not compiled ahead); ``fn`` made by ``on_mesh``, or a plain ``jax.jit``."""
    if any(a is None for a in jax.tree.leaves(args, is_leaf=lambda x: x is None)):
        return None
    jitted = getattr(fn, "jitted", fn)
    try:
        return compiler.program(jitted, *args, mesh=getattr(fn, "mesh", None), optional=True)
    except NotCompiledAhead:
        return None


def shaped_value(ref: OuterRef, mesh: int, placed: Sequence[dict[int, Any]], consts: Sequence[Any],
                 values: dict[tuple[OuterRef, int], Any]) -> Any:
    """``ref`` on ``mesh`` as ``StepState.value`` reads it, from the inputs' types once ``placed``
    (per leaf, per mesh), the step's ``consts`` and the other ``values``' types; ``None``: unknown."""
    if ref.kind is OuterKind.IN:
        if ref.index >= len(placed):
            return None
        arrays = placed[ref.index]
        return arrays.get(mesh, next(iter(arrays.values()), None))
    if ref.kind is OuterKind.CONST:
        return consts[ref.index]
    return values.get((ref, mesh))
