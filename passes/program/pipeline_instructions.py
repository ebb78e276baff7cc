"""The pipeline program: per mesh, a list of typed instructions over named buffers (``BufferId``),
each saying what it reads, writes and frees, run by ``runtime.program_interpreter``."""

from __future__ import annotations

import abc
import dataclasses
import enum

from .moves import Direction, EdgeTransfer
from .tasks import Task, TaskKind

__all__ = ["received_activation", "received_cotangent", "input_cotangent", "output_buffer", "BufferId", "BufferKind",
           "Free", "Instruction", "LocalMove", "PipelineProgram", "received_buffer", "Recv", "ReduceGradients",
           "RunBackward", "RunBackwardInput", "RunBackwardWeight", "RunForward", "RunFused", "Send", "StageIO"]


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
        if self.inputs != tuple(received_activation(e, self.micro_batch) for e in io.in_edges):
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
        want = (output_buffer(program.stages[t.src_stage], t.src_stage, t.slot, self.micro_batch)
                if t.direction is Direction.ACTIVATION else input_cotangent(t.edge, self.micro_batch))
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
        dependencies differ: ``tasks.task_dependencies``).
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


def received_buffer(transfer: EdgeTransfer, micro_batch: int) -> BufferId:
    """The buffer ``transfer``'s value of ``micro_batch`` is received into, on its destination mesh."""
    kind = (BufferKind.RECEIVED_ACTIVATION if transfer.direction is Direction.ACTIVATION
            else BufferKind.RECEIVED_COTANGENT)
    return BufferId(kind, transfer.edge, micro_batch)


@dataclasses.dataclass(frozen=True)
class LocalMove:
    """A move between two stages of one mesh inside a fused program: ``into`` is ``source`` laid
    out as transfer ``transfer`` delivers it."""

    transfer: int
    source: BufferId
    into: BufferId


@dataclasses.dataclass(frozen=True)
class RunFused(Instruction):
    """``members`` (compute instructions of one mesh, in order) run as one program.

    Attributes:
      members: what the program computes, in order; each reads the buffers its fields name.
      moves: the local moves between members the program makes inside itself, each after the
        member writing its source.
      inputs: buffers it reads that were live before it.
      outputs: buffers its members (or its moves) write that outlive it.
      dropped: buffers live before it that it frees (their last reader is a member).
      internal: buffers written and freed inside it (never materialised as buffers).
    """

    members: tuple[Instruction, ...]
    moves: tuple[LocalMove, ...]
    inputs: tuple[BufferId, ...]
    outputs: tuple[BufferId, ...]
    dropped: tuple[BufferId, ...]
    internal: tuple[BufferId, ...]

    reads = property(lambda self: self.inputs)
    writes = property(lambda self: self.outputs)
    frees = property(lambda self: self.dropped)
    temporaries = property(lambda self: self.internal)

    @property
    def tasks(self) -> tuple[Task, ...]:
        return tuple(t for m in self.members for t in m.tasks)

    @property
    def accumulates(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(s for m in self.members for s in m.accumulates))

    def check(self, program: PipelineProgram, mesh: int) -> str | None:
        for m in self.members:
            wrong = m.check(program, mesh)
            if wrong:
                return f"member {m} {wrong}"
        written = {b for m in self.members for b in m.writes} | {mv.into for mv in self.moves}
        read = {b for m in self.members for b in m.reads} | {mv.source for mv in self.moves}
        if set(self.outputs) | set(self.internal) != written:
            return "does not account for every buffer its members write as an output or a temporary"
        if not set(self.inputs) <= read or set(self.inputs) & written:
            return "reads buffers its members do not read, or that they write"
        return None

    def __str__(self) -> str:
        return f"fused {' '.join(str(t) for t in self.tasks)}"


def received_activation(e: int, m: int) -> BufferId:
    return BufferId(BufferKind.RECEIVED_ACTIVATION, e, m)


def received_cotangent(e: int, m: int) -> BufferId:
    return BufferId(BufferKind.RECEIVED_COTANGENT, e, m)


def input_cotangent(e: int, m: int) -> BufferId:
    return BufferId(BufferKind.INPUT_COTANGENT, e, m)


def output_buffer(io: StageIO, s: int, slot: int, m: int) -> BufferId:
    return BufferId(BufferKind.RESULT if slot in io.kept_slots else BufferKind.ACTIVATION, s, m, slot)


def _off_its_mesh(program: PipelineProgram, mesh: int, stage: int) -> str | None:
    home = program.stage_mesh[stage]
    return None if home == mesh else f"runs stage {stage}, which the schedule places on mesh {home}"


def _cotangent_wiring(program: PipelineProgram, mesh: int, stage: int, m: int, cotangents: tuple[BufferId, ...],
                      input_cotangents: tuple[BufferId, ...]) -> str | None:
    """Whether a backward (or input pass) of ``stage`` reads and writes its ``StageIO``'s cotangents."""
    io = program.stages[stage]
    if cotangents != tuple(received_cotangent(e, m) for e in io.cotangent_edges):
        return "does not read its received cotangents in StageIO.cotangent_edges order"
    if input_cotangents != tuple(input_cotangent(e, m) for e in io.cotangent_in_edges):
        return "does not write its input cotangents in StageIO.cotangent_in_edges order"
    return _off_its_mesh(program, mesh, stage)
