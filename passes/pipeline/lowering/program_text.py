"""The compiled programs as text: the step program, one line per instruction in the order every
process runs it, and the pipeline program in its middle, per mesh, one line per instruction in
that mesh's order. Each line is the instruction's own ``__str__``, which is short by contract
(``StepInstruction``, ``program.pipeline_instructions.Instruction``): no line prints a jaxpr, so the text
stays small whatever the model."""

from __future__ import annotations

from ...program.pipeline_instructions import PipelineProgram
from ...program.step_instructions import StepProgram

__all__ = ["program_text"]


def program_text(step: StepProgram, program: PipelineProgram) -> str:
    """``step`` and ``program`` as text (module doc): the step's instructions numbered, then per
    mesh its stages and its instructions numbered in its own order, each with its position in
    the launch order every process follows."""
    lines = [f"step program: {len(step.instructions)} instructions"]
    width = len(str(max(len(step.instructions) - 1, 0)))
    lines += [f"  {k:>{width}}  {ins}" for k, ins in enumerate(step)]
    launched = {at: n for n, at in enumerate(program.order)}
    home = program.stage_mesh
    lines.append(f"pipeline program: {len(program.instructions)} meshes, "
                 f"{len(program.order)} instructions, {program.num_micro_batches} micro-batches")
    for mesh, instructions in enumerate(program.instructions):
        stages = ", ".join(str(s) for s, m in enumerate(home) if m == mesh) or "none"
        lines.append(f"  mesh {mesh} (stages {stages}): {len(instructions)} instructions")
        width = len(str(max(len(instructions) - 1, 0)))
        lines += [f"    {k:>{width}}  {ins}  (launch {launched.get((mesh, k), '?')})"
                  for k, ins in enumerate(instructions)]
    return "\n".join(lines)
