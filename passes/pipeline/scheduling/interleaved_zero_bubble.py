"""Interleaved zero bubble (ZB1P) on the looped placement: ``v`` stages per mesh, stage ``k`` on
mesh ``k mod P``, every backward split into its input pass (``BACKWARD_INPUT``) and its weight
pass (``BACKWARD_WEIGHT``), the weight passes held back to fill the pipeline's bubbles.

PyTorch's ``torch.distributed.pipelining.ScheduleInterleavedZeroBubble`` (its
``_calculate_single_rank_operations`` with ``_get_warmup_ops(multiply_factor=1)`` and
``_get_1f1b_rank_ops(enable_zero_bubble=True)``), the ZB1P schedule of Qi et al., "Zero Bubble
Pipeline Parallelism" (ICLR 2024, arXiv:2401.10241), on interleaved 1F1B's looped placement.

Rounds. torch's flexible interleaving cuts the ``M`` micro-batches into ``max(1, M // P)``
rounds of ``M / rounds`` micro-batches each (``M`` must be a multiple of the rounds: with
``P = 4``, ``M = 10`` is 2 rounds of 5 and ``M = 3`` one round of 3, but ``M = 9`` does not
split). A mesh visits its stages in rounds: forwards go through its chunks ``0 .. v-1``, each
for one round of micro-batches, backwards through them in reverse.

torch then pads each rank's list with idle steps (``None``, ``_add_bubbles_to_actions``) for
its lock-step simulation. meshpar's order has no idle steps (the launch order and the simulator
start each task when its inputs are ready), so a mesh's tasks here are torch's rank list
without them.
"""

from __future__ import annotations

from collections import defaultdict, deque

from ...program.tasks import Task, TaskKind

F, I, W = TaskKind.FORWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT

__all__ = ["interleaved_zb_actions", "interleaved_zb_rounds"]


def interleaved_zb_rounds(num_meshes: int, num_micro_batches: int) -> int:
    """The rounds ``max(1, M // P)`` torch cuts ``M`` micro-batches into on ``P`` meshes;
    ``M`` must be a multiple of them (module doc)."""
    return max(1, num_micro_batches // num_meshes)


def _check(num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> None:
    if num_meshes < 1 or stages_per_mesh < 1 or num_micro_batches < 1:
        raise ValueError(f"num_meshes, stages_per_mesh, num_micro_batches: interleaved_zb needs positive counts, "
                         f"got {num_meshes}, {stages_per_mesh}, {num_micro_batches}")
    rounds = interleaved_zb_rounds(num_meshes, num_micro_batches)
    # With one stage per mesh every op is on chunk 0: the rounds do not change the order.
    if stages_per_mesh > 1 and num_micro_batches % rounds:
        raise ValueError(f"num_micro_batches: interleaved_zb cuts {num_micro_batches} micro-batches into "
                         f"max(1, M // P) = {rounds} rounds on {num_meshes} meshes, which do not divide them")


def _mesh_tasks(mesh: int, num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> list[Task]:
    """Mesh ``mesh``'s ``3vM`` tasks (torch's rank list, module doc).

    Ops ``k = 0 .. vM + warmup - 1``: op ``k < vM`` runs a forward of chunk ``(k // round) mod v``;
    op ``k >= warmup`` runs an input pass of chunk ``v - 1 - ((k - warmup) // round) mod v``;
    ``warmup = min((v - 1)·round + P - 1 - mesh, vM)`` ops are forwards only. Once ``mesh``
    input passes are held, each input pass is followed by the oldest held weight pass; the held
    ones drain at the end. Each (kind, stage) takes its micro-batches in order.
    """
    P, v, M = num_meshes, stages_per_mesh, num_micro_batches
    per_round = M // interleaved_zb_rounds(P, M)
    warmup = min((v - 1) * per_round + P - 1 - mesh, v * M)
    taken: dict[tuple[TaskKind, int], int] = defaultdict(int)
    held: deque[Task] = deque()
    tasks: list[Task] = []

    def put(kind: TaskKind, chunk: int) -> Task:
        stage = chunk * P + mesh
        task = Task(kind, stage, taken[(kind, stage)])
        taken[(kind, stage)] += 1
        tasks.append(task)
        return task

    for k in range(v * M + warmup):
        if k < v * M:
            put(F, (k // per_round) % v)
        if k < warmup:
            continue
        done = put(I, v - 1 - ((k - warmup) // per_round) % v)
        held.append(Task(W, done.where, done.micro_batch))
        if k - warmup >= mesh:
            tasks.append(held.popleft())
    return tasks + list(held)


def interleaved_zb_actions(num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> list[list[Task]]:
    """ZB1P (torch's ``ScheduleInterleavedZeroBubble``): per mesh ``r`` (stages ``c·P + r``), its
    ``3vM`` tasks in order (module doc).

    With one stage per mesh this is ZB-H1 (``zb_h1``), for any ``M``.

    Raises:
      ValueError: naming ``num_micro_batches`` when its rounds (``interleaved_zb_rounds``) do not
        divide it with virtual stages, or any count below one.
    """
    _check(num_meshes, stages_per_mesh, num_micro_batches)
    return [_mesh_tasks(r, num_meshes, stages_per_mesh, num_micro_batches) for r in range(num_meshes)]
