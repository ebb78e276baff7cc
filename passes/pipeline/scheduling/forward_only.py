"""The forward-only schedule: a step without a gradient (evaluation, inference) runs each
stage's forward of every micro-batch, and nothing else.

Mesh ``r`` runs the forwards of the stages it hosts in stage order, each over the micro-batches
in order (GPipe's forward phase; for virtual stages, each of its stages in turn). With no
backward there is no residual to hold, so running ahead costs no memory, and a mesh's stages
only read earlier stages' results: no order of a mesh's lower stages first can deadlock. The
placement (which mesh hosts which stage) is the train step's schedule's, so an evaluation
step finds every parameter where the train step keeps it
(``pipeline_schedule.forward_only_schedule``).
"""

from __future__ import annotations

from ...program.tasks import Task, TaskKind

__all__ = ["forward_only_actions", "FORWARD_ONLY", "FORWARD_ONLY_V"]

# The registered names: one per stage placement (loop and V).
FORWARD_ONLY = "forward_only"
FORWARD_ONLY_V = "forward_only_v"


def forward_only_actions(stage_mesh: list[int], num_meshes: int, num_micro_batches: int) -> list[list[Task]]:
    """Per mesh of ``num_meshes``, the forwards of its stages (``stage_mesh[s]`` hosts stage
    ``s``), stage by stage, each over every micro-batch in order."""
    out: list[list[Task]] = [[] for _ in range(num_meshes)]
    for s, mesh in enumerate(stage_mesh):
        out[mesh] += [Task(TaskKind.FORWARD, s, m) for m in range(num_micro_batches)]
    return out
