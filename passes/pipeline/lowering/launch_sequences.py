"""Pass: what each process launches per step, and the check that no two processes disagree on it.

Every process walks the same step program (``step_program``) and, in its middle, the pipeline
program's one launch order (``PipelineProgram.order``). What a process *issues* depends on which
devices it owns, and two kinds of launch must pair up across processes or the step hangs:

- a program on a mesh spanning processes: XLA:CPU runs its cross-process collectives through
  gloo with one tag per communicator, so the processes of a mesh must launch that mesh's
  programs in one order (BENCHMARKS.md, "The four-process test"). Every program the IR names on
  a mesh counts, whether or not XLA puts a collective in it (which only its HLO says): stage
  passes and fused runs, gradient reductions, computations around the pipeline, combiners,
  packing for a move, the sum of a gradient's contributions, and collective moves (one program
  over both meshes, listed on every mesh it touches). Helper programs that keep each device's
  data where it is (per-micro-batch slices, folded keys, zero accumulators) are left out;
- a cross-process transfer: JAX numbers a process's cross-process ``jax.device_put``s by a
  counter, so the sender's ``n``-th and the receiver's ``n``-th must be the same transfer. Every
  process issues every cross-process hop of a p2p move (``p2p_executor``), every round gate's
  token sent across processes, and every cross-process copy of ``ShareOutputs``.

Each step instruction lists its own launches (``StepInstruction.launches``, records of
``program.launches``), so a new kind is listed here without a change to this pass.
``launch_sequences`` lists both per process; ``verify_launch_sequences`` checks that the
processes of each mesh spanning processes list that mesh's launches alike, and that every
transfer has one number on its sender and its receiver. Both read only compiled IR, so every
process computes every process's lists, without talking to any.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from jax.sharding import Mesh

from ...compiler_pass import compiler_pass
from ...program.devices import device_key
from ...program.moves import MoveKey, MoveTable, TransferKind, move_device_ids
from ...program.pipeline_instructions import PipelineProgram
from ...program.step_instructions import StepProgram
from ...verification import PlanVerificationError

__all__ = ["Transfer", "ProcessLaunches", "LaunchSequences", "launch_sequences", "verify_launch_sequences"]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One cross-process ``jax.device_put``: from process ``src`` to process ``dst``; ``what``
    names it (the instruction, the move's hop or gate), unique within a step."""

    what: str
    src: int
    dst: int

    def __str__(self) -> str:
        return f"{self.what} (process {self.src} -> {self.dst})"


@dataclasses.dataclass(frozen=True)
class ProcessLaunches:
    """What process ``process`` issues in one step, in issue order.

    Attributes:
      collectives: per mesh of the pipeline, the programs it launches there (each named; empty
        for a mesh it owns no device of).
      transfers: every cross-process transfer it takes part in numbering (JAX's counter), the
        ``n``-th being its transfer number ``n``.
    """

    process: int
    collectives: tuple[tuple[str, ...], ...]
    transfers: tuple[Transfer, ...]


@dataclasses.dataclass(frozen=True)
class LaunchSequences:
    """Per process (index = process), what it issues; ``mesh_processes[m]``: the processes owning a
    device of mesh ``m``, ascending."""

    mesh_processes: tuple[tuple[int, ...], ...]
    processes: tuple[ProcessLaunches, ...]


class _Walk:
    """Appends each launch to the lists of the processes issuing it (a ``program.launches.LaunchSink``)."""

    def __init__(self, program: PipelineProgram, moves: MoveTable, meshes: Sequence[Mesh],
                 process_of: Callable[[Any], int]) -> None:
        self.program, self.moves, self.process_of = program, moves, process_of
        self.mesh_devices = [frozenset(device_key(d) for d in m.devices.flat) for m in meshes]
        self.mesh_processes = tuple(tuple(sorted({process_of(d) for d in m.devices.flat})) for m in meshes)
        self.num_processes = 1 + max(p for ps in self.mesh_processes for p in ps)
        self.collectives = [[[] for _ in meshes] for _ in range(self.num_processes)]
        self.transfers: list[list[Transfer]] = [[] for _ in range(self.num_processes)]

    def on_mesh(self, mesh: int, what: str) -> None:
        for p in self.mesh_processes[mesh]:
            self.collectives[p][mesh].append(what)

    def transfer(self, what: str, src: Any, dst: Any) -> None:
        """A ``jax.device_put`` from device ``src`` to ``dst`` every process issues."""
        a, b = self.process_of(src), self.process_of(dst)
        if a != b:
            for seq in self.transfers:
                seq.append(Transfer(what, a, b))

    def move(self, key: MoveKey, what: str) -> None:
        planned = self.moves.of(key)
        if key.kind is TransferKind.SIGNAL:
            planned, key = planned.carry, planned.carry.key
        if key.kind is TransferKind.COLLECTIVE:
            devices = [*key.src.mesh.devices.flat, *key.dst.mesh.devices.flat]
            keys = {device_key(d) for d in devices}
            processes = {self.process_of(d) for d in devices}
            for m, on in enumerate(self.mesh_devices):
                if on & keys:
                    for p in self.mesh_processes[m]:
                        if p in processes:
                            self.collectives[p][m].append(what)
        elif key.kind is TransferKind.P2P:
            ids = move_device_ids(key.src, key.dst)
            device = {ids[device_key(d)]: d for d in [*key.src.mesh.devices.flat, *key.dst.mesh.devices.flat]}
            program, gates, moved = planned.program, planned.gates, set()
            for k, step in enumerate(program.steps):
                for gate in (g for g in gates if program.rounds[g.round][0] == k):
                    token = (gate.collector, gate.arrivals, gate.src_device)
                    if token not in moved:  # the runtime moves each gathered token to a sender once
                        moved.add(token)
                        self.transfer(f"{what}: round {gate.round}'s gate token to device {gate.src_device}",
                                      device[gate.collector], device[gate.src_device])
                for h in step:
                    self.transfer(f"{what}: hop of piece {h.piece} in step {k}, device {h.src_device} -> "
                                  f"{h.dst_device}", device[h.src_device], device[h.dst_device])
        elif key.kind is TransferKind.LOCAL and key.src != key.dst:
            # A relayout on its mesh, a program there (the runtime's ``_local`` move).
            keys = frozenset(device_key(d) for d in key.dst.mesh.devices.flat)
            self.on_mesh(self.mesh_devices.index(keys), what)
        # DEVICE_PUT stays within one process (``choose_transfer``): nothing to pair.

    def pipeline(self) -> None:
        program = self.program
        for mesh, ins in program.launch_sequence():
            if ins.sends:
                self.move(program.transfers[ins.transfer].move_key, str(ins))
            elif ins.tasks or ins.reduces:
                self.on_mesh(mesh, str(ins))

    def step(self, step: StepProgram) -> None:
        # Each instruction lists its own launches (``StepInstruction.launches``), whatever its kind.
        for ins in step:
            for launch in ins.launches:
                launch.issue(self)


@compiler_pass
def launch_sequences(step: StepProgram, program: PipelineProgram, moves: MoveTable, meshes: Sequence[Mesh],
                     process_of: Callable[[Any], int] = lambda device: device.process_index) -> LaunchSequences:
    """Per process, the programs it launches on each of ``meshes`` and the cross-process transfers
    it numbers, in one step of ``step`` (``program`` in its middle), each move as ``moves``
    planned it. ``process_of`` gives a device's process (a test may pretend one process's devices
    are several processes')."""
    walk = _Walk(program, moves, meshes, process_of)
    walk.step(step)
    return LaunchSequences(walk.mesh_processes, tuple(
        ProcessLaunches(p, tuple(map(tuple, walk.collectives[p])), tuple(walk.transfers[p]))
        for p in range(walk.num_processes)))


def _at(seq: Sequence[Any], n: int) -> str:
    return f"'{seq[n]}'" if n < len(seq) else "nothing (its list has ended)"


def verify_launch_sequences(sequences: LaunchSequences) -> None:
    """For every mesh spanning processes, every process owning part of it launches that mesh's
    programs in one order; every cross-process transfer has the same number (its position in
    the process's transfers) on its sender and on its receiver.

    Raises:
      PlanVerificationError: naming the mesh and its two processes and the first launch they
        disagree on (its index and each side's launch), or the sender and receiver of the first
        transfer numbered differently (its number on the sender and what each side numbers so).
    """
    for mesh, processes in enumerate(sequences.mesh_processes):
        first = processes[0]
        want = sequences.processes[first].collectives[mesh]
        for p in processes[1:]:
            got = sequences.processes[p].collectives[mesh]
            if got == want:
                continue
            n = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
            raise PlanVerificationError(
                f"mesh {mesh} (processes {', '.join(map(str, processes))}): processes {first} and {p} launch its "
                f"programs in different orders, which deadlocks its collectives; launch #{n} is {_at(want, n)} "
                f"on process {first} but {_at(got, n)} on process {p}")
    seqs = [ps.transfers for ps in sequences.processes]
    for a, sent in enumerate(seqs):
        for n, t in enumerate(sent):
            if t.src != a:
                continue
            received = seqs[t.dst]
            if n < len(received) and received[n] == t:
                continue
            raise PlanVerificationError(
                f"transfers from process {a} to process {t.dst} are numbered differently on the two processes, "
                f"which pairs the wrong values or hangs: transfer #{n} is {_at(sent, n)} on process {a} (sender) "
                f"but {_at(received, n)} on process {t.dst} (receiver)")
    for b, received in enumerate(seqs):
        for n, t in enumerate(received):
            if t.dst == b and (n >= len(seqs[t.src]) or seqs[t.src][n] != t):
                raise PlanVerificationError(
                    f"transfers from process {t.src} to process {b} are numbered differently on the two processes, "
                    f"which pairs the wrong values or hangs: transfer #{n} is {_at(received, n)} on process {b} "
                    f"(receiver) but {_at(seqs[t.src], n)} on process {t.src} (sender)")
