"""The program interpreter on its own, with fake stage executables and moves: it runs each mesh's
instructions in launch order, keeps each buffer from its write to its free, accumulates each
stage's gradients once per backward, skips compute of meshes this process does not own while
joining every move, and names the instruction that failed."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.program.moves import Direction, EdgeTransfer, TransferKind
from meshpar.passes.program.pipeline_instructions import BufferKind, Free, RunForward
from meshpar.passes.pipeline.lowering.pipeline_program import lower_to_program, stage_io
from meshpar.passes.pipeline.scheduling.pipeline_schedule import make_schedule
from meshpar.passes.program.tasks import TaskKind
from meshpar.runtime.program_interpreter import InstructionError, ProgramInterpreter, StageInputs


def _program(name, S, M, num_meshes=None, delays=None):
    edges = [(s, s + 1) for s in range(S - 1)]
    quads = [(p, c, 0, 0) for p, c in edges]
    # The interpreter reads a transfer's source only to name its senders: one device stands in.
    one = NamedSharding(Mesh(np.array(jax.devices()[:1]), ("x",)), P())
    transfers = [EdgeTransfer(e, d, a, b, 0, (2,), np.dtype("float32"), one, one, TransferKind.P2P)
                 for e, (p, c) in enumerate(edges)
                 for d, (a, b) in ((Direction.ACTIVATION, (p, c)), (Direction.COTANGENT, (c, p)))]
    return lower_to_program(make_schedule(name, S, M, edges, delays, num_meshes),
                            stage_io(S, quads, (S - 1, 0), [1] * S), transfers)


class FakeStage:
    """Records every call as (kind, stage, micro-batch); values are tagged tuples, gradients
    count the backwards that reached them."""

    def __init__(self, stage, log, fail_at=None):
        self.stage, self.log, self.fail_at = stage, log, fail_at

    def _note(self, kind, m):
        self.log.append((kind, self.stage, m))
        if self.fail_at == (kind, m):
            raise ValueError(f"boom in stage {self.stage}")

    def forward(self, fixed, batch, acts):
        (m,) = batch
        self._note(TaskKind.FORWARD, m)
        assert all(a in (None, ("act", self.stage - 1, m)) for a in acts), acts
        return [("act", self.stage, m)], [("res", self.stage, m)]

    def backward(self, residuals, cotangents, grads):
        (_, _, m), = residuals
        self._note(TaskKind.BACKWARD, m)
        # None: sent by a process of its own (the stand-in of a value held elsewhere).
        assert all(c in (None, ("ct", self.stage + 1, m)) for c in cotangents), cotangents
        return [("ct", self.stage, m)] if self.stage else [], [g + 1 for g in grads]

    def backward_input(self, residuals, cotangents):
        (_, _, m), = residuals
        self._note(TaskKind.BACKWARD_INPUT, m)
        return ([("ct", self.stage, m)] if self.stage else []), [("computed", self.stage, m)]

    def weight_state(self, residuals, computed):
        return [residuals[0], *computed]

    def backward_weight(self, weight_state, grads):
        self._note(TaskKind.BACKWARD_WEIGHT, weight_state[0][2])
        return [g + 1 for g in grads]


def _run(program, local=None, fail_at=None):
    S, M = len(program.stages), program.num_micro_batches
    log, moved = [], []
    stages = [FakeStage(s, log, fail_at if s == S - 1 else None) for s in range(S)]

    def move(k):
        def run(value):
            moved.append((k, value))
            return value if value is None else (("ct" if program.transfers[k].direction is Direction.COTANGENT
                                                 else "act"), *value[1:])
        return run

    local = [True] * program.num_meshes if local is None else local
    home = program.stage_mesh
    interpreter = ProgramInterpreter(program, stages, [move(k) for k in range(len(program.transfers))], {}, local,
                                     watch=False)
    inputs = [StageInputs((), tuple((m,) for m in range(M))) if local[home[s]] else None for s in range(S)]
    grads = [[np.float64(0)] if local[home[s]] else None for s in range(S)]
    return interpreter.run(inputs, grads), log, moved


@pytest.mark.parametrize("name,S,P,M,delays", [("1f1b", 3, None, 4, None), ("gpipe", 2, None, 3, [1, 1]),
                                                ("zb_h1", 3, None, 4, None), ("interleaved_1f1b", 4, 2, 4, None),
                                                ("interleaved_1f1b", 6, 3, 6, [2, 2, 2])])
def test_runs_each_meshs_sequence_in_order_and_accumulates_every_backward(name, S, P, M, delays):
    program = _program(name, S, M, P, delays)
    run, log, moved = _run(program)
    edges = [(s, s + 1) for s in range(S - 1)]
    for mesh, seq in enumerate(make_schedule(name, S, M, edges, delays, P).sequences):
        on_mesh = [(k, s, m) for k, s, m in log if program.stage_mesh[s] == mesh]
        assert on_mesh == [(t.kind, t.where, t.micro_batch) for t in seq]
    # One gradient contribution per micro-batch: each whole backward or weight pass adds one.
    assert [g[0] for g in run.grads] == [M] * S
    assert len(moved) == M * 2 * (S - 1)
    # Only the loss of every micro-batch outlives the program.
    assert set(run.results) == set(program.results)
    assert all(b.kind is BufferKind.RESULT for b in run.results)


def test_peak_residuals_follow_the_frees():
    program = _program("1f1b", 3, 6)
    run, _, _ = _run(program)
    assert run.peak_live_activations == [3, 2, 1]
    gpipe, _, _ = _run(_program("gpipe", 3, 6))
    assert gpipe.peak_live_activations == [6, 6, 6]


def test_compute_of_a_mesh_owned_elsewhere_is_skipped_but_every_move_is_joined(monkeypatch):
    # In one process every device is this process's: what another process would name instead of
    # a value it does not hold stands in as None.
    monkeypatch.setattr("meshpar.runtime.program_interpreter.absent", lambda shape, dtype, sharding: None)
    program = _program("1f1b", 2, 3)
    run, log, moved = _run(program, local=[True, False])
    assert {s for _, s, _ in log} == {0}
    assert run.grads[1] is None and run.grads[0] == [3]
    assert len(moved) == 2 * 3  # every activation and cotangent move, sent from here or not
    assert run.results == {}  # the loss lives on mesh 1


def test_a_failing_stage_names_the_instruction_and_mesh():
    program = _program("1f1b", 2, 3)
    with pytest.raises(InstructionError, match=r"mesh 1: forward of stage 1, micro-batch 2 .*boom in stage 1"):
        _run(program, fail_at=(TaskKind.FORWARD, 2))


def test_reading_a_freed_buffer_names_the_instruction():
    # A program the verifier would reject, run anyway: micro-batch 0's received activation
    # freed before the forward that reads it.
    program = _program("1f1b", 2, 2)
    seq = list(program.instructions[1])
    forward = next(k for k, ins in enumerate(seq) if isinstance(ins, RunForward))
    free = next(k for k, ins in enumerate(seq) if isinstance(ins, Free) and ins.buffer == seq[forward].inputs[0])
    seq[forward], seq[free] = seq[free], seq[forward]
    broken = dataclasses.replace(program, instructions=(program.instructions[0], tuple(seq)))
    with pytest.raises(InstructionError, match=r"mesh 1: free of recv_act0\[0\].*|mesh 1: forward of stage 1, "
                                               r"micro-batch 0 .*recv_act0\[0\] is not live"):
        _run(broken)


def test_a_program_with_a_kind_the_interpreter_cannot_run_is_refused_naming_it():
    from meshpar.passes.program.pipeline_instructions import Instruction

    @dataclasses.dataclass(frozen=True)
    class Peek(Instruction):
        reads = property(lambda self: ())
        writes = property(lambda self: ())

    program = _program("1f1b", 2, 2)
    program = dataclasses.replace(program, instructions=(program.instructions[0] + (Peek(),), program.instructions[1]),
                                  order=(*program.order, (0, len(program.instructions[0]))))
    with pytest.raises(TypeError, match=r"program: instructions of kinds \['Peek'\] have no handler"):
        ProgramInterpreter(program, [], [], {}, [True, True], watch=False)
