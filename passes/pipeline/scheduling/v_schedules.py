"""Schedules on the V placement: ``2P`` stages on ``P`` meshes, mesh ``r`` hosting stages ``r``
and ``2P - 1 - r``.

A micro-batch goes down the meshes (stages ``0 .. P-1``, the *down* chunk) and back up them
(stages ``P .. 2P-1``, the *up* chunk), so the first and last stages share mesh 0 (the loss and
the embedding's input sit together) and stages ``P - 1`` and ``P`` share mesh ``P - 1`` (the
turn of the V costs no transfer). Both schedules split every backward into its input pass
(``BACKWARD_INPUT``) and weight pass (``BACKWARD_WEIGHT``) and place the weight passes
themselves, and both need at least ``2P`` micro-batches.

- ``zb_v`` (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, the ZB-V schedule of the
  later version, arXiv:2401.10241 §6): the handcrafted order for ``T_F = T_B = T_W``. With
  those times and free transfers each mesh computes without a gap from its first task to its
  last (the paper's parallelogram, zero bubble once steps overlap), and each mesh holds at
  most ``2P`` chunk micro-batches of forward residuals, 1F1B's peak of ``P`` whole-stage ones.
- ``dualpipev`` (DeepSeek's DualPipe cut in half, "Cut-in-half" by Sea AI Lab): warm-up
  forwards, then pairs of one micro-batch's forward and another's backward on the same mesh
  (*overlapped* pairs, which a runtime may run concurrently to hide their transfers), then
  the backwards drain, the second half of them with split weight passes filling the bubbles.

Task lists use meshpar's split backward throughout: a whole backward of the references
(``B``, input and weight pass in one call) is its ``BACKWARD_INPUT`` directly followed by its
``BACKWARD_WEIGHT``, since a schedule here either splits every backward or none.
"""

from __future__ import annotations

from collections import deque

from ...program.tasks import Task, TaskKind

F, I, W = TaskKind.FORWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT

__all__ = ["V_STAGES_PER_MESH", "dualpipev_actions", "dualpipev_overlapped_pairs", "min_micro_batches_v",
           "v_stages", "zb_v_actions"]

V_STAGES_PER_MESH = 2


def v_stages(mesh: int, num_meshes: int) -> tuple[int, int]:
    """The ``(down, up)`` stages mesh ``mesh`` hosts on the V: ``(mesh, 2P - 1 - mesh)``."""
    return mesh, 2 * num_meshes - 1 - mesh


def min_micro_batches_v(num_meshes: int) -> int:
    """The fewest micro-batches both V schedules take: ``2P``, one per stage, as DualPipe asserts
    (``num_chunks >= num_ranks * 2``) and torch's ``ScheduleDualPipeV`` raises. ZB-V's order
    itself runs from ``2P - 1`` (mesh 0's warm-up forwards; the references pad fewer with idle
    slots) and takes the same bound here, so both V schedules accept the same sizes."""
    return 2 * num_meshes


def _check(name: str, num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> None:
    if num_meshes < 1:
        raise ValueError(f"num_meshes: {name} needs at least one mesh, got {num_meshes}")
    if stages_per_mesh != V_STAGES_PER_MESH:
        raise ValueError(f"stages_per_mesh: {name} places exactly {V_STAGES_PER_MESH} stages on each mesh (a V), "
                         f"got {stages_per_mesh}")
    if num_micro_batches < min_micro_batches_v(num_meshes):
        raise ValueError(f"num_micro_batches: {name} needs at least 2 x meshes = {min_micro_batches_v(num_meshes)} "
                         f"micro-batches on {num_meshes} meshes, got {num_micro_batches}")


class _MeshTasks:
    """One mesh's task list under construction: each (kind, stage) takes its micro-batches in
    order, so a caller names only the kind and the stage."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []
        self._next: dict[tuple[TaskKind, int], int] = {}

    def count(self, kind: TaskKind, stage: int) -> int:
        return self._next.get((kind, stage), 0)

    def put(self, kind: TaskKind, stage: int) -> Task:
        task = Task(kind, stage, self.count(kind, stage))
        self._next[(kind, stage)] = task.micro_batch + 1
        self.tasks.append(task)
        return task


def zb_v_actions(num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> list[list[Task]]:
    """ZB-V: per mesh ``r`` (stages ``d = r``, ``u = 2P - 1 - r``), its ``6M`` tasks in order.

    The handcrafted order of the zero-bubble authors, as in sail-sg/zero-bubble-pipeline-parallelism
    ``megatron/core/pipeline_parallel/handcrafted_zb_v`` (``get_zb_v_schedule``) and PyTorch's
    ``torch/distributed/pipelining/schedules.py`` (``ScheduleZBVZeroBubble``):

    1. warm-up: ``2(P - r) - 1`` forwards of ``d``; ``r`` times a forward of ``u`` then of ``d``;
       ``P - r`` times a forward, input pass and weight pass of ``u``;
    2. steady state, until ``d``'s forwards are done and ``u``'s have caught up: a forward of
       ``d`` (while any is left), the input and weight passes of ``d``, then a forward, input and
       weight pass of ``u``;
    3. cool-down: ``r`` times the input pass of ``d`` then of ``u``; ``P - r`` times an input pass
       of ``d`` then the oldest weight pass of ``d``; then ``u``'s remaining weight passes, then
       ``d``'s.

    Each (kind, stage) runs its micro-batches in increasing order. Mesh ``r`` holds at most
    ``2P`` micro-batches' forward residuals over its two stages.

    Raises:
      ValueError: naming ``stages_per_mesh`` (not 2) or ``num_micro_batches`` (fewer than
        ``2P``, ``min_micro_batches_v``).
    """
    _check("zb_v", num_meshes, stages_per_mesh, num_micro_batches)
    P, m = num_meshes, num_micro_batches
    out = []
    for r in range(P):
        d, u = v_stages(r, P)
        mesh = _MeshTasks()
        for _ in range(2 * (P - r) - 1):
            mesh.put(F, d)
        for _ in range(r):
            mesh.put(F, u)
            mesh.put(F, d)
        for _ in range(P - r):
            for kind in (F, I, W):
                mesh.put(kind, u)
        while mesh.count(F, u) < mesh.count(F, d) or mesh.count(F, d) < m:
            if mesh.count(F, d) < m:
                mesh.put(F, d)
            for kind, stage in ((I, d), (W, d), (F, u), (I, u), (W, u)):
                mesh.put(kind, stage)
        for _ in range(r):
            mesh.put(I, d)
            mesh.put(I, u)
        for _ in range(P - r):
            mesh.put(I, d)
            mesh.put(W, d)
        for stage in (u, d):
            while mesh.count(W, stage) < m:
                mesh.put(W, stage)
        out.append(mesh.tasks)
    return out


def _dualpipev(num_meshes: int, num_micro_batches: int) -> tuple[list[list[Task]], list[list[tuple[int, int]]]]:
    """DualPipeV's task lists and, per mesh, the positions ``(forward, input pass)`` of its
    overlapped pairs (the pair's weight pass right after its input pass)."""
    P, m = num_meshes, num_micro_batches
    lists, pairs = [], []
    for r in range(P):
        d, u = v_stages(r, P)
        mesh = _MeshTasks()
        overlapped: list[tuple[int, int]] = []
        waiting: deque[Task] = deque()  # weight passes of split backwards, oldest first

        def backward(stage: int, split: bool) -> None:
            # A split backward leaves its weight pass for a later bubble; a whole one runs it now.
            weight_pass = Task(W, stage, mesh.put(I, stage).micro_batch)
            if split:
                waiting.append(weight_pass)
            else:
                mesh.tasks.append(weight_pass)

        def weight() -> None:
            if waiting:
                mesh.tasks.append(waiting.popleft())

        def forward_backward(forward_stage: int, backward_stage: int) -> None:
            overlapped.append((len(mesh.tasks), len(mesh.tasks) + 1))
            mesh.put(F, forward_stage)
            backward(backward_stage, split=False)

        for _ in range(2 * (P - r - 1)):
            mesh.put(F, d)
        for _ in range(r + 1):
            mesh.put(F, d)
            mesh.put(F, u)
        for _ in range(P - r - 1):
            backward(u, split=True)
            weight()
            mesh.put(F, u)
        for i in range(m - 2 * P + r + 1):
            if i == 0 and r == P - 1:
                # The turn of the V: u's backward of micro-batch 0 waits for d's forward of it
                # on this very mesh, so the two cannot overlap.
                mesh.put(F, d)
                backward(u, split=False)
            else:
                forward_backward(d, u)
            forward_backward(u, d)
        for _ in range(P - r - 1):
            backward(u, split=False)
            forward_backward(u, d)
        split = False
        for i in range(r + 1):
            # The second half of these backwards is split, on u first on odd meshes.
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            backward(u, split)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            backward(d, split)
        for _ in range(P - r - 1):
            weight()
            backward(d, split)
        for _ in range(r + 1):
            weight()
        assert not waiting, "DualPipeV: weight passes left over"
        lists.append(mesh.tasks)
        pairs.append(overlapped)
    return lists, pairs


def dualpipev_actions(num_meshes: int, stages_per_mesh: int, num_micro_batches: int) -> list[list[Task]]:
    """DualPipeV: per mesh ``r`` (stages ``d = r``, ``u = 2P - 1 - r``), its ``6M`` tasks in order.

    DeepSeek's order, as in deepseek-ai/DualPipe ``dualpipe/dualpipev.py`` (``DualPipeV.step``)
    and PyTorch's ``torch/distributed/pipelining/schedules.py`` (``ScheduleDualPipeV``), whose
    golden ``test/distributed/pipelining/artifacts/dualpipev_4rank_10mb.csv`` it reproduces:

    1. ``2(P - r - 1)`` forwards of ``d``; ``r + 1`` times a forward of ``d`` then of ``u``;
    2. ``P - r - 1`` times a split input pass of ``u``, the oldest waiting weight pass, a
       forward of ``u``;
    3. main phase, ``M - 2P + r + 1`` times: the overlapped pair (forward ``d``, backward ``u``),
       not overlapped on the last mesh the first time (the V's turn), then the pair (forward
       ``u``, backward ``d``);
    4. ``P - r - 1`` times a backward of ``u`` then the pair (forward ``u``, backward ``d``);
    5. ``r + 1`` times a backward of ``u`` then of ``d``, split from the middle one on (from
       ``u``'s on odd meshes, ``d``'s on even ones);
    6. ``P - r - 1`` times the oldest waiting weight pass then a split input pass of ``d``;
       then the ``r + 1`` weight passes still waiting.

    A whole backward is its input pass directly followed by its weight pass (module doc).
    ``dualpipev_overlapped_pairs`` gives the positions of the overlapped pairs.

    Raises:
      ValueError: naming ``stages_per_mesh`` (not 2) or ``num_micro_batches`` (fewer than
        ``2P``, as DualPipe asserts and torch raises).
    """
    _check("dualpipev", num_meshes, stages_per_mesh, num_micro_batches)
    return _dualpipev(num_meshes, num_micro_batches)[0]


def dualpipev_overlapped_pairs(num_meshes: int, num_micro_batches: int) -> list[list[tuple[int, int]]]:
    """Per mesh, the overlapped pairs of ``dualpipev_actions(num_meshes, 2, num_micro_batches)``
    as positions ``(k, k + 1)`` in the mesh's list: a forward of one stage and the input pass
    of the other (of another micro-batch), whose weight pass is at ``k + 2``. A runtime that
    overlaps them dispatches the three back to back.

    Raises:
      ValueError: naming ``num_micro_batches`` (fewer than ``2P``).
    """
    _check("dualpipev", num_meshes, V_STAGES_PER_MESH, num_micro_batches)
    return _dualpipev(num_meshes, num_micro_batches)[1]
