"""A new pipeline instruction is one module plus one registry entry (issue 43, item 1): this file
alone defines a toy kind (``Scale``: a buffer times a factor, into a buffer of its own), registers
its handler with the runtime (``program_interpreter.register_handler``), and the verifier, the
live-byte prediction and the interpreter take it through ``Instruction``'s interface, with no
other change. A kind nobody registered is refused, naming it. A toy step instruction (``Note``)
is verified through ``StepInstruction``'s interface alike; the step's executor refuses it, naming
it, until its handler is registered (``step_handlers.register_step_handler``), and then runs it.

What emits the toy stands in for a pass of its own: here it is inserted into a compiled pipeline
program (``dataclasses.replace``), as a pass rewriting the program would."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import meshpar
from examples.mlp import MLP
from meshpar.passes.program.pipeline_instructions import BufferId, BufferKind, Instruction, PipelineProgram
from meshpar.passes.pipeline.lowering.pipeline_program import verify_pipeline_program
from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.passes.program.step_instructions import AssembleOutputs, StepInstruction
from meshpar.passes.pipeline.lowering.step_program import verify_step_program
from meshpar.passes.program.live_bytes import MemoryProfile
from meshpar.passes.simulation.live_bytes import predict_live_bytes
from meshpar.passes.verification import PlanVerificationError
from meshpar.runtime.pipeline_executor import PipelineExecutable
from meshpar.runtime.program_interpreter import HANDLERS, ProgramInterpreter, register_handler
from meshpar.runtime.step_handlers import STEP_HANDLERS, register_step_handler
from pipeline_models import aux_sum_step, make_state, regression_batch
from test_program_interpreter import _program


@dataclasses.dataclass(frozen=True)
class Scale(Instruction):
    """``source`` times ``factor`` into ``into``, a result of the source's stage kept past the
    program, on that stage's mesh."""

    source: BufferId
    into: BufferId
    factor: float

    reads = property(lambda self: (self.source,))
    writes = property(lambda self: (self.into,))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        home = program.stage_mesh[self.source.index]
        return None if home == mesh else f"scales a buffer of stage {self.source.index}, which lives on mesh {home}"

    def __str__(self) -> str:
        return f"scale of {self.source} by {self.factor} into {self.into}"


# Per scale run: its mesh, the buffer it wrote, the value it read and the value it wrote.
SEEN: list[tuple] = []


def scale(interpreter: ProgramInterpreter, mesh: int, ins: Scale, state) -> tuple:
    """``Scale``'s handler: the runtime's whole part of the new kind."""
    if not interpreter.local[mesh]:
        return ()
    value = state.read(ins.source)
    if state.compile_only:  # compiling ahead: values are shapes, and so is the scaled one
        state.buffers[ins.into] = value
        return ()
    scaled = state.buffers[ins.into] = value * ins.factor
    SEEN.append((mesh, ins.into, value, scaled))
    return (scaled,)


@pytest.fixture
def registered():
    register_handler(Scale, scale)
    SEEN.clear()
    yield
    del HANDLERS[Scale]


def with_scales(program: PipelineProgram, stage: int, slot: int, factor: float = 2.0,
                on: int | None = None) -> tuple[PipelineProgram, list[Scale]]:
    """``program`` with, at the end of its mesh's list (``on``: another one), one ``Scale`` of
    each micro-batch's result ``slot`` of ``stage`` into a result of its own, kept past it."""
    mesh = program.stage_mesh[stage] if on is None else on
    into_slot = len(program.stages[stage].out_edges)
    scales = [Scale(BufferId(BufferKind.RESULT, stage, m, slot), BufferId(BufferKind.RESULT, stage, m, into_slot),
                    factor) for m in range(program.num_micro_batches)]
    lists = list(program.instructions)
    order = [*program.order, *((mesh, len(lists[mesh]) + k) for k in range(len(scales)))]
    lists[mesh] = (*lists[mesh], *scales)
    return dataclasses.replace(program, instructions=tuple(lists), order=tuple(order),
                               results=(*program.results, *(s.into for s in scales))), scales


def test_the_verifier_reads_the_new_kind_through_its_interface():
    program = _program("1f1b", 2, 3)  # the loss is stage 1's output 0
    scaled, scales = with_scales(program, 1, 0)
    verify_pipeline_program(scaled)
    # Its own check, named by the verifier.
    elsewhere, _ = with_scales(program, 1, 0, on=0)
    with pytest.raises(PlanVerificationError, match=r"mesh 0: scale of result1.0\[0\] by 2.0 into result1.1\[0\] "
                                                    r"scales a buffer of stage 1, which lives on mesh 1"):
        verify_pipeline_program(elsewhere)
    # Its reads: a buffer the program never writes.
    wrong, _ = with_scales(program, 1, 3)
    with pytest.raises(PlanVerificationError, match=r"mesh 1: scale of result1.3\[0\] .* reads result1.3\[0\], "
                                                    r"which is not live there"):
        verify_pipeline_program(wrong)
    # Its writes: a buffer left live that is not a result.
    kept = dataclasses.replace(scaled, results=program.results)
    with pytest.raises(PlanVerificationError, match=r"live after the program other than its results"):
        verify_pipeline_program(kept)


def test_the_live_byte_prediction_counts_what_the_new_kind_writes():
    program = _program("1f1b", 2, 3)
    scaled, scales = with_scales(program, 1, 0)
    # Only the toy's buffers are priced: the prediction is exactly what they hold, on their mesh.
    profile = MemoryProfile({(BufferKind.RESULT, 1, 1): 1000}, [0, 0], [0, 0], [[0], [1]])
    assert predict_live_bytes(program, profile).activations == {0: 0, 1: 0}
    assert predict_live_bytes(scaled, profile).activations == {0: 0, 1: 1000 * len(scales)}


def test_a_kind_with_no_handler_is_refused_naming_it():
    scaled, _ = with_scales(_program("1f1b", 2, 2), 1, 0)
    with pytest.raises(TypeError, match=r"program: instructions of kinds \['Scale'\] have no handler"):
        ProgramInterpreter(scaled, [], [], {}, [True, True], watch=False)


def test_registering_refuses_a_second_handler_and_what_is_not_an_instruction(registered):
    with pytest.raises(ValueError, match="Scale has a handler already"):
        register_handler(Scale, scale)
    from meshpar.passes.program.pipeline_instructions import Send
    with pytest.raises(ValueError, match="Send has a handler already"):
        register_handler(Send, scale)
    with pytest.raises(TypeError, match="not an Instruction subclass"):
        register_handler(int, scale)


@pytest.fixture(scope="module")
def mlp():
    """A 2-stage MLP step with aux values, compiled, and its executable."""
    batch = regression_batch()
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=2), batch["x"][:1])
    state = state.replace(tx=optax.adam(1e-3), opt_state=optax.adam(1e-3).init(state.params))
    parallel = meshpar.parallelize(aux_sum_step, method=meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2))
    return parallel, state, batch, parallel.get_compiled(state, batch), parallel.get_executable(state, batch)


def test_a_compiled_pipeline_runs_the_registered_kind(registered, mlp):
    parallel, state, batch, compiled, original = mlp
    loss = compiled.graph.loss
    program, scales = with_scales(compiled.program, loss.index, loss.slot, factor=3.0)
    verify_pipeline_program(program, compiled.gradients.reduced_stages())

    executable = PipelineExecutable(compiled.step, program, compiled.moves, compiled.kernels, original.out_tree,
                                    original.out_avals)
    leaves = jax.tree.leaves((state, batch))
    got = executable(leaves)
    # Each scale ran once, on the loss's mesh, in the program's order, scaling each micro-batch's
    # loss; the step's outputs are unchanged.
    home = compiled.schedule.stage_mesh[loss.index]
    assert [(mesh, into) for mesh, into, _, _ in SEEN] == [(home, s.into) for s in scales]
    for _, _, value, scaled in SEEN:
        np.testing.assert_allclose(np.asarray(scaled), 3.0 * np.asarray(value), rtol=1e-6)
    for g, w in zip(got, jax.tree.leaves(parallel(state, batch))):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


@dataclasses.dataclass(frozen=True)
class Note(StepInstruction):
    """A toy step instruction: reads ``value`` on ``mesh``, makes nothing."""

    value: OuterRef
    mesh: int

    reads = property(lambda self: ((self.value, self.mesh),))
    writes = property(lambda self: ())

    def __str__(self) -> str:
        return f"note of {self.value} on mesh {self.mesh}"


def test_a_new_step_kind_is_verified_through_its_interface_and_refused_by_the_executor_unless_handled(mlp):
    _, _, _, compiled, original = mlp
    step = list(compiled.step)
    assemble = next(k for k, ins in enumerate(step) if isinstance(ins, AssembleOutputs))
    loss_mesh = compiled.schedule.stage_mesh[compiled.graph.loss.index]
    loss = OuterRef(OuterKind.LOSS)

    def verify(instructions):
        verify_step_program(dataclasses.replace(compiled.step, instructions=tuple(instructions)), compiled.split,
                            compiled.graph, compiled.program)

    noted = step[:assemble] + [Note(loss, loss_mesh)] + step[assemble:]
    verify(noted)
    # What it reads, as it says: the loss is made (combined) after the pipeline, not before.
    with pytest.raises(PlanVerificationError, match=rf"note of loss0 on mesh {loss_mesh} reads loss0 on mesh "
                                                    rf"{loss_mesh} before it is made there"):
        verify([Note(loss, loss_mesh), *step])
    with pytest.raises(TypeError, match=r"step: instructions of kinds \['Note'\] have no handler"):
        PipelineExecutable(dataclasses.replace(compiled.step, instructions=tuple(noted)), compiled.program,
                           compiled.moves, compiled.kernels, original.out_tree, original.out_avals)


# Per note run: the value it read, and what its prepare made for it; per walk compiling the
# step's programs ahead, what it knew of that value then, and what its prepare made.
NOTED: list[tuple] = []
AHEAD: list[tuple] = []


def prepare_note(executable, ins: Note) -> str:
    return f"prepared for {ins}"


def run_note(executable, ins: Note, ready: str, state) -> None:
    """``Note``'s handler: the runtime's whole part of the new step kind."""
    if executable.mesh_local[ins.mesh]:
        NOTED.append((state.value(ins.value, ins.mesh), ready))


def note_ahead(walk, ins: Note, ready: str) -> None:
    """``Note``'s part of compiling the step's programs before its first step (it launches none)."""
    AHEAD.append((walk.value(ins.value, ins.mesh), ready))


@pytest.fixture
def note_handled():
    register_step_handler(Note, run_note, prepare_note, note_ahead)
    NOTED.clear()
    AHEAD.clear()
    yield
    del STEP_HANDLERS[Note]


def test_a_registered_step_kind_runs_in_the_step(note_handled, mlp):
    parallel, state, batch, compiled, original = mlp
    step = list(compiled.step)
    assemble = next(k for k, ins in enumerate(step) if isinstance(ins, AssembleOutputs))
    note = Note(OuterRef(OuterKind.LOSS), compiled.schedule.stage_mesh[compiled.graph.loss.index])
    noted = dataclasses.replace(compiled.step, instructions=(*step[:assemble], note, *step[assemble:]))
    verify_step_program(noted, compiled.split, compiled.graph, compiled.program)
    executable = PipelineExecutable(noted, compiled.program, compiled.moves, compiled.kernels, original.out_tree,
                                    original.out_avals)
    got = jax.tree.unflatten(original.out_tree, executable(jax.tree.leaves((state, batch))))
    want = jax.jit(aux_sum_step)(state, batch)
    # It ran once, with what its prepare made, reading the combined loss the step returns; before
    # the step, the walk compiling ahead met it once, the loss known there as a scalar.
    assert [ready for _, ready in NOTED] == [f"prepared for {note}"]
    assert [ready for _, ready in AHEAD] == [f"prepared for {note}"] and AHEAD[0][0] is not None
    assert AHEAD[0][0].shape == ()
    np.testing.assert_allclose(float(NOTED[0][0]), float(want[1]), rtol=1e-5)
    np.testing.assert_allclose(float(got[1]), float(want[1]), rtol=1e-5)
    with pytest.raises(ValueError, match="Note has a handler already"):
        register_step_handler(Note, run_note)
    with pytest.raises(TypeError, match="expected a StepInstruction subclass"):
        register_step_handler(int, run_note)
