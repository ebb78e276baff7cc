"""What the step program's handlers share: the executable they run on (``StepExecutable``), what
one step has made so far (``StepState``), and what a handler is (``StepHandler``).

A handler runs one kind of step instruction (``passes.program.step_instructions``) and decides
nothing: the instruction says what to do; the handler does it on this process's devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

from meshpar.passes.program.moves import MoveKey
from meshpar.passes.program.step_instructions import StepProgram
from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.runtime.coordination import Arrival
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.move_handlers import Move
from meshpar.runtime.program_interpreter import ProgramInterpreter, ProgramRun, StageInputs
from meshpar.runtime.remote import absent
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["AheadWalk", "StepExecutable", "StepHandler", "StepState"]


class StepExecutable(Protocol):
    """What a handler reads of the executable running it (``pipeline_executor.PipelineExecutable``).

    Attributes:
      step_program: the step program it runs (its constants and value types).
      meshes: the meshes, by index.
      mesh_local, local: per mesh, per stage: whether a device of it is this process's.
      timeout_s: how long a wait for another process lasts.
      num_micro_batches: the pipeline's micro-batch count.
      out_avals: per output leaf of the (rewritten) step, its shape and dtype.
      interpreter: the pipeline program's interpreter.
      stacked_leaves: the stacked leaves' splitter and joiner, if the step has them.
      peak_live_activations, peak_weight_states: per stage, the last step's peaks.
    """

    step_program: StepProgram
    meshes: tuple[Mesh, ...]
    mesh_local: Sequence[bool]
    local: Sequence[bool]
    timeout_s: float
    num_micro_batches: int
    out_avals: tuple[Any, ...]
    interpreter: ProgramInterpreter
    stacked_leaves: Any
    peak_live_activations: list[int]
    peak_weight_states: list[int]

    def move(self, key: MoveKey) -> Move:
        """The prepared move of ``key`` (one per distinct move)."""

    def stage_inputs(self, operands: dict[tuple[int, int], Any]) -> list[StageInputs | None]:
        """Per stage here, the fed ``operands`` as its programs take them (``None``: elsewhere)."""

    def zero_grads(self) -> list[list[jax.Array] | None]:
        """Per stage here, its zero gradient accumulators, for one step."""

    def operand_aval(self, stage: int, position: int) -> Any:
        """The type stage ``stage``'s program takes operand ``position`` as (one micro-batch's)."""

    def accumulator_programs(self) -> list[Callable[[], list[list[jax.Array]]]]:
        """Per mesh here, the program making its stages' zero accumulators."""

    def ready(self, ins: Any) -> Any:
        """What step instruction ``ins``'s handler prepared for it (``StepHandler.prepare``)."""


class AheadWalk(Protocol):
    """What a handler's ``ahead`` reads and writes of the walk compiling the step's programs
    before its first step (``runtime.step_ahead``): the step's values as shapes.

    Attributes:
      ex: the executable being compiled.
      compiler: where programs are queued (``compile_ahead.AheadOfTime``).
      leaves: the step's flattened arguments; ``None`` once they are no longer followed.
      inputs, grads: the stages' operands and accumulators as shapes (for the pipeline).
      values: ``(ref, mesh)`` -> its shape (``jax.ShapeDtypeStruct`` or a pending result;
        absent or ``None``: unknown).
      placed: per input leaf, per mesh, its shape once placed.
      run: the pipeline's run as shapes, once walked.
    """

    ex: StepExecutable
    compiler: Any
    leaves: Sequence[Any] | None
    inputs: list[StageInputs | None]
    grads: list[list[Any] | None]
    values: dict[tuple[OuterRef, int], Any]
    placed: list[dict[int, Any]]
    run: ProgramRun | None

    def program(self, fn: Any, *args: Any) -> Any:
        """Queues ``fn`` for ``args`` (shapes); its results as shapes (``None``: unknown)."""

    def value(self, ref: OuterRef, mesh: int) -> Any:
        """``ref`` on ``mesh`` as ``StepState.value`` reads it; ``None``: unknown."""


@dataclasses.dataclass(frozen=True)
class StepHandler:
    """How the executor runs one kind of step instruction.

    Attributes:
      run: ``(executable, ins, ready, state) -> None``: ``ins`` in one step, ``ready`` what
        ``prepare`` made of it (``None`` without one), ``state`` the step so far.
      prepare: ``(executable, ins) -> ready``, once, when the executable is built: the programs
        and moves ``run`` launches, so the step's hot path builds nothing.
      ahead: ``(walk, ins, ready) -> None``: ``ins`` in the walk that compiles the step's
        programs before its first step (an ``AheadWalk``: values as shapes),
        queuing the programs ``run`` would launch; ``None``: they compile in the first step.
    """

    run: Callable[[Any, Any, Any, StepState], None]
    prepare: Callable[[Any, Any], Any] | None = None
    ahead: Callable[[Any, Any, Any], None] | None = None


@dataclasses.dataclass
class StepState:
    """What one step has made so far: the placed inputs (per leaf, per mesh), the values computed
    or moved around the pipeline (``(ref, mesh)`` -> array), the stages' operands and inputs, the
    pipeline's run, the outputs."""

    program: StepProgram
    leaves: Sequence[Any]
    recorder: StepRecorder | None
    meter: LiveBytesMeter | None
    arrivals: list[Arrival]
    placed: list[dict[int, jax.Array]] = dataclasses.field(default_factory=list)
    values: dict[tuple[OuterRef, int], jax.Array] = dataclasses.field(default_factory=dict)
    # Per (stage, position), the operand a feed made: one value, or one per micro-batch.
    operands: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    inputs: list[StageInputs | None] = dataclasses.field(default_factory=list)
    run: ProgramRun | None = None
    outputs: list[Any] = dataclasses.field(default_factory=list)
    # The outputs as assembled, and which of them are one mesh's array (by output leaf: the mesh).
    assembled: list[Any] = dataclasses.field(default_factory=list)
    on_one_mesh: dict[int, int] = dataclasses.field(default_factory=dict)
    # Values other processes send here, by (ref, mesh), until a program reading them waited.
    remote: dict[tuple[OuterRef, int], Arrival] = dataclasses.field(default_factory=dict)
    # Stage operands other processes send here (fetches, micro-batches), awaited before the pipeline.
    feeding: list[Arrival] = dataclasses.field(default_factory=list)
    # What handlers note of this step once it is done (the executor calls each with the state).
    at_end: list[Callable[[StepState], None]] = dataclasses.field(default_factory=list)

    def held(self) -> list[Any]:
        """Every array (or nested list of arrays) this step holds outside the pipeline program."""
        held: list[Any] = [list(self.leaves), [list(p.values()) for p in self.placed], list(self.values.values()),
                           list(self.operands.values()), self.outputs]
        if self.run is not None:
            held += [list(self.run.results.values()), self.run.grads]
        return held

    def value(self, ref: OuterRef, mesh: int, stand_in: NamedSharding | None = None) -> Any:
        """``ref`` on ``mesh``, where the step put it; on another process's mesh, an array with no
        shards here laid out as ``stand_in`` (the sharding of what reads it)."""
        if ref.kind is OuterKind.IN:
            arrays = self.placed[ref.index]
            return arrays[mesh] if mesh in arrays else next(iter(arrays.values()))
        if ref.kind is OuterKind.CONST:
            return self.program.consts[ref.index]
        if (ref, mesh) in self.values:
            return self.values[(ref, mesh)]
        aval = self.program.avals[ref]
        return absent(aval.shape, aval.dtype, stand_in)
