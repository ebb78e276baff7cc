"""Pass: lower a schedule to a typed per-mesh program over typed buffers.

Each mesh gets a list of instructions: run a part of one of the stages it
hosts (``PipelineSchedule.stage_mesh``) for a micro-batch, send or receive
one boundary value, free a buffer, reduce its stages' accumulated parameter
gradients once per step (``ReduceGradients``). Buffers are
``BufferId``s, never strings; every value a transfer moves, with its
shardings and its kind of move, was decided before this pass
(``edge_transfer.plan_edge_transfers``). ``PipelineProgram.order`` merges the
lists into the one launch order every process follows.

Buffers (``m`` is the micro-batch):

- ``ACTIVATION(s, slot, m)``: stage ``s``'s output ``slot`` on its own mesh,
  kept until its last send; ``RESULT(s, slot, m)`` when it is the loss or an
  aux value, kept past the program (a result);
- ``RECEIVED_ACTIVATION(e, m)``: edge ``e``'s activation on the consumer mesh;
- ``RESIDUALS(s, m)``: what stage ``s``'s backward reads of its forward;
- ``WEIGHT_STATE(s, m)``: what a weight pass reads (split backwards only);
- ``INPUT_COTANGENT(e, m)``: the cotangent of edge ``e``'s activation on the
  consumer mesh, kept until it is sent;
- ``RECEIVED_COTANGENT(e, m)``: the same on the producer mesh.

An edge whose value has no cotangent (integer, bool or key values) moves only
forward: its schedule's gradient tasks lower to nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...compiler_pass import compiler_pass
from ...program.moves import Direction, EdgeTransfer
from ...program.pipeline_instructions import (
    BufferId, BufferKind, Free, Instruction, PipelineProgram, Recv, ReduceGradients, RunBackward, RunBackwardInput,
    RunBackwardWeight, RunForward, Send, StageIO, input_cotangent, output_buffer, received_activation,
    received_cotangent,
)
from ...program.tasks import Task, TaskKind
from ..scheduling.pipeline_schedule import PipelineSchedule

__all__ = ["lower_to_program", "verify_pipeline_program"]


def stage_io(num_stages: int, edges: Sequence[tuple[int, int, int, int]], loss: tuple[int, int],
             num_outputs: Sequence[int], aux: Sequence[tuple[int, int]] = (),
             no_cotangent: frozenset[int] = frozenset()) -> tuple[StageIO, ...]:
    """``edges`` as ``(producer, consumer, producer slot, consumer activation-input position)``;
    ``loss`` and each ``aux`` value as ``(stage, slot)``; ``num_outputs`` per stage;
    ``no_cotangent`` the edges whose value has no cotangent."""
    out = []
    for s in range(num_stages):
        ins = sorted((pos, e) for e, (_, c, _, pos) in enumerate(edges) if c == s)
        slots = tuple(tuple(e for e, (p, _, slot, _) in enumerate(edges) if p == s and slot == k) for k in range(num_outputs[s]))
        kept = sorted({slot for stage, slot in (loss, *aux) if stage == s})
        touching = frozenset(e for e, (p, c, _, _) in enumerate(edges) if s in (p, c)) & no_cotangent
        out.append(StageIO(tuple(e for _, e in ins), slots, loss[1] if loss[0] == s else None, tuple(kept), touching))
    return tuple(out)


@compiler_pass
def lower_to_program(schedule: PipelineSchedule, stages: Sequence[StageIO], transfers: Sequence[EdgeTransfer],
                     reduced_stages: frozenset[int] = frozenset()) -> PipelineProgram:
    """Each task of ``schedule``'s launch order becomes instructions on the meshes it touches,
    followed by the frees of the buffers it used last; each mesh hosting a stage of
    ``reduced_stages`` reduces those of them it hosts with one ``ReduceGradients``, right after
    their last gradient pass (``RunBackward`` or ``RunBackwardWeight``)."""
    stages, transfers = tuple(stages), tuple(transfers)
    by_edge = {(t.edge, t.direction): k for k, t in enumerate(transfers)}
    home = schedule.stage_mesh
    lists: list[list[Instruction]] = [[] for _ in range(schedule.num_meshes)]
    order: list[tuple[int, int]] = []

    def emit(mesh: int, ins: Instruction) -> None:
        order.append((mesh, len(lists[mesh])))
        lists[mesh].append(ins)

    # A mesh's reduction goes behind its reduced stages' last gradient pass, found ahead of time.
    last_gradient: dict[int, Task] = {}
    for t in schedule.order:
        if t.kind in (TaskKind.BACKWARD, TaskKind.BACKWARD_WEIGHT) and t.where in reduced_stages:
            last_gradient[home[t.where]] = t
    reduce_after = {t: tuple(sorted(s for s in reduced_stages if home[s] == mesh))
                    for mesh, t in last_gradient.items()}
    # An activation is freed after its last send, found ahead of time.
    last_send: dict[BufferId, Task] = {}
    for t in schedule.order:
        if t.kind is TaskKind.SEND_ACT:
            p = schedule.edges[t.where][0]
            slot = transfers[by_edge[(t.where, Direction.ACTIVATION)]].slot
            last_send[output_buffer(stages[p], p, slot, t.micro_batch)] = t

    for t in schedule.order:
        m, s = t.micro_batch, t.where
        if t.kind is TaskKind.FORWARD:
            io = stages[s]
            outputs = tuple(output_buffer(io, s, k, m) for k in range(len(io.out_edges)))
            inputs = tuple(received_activation(e, m) for e in io.in_edges)
            residuals = BufferId(BufferKind.RESIDUALS, s, m)
            emit(home[s], RunForward(s, m, inputs, outputs, residuals))
            if schedule.forward_only:
                emit(home[s], Free(residuals))  # no backward reads them (a forward-only stage keeps none)
            for b in inputs:
                emit(home[s], Free(b))
            for b in outputs:
                if b.kind is BufferKind.ACTIVATION and b not in last_send:
                    emit(home[s], Free(b))  # an output no later stage reads
        elif t.kind in (TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT):
            io = stages[s]
            residuals = BufferId(BufferKind.RESIDUALS, s, m)
            cts = tuple(received_cotangent(e, m) for e in io.cotangent_edges)
            input_cts = tuple(input_cotangent(e, m) for e in io.cotangent_in_edges)
            if t.kind is TaskKind.BACKWARD:
                emit(home[s], RunBackward(s, m, residuals, cts, input_cts))
            else:
                emit(home[s], RunBackwardInput(s, m, residuals, cts, input_cts, BufferId(BufferKind.WEIGHT_STATE, s, m)))
            for b in (residuals, *cts):
                emit(home[s], Free(b))
        elif t.kind is TaskKind.BACKWARD_WEIGHT:
            state = BufferId(BufferKind.WEIGHT_STATE, s, m)
            emit(home[s], RunBackwardWeight(s, m, state))
            emit(home[s], Free(state))
        else:
            direction = Direction.ACTIVATION if t.kind is TaskKind.SEND_ACT else Direction.COTANGENT
            if (s, direction) not in by_edge:
                continue  # the cotangent of a value that has none
            k = by_edge[(s, direction)]
            transfer = transfers[k]
            if direction is Direction.ACTIVATION:
                src = output_buffer(stages[transfer.src_stage], transfer.src_stage, transfer.slot, m)
                dst = received_activation(s, m)
            else:
                src, dst = input_cotangent(s, m), received_cotangent(s, m)
            emit(home[transfer.src_stage], Send(k, m, src, dst))
            emit(home[transfer.dst_stage], Recv(k, m, dst))
            if direction is Direction.COTANGENT or last_send.get(src) == t:
                emit(home[transfer.src_stage], Free(src))
        if t in reduce_after:
            emit(home[s], ReduceGradients(reduce_after[t]))
    results = tuple(
        BufferId(BufferKind.RESULT, s, m, slot)
        for s, io in enumerate(stages) for slot in io.kept_slots for m in range(schedule.num_micro_batches)
    )
    program = PipelineProgram(schedule.stage_mesh, schedule.num_micro_batches, tuple(schedule.edges),
                              schedule.split_backward, stages, transfers, tuple(map(tuple, lists)), tuple(order), results)
    verify_pipeline_program(program, reduced_stages)
    return program


def _reduction_error(program: PipelineProgram, reduced_stages: frozenset[int]) -> str | None:
    """Whether each mesh reduces exactly its stages of ``reduced_stages``, once, after every
    gradient pass of them."""
    home = program.stage_mesh
    for mesh, instructions in enumerate(program.instructions):
        want = tuple(sorted(s for s in reduced_stages if home[s] == mesh))
        at = [k for k, ins in enumerate(instructions) if ins.reduces]
        if not want:
            if at:
                return f"mesh {mesh}: {instructions[at[0]]}, but none of its stages is reduced per step"
            continue
        if len(at) != 1 or instructions[at[0]].reduces != want:
            return f"mesh {mesh}: not one gradient reduction of stages {want}"
        late = [ins for ins in instructions[at[0]:] if set(ins.accumulates) & set(want)]
        if late:
            return f"mesh {mesh}: {late[0]} accumulates after the step's gradient reduction"
    return None


def verify_pipeline_program(program: PipelineProgram, reduced_stages: frozenset[int] = frozenset()) -> None:
    """Per mesh: every instruction wired to its stage's buffers (``StageIO``); every buffer
    written once before it is read, read while live, freed once, and none left live but the
    results. Every send has one receive on the transfer's other mesh,
    after it in the launch order, which lists every instruction once in each mesh's order (so
    no process waits for a value nobody has sent yet: no deadlock). Each mesh hosting stages
    of ``reduced_stages`` reduces them in one ``ReduceGradients`` after all their gradient
    passes; no other mesh reduces.

    Raises:
      PlanVerificationError: naming the mesh, instruction and buffer.
    """
    from ...verification import PlanVerificationError

    seen: list[int] = [-1] * len(program.instructions)
    if len(program.order) != sum(map(len, program.instructions)) or len(set(program.order)) != len(program.order):
        raise PlanVerificationError("the launch order does not list every instruction exactly once")
    live: list[set[BufferId]] = [set() for _ in program.instructions]
    ever: list[set[BufferId]] = [set() for _ in program.instructions]
    sent: dict[tuple[int, int], int] = {}
    received: set[tuple[int, int]] = set()
    for mesh, k in program.order:
        if k != seen[mesh] + 1:
            raise PlanVerificationError(f"mesh {mesh}: the launch order breaks the mesh's own instruction order at {k}")
        seen[mesh] = k
        ins = program.instructions[mesh][k]
        wiring = ins.check(program, mesh)
        if wiring:
            raise PlanVerificationError(f"mesh {mesh}: {ins} {wiring}")
        for b in ins.reads:
            if b not in live[mesh]:
                raise PlanVerificationError(f"mesh {mesh}: {ins} reads {b}, which is not live there")
        for b in ins.frees:
            live[mesh].remove(b)
        for key in ins.sends:
            if key in sent:
                raise PlanVerificationError(f"mesh {mesh}: {ins} is not the one send of {program.transfers[key[0]]}")
            sent[key] = mesh
        for key in ins.receives:
            if key not in sent or key in received:
                home = program.stage_mesh[program.transfers[key[0]].src_stage]
                raise PlanVerificationError(f"mesh {mesh}: {ins} has no earlier unmatched send on mesh {home}")
            received.add(key)
        for b in ins.writes:
            if b in ever[mesh]:
                raise PlanVerificationError(f"mesh {mesh}: {ins} writes {b} a second time")
            live[mesh].add(b)
            ever[mesh].add(b)
    if set(sent) != received:
        raise PlanVerificationError(f"sends never received: {sorted(set(sent) - received)}")
    reduction = _reduction_error(program, frozenset(reduced_stages))
    if reduction:
        raise PlanVerificationError(reduction)
    left = {(mesh, b) for mesh, bs in enumerate(live) for b in bs}
    expected = {(program.stage_mesh[b.index], b) for b in program.results}
    if left != expected:
        raise PlanVerificationError(f"buffers live after the program other than its results: {sorted(map(str, (b for _, b in left ^ expected)))}")
