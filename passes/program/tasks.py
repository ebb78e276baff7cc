"""The tasks of a pipeline step and the data each one reads.

Compute tasks of (stage, micro-batch): ``FORWARD``, a whole ``BACKWARD``, or
a backward split into ``BACKWARD_INPUT`` (the activation cotangents the
previous stage waits for) and ``BACKWARD_WEIGHT`` (the parameter cotangents
nobody waits for). Transfer tasks along a stage-graph edge: an activation
(``SEND_ACT``) or its cotangent (``SEND_GRAD``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence

__all__ = ["TaskKind", "Task", "task_dependencies"]


class TaskKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "A"
    SEND_GRAD = "G"

    # Members are singletons: identity hashing, in C, keeps the schedules' task sets and
    # graphs of a hundred thousand tasks (planning 1,024 devices) from hashing names in Python.
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self not in (TaskKind.SEND_ACT, TaskKind.SEND_GRAD)


@dataclasses.dataclass(frozen=True)
class Task:
    """One unit of pipeline work.

    ``where`` is the stage for compute tasks and the edge index for transfers.
    Printed as ``<kind letter><where>.<micro_batch>``, e.g. ``F0.2``, ``G1.0``.
    """

    kind: TaskKind
    where: int
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.where}.{self.micro_batch}"


def task_dependencies(task: Task, edges: Sequence[tuple[int, int]], split_backward: bool) -> list[Task]:
    """The tasks whose results ``task`` reads (its data dependencies).

    ``edges`` are ``(producer, consumer)`` stage pairs; ``split_backward``
    says whether cotangents leave a stage after its input pass or its whole
    backward.
    """
    m = task.micro_batch
    if task.kind is TaskKind.FORWARD:
        return [Task(TaskKind.SEND_ACT, e, m) for e in _incident(tuple(edges))[0].get(task.where, ())]
    if task.kind is TaskKind.SEND_ACT:
        return [Task(TaskKind.FORWARD, edges[task.where][0], m)]
    if task.kind in (TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT):
        return [Task(TaskKind.FORWARD, task.where, m)] + [
            Task(TaskKind.SEND_GRAD, e, m) for e in _incident(tuple(edges))[1].get(task.where, ())
        ]
    if task.kind is TaskKind.BACKWARD_WEIGHT:
        return [Task(TaskKind.BACKWARD_INPUT, task.where, m)]
    consumer = edges[task.where][1]
    return [Task(TaskKind.BACKWARD_INPUT if split_backward else TaskKind.BACKWARD, consumer, m)]


@functools.lru_cache(maxsize=64)
def _incident(edges: tuple[tuple[int, int], ...]) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, ...]]]:
    """Per stage, the indices of the edges into it and of those out of it, in edge order."""
    into: dict[int, list[int]] = {}
    out_of: dict[int, list[int]] = {}
    for e, (p, c) in enumerate(edges):
        into.setdefault(c, []).append(e)
        out_of.setdefault(p, []).append(e)
    return ({k: tuple(v) for k, v in into.items()}, {k: tuple(v) for k, v in out_of.items()})
