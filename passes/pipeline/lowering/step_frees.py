"""Pass: each value of the step is dropped right after its last use.

The step program's values (computed around the pipeline, moved between meshes, combined from
micro-batches, gradients reduced on their owners' meshes) are held by the runtime until
something frees them. Held to the step's end, a step holds, during its update, every gradient
beside the parameters and the optimizer state it writes anew. ``free_step_values`` adds, after
the last instruction that reads or makes a value on a mesh (a gradient summed from several
stages is made again by each: its last sum), one ``FreeValues`` naming everything that
instruction was last to use, as the pipeline program frees its buffers (``Free``). A value
the outputs read is the caller's, never freed; inputs and constants are not the step's.

Together with ``ReduceGradient`` consuming its stage's accumulator, the update then runs
without the accumulators, and each gradient is gone once the update has read it.
"""

from __future__ import annotations

import dataclasses

from ...compiler_pass import compiler_pass
from ...program.step_instructions import AssembleOutputs, FreeValues, Located, StepInstruction, StepProgram
from ...program.step_values import OuterKind
from ...verification import PlanVerificationError

__all__ = ["free_step_values", "verify_step_frees"]

# Values the step does not own: the caller's inputs, its constants, the literals it returns.
_NOT_THE_STEPS = (OuterKind.IN, OuterKind.CONST, OuterKind.LITERAL)


def _last_uses(instructions: tuple[StepInstruction, ...]) -> dict[Located, int]:
    """Per value the step owns, the position of the last instruction reading or making it."""
    last: dict[Located, int] = {}
    for k, ins in enumerate(instructions):
        for located in (*ins.reads, *ins.writes):
            if located[0].kind not in _NOT_THE_STEPS:
                last[located] = k
    return last


@compiler_pass
def free_step_values(step: StepProgram) -> StepProgram:
    """``step`` with a ``FreeValues`` after each last use (module doc)."""
    instructions = step.instructions
    end = next(k for k, ins in enumerate(instructions) if isinstance(ins, AssembleOutputs))
    after: dict[int, list[Located]] = {}
    for located, k in _last_uses(instructions).items():
        if k < end:
            after.setdefault(k, []).append(located)
    out: list[StepInstruction] = []
    for k, ins in enumerate(instructions):
        out.append(ins)
        if k in after:
            out.append(FreeValues(tuple(sorted(after[k], key=lambda v: (v[1], v[0])))))
    return dataclasses.replace(step, instructions=tuple(out))


def verify_step_frees(step: StepProgram) -> None:
    """Every value the step owns that nothing uses from the outputs on is freed (that nothing
    uses a value after its free, and each is freed once, ``verify_step_program`` checks).

    Raises:
      PlanVerificationError: naming the value held to the step's end.
    """
    freed = {v for ins in step for v in ins.frees}
    end = next(k for k, ins in enumerate(step) if isinstance(ins, AssembleOutputs))
    kept = sorted((v for v, k in _last_uses(step.instructions).items() if k < end and v not in freed),
                  key=lambda v: (v[1], v[0]))
    if kept:
        raise PlanVerificationError(f"{kept[0][0]} on mesh {kept[0][1]} is held to the step's end, though "
                                    f"nothing from the outputs on uses it")
