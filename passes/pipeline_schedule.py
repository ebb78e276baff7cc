"""Pass: emit a pipeline schedule (GPipe, 1F1B) as per-mesh instruction lists.

Tasks are ``forward``/``backward`` of (stage, micro-batch) and transfers of
an activation (forward) or its cotangent (backward) along a stage-graph edge.
Each stage runs its own task sequence (the schedule); the launch order merges
those sequences into one list that every process follows, so collective
transfers start in the same order everywhere and cannot deadlock.

- ``gpipe``: all forwards, then all backwards.
- ``1f1b``: stage ``s`` runs ``min(S - s - 1, M)`` forwards to warm up, then
  alternates one forward and one backward, then drains the backwards
  (Narayanan et al.), so at most ``S - s`` micro-batches are in flight.
- ``eager_1f1b``: the same with ``min(2(S - s) - 1, M)`` forwards before the
  first backward (the paper's 2(#stages - i) + 1 with 1-indexed ``i``; Alpa's
  ``1f1b_overlap_friendly``): the extra forwards give the next stage work
  while a boundary transfer is in flight, for at most ``S - s - 1`` more
  live micro-batches than 1F1B.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["Task", "Instruction", "PipelineSchedule", "SCHEDULES", "make_schedule", "verify_schedule"]


@dataclasses.dataclass(frozen=True, order=True)
class Task:
    """``kind`` is ``forward``, ``backward``, ``send_act`` or ``send_grad``.

    ``where`` is the stage for compute tasks and the edge index for transfers.
    """

    kind: str
    where: int
    micro_batch: int

    def __str__(self) -> str:
        tag = {"forward": "F", "backward": "B", "send_act": "A", "send_grad": "G"}[self.kind]
        return f"{tag}{self.where}.{self.micro_batch}"


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One line of a mesh's instruction list.

    ``op`` is ``run`` (a compute task), ``send``/``recv`` (a transfer task,
    listed on both meshes), or ``free`` (drop ``buffer``).
    """

    op: str
    task: Task | None = None
    buffer: str = ""

    def __str__(self) -> str:
        return f"{self.op} {self.buffer}" if self.op == "free" else f"{self.op} {self.task}"


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """A schedule for a stage graph.

    Attributes:
      name: ``gpipe``, ``1f1b`` or ``eager_1f1b``.
      num_stages, num_micro_batches: its size.
      edges: ``(producer, consumer)`` stage pairs, indexed by transfer tasks.
      order: every task once, in launch order.
      per_mesh: each stage mesh's instruction list (its compute, its sends
        and receives, and frees), in launch order.
    """

    name: str
    num_stages: int
    num_micro_batches: int
    edges: tuple[tuple[int, int], ...]
    order: tuple[Task, ...]
    per_mesh: tuple[tuple[Instruction, ...], ...]


def _stage_sequence(name: str, s: int, num_stages: int, m: int) -> list[Task]:
    fwd = [Task("forward", s, i) for i in range(m)]
    bwd = [Task("backward", s, i) for i in range(m)]
    if name == "gpipe":
        return fwd + bwd
    # Forwards before the first backward, counting the steady phase's first.
    ahead = num_stages - s if name == "1f1b" else 2 * (num_stages - s) - 1
    warmup = min(ahead - 1, m)
    seq = fwd[:warmup]
    for i in range(m - warmup):
        seq += [fwd[warmup + i], bwd[i]]
    return seq + bwd[m - warmup :]


def _deps(task: Task, edges: Sequence[tuple[int, int]]) -> list[Task]:
    m = task.micro_batch
    if task.kind == "forward":
        return [Task("send_act", e, m) for e, (_, c) in enumerate(edges) if c == task.where]
    if task.kind == "send_act":
        return [Task("forward", edges[task.where][0], m)]
    if task.kind == "backward":
        return [Task("forward", task.where, m)] + [
            Task("send_grad", e, m) for e, (p, _) in enumerate(edges) if p == task.where
        ]
    return [Task("backward", edges[task.where][1], m)]


def make_schedule(name: str, num_stages: int, num_micro_batches: int, edges: Sequence[tuple[int, int]]) -> PipelineSchedule:
    """The ``name`` schedule for ``num_stages`` stages joined by ``edges``.

    Raises:
      ValueError: unknown ``name``, or sizes below 1.
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule: unknown {name!r}; expected one of {sorted(SCHEDULES)}")
    if num_stages < 1 or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches: expected >= 1, got {num_micro_batches}")
    edges = tuple(edges)
    sequences = [_stage_sequence(name, s, num_stages, num_micro_batches) for s in range(num_stages)]
    transfers = [Task(kind, e, m) for m in range(num_micro_batches) for e in range(len(edges)) for kind in ("send_act", "send_grad")]
    done: set[Task] = set()
    order: list[Task] = []
    pending_transfers = list(transfers)
    position = [0] * num_stages
    while any(p < len(seq) for p, seq in zip(position, sequences)):
        progressed = False
        for s, seq in enumerate(sequences):
            if position[s] < len(seq) and all(d in done for d in _deps(seq[position[s]], edges)):
                order.append(seq[position[s]])
                done.add(seq[position[s]])
                position[s] += 1
                progressed = True
                # Launch transfers as soon as their data exists: eager sends
                # let the next stage start as early as the schedule allows.
                ready = [t for t in pending_transfers if all(d in done for d in _deps(t, edges))]
                for t in ready:
                    order.append(t)
                    done.add(t)
                    pending_transfers.remove(t)
        if not progressed:
            stuck = [str(seq[p]) for p, seq in zip(position, sequences) if p < len(seq)]
            raise RuntimeError(f"schedule {name!r} deadlocks: stages wait at {stuck}")
    per_mesh = tuple(_instructions(s, order, edges, num_micro_batches) for s in range(num_stages))
    schedule = PipelineSchedule(name, num_stages, num_micro_batches, edges, tuple(order), per_mesh)
    verify_schedule(schedule)
    return schedule


def _buffers_after(task: Task, s: int, edges: Sequence[tuple[int, int]], order_pos: dict[Task, int]) -> list[str]:
    """Buffers of mesh ``s`` whose last use is ``task``."""
    m = task.micro_batch
    out = []
    if task.kind == "forward" and task.where == s:
        out += [f"act{e}.{m}@in" for e, (_, c) in enumerate(edges) if c == s]
    if task.kind == "backward" and task.where == s:
        out += [f"res{s}.{m}"] + [f"ct{e}.{m}@in" for e, (p, _) in enumerate(edges) if p == s]
    if task.kind == "send_act" and edges[task.where][0] == s:
        # The producer's copy of an output goes after its last send.
        p = s
        sends = [Task("send_act", e, m) for e, (q, _) in enumerate(edges) if q == p]
        if task == max(sends, key=order_pos.__getitem__):
            out.append(f"out{s}.{m}")
    if task.kind == "send_grad" and edges[task.where][1] == s:
        out.append(f"ct{task.where}.{m}@out")
    return out


def _instructions(s: int, order: Sequence[Task], edges, num_micro_batches: int) -> tuple[Instruction, ...]:
    pos = {t: i for i, t in enumerate(order)}
    out: list[Instruction] = []
    for t in order:
        if t.kind in ("forward", "backward"):
            if t.where != s:
                continue
            out.append(Instruction("run", t))
        else:
            p, c = edges[t.where]
            src, dst = (p, c) if t.kind == "send_act" else (c, p)
            if s == src:
                out.append(Instruction("send", t))
            elif s == dst:
                out.append(Instruction("recv", t))
            else:
                continue
        out += [Instruction("free", buffer=b) for b in _buffers_after(t, s, edges, pos)]
    return tuple(out)


def verify_schedule(schedule: PipelineSchedule) -> None:
    """Each task once, after its dependencies; per mesh, every buffer made before use and freed once.

    Raises:
      PlanVerificationError: naming the first broken invariant.
    """
    from .unit_tasks import PlanVerificationError

    S, M, edges = schedule.num_stages, schedule.num_micro_batches, schedule.edges
    expected = {Task(k, s, m) for k in ("forward", "backward") for s in range(S) for m in range(M)}
    expected |= {Task(k, e, m) for k in ("send_act", "send_grad") for e in range(len(edges)) for m in range(M)}
    if len(schedule.order) != len(expected) or set(schedule.order) != expected:
        raise PlanVerificationError("the launch order does not run every task exactly once")
    seen: set[Task] = set()
    for t in schedule.order:
        missing = [d for d in _deps(t, edges) if d not in seen]
        if missing:
            raise PlanVerificationError(f"{t} launches before {missing[0]}")
        seen.add(t)
    for s, instructions in enumerate(schedule.per_mesh):
        live: set[str] = set()
        freed: set[str] = set()
        for ins in instructions:
            made = []
            if ins.op == "run" and ins.task.kind == "forward":
                m = ins.task.micro_batch
                made = [f"res{s}.{m}"] + ([f"out{s}.{m}"] if any(p == s for p, _ in edges) else [])
            elif ins.op == "recv":
                m, e = ins.task.micro_batch, ins.task.where
                made = [f"act{e}.{m}@in" if ins.task.kind == "send_act" else f"ct{e}.{m}@in"]
            elif ins.op == "run" and ins.task.kind == "backward":
                m = ins.task.micro_batch
                made = [f"ct{e}.{m}@out" for e, (_, c) in enumerate(edges) if c == s]
            for b in made:
                if b in live or b in freed:
                    raise PlanVerificationError(f"mesh {s}: buffer {b} made twice")
                live.add(b)
            if ins.op == "free":
                if ins.buffer not in live:
                    raise PlanVerificationError(f"mesh {s}: frees {ins.buffer} which is not live")
                live.remove(ins.buffer)
                freed.add(ins.buffer)
        if live:
            raise PlanVerificationError(f"mesh {s}: buffers never freed: {sorted(live)}")


SCHEDULES = {"gpipe": "gpipe", "1f1b": "1f1b", "eager_1f1b": "eager_1f1b"}
