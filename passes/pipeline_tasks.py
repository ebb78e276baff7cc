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
from collections.abc import Sequence

__all__ = ["TaskKind", "Task", "task_dependencies"]


class TaskKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "A"
    SEND_GRAD = "G"

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
        return [Task(TaskKind.SEND_ACT, e, m) for e, (_, c) in enumerate(edges) if c == task.where]
    if task.kind is TaskKind.SEND_ACT:
        return [Task(TaskKind.FORWARD, edges[task.where][0], m)]
    if task.kind in (TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT):
        return [Task(TaskKind.FORWARD, task.where, m)] + [
            Task(TaskKind.SEND_GRAD, e, m) for e, (p, _) in enumerate(edges) if p == task.where
        ]
    if task.kind is TaskKind.BACKWARD_WEIGHT:
        return [Task(TaskKind.BACKWARD_INPUT, task.where, m)]
    consumer = edges[task.where][1]
    return [Task(TaskKind.BACKWARD_INPUT if split_backward else TaskKind.BACKWARD, consumer, m)]
