"""Pass: compute that runs back to back on one mesh with only local values between it becomes one program.

Each stage pass a program launches is one execution, and an execution costs its device a fixed
price besides its arithmetic (XLA's setup of every operation of the program; on CPU about a
millisecond for a small GPT stage, whatever the batch). JaxPP fuses a mesh's steady state for
this reason. ``fuse_compute_runs`` replaces each *run* of a mesh's compute instructions (its
forwards, backwards, input and weight passes) by one ``RunFused`` that the runtime compiles as
one program. A run grows from its first instruction while the next compute instruction:

- reads only buffers that were live on the mesh before the run started, or that the run wrote
  (directly, or through a ``LOCAL`` move between two stages of the mesh, which the fused program
  passes on inside itself): so the fused program can start as soon as its first member could,
  and no member waits, inside it, for a value another mesh has not sent yet;
- comes before any send to another mesh, any gradient reduction, and any local move whose
  receive is not in the run: what another mesh waits for leaves when the member making it
  ends, never later (a member whose output crosses meshes ends its run);
- and the run has fewer than ``max_members`` members.

Instructions between members that are not absorbed (receives of values from other meshes,
frees of buffers live before the run) keep their order and follow the fused instruction; a
free of a buffer live before the run is the fused instruction's own. Buffers written and freed
inside the run are the program's temporaries: no buffer, no free. Every process fuses alike,
so the launch order stays one order for all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ...compiler_pass import compiler_pass
from ...program.moves import TransferKind
from ...program.pipeline_instructions import BufferId, Instruction, LocalMove, PipelineProgram, Recv, RunFused, Send

__all__ = ["fuse_compute_runs"]


def _is_compute(ins: Instruction) -> bool:
    return bool(ins.tasks) and all(t.kind.is_compute for t in ins.tasks)


@dataclasses.dataclass
class _Run:
    """A run being grown on one mesh: the positions of its members, the buffers live before it
    and those it writes."""

    start: int
    live_before: frozenset[BufferId]
    members: list[int] = dataclasses.field(default_factory=list)
    written: set[BufferId] = dataclasses.field(default_factory=set)
    aliases: dict[BufferId, BufferId] = dataclasses.field(default_factory=dict)  # local recv -> source


def _runs(program: PipelineProgram, mesh: int, max_members: int | None) -> list[_Run]:
    """The runs of ``mesh``'s instructions (module doc), in order; single instructions too."""
    instructions = program.instructions[mesh]
    local = {k for k, t in enumerate(program.transfers) if t.kind is TransferKind.LOCAL}
    live: set[BufferId] = set()
    runs: list[_Run] = []
    run: _Run | None = None

    def close() -> None:
        nonlocal run
        if run is not None:
            runs.append(run)
            run = None

    for k, ins in enumerate(instructions):
        if _is_compute(ins):
            fits = (run is not None and (max_members is None or len(run.members) < max_members)
                    and all(b in run.written or b in run.live_before for b in ins.reads))
            if not fits:
                close()
                run = _Run(k, frozenset(live))
            run.members.append(k)
            run.written |= set(ins.writes)
        elif run is not None:
            breaks = bool(ins.reduces) or any(t not in local for t, _ in ins.sends)
            if isinstance(ins, Send) and ins.transfer in local:
                run.aliases[ins.into] = ins.buffer
            if isinstance(ins, Recv) and ins.transfer in local and ins.buffer in run.aliases:
                run.written.add(ins.buffer)
            if breaks:
                close()
        for b in ins.frees:
            live.discard(b)
        live |= set(ins.writes)
    close()
    return runs


def _fuse(program: PipelineProgram, mesh: int, run: _Run) -> tuple[RunFused, list[int], list[int], int]:
    """The run as one instruction, the positions it absorbs, those moved after it, and the last
    position it spans."""
    instructions = program.instructions[mesh]
    first, last = run.members[0], run.members[-1]
    # The frees right behind the last member are the run's too: what it wrote and they free
    # never has to outlive the program.
    while last + 1 < len(instructions) and instructions[last + 1].frees and not instructions[last + 1].writes:
        last += 1
    members = [instructions[k] for k in run.members]
    between = [k for k in range(first, last + 1) if k not in run.members]
    local = {k for k, t in enumerate(program.transfers) if t.kind is TransferKind.LOCAL}
    written: set[BufferId] = set()
    moves: list[LocalMove] = []
    absorbed: set[int] = set(run.members)
    sends: dict[BufferId, tuple[int, Send]] = {}
    for k in range(first, last + 1):
        ins = instructions[k]
        if k in run.members:
            written |= set(ins.writes)
        elif isinstance(ins, Send) and ins.transfer in local:
            sends[ins.into] = (k, ins)
        elif isinstance(ins, Recv) and ins.buffer in sends:
            k_send, send = sends.pop(ins.buffer)
            moves.append(LocalMove(send.transfer, send.buffer, ins.buffer))
            written.add(ins.buffer)
            absorbed |= {k_send, k}
    freed_inside = {b for k in between for b in instructions[k].frees
                    if k not in absorbed and b in written}
    dropped = [b for k in between for b in instructions[k].frees if b not in written]
    absorbed |= {k for k in between if instructions[k].frees
                 and all(b in freed_inside or b in dropped for b in instructions[k].frees)}
    # A local move's source counts as read (so a value only moved still reads its source).
    reads: dict[BufferId, None] = {}
    for ins in members:
        reads.update((b, None) for b in ins.reads if b not in written)
    for mv in moves:
        if mv.source not in written:
            reads[mv.source] = None
    temporaries = [b for b in (*[b for ins in members for b in ins.writes], *[mv.into for mv in moves])
                   if b in freed_inside]
    outputs = [b for b in (*[b for ins in members for b in ins.writes], *[mv.into for mv in moves])
               if b not in freed_inside]
    moved = [k for k in between if k not in absorbed]
    fused = RunFused(tuple(members), tuple(moves), tuple(reads), tuple(outputs), tuple(dropped),
                     tuple(temporaries))
    return fused, sorted(absorbed), moved, last


@compiler_pass
def fuse_compute_runs(program: PipelineProgram, max_members: int | None = None) -> PipelineProgram:
    """``program`` with every run of two or more compute instructions of a mesh fused into one
    ``RunFused`` (module doc); runs of one instruction stay as they are. The result is what
    ``verify_pipeline_program`` checks, as any program.

    Args:
      program: a verified program.
      max_members: the most instructions one fused program runs (``None``: no limit).
    """
    if max_members is not None and max_members < 1:
        raise ValueError(f"max_members: expected a positive count or None, got {max_members}")
    # Per (mesh, old position): the instruction that replaces it and what follows it.
    replace: dict[tuple[int, int], list[Instruction]] = {}
    skip: set[tuple[int, int]] = set()
    for mesh in range(len(program.instructions)):
        for run in _runs(program, mesh, max_members):
            if len(run.members) < 2:
                continue
            fused, absorbed, moved, last = _fuse(program, mesh, run)
            skip |= {(mesh, k) for k in (*absorbed, *moved)}
            # Launched where the last instruction it spans was: everything it reads is launched by then.
            replace[(mesh, last)] = [fused, *(program.instructions[mesh][k] for k in moved)]
            skip.discard((mesh, last))
    lists: list[list[Instruction]] = [[] for _ in program.instructions]
    order: list[tuple[int, int]] = []
    for mesh, k in program.order:
        if (mesh, k) in skip:
            continue
        for ins in replace.get((mesh, k), [program.instructions[mesh][k]]):
            order.append((mesh, len(lists[mesh])))
            lists[mesh].append(ins)
    return dataclasses.replace(program, instructions=tuple(map(tuple, lists)), order=tuple(order))


def fused_groups(program: PipelineProgram) -> Sequence[RunFused]:
    """The fused instructions of ``program``, in launch order."""
    return [ins for _, ins in program.launch_sequence() if isinstance(ins, RunFused)]
