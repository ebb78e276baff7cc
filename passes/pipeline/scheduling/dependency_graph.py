"""The cross-mesh dependency graph of a schedule, and its launch order.

Nodes are ``Task``s. An edge ``a -> b`` means ``b`` cannot start before
``a``: ``kind="data"`` when ``b`` reads ``a``'s result (a forward reads the
activation transfer into it, a transfer reads what its producer computed),
``kind="sequence"`` when both run on one stage and the schedule puts ``a``
first. The stage sequences cannot deadlock exactly when this graph is
acyclic. The simulator walks the same graph with durations on its nodes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import networkx as nx

from ...program.tasks import Task, TaskKind, task_dependencies

__all__ = ["dependency_graph", "verify_acyclic", "launch_order"]

_TRANSFER_RANK = {TaskKind.SEND_ACT: 0, TaskKind.SEND_GRAD: 1}


def dependency_graph(
    sequences: Sequence[Sequence[Task]], edges: Sequence[tuple[int, int]], split_backward: bool, num_micro_batches: int,
    forward_only: bool = False,
) -> nx.DiGraph:
    """Every compute task of ``sequences`` and every transfer over ``edges`` (activations only
    when ``forward_only``), with both kinds of edge."""
    graph = nx.DiGraph()
    for s, seq in enumerate(sequences):
        graph.add_nodes_from(seq, stage=s)
        graph.add_edges_from(zip(seq, seq[1:]), kind="sequence")
    kinds = (TaskKind.SEND_ACT,) if forward_only else tuple(_TRANSFER_RANK)
    graph.add_nodes_from(
        Task(kind, e, m) for m in range(num_micro_batches) for e in range(len(edges)) for kind in kinds
    )
    for task in list(graph.nodes):
        for dep in task_dependencies(task, edges, split_backward):
            if dep not in graph:
                raise ValueError(f"{task} reads {dep}, which no stage sequence runs")
            graph.add_edge(dep, task, kind="data")
    return graph


def verify_acyclic(graph: nx.DiGraph, name: str, given: bool = False,
                   task_name: Callable[[Task], str] | None = None) -> None:
    """Raises naming a cycle (a deadlock) of schedule ``name``: ``ValueError`` naming ``schedule``
    when its order was ``given`` as data (a user's input), else ``PlanVerificationError`` (a
    built-in schedule's bug).

    ``task_name`` names a compute task as the order's author wrote it (a CSV's action and its
    cell, ``schedule_csv``); the cycle then lists only compute tasks, a transfer being the data
    edge it carries, since the author wrote no transfers. ``None``: every task as ``Task`` prints.
    """
    from ...verification import PlanVerificationError

    if not nx.is_directed_acyclic_graph(graph):
        edges = nx.find_cycle(graph)
        if task_name is None:
            cycle = " -> ".join(f"{a} ({graph.edges[a, b]['kind']})" for a, b in edges)
        else:
            # Transfers sit only between compute tasks, so every cycle holds one; it is closed
            # with its first task, each arrow labelled with why the next task waits.
            named = [(a, graph.edges[a, b]["kind"]) for a, b in edges if a.kind.is_compute]
            cycle = " ".join(f"{task_name(a)} -{kind}->" for a, kind in named) + f" {task_name(named[0][0])}"
        if given:
            raise ValueError(f"schedule: the order of {name!r} deadlocks on the cycle {cycle}, each task waiting "
                             f"for the one before it (in its mesh's sequence, or for its data)")
        raise PlanVerificationError(f"schedule {name!r} deadlocks: {cycle}")


def launch_order(graph: nx.DiGraph, sequences: Sequence[Sequence[Task]]) -> tuple[Task, ...]:
    """One order for every process: stages take turns launching their next ready task, and each
    transfer launches right after the task that computes its value, so the next stage can start
    as early as the schedule allows. ``graph`` must be acyclic."""
    done: set[Task] = set()
    order: list[Task] = []
    position = [0] * len(sequences)

    def launch(task: Task) -> None:
        order.append(task)
        done.add(task)

    while any(p < len(seq) for p, seq in zip(position, sequences)):
        progressed = False
        for s, seq in enumerate(sequences):
            if position[s] < len(seq) and all(d in done for d in graph.predecessors(seq[position[s]])):
                task = seq[position[s]]
                launch(task)
                position[s] += 1
                progressed = True
                transfers = [t for t in graph.successors(task) if not t.kind.is_compute]
                for t in sorted(transfers, key=lambda t: (t.micro_batch, t.where, _TRANSFER_RANK[t.kind])):
                    if all(d in done for d in graph.predecessors(t)):
                        launch(t)
        if not progressed:
            raise AssertionError("launch_order: no stage can start; verify_acyclic should have caught this")
    return tuple(order)
