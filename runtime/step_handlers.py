"""The step program's handlers, one per instruction kind (``passes.program.step_instructions``):
the registry ``pipeline_executor.PipelineExecutable`` runs a step by.

A new kind of step instruction is its ``StepInstruction`` subclass in the program format and one
``register_step_handler`` call here, from any module: an executable built for a step holding a
kind with no handler refuses it, naming the kind.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshpar.passes.program.step_instructions import StepInstruction
from meshpar.runtime import (around_pipeline, micro_batch_results, pipeline_run, placing_inputs, stacked_leaves,
                             stage_feeds, step_outputs)
from meshpar.runtime.step_state import StepHandler, StepState

__all__ = ["STEP_HANDLERS", "register_step_handler"]

STEP_HANDLERS: dict[type, StepHandler] = {
    **stacked_leaves.HANDLERS, **placing_inputs.HANDLERS, **around_pipeline.HANDLERS, **stage_feeds.HANDLERS,
    **pipeline_run.HANDLERS, **micro_batch_results.HANDLERS, **step_outputs.HANDLERS,
}


def register_step_handler(kind: type, run: Callable[[Any, Any, Any, StepState], None],
                          prepare: Callable[[Any, Any], Any] | None = None,
                          ahead: Callable[[Any, Any, Any], None] | None = None) -> None:
    """Runs every step instruction of ``kind`` with ``run(executable, ins, ready, state)``, where
    ``ready = prepare(executable, ins)`` once, when an executable is built, and compiles its
    programs before the first step with ``ahead(walk, ins, ready)`` (``StepHandler``).

    Raises:
      TypeError: ``kind`` is not a ``StepInstruction`` subclass.
      ValueError: ``kind`` has a handler already.
    """
    if not (isinstance(kind, type) and issubclass(kind, StepInstruction)):
        raise TypeError(f"kind: expected a StepInstruction subclass, got {kind!r}")
    if kind in STEP_HANDLERS:
        raise ValueError(f"kind: {kind.__name__} has a handler already")
    STEP_HANDLERS[kind] = StepHandler(run, prepare, ahead)
