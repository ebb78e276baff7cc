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

import dataclasses
import enum
from collections.abc import Sequence
from typing import Union

from .edge_transfer import Direction, EdgeTransfer
from .pipeline_schedule import PipelineSchedule
from .pipeline_tasks import Task, TaskKind

__all__ = [
    "BufferKind", "BufferId", "StageIO", "RunForward", "RunBackward", "RunBackwardInput", "RunBackwardWeight",
    "Send", "Recv", "Free", "ReduceGradients", "Instruction", "PipelineProgram", "lower_to_program",
    "received_buffer", "verify_pipeline_program",
]


class BufferKind(enum.Enum):
    ACTIVATION = "act"
    RESULT = "result"
    RECEIVED_ACTIVATION = "recv_act"
    RESIDUALS = "res"
    WEIGHT_STATE = "wstate"
    INPUT_COTANGENT = "ct"
    RECEIVED_COTANGENT = "recv_ct"


@dataclasses.dataclass(frozen=True)
class BufferId:
    """A value of one micro-batch on one mesh; ``index`` is a stage or an edge (see module doc)."""

    kind: BufferKind
    index: int
    micro_batch: int
    slot: int = 0

    def __str__(self) -> str:
        slot = f".{self.slot}" if self.kind in (BufferKind.ACTIVATION, BufferKind.RESULT) else ""
        return f"{self.kind.value}{self.index}{slot}[{self.micro_batch}]"


@dataclasses.dataclass(frozen=True)
class StageIO:
    """How a stage's compute parts meet the buffers.

    Attributes:
      in_edges: for each activation input of the stage, in input order, the
        edge that delivers it.
      out_edges: for each output slot, the edges that carry it onwards; the
        slot's cotangent is the sum of what comes back along them.
      loss_slot: the output slot that is the loss (its cotangent is seeded
        with the loss reduction's weight), or ``None``.
      kept_slots: output slots kept past the program as results (the loss and aux values).
      no_cotangent: edges in or out of the stage whose value has no cotangent.
    """

    in_edges: tuple[int, ...]
    out_edges: tuple[tuple[int, ...], ...]
    loss_slot: int | None
    kept_slots: tuple[int, ...] = ()
    no_cotangent: frozenset[int] = frozenset()

    @property
    def cotangent_edges(self) -> tuple[int, ...]:
        """The received cotangents a backward reads, flattened in slot order."""
        return tuple(e for edges in self.out_edges for e in edges if e not in self.no_cotangent)

    @property
    def cotangent_in_edges(self) -> tuple[int, ...]:
        """The activation inputs whose cotangents a backward writes, in ``in_edges`` order."""
        return tuple(e for e in self.in_edges if e not in self.no_cotangent)


@dataclasses.dataclass(frozen=True)
class RunForward:
    stage: int
    micro_batch: int
    inputs: tuple[BufferId, ...]  # RECEIVED_ACTIVATION, in the stage's activation-input order
    outputs: tuple[BufferId, ...]  # one per output slot
    residuals: BufferId

    def __str__(self) -> str:
        return f"forward of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class RunBackward:
    """The whole backward: accumulates parameter cotangents, writes input cotangents."""

    stage: int
    micro_batch: int
    residuals: BufferId
    cotangents: tuple[BufferId, ...]  # RECEIVED_COTANGENT, in StageIO.cotangent_edges order
    input_cotangents: tuple[BufferId, ...]  # INPUT_COTANGENT, one per activation input

    def __str__(self) -> str:
        return f"backward of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class RunBackwardInput:
    """The activation-gradient part of a split backward; also writes the weight pass's state."""

    stage: int
    micro_batch: int
    residuals: BufferId
    cotangents: tuple[BufferId, ...]
    input_cotangents: tuple[BufferId, ...]
    weight_state: BufferId

    def __str__(self) -> str:
        return f"input pass of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class RunBackwardWeight:
    """The weight-gradient part of a split backward: accumulates parameter cotangents."""

    stage: int
    micro_batch: int
    weight_state: BufferId

    def __str__(self) -> str:
        return f"weight pass of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class Send:
    transfer: int  # index into PipelineProgram.transfers
    micro_batch: int
    buffer: BufferId

    def __str__(self) -> str:
        return f"send of {self.buffer} (transfer {self.transfer})"


@dataclasses.dataclass(frozen=True)
class Recv:
    transfer: int
    micro_batch: int
    buffer: BufferId

    def __str__(self) -> str:
        return f"receive into {self.buffer} (transfer {self.transfer})"


@dataclasses.dataclass(frozen=True)
class Free:
    buffer: BufferId

    def __str__(self) -> str:
        return f"free of {self.buffer}"


@dataclasses.dataclass(frozen=True)
class ReduceGradients:
    """The step's one reduction of ``stages``' accumulated parameter gradients on their mesh
    (over its data axis, ``data_replicas``), launched right after the mesh's last gradient pass
    of any of them, so it runs beside the other meshes' remaining work."""

    stages: tuple[int, ...]

    def __str__(self) -> str:
        return f"gradient reduction of stages {', '.join(map(str, self.stages))}"


Instruction = Union[RunForward, RunBackward, RunBackwardInput, RunBackwardWeight, Send, Recv, Free, ReduceGradients]


@dataclasses.dataclass(frozen=True)
class PipelineProgram:
    """Per-mesh instruction lists and the launch order that interleaves them.

    Attributes:
      schedule: the schedule this program runs.
      stages: one ``StageIO`` per stage (stage ``s`` runs on mesh ``schedule.stage_mesh[s]``).
      transfers: every boundary move, two per edge (``EdgeTransfer``).
      instructions: per mesh, its instructions in launch order.
      order: ``(mesh, position)`` of every instruction once, per-mesh
        positions increasing: the order every process launches them in.
      results: buffers alive after the program (the loss of each micro-batch).
    """

    schedule: PipelineSchedule
    stages: tuple[StageIO, ...]
    transfers: tuple[EdgeTransfer, ...]
    instructions: tuple[tuple[Instruction, ...], ...]
    order: tuple[tuple[int, int], ...]
    results: tuple[BufferId, ...]

    def launch_sequence(self) -> list[tuple[int, Instruction]]:
        """``(mesh, instruction)`` in launch order."""
        return [(mesh, self.instructions[mesh][k]) for mesh, k in self.order]


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


def received_buffer(transfer: EdgeTransfer, micro_batch: int) -> BufferId:
    """The buffer ``transfer``'s value of ``micro_batch`` is received into, on its destination mesh."""
    if transfer.direction is Direction.ACTIVATION:
        return _received_act(transfer.edge, micro_batch)
    return _received_ct(transfer.edge, micro_batch)


def _received_act(e: int, m: int) -> BufferId:
    return BufferId(BufferKind.RECEIVED_ACTIVATION, e, m)


def _received_ct(e: int, m: int) -> BufferId:
    return BufferId(BufferKind.RECEIVED_COTANGENT, e, m)


def _input_ct(e: int, m: int) -> BufferId:
    return BufferId(BufferKind.INPUT_COTANGENT, e, m)


def _output(io: StageIO, s: int, slot: int, m: int) -> BufferId:
    return BufferId(BufferKind.RESULT if slot in io.kept_slots else BufferKind.ACTIVATION, s, m, slot)


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
            last_send[_output(stages[p], p, transfers[by_edge[(t.where, Direction.ACTIVATION)]].slot, t.micro_batch)] = t

    for t in schedule.order:
        m, s = t.micro_batch, t.where
        if t.kind is TaskKind.FORWARD:
            io = stages[s]
            outputs = tuple(_output(io, s, k, m) for k in range(len(io.out_edges)))
            inputs = tuple(_received_act(e, m) for e in io.in_edges)
            emit(home[s], RunForward(s, m, inputs, outputs, BufferId(BufferKind.RESIDUALS, s, m)))
            for b in inputs:
                emit(home[s], Free(b))
            for b in outputs:
                if b.kind is BufferKind.ACTIVATION and b not in last_send:
                    emit(home[s], Free(b))  # an output no later stage reads
        elif t.kind in (TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT):
            io = stages[s]
            residuals = BufferId(BufferKind.RESIDUALS, s, m)
            cts = tuple(_received_ct(e, m) for e in io.cotangent_edges)
            input_cts = tuple(_input_ct(e, m) for e in io.cotangent_in_edges)
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
                src = _output(stages[transfer.src_stage], transfer.src_stage, transfer.slot, m)
                dst = _received_act(s, m)
            else:
                src, dst = _input_ct(s, m), _received_ct(s, m)
            emit(home[transfer.src_stage], Send(k, m, src))
            emit(home[transfer.dst_stage], Recv(k, m, dst))
            if direction is Direction.COTANGENT or last_send.get(src) == t:
                emit(home[transfer.src_stage], Free(src))
        if t in reduce_after:
            emit(home[s], ReduceGradients(reduce_after[t]))
    results = tuple(
        BufferId(BufferKind.RESULT, s, m, slot)
        for s, io in enumerate(stages) for slot in io.kept_slots for m in range(schedule.num_micro_batches)
    )
    program = PipelineProgram(schedule, stages, transfers, tuple(map(tuple, lists)), tuple(order), results)
    verify_pipeline_program(program, reduced_stages)
    return program


def _reads_writes(ins: Instruction) -> tuple[tuple[BufferId, ...], tuple[BufferId, ...]]:
    if isinstance(ins, RunForward):
        return ins.inputs, (*ins.outputs, ins.residuals)
    if isinstance(ins, RunBackward):
        return (ins.residuals, *ins.cotangents), ins.input_cotangents
    if isinstance(ins, RunBackwardInput):
        return (ins.residuals, *ins.cotangents), (*ins.input_cotangents, ins.weight_state)
    if isinstance(ins, RunBackwardWeight):
        return (ins.weight_state,), ()
    if isinstance(ins, Send):
        return (ins.buffer,), ()
    if isinstance(ins, Recv):
        return (), (ins.buffer,)
    if isinstance(ins, ReduceGradients):
        return (), ()
    return (ins.buffer,), ()


def _wiring_error(program: PipelineProgram, mesh: int, ins: Instruction) -> str | None:
    """Whether ``ins`` reads and writes the buffers its stage's ``StageIO`` says, on its own mesh."""
    if isinstance(ins, (RunForward, RunBackward, RunBackwardInput, RunBackwardWeight)):
        if program.schedule.stage_mesh[ins.stage] != mesh:
            return f"runs stage {ins.stage}, which the schedule places on mesh {program.schedule.stage_mesh[ins.stage]}"
        io, m = program.stages[ins.stage], ins.micro_batch
        if isinstance(ins, RunForward) and ins.inputs != tuple(_received_act(e, m) for e in io.in_edges):
            return "does not read its activation inputs in StageIO.in_edges order"
        if isinstance(ins, (RunBackward, RunBackwardInput)):
            if ins.cotangents != tuple(_received_ct(e, m) for e in io.cotangent_edges):
                return "does not read its received cotangents in StageIO.cotangent_edges order"
            if ins.input_cotangents != tuple(_input_ct(e, m) for e in io.cotangent_in_edges):
                return "does not write its input cotangents in StageIO.cotangent_in_edges order"
    if isinstance(ins, Send):
        t = program.transfers[ins.transfer]
        want = (_output(program.stages[t.src_stage], t.src_stage, t.slot, ins.micro_batch)
                if t.direction is Direction.ACTIVATION else _input_ct(t.edge, ins.micro_batch))
        if ins.buffer != want:
            return f"sends {ins.buffer}, but transfer {ins.transfer} carries {want}"
    if isinstance(ins, Recv):
        t = program.transfers[ins.transfer]
        want = (_received_act if t.direction is Direction.ACTIVATION else _received_ct)(t.edge, ins.micro_batch)
        if ins.buffer != want:
            return f"receives into {ins.buffer}, but transfer {ins.transfer} delivers {want}"
    return None


def _reduction_error(program: PipelineProgram, reduced_stages: frozenset[int]) -> str | None:
    """Whether each mesh reduces exactly its stages of ``reduced_stages``, once, after every
    gradient pass of them."""
    home = program.schedule.stage_mesh
    for mesh, instructions in enumerate(program.instructions):
        want = tuple(sorted(s for s in reduced_stages if home[s] == mesh))
        at = [k for k, ins in enumerate(instructions) if isinstance(ins, ReduceGradients)]
        if not want:
            if at:
                return f"mesh {mesh}: {instructions[at[0]]}, but none of its stages is reduced per step"
            continue
        if len(at) != 1 or instructions[at[0]].stages != want:
            return f"mesh {mesh}: not one gradient reduction of stages {want}"
        late = [ins for ins in instructions[at[0]:] if isinstance(ins, (RunBackward, RunBackwardWeight))
                and ins.stage in want]
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
    from ..verification import PlanVerificationError

    seen: list[int] = [-1] * len(program.instructions)
    if len(program.order) != sum(map(len, program.instructions)) or len(set(program.order)) != len(program.order):
        raise PlanVerificationError("the launch order does not list every instruction exactly once")
    live: list[set[BufferId]] = [set() for _ in program.instructions]
    ever: list[set[BufferId]] = [set() for _ in program.instructions]
    sent: dict[tuple[int, int], BufferId] = {}
    received: set[tuple[int, int]] = set()
    for mesh, k in program.order:
        if k != seen[mesh] + 1:
            raise PlanVerificationError(f"mesh {mesh}: the launch order breaks the mesh's own instruction order at {k}")
        seen[mesh] = k
        ins = program.instructions[mesh][k]
        wiring = _wiring_error(program, mesh, ins)
        if wiring:
            raise PlanVerificationError(f"mesh {mesh}: {ins} {wiring}")
        reads, writes = _reads_writes(ins)
        for b in reads:
            if b not in live[mesh]:
                raise PlanVerificationError(f"mesh {mesh}: {ins} reads {b}, which is not live there")
        if isinstance(ins, Free):
            live[mesh].remove(ins.buffer)
        if isinstance(ins, (Send, Recv)):
            transfer = program.transfers[ins.transfer]
            key = (ins.transfer, ins.micro_batch)
            home = program.schedule.stage_mesh
            if isinstance(ins, Send):
                if mesh != home[transfer.src_stage] or key in sent:
                    raise PlanVerificationError(f"mesh {mesh}: {ins} is not the one send of {transfer}")
                sent[key] = ins.buffer
            else:
                if mesh != home[transfer.dst_stage] or key not in sent or key in received:
                    raise PlanVerificationError(f"mesh {mesh}: {ins} has no earlier unmatched send on mesh "
                                                f"{home[transfer.src_stage]}")
                received.add(key)
        for b in writes:
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
    expected = {(program.schedule.stage_mesh[b.index], b) for b in program.results}
    if left != expected:
        raise PlanVerificationError(f"buffers live after the program other than its results: {sorted(map(str, (b for _, b in left ^ expected)))}")
