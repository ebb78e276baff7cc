"""Runs a ``PipelineProgram``: one handler per instruction kind, in launch order.

Every process walks the same launch order (multi-controller). Compute on a
mesh with no device here is skipped; every process joins every send, since
a point-to-point move needs all processes to take part (each move knows
where it has nothing to do). Launches are asynchronous, so stages on
different meshes, and the moves between them, overlap as the order allows.

Each handler returns the arrays it launched (nothing when it launched
nothing), which a ``StepRecorder`` (``runtime.step_trace``) times.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from meshpar.passes.pipeline.edge_transfer import Direction
from meshpar.passes.pipeline.pipeline_program import (
    BufferId, BufferKind, Free, Instruction, PipelineProgram, Recv, ReduceGradients, RunBackward,
    RunBackwardInput, RunBackwardWeight, RunForward, Send, received_buffer,
)
from meshpar.runtime.coordination import Arrival, CoordinationError, not_delivered, raise_lost_peer, senders, wait_ready
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.remote import absent
from meshpar.runtime.stage_executables import StageExecutables
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["InstructionError", "StageInputs", "ProgramRun", "ProgramInterpreter"]

Move = Callable[[jax.Array], jax.Array]
# A mesh's gradient reduction: its reduced stages' accumulators in, their reduced gradients out.
Reducer = Callable[[list[list[jax.Array]]], list[list[jax.Array]]]
Launched = tuple[jax.Array, ...]  # what a handler launched: the arrays its instruction produced


class InstructionError(RuntimeError):
    """An instruction failed: names it and its mesh; the cause is chained."""


@dataclasses.dataclass(frozen=True)
class StageInputs:
    """A stage's non-activation operands for one step: ``fixed`` once, ``batch[m]`` per micro-batch."""

    fixed: tuple[jax.Array, ...]
    batch: tuple[tuple[jax.Array, ...], ...]


@dataclasses.dataclass
class ProgramRun:
    """What one run of the program leaves behind.

    Attributes:
      results: the program's result buffers held here (losses per micro-batch).
      grads: per stage, its accumulated parameter gradients (``None`` elsewhere).
      peak_live_activations: per stage, most micro-batches whose forward
        residuals were held at once.
      peak_weight_states: per stage, most weight passes waiting at once.
      arriving: values other processes sent here, with what they are and who
        sent them, for the end-of-step bounded wait.
    """

    results: dict[BufferId, jax.Array]
    grads: list[list[jax.Array] | None]
    peak_live_activations: list[int]
    peak_weight_states: list[int]
    arriving: list[Arrival]


class ProgramInterpreter:
    """Interprets ``program`` with the stages' executables and one prepared move per transfer.

    Args:
      program: the verified program.
      executables: per stage.
      moves: per ``program.transfers`` entry, the callable that moves it.
      reducers: per mesh with a ``ReduceGradients``, the callable that reduces its stages'
        accumulators, in the instruction's stage order.
      local: per mesh, whether this process owns a device of it.
      watch: record values arriving from other processes (multi-process runs).
      launch_window: at most this many launches not yet finished before the next launch waits
        for the oldest (``None``: unbounded). XLA's CPU client blocks a launch, with no time
        limit, once a device holds too many unfinished programs; with several processes the
        ones it holds can wait on values a peer sends only after its own launch blocked, and
        both hang. Waiting here instead, for the oldest launch, cannot deadlock: every process
        launches in one order, which puts what the oldest reads earlier still.
      timeout_s: how long that wait lasts before raising ``CoordinationError``.

    A run raises ``PeerLostError`` naming the value and its sender when a value another process
    was sending failed in transit, and ``CoordinationError`` naming the processes that did not
    deliver when the launch window's wait times out on values not yet arrived.
    """

    def __init__(
        self,
        program: PipelineProgram,
        executables: Sequence[StageExecutables],
        moves: Sequence[Move],
        reducers: Mapping[int, Reducer],
        local: Sequence[bool],
        watch: bool,
        launch_window: int | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self.program, self.executables, self.moves = program, tuple(executables), tuple(moves)
        self.reducers = dict(reducers)
        self.local, self.watch = tuple(local), watch
        self.launch_window, self.timeout_s = launch_window, timeout_s
        self._handlers: dict[type, Callable[[int, Any, _State], Launched]] = {
            RunForward: self._forward,
            RunBackward: self._backward,
            RunBackwardInput: self._backward_input,
            RunBackwardWeight: self._backward_weight,
            Send: self._send,
            Recv: self._recv,
            Free: self._free,
            ReduceGradients: self._reduce_gradients,
        }
        self._sequence: list[tuple[int, Instruction]] = program.launch_sequence()
        unknown = sorted({type(ins).__name__ for _, ins in self._sequence} - {k.__name__ for k in self._handlers})
        if unknown:
            raise TypeError(f"program: instructions of kinds {unknown} have no handler in the program interpreter")
        self._senders = tuple(senders(t.src) for t in program.transfers)

    def run(self, inputs: Sequence[StageInputs | None], grads: list[list[jax.Array] | None],
            recorder: StepRecorder | None = None, meter: LiveBytesMeter | None = None) -> ProgramRun:
        """Runs every instruction; ``inputs`` and ``grads`` (zeros, donated) per stage, ``None`` where
        not local. ``recorder`` is told of every launch; ``meter`` samples what is held after each."""
        n = len(self.program.stages)
        state = _State(inputs, grads, {}, {}, [0] * n, [0] * n, [0] * n, [0] * n, [])
        if recorder is not None:
            operands = [v for i in inputs if i is not None for v in (*i.fixed, *(x for mb in i.batch for x in mb))]
            recorder.begin(operands, grads)
        unfinished: collections.deque[tuple[jax.Array, Instruction]] = collections.deque()
        for mesh, ins in self._sequence:
            launch_time = time.perf_counter() if recorder is not None else 0.0
            try:
                launched = self._handlers[type(ins)](mesh, ins, state)
            except jax.errors.JaxRuntimeError as e:
                raise_lost_peer(e, state.arriving, "pipeline transfers", f"launching {ins}")
            except (CoordinationError, InstructionError):
                raise
            except Exception as e:
                raise InstructionError(f"mesh {mesh}: {ins} failed: {e}") from e
            if recorder is not None:
                recorder.launched(mesh, ins, launched, launch_time)
            if meter is not None:
                self._sample(meter, state)
            if self.launch_window is not None and launched:
                # An execution's outputs are ready together: one array stands for the launch.
                unfinished.append((launched[0], ins))
                if len(unfinished) > self.launch_window:
                    self._wait(*unfinished.popleft(), state)
        results = {b: state.buffers[b] for b in self.program.results if b in state.buffers}
        return ProgramRun(results, state.grads, state.peak_live, state.peak_weight, state.arriving)

    def _sample(self, meter: LiveBytesMeter, state: _State) -> None:
        """What is held now: stage operands and accumulators resident, buffers and moves in flight
        (under the buffer they will be received into) as activations."""
        resident = [state.grads, *((i.fixed, i.batch) for i in state.inputs if i is not None)]
        activations = dict(state.buffers)
        for (k, m), value in state.in_flight.items():
            activations[received_buffer(self.program.transfers[k], m)] = value
        meter.sample(resident, activations)

    def _wait(self, array: jax.Array, ins: Instruction, state: _State) -> None:
        # A gradient accumulator donated to the stage's next pass is that pass's to finish.
        if array.is_deleted():
            return
        doing = f"waiting to launch past {ins}"
        try:
            wait_ready([array], self.timeout_s, f"the launch window (waiting for {ins})")
        except CoordinationError as e:
            # What holds a launch up across processes is a value a peer has not sent: name it.
            if all(a.value.is_ready() for a in state.arriving):
                raise
            raise not_delivered(state.arriving, self.timeout_s, "pipeline transfers", doing) from e
        except jax.errors.JaxRuntimeError as e:
            # The launch read a value whose sender is gone (or failed on its own: then as it is).
            raise_lost_peer(e, state.arriving, "pipeline transfers", doing)

    # -- handlers -------------------------------------------------------------

    def _forward(self, mesh: int, ins: RunForward, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        inputs = state.inputs[ins.stage]
        outs, residuals = self.executables[ins.stage].forward(
            inputs.fixed, inputs.batch[ins.micro_batch] if inputs.batch else (),
            [state.read(b) for b in ins.inputs])
        for b, v in zip(ins.outputs, outs):
            state.buffers[b] = v
        state.buffers[ins.residuals] = residuals
        state.live[ins.stage] += 1
        state.peak_live[ins.stage] = max(state.peak_live[ins.stage], state.live[ins.stage])
        return (*outs, *residuals)

    def _backward(self, mesh: int, ins: RunBackward, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        input_cts, state.grads[ins.stage] = self.executables[ins.stage].backward(
            state.read(ins.residuals), [state.read(b) for b in ins.cotangents], state.grads[ins.stage])
        for b, v in zip(ins.input_cotangents, input_cts):
            state.buffers[b] = v
        return (*input_cts, *state.grads[ins.stage])

    def _backward_input(self, mesh: int, ins: RunBackwardInput, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        executables = self.executables[ins.stage]
        residuals = state.read(ins.residuals)
        input_cts, computed = executables.backward_input(residuals, [state.read(b) for b in ins.cotangents])
        for b, v in zip(ins.input_cotangents, input_cts):
            state.buffers[b] = v
        state.buffers[ins.weight_state] = executables.weight_state(residuals, computed)
        state.waiting[ins.stage] += 1
        state.peak_weight[ins.stage] = max(state.peak_weight[ins.stage], state.waiting[ins.stage])
        return (*input_cts, *computed)

    def _backward_weight(self, mesh: int, ins: RunBackwardWeight, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        state.grads[ins.stage] = self.executables[ins.stage].backward_weight(
            state.read(ins.weight_state), state.grads[ins.stage])
        return tuple(state.grads[ins.stage])

    def _send(self, mesh: int, ins: Send, state: _State) -> Launched:
        transfer = self.program.transfers[ins.transfer]
        value = state.buffers.get(ins.buffer)
        if value is None:  # computed on a mesh of another process
            value = absent(transfer.shape, transfer.dtype, transfer.src)
        moved = state.in_flight[(ins.transfer, ins.micro_batch)] = self.moves[ins.transfer](value)
        return (moved,)

    def _recv(self, mesh: int, ins: Recv, state: _State) -> Launched:
        value = state.in_flight.pop((ins.transfer, ins.micro_batch))
        if not self.local[mesh]:
            return ()
        state.buffers[ins.buffer] = value
        transfer = self.program.transfers[ins.transfer]
        if self.watch:
            producer = self.program.schedule.edges[transfer.edge][0]
            what = "activation" if transfer.direction is Direction.ACTIVATION else "gradient"
            state.arriving.append(Arrival(
                value, f"{what} of act{producer}.{transfer.slot} stage {transfer.src_stage} -> {transfer.dst_stage}, "
                       f"micro-batch {ins.micro_batch}", self._senders[ins.transfer]))
        return ()

    def _reduce_gradients(self, mesh: int, ins: ReduceGradients, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        reduced = self.reducers[mesh]([state.grads[s] for s in ins.stages])
        for s, grads in zip(ins.stages, reduced):
            state.grads[s] = grads
        return tuple(g for grads in reduced for g in grads)

    def _free(self, mesh: int, ins: Free, state: _State) -> Launched:
        if state.buffers.pop(ins.buffer, None) is None:
            return ()
        if ins.buffer.kind is BufferKind.RESIDUALS:
            state.live[ins.buffer.index] -= 1
        elif ins.buffer.kind is BufferKind.WEIGHT_STATE:
            state.waiting[ins.buffer.index] -= 1
        return ()


@dataclasses.dataclass
class _State:
    inputs: Sequence[StageInputs | None]
    grads: list[list[jax.Array] | None]
    buffers: dict[BufferId, Any]
    in_flight: dict[tuple[int, int], jax.Array]
    live: list[int]
    peak_live: list[int]
    waiting: list[int]
    peak_weight: list[int]
    arriving: list[Arrival]

    def read(self, buffer: BufferId) -> Any:
        """The live buffer ``buffer``; a ``KeyError`` naming it when it is not live."""
        try:
            return self.buffers[buffer]
        except KeyError:
            raise KeyError(f"{buffer} is not live") from None
