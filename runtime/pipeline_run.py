"""The handlers of ``RunPipeline`` (the pipeline program, run by ``program_interpreter``, once the
stage operands other processes send here have arrived) and ``AwaitArrivals`` (the bounded wait,
at the end of a step, for the pipeline's transfers into this process)."""

from __future__ import annotations

from typing import Any

from meshpar.passes.program.step_instructions import AwaitArrivals, RunPipeline
from meshpar.runtime.coordination import wait_arrivals
from meshpar.runtime.step_state import AheadWalk, StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS"]


def run_pipeline(ex: StepExecutable, ins: RunPipeline, ready: None, state: StepState) -> None:
    # The stages' fetched parameters and micro-batches other processes send here, arrived before
    # any stage program reading them is launched (``coordination.wait_pending`` says why).
    if state.feeding:
        wait_arrivals(state.feeding, ex.timeout_s, "stage operands", "starting the pipeline")
    state.inputs = ex.stage_inputs(state.operands)
    state.run = ex.interpreter.run(state.inputs, ex.zero_grads(), state.recorder, state.meter)
    state.arrivals += state.run.arriving
    ex.peak_live_activations = state.run.peak_live_activations
    ex.peak_weight_states = state.run.peak_weight_states


def await_arrivals(ex: StepExecutable, ins: AwaitArrivals, ready: None, state: StepState) -> None:
    if state.run.arriving:
        wait_arrivals(state.run.arriving, ex.timeout_s, "pipeline transfers", "waiting for them at the end of a step")


def pipeline_ahead(walk: AheadWalk, ins: RunPipeline, ready: Any) -> None:
    """The pipeline's programs (each stage's passes, fused runs, gradient reductions) and the
    zero accumulators it starts from."""
    walk.run = walk.ex.interpreter.compile_ahead(walk.inputs, walk.grads, walk.compiler)
    for make in walk.ex.accumulator_programs():
        walk.program(make)


HANDLERS = {RunPipeline: StepHandler(run_pipeline, ahead=pipeline_ahead), AwaitArrivals: StepHandler(await_arrivals)}
