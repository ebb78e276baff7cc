"""A measured timeline of one pipeline step: when each task of the program ran, as this process saw it.

The interpreter (``runtime.program_interpreter``) hands a ``StepRecorder``
every instruction it launched, with the arrays it produced and the time just
before the launch. Launches are asynchronous, so the recorder notes when
those arrays become ready:

- ``serialize=False``: a waiter thread per lane takes the lane's launches in
  launch order and blocks on each (``block_until_ready`` releases the GIL),
  so the launching thread never waits and the pipeline keeps its overlap
  (each waiter's wake-up still takes some CPU time from it). A lane runs
  what was launched on it first in, first out, so by the time its waiter
  reaches a launch the previous one has finished, and each ready time is
  noted as it happens, late only by the waiter's wait for the GIL: while
  recording, the GIL is handed over every ``SWITCH_INTERVAL_S`` instead of
  every 5 ms. A gradient pass's accumulators are donated to the stage's next
  one, and a donated array cannot be waited on, so the waiter waits on a
  0-d marker computed from them, launched right after the pass.
- ``serialize=True``: the recorder blocks right after each launch, so every
  instruction runs alone: isolated durations, the per-task compute a cost
  model wants, not the step's overlap.

Each event ends when its arrays were ready. Its start is inferred as the
latest of the lower bounds a device cannot start before: its launch, the end
of the previous event on its lane, and the ends of its data dependencies
(``passes.program.tasks.task_dependencies``) recorded here. Waiters wake in
no particular order, so an end noted earlier than that start (a dependency's
waiter woke later than this one's) is raised to it.

Only what this process observes is recorded: compute on its own meshes, and
transfers delivered to its own meshes (a process owning only the source mesh
holds no shard of the moved value, so cannot see it arrive). Instructions
that produce nothing (``Recv``, ``Free``, compute skipped on other
processes' meshes) get no event. A fused program (``passes.pipeline.lowering.fused_runs``) runs
several tasks in one execution, which no clock sees inside: its interval is split evenly
among them, in order (run with ``fuse_compute=1`` to time each task alone).
"""

from __future__ import annotations

import dataclasses
import queue
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from meshpar.passes.program.live_bytes import LiveBytes, MemoryProfile
from meshpar.passes.program.pipeline_instructions import Instruction, PipelineProgram
from meshpar.passes.program.tasks import Task, task_dependencies
from meshpar.passes.program.timeline import Lane, LaneKind, Timeline, TimelineEvent, timeline_of

__all__ = ["StepRecorder", "StepTrace", "SWITCH_INTERVAL_S"]

# GIL hand-over interval while recording: a waiter whose array became ready
# otherwise waits up to the default 5 ms for the dispatching thread to let go
# of the GIL; at 20 us the measured lag is ~0.1 ms.
SWITCH_INTERVAL_S = 2e-5

# A 0-d array ready once its operand is (keep_unused: jit would drop an unread
# operand, and with it the dependency). Stands in for a gradient accumulator
# the stage's next gradient pass donates: a donated array cannot be waited on.
_ready_marker = jax.jit(lambda value: jnp.zeros((), jnp.uint8), keep_unused=True)


@dataclasses.dataclass(frozen=True)
class StepTrace:
    """What tracing one step measured.

    Attributes:
      timeline: when each task ran (times in seconds from the first task's start).
      live_bytes: per device of this process, the peak bytes of the live buffers the runtime
        held (``passes.simulation.live_bytes``).
      memory_profile: the per-buffer and resident bytes behind them, from which
        ``passes.simulation.live_bytes.predict_live_bytes`` predicts the peaks of a schedule.
      outside_pipeline_s: serialized steps only (else 0): the seconds this process spent on
        the step's work around the pipeline program (placing inputs, the work before and after
        the gradient, micro-batches combined, gradients reduced and moved to their owners,
        outputs assembled), each instruction run alone.
    """

    timeline: Timeline
    live_bytes: LiveBytes
    memory_profile: MemoryProfile
    outside_pipeline_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class _Launch:
    """An instruction's launch: ``seq`` counts launches, ``witness`` is ready when it is done;
    ``tasks`` are the schedule tasks it runs (several for a fused program)."""

    seq: int
    tasks: tuple[Task, ...]
    launch: float
    witness: jax.Array


@dataclasses.dataclass(frozen=True)
class _Record:
    seq: int
    tasks: tuple[Task, ...]
    lane: Lane
    launch: float
    ready: float


class _LaneWaiter:
    """A thread noting, in launch order, when each of one lane's launches is ready."""

    def __init__(self, lane: Lane) -> None:
        self.lane = lane
        self.pending: queue.SimpleQueue[_Launch | None] = queue.SimpleQueue()
        self.records: list[_Record] = []
        self.waiting_for: Task | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"meshpar step trace: {lane}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (launch := self.pending.get()) is not None:
            self.waiting_for = launch.tasks[-1]
            try:
                launch.witness.block_until_ready()
            except Exception as e:  # reported by StepRecorder.timeline
                self.error = e
                return
            self.records.append(_Record(launch.seq, launch.tasks, self.lane, launch.launch, time.perf_counter()))
        self.waiting_for = None


class StepRecorder:
    """Records one run of ``program``; use it as a context manager around the run and ``timeline()``.

    Args:
      program: the program the interpreter runs.
      local: per mesh, whether this process owns a device of it.
      serialize: block after each launch (isolated durations) instead of
        waiting on other threads (the step as it overlaps).
      timeout_s: how long ``timeline()`` waits for the launched work.
    """

    def __init__(self, program: PipelineProgram, local: Sequence[bool], serialize: bool,
                 timeout_s: float = 120.0) -> None:
        self.program, self.local, self.serialize, self.timeout_s = program, tuple(local), serialize, timeout_s
        self._waiters: dict[Lane, _LaneWaiter] = {}
        self._records: list[_Record] = []  # serialized runs only
        self._seq = 0
        self._switch_interval: float | None = None
        self.outside_pipeline_s = 0.0

    def __enter__(self) -> StepRecorder:
        if not self.serialize:
            self._switch_interval = sys.getswitchinterval()
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._switch_interval is not None:
            sys.setswitchinterval(self._switch_interval)
            self._switch_interval = None
        # Waiters left blocked by a failed run are daemons: they end with their arrays or the process.
        for waiter in self._waiters.values():
            waiter.pending.put(None)

    def begin(self, operands: Sequence[jax.Array], gradients: Sequence[Sequence[jax.Array] | None]) -> None:
        """Called once before the first launch with what the program reads from outside: stage
        operands, and per stage its gradient accumulators (``None`` where not local).

        Serialized, waits for all of them, so the first tasks time only themselves. Otherwise
        compiles the ready markers of the accumulators now, not in the middle of the step.
        """
        if self.serialize:
            jax.block_until_ready((list(operands), [g for g in gradients if g]))
            return
        for grads in gradients:
            if grads:
                _ready_marker(grads[-1])

    def launched(self, mesh: int, instruction: Instruction, arrays: Sequence[jax.Array], launch_time: float) -> None:
        """``instruction`` was launched on ``mesh`` at ``launch_time`` (``time.perf_counter()``
        just before its launch) and produced ``arrays``: for ``RunBackward`` the input cotangents
        then the gradient accumulators, for ``RunBackwardWeight`` the accumulators."""
        if not arrays:
            return
        at = self._task_lane(mesh, instruction)
        if at is None:
            return
        tasks, lane = at
        seq, self._seq = self._seq, self._seq + 1
        if self.serialize:
            jax.block_until_ready(arrays)
            self._records.append(_Record(seq, tasks, lane, launch_time, time.perf_counter()))
            return
        # Each instruction is one execution (or one move), whose outputs are ready together:
        # one of them times it. Accumulated gradients get donated, so a marker on one does.
        last = arrays[-1]
        witness = _ready_marker(last) if instruction.accumulates else last
        if lane not in self._waiters:
            self._waiters[lane] = _LaneWaiter(lane)
        self._waiters[lane].pending.put(_Launch(seq, tasks, launch_time, witness))

    def outside_pipeline(self, seconds: float) -> None:
        """An instruction of the step around the pipeline program took ``seconds`` (run alone)."""
        self.outside_pipeline_s += seconds

    def _task_lane(self, mesh: int, instruction: Instruction) -> tuple[tuple[Task, ...], Lane] | None:
        """The tasks ``instruction`` runs and its lane, or ``None`` when this process cannot see it."""
        tasks = instruction.tasks
        if not tasks:
            return None  # a reduction: no schedule task, the simulator prices it beside the timeline
        if instruction.sends:
            transfer = self.program.transfers[instruction.sends[0][0]]
            home = self.program.stage_mesh
            if not self.local[home[transfer.dst_stage]]:
                return None
            return tasks, Lane(LaneKind.LINK, home[transfer.src_stage], home[transfer.dst_stage])
        return tasks, Lane(LaneKind.COMPUTE, mesh)

    def timeline(self) -> Timeline:
        """The step's events once everything launched is ready, times from the first start.

        Raises:
          TimeoutError: something launched was not ready within ``timeout_s``, naming its lane
            and task.
          RuntimeError: waiting for a launch failed.
        """
        records = list(self._records)
        deadline = time.monotonic() + self.timeout_s
        for waiter in self._waiters.values():
            waiter.pending.put(None)
        for waiter in self._waiters.values():
            waiter.thread.join(max(0.0, deadline - time.monotonic()))
            if waiter.thread.is_alive():
                raise TimeoutError(
                    f"StepRecorder: {waiter.lane} did not finish {waiter.waiting_for} within {self.timeout_s:g} s "
                    f"(process {jax.process_index()}; did every process run the traced step?)")
            if waiter.error is not None:
                raise RuntimeError(f"StepRecorder: waiting for {waiter.waiting_for} on {waiter.lane} failed") \
                    from waiter.error
            records += waiter.records
        source = "measured, serialized" if self.serialize else "measured"
        return timeline_of(_infer_events(records, self.program), source)


def _infer_events(records: Sequence[_Record], program: PipelineProgram) -> list[TimelineEvent]:
    """Events from launches and ready times (see the module doc); dependencies launch first, so
    one walk in launch order knows every dependency's end before its dependents'."""
    ends: dict[Task, float] = {}
    lane_free: dict[Lane, float] = {}
    events = []
    for r in sorted(records, key=lambda r: r.seq):
        bounds = [r.launch, lane_free.get(r.lane, r.launch)]
        bounds += [ends[d] for task in r.tasks for d in task_dependencies(task, program.edges, program.split_backward)
                   if d in ends and d not in r.tasks]
        start = max(bounds)
        end = max(r.ready, start)
        # A fused program's tasks ran inside one execution: its time is split evenly among them.
        step = (end - start) / len(r.tasks)
        for k, task in enumerate(r.tasks):
            ends[task] = start + (k + 1) * step
            events.append(TimelineEvent(task, r.lane, start + k * step, start + (k + 1) * step))
        lane_free[r.lane] = end
    return events
