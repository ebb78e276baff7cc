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

import abc
import dataclasses
import enum
from collections.abc import Sequence

from ...compiler_pass import compiler_pass
from ..placing.edge_transfer import Direction, EdgeTransfer
from ..scheduling.pipeline_schedule import PipelineSchedule
from ..scheduling.pipeline_tasks import Task, TaskKind

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

    # Members are singletons: hashing by identity is exact and costs the runtime no Python call
    # (Enum's own hashes its name in Python; a step hashes buffer ids thousands of times).
    __hash__ = object.__hash__


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


class Instruction(abc.ABC):
    """What an instruction of a program says about itself, so that every pass over programs
    (the verifier, the launch-time trace, the live-byte prediction, fusion) reads it without a
    list of kinds: the buffers it reads and writes on its mesh and those it frees, the schedule
    tasks it runs, and the stages whose gradient accumulators it updates. A new kind is this
    class's subclass here and one handler in the runtime."""

    @property
    @abc.abstractmethod
    def reads(self) -> tuple[BufferId, ...]:
        """Buffers of its mesh it reads, which must be live."""

    @property
    @abc.abstractmethod
    def writes(self) -> tuple[BufferId, ...]:
        """Buffers of its mesh it makes live (a receive: the value its send moved)."""

    @property
    def frees(self) -> tuple[BufferId, ...]:
        """Buffers of its mesh it drops."""
        return ()

    @property
    def temporaries(self) -> tuple[BufferId, ...]:
        """Buffers it makes and drops within itself (a fused program's insides)."""
        return ()

    @property
    def tasks(self) -> tuple[Task, ...]:
        """The schedule tasks it runs, in order (none for a receive, a free, a reduction)."""
        return ()

    @property
    def accumulates(self) -> tuple[int, ...]:
        """The stages whose gradient accumulators it updates."""
        return ()

    @property
    def reduces(self) -> tuple[int, ...]:
        """The stages whose accumulated gradients it reduces (once per step)."""
        return ()

    @property
    def sends(self) -> tuple[tuple[int, int], ...]:
        """``(transfer, micro_batch)`` of the values it sends."""
        return ()

    @property
    def receives(self) -> tuple[tuple[int, int], ...]:
        """``(transfer, micro_batch)`` of the values it receives."""
        return ()

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        """Why it is wired wrongly on ``mesh`` of ``program`` (its buffers against its stage's
        ``StageIO`` or its transfer), or ``None``."""
        return None


@dataclasses.dataclass(frozen=True)
class RunForward(Instruction):
    stage: int
    micro_batch: int
    inputs: tuple[BufferId, ...]  # RECEIVED_ACTIVATION, in the stage's activation-input order
    outputs: tuple[BufferId, ...]  # one per output slot
    residuals: BufferId

    reads = property(lambda self: self.inputs)
    writes = property(lambda self: (*self.outputs, self.residuals))
    tasks = property(lambda self: (Task(TaskKind.FORWARD, self.stage, self.micro_batch),))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        io = program.stages[self.stage]
        if self.inputs != tuple(_received_act(e, self.micro_batch) for e in io.in_edges):
            return "does not read its activation inputs in StageIO.in_edges order"
        return _off_its_mesh(program, mesh, self.stage)

    def __str__(self) -> str:
        return f"forward of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class RunBackward(Instruction):
    """The whole backward: accumulates parameter cotangents, writes input cotangents."""

    stage: int
    micro_batch: int
    residuals: BufferId
    cotangents: tuple[BufferId, ...]  # RECEIVED_COTANGENT, in StageIO.cotangent_edges order
    input_cotangents: tuple[BufferId, ...]  # INPUT_COTANGENT, one per activation input

    reads = property(lambda self: (self.residuals, *self.cotangents))
    writes = property(lambda self: self.input_cotangents)
    tasks = property(lambda self: (Task(TaskKind.BACKWARD, self.stage, self.micro_batch),))
    accumulates = property(lambda self: (self.stage,))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        return _cotangent_wiring(program, mesh, self.stage, self.micro_batch, self.cotangents, self.input_cotangents)

    def __str__(self) -> str:
        return f"backward of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class RunBackwardInput(Instruction):
    """The activation-gradient part of a split backward; also writes the weight pass's state."""

    stage: int
    micro_batch: int
    residuals: BufferId
    cotangents: tuple[BufferId, ...]
    input_cotangents: tuple[BufferId, ...]
    weight_state: BufferId

    reads = property(lambda self: (self.residuals, *self.cotangents))
    writes = property(lambda self: (*self.input_cotangents, self.weight_state))
    tasks = property(lambda self: (Task(TaskKind.BACKWARD_INPUT, self.stage, self.micro_batch),))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        return _cotangent_wiring(program, mesh, self.stage, self.micro_batch, self.cotangents, self.input_cotangents)

    def __str__(self) -> str:
        return f"input pass of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class RunBackwardWeight(Instruction):
    """The weight-gradient part of a split backward: accumulates parameter cotangents."""

    stage: int
    micro_batch: int
    weight_state: BufferId

    reads = property(lambda self: (self.weight_state,))
    writes = property(lambda self: ())
    tasks = property(lambda self: (Task(TaskKind.BACKWARD_WEIGHT, self.stage, self.micro_batch),))
    accumulates = property(lambda self: (self.stage,))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        return _off_its_mesh(program, mesh, self.stage)

    def __str__(self) -> str:
        return f"weight pass of stage {self.stage}, micro-batch {self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class Send(Instruction):
    """Moves ``buffer`` along ``transfer`` (an index into ``PipelineProgram.transfers``); the
    receive on the other mesh writes it into ``into``."""

    transfer: int
    micro_batch: int
    buffer: BufferId
    into: BufferId

    reads = property(lambda self: (self.buffer,))
    writes = property(lambda self: ())
    sends = property(lambda self: ((self.transfer, self.micro_batch),))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        t = program.transfers[self.transfer]
        want = (_output(program.stages[t.src_stage], t.src_stage, t.slot, self.micro_batch)
                if t.direction is Direction.ACTIVATION else _input_ct(t.edge, self.micro_batch))
        if self.buffer != want:
            return f"sends {self.buffer}, but transfer {self.transfer} carries {want}"
        if self.into != received_buffer(t, self.micro_batch):
            return f"names {self.into} as where it arrives, but transfer {self.transfer} delivers into " \
                   f"{received_buffer(t, self.micro_batch)}"
        if program.stage_mesh[t.src_stage] != mesh:
            return f"is not on the mesh of transfer {self.transfer}'s source"
        return None

    @property
    def tasks(self) -> tuple[Task, ...]:
        kind = TaskKind.SEND_ACT if self.into.kind is BufferKind.RECEIVED_ACTIVATION else TaskKind.SEND_GRAD
        return (Task(kind, self.into.index, self.micro_batch),)

    def __str__(self) -> str:
        return f"send of {self.buffer} (transfer {self.transfer})"


@dataclasses.dataclass(frozen=True)
class Recv(Instruction):
    transfer: int
    micro_batch: int
    buffer: BufferId

    reads = property(lambda self: ())
    writes = property(lambda self: (self.buffer,))
    receives = property(lambda self: ((self.transfer, self.micro_batch),))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        t = program.transfers[self.transfer]
        want = received_buffer(t, self.micro_batch)
        if self.buffer != want:
            return f"receives into {self.buffer}, but transfer {self.transfer} delivers {want}"
        if program.stage_mesh[t.dst_stage] != mesh:
            return f"is not on the mesh of transfer {self.transfer}'s destination"
        return None

    def __str__(self) -> str:
        return f"receive into {self.buffer} (transfer {self.transfer})"


@dataclasses.dataclass(frozen=True)
class Free(Instruction):
    buffer: BufferId

    reads = property(lambda self: (self.buffer,))
    writes = property(lambda self: ())
    frees = property(lambda self: (self.buffer,))

    def __str__(self) -> str:
        return f"free of {self.buffer}"


@dataclasses.dataclass(frozen=True)
class ReduceGradients(Instruction):
    """The step's one reduction of ``stages``' accumulated parameter gradients on their mesh
    (over its data axis, ``data_replicas``), launched right after the mesh's last gradient pass
    of any of them, so it runs beside the other meshes' remaining work."""

    stages: tuple[int, ...]

    reads = property(lambda self: ())
    writes = property(lambda self: ())
    reduces = property(lambda self: self.stages)

    def __str__(self) -> str:
        return f"gradient reduction of stages {', '.join(map(str, self.stages))}"


@dataclasses.dataclass(frozen=True)
class PipelineProgram:
    """Per-mesh instruction lists and the launch order that interleaves them.

    What the runtime needs of the schedule it was lowered from is here as plain values (the
    schedule itself stays with the compiler: ``CompiledPipeline.schedule``).

    Attributes:
      stage_mesh: per stage, the mesh running it.
      num_micro_batches: the micro-batches of a step.
      edges: per schedule edge, ``(producer, consumer)`` stages (``EdgeTransfer.edge`` indexes it).
      split_backward: whether a backward runs as an input pass and a weight pass (the tasks'
        dependencies differ: ``pipeline_tasks.task_dependencies``).
      stages: one ``StageIO`` per stage (stage ``s`` runs on mesh ``stage_mesh[s]``).
      transfers: every boundary move, two per edge (``EdgeTransfer``).
      instructions: per mesh, its instructions in launch order.
      order: ``(mesh, position)`` of every instruction once, per-mesh
        positions increasing: the order every process launches them in.
      results: buffers alive after the program (the loss of each micro-batch).
    """

    stage_mesh: tuple[int, ...]
    num_micro_batches: int
    edges: tuple[tuple[int, int], ...]
    split_backward: bool
    stages: tuple[StageIO, ...]
    transfers: tuple[EdgeTransfer, ...]
    instructions: tuple[tuple[Instruction, ...], ...]
    order: tuple[tuple[int, int], ...]
    results: tuple[BufferId, ...]

    @property
    def num_meshes(self) -> int:
        return len(self.instructions)

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
            last_send[_output(stages[p], p, transfers[by_edge[(t.where, Direction.ACTIVATION)]].slot, t.micro_batch)] = t

    for t in schedule.order:
        m, s = t.micro_batch, t.where
        if t.kind is TaskKind.FORWARD:
            io = stages[s]
            outputs = tuple(_output(io, s, k, m) for k in range(len(io.out_edges)))
            inputs = tuple(_received_act(e, m) for e in io.in_edges)
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


def _off_its_mesh(program: PipelineProgram, mesh: int, stage: int) -> str | None:
    home = program.stage_mesh[stage]
    return None if home == mesh else f"runs stage {stage}, which the schedule places on mesh {home}"


def _cotangent_wiring(program: PipelineProgram, mesh: int, stage: int, m: int, cotangents: tuple[BufferId, ...],
                      input_cotangents: tuple[BufferId, ...]) -> str | None:
    """Whether a backward (or input pass) of ``stage`` reads and writes its ``StageIO``'s cotangents."""
    io = program.stages[stage]
    if cotangents != tuple(_received_ct(e, m) for e in io.cotangent_edges):
        return "does not read its received cotangents in StageIO.cotangent_edges order"
    if input_cotangents != tuple(_input_ct(e, m) for e in io.cotangent_in_edges):
        return "does not write its input cotangents in StageIO.cotangent_in_edges order"
    return _off_its_mesh(program, mesh, stage)


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
