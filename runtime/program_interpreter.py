"""Runs a ``PipelineProgram``: one handler per instruction kind, in launch order.

Every process walks the same launch order (multi-controller). Compute on a
mesh with no device here is skipped; every process joins every send, since
a point-to-point move needs all processes to take part (each move knows
where it has nothing to do). Launches are asynchronous, so stages on
different meshes, and the moves between them, overlap as the order allows.

Each handler returns the arrays it launched (nothing when it launched
nothing), which a ``StepRecorder`` (``runtime.step_trace``) times. A kind defined outside this
module (an ``Instruction`` subclass anywhere) runs once ``register_handler`` names its handler;
an interpreter refuses, at construction, a program holding a kind with no handler, naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from meshpar.passes.program.live_bytes import program_key
from meshpar.passes.program.moves import Direction, TransferKind
from meshpar.passes.program.pipeline_instructions import (
    BufferId, BufferKind, Free, Instruction, PipelineProgram, Recv, ReduceGradients, RunBackward, RunBackwardInput,
    RunBackwardWeight, RunForward, RunFused, Send, received_buffer,
)
from meshpar.runtime.compile_ahead import AheadOfTime
from meshpar.runtime.coordination import (
    Arrival, CoordinationError, not_delivered, raise_lost_peer, senders, wait_pending, wait_ready,
)
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.remote import absent
from meshpar.runtime.stage_executables import StageExecutables, on_mesh
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["HANDLERS", "InstructionError", "StageInputs", "ProgramRun", "ProgramInterpreter", "register_handler"]

Move = Callable[[jax.Array], jax.Array]
# A mesh's gradient reduction: its reduced stages' accumulators in, their reduced gradients out.
Reducer = Callable[[list[list[jax.Array]]], list[list[jax.Array]]]
Launched = tuple[jax.Array, ...]  # what a handler launched: the arrays its instruction produced
# A registered kind's handler: ``handler(interpreter, mesh, instruction, state) -> Launched``.
Handler = Callable[["ProgramInterpreter", int, Any, "_State"], Launched]

# The kinds this module runs itself.
_BUILT_IN = frozenset({RunForward, RunBackward, RunBackwardInput, RunBackwardWeight, RunFused, Send, Recv, Free,
                       ReduceGradients})
# Kinds defined elsewhere, each with its handler (``register_handler``).
HANDLERS: dict[type, Handler] = {}


def register_handler(kind: type, handler: Handler) -> None:
    """Interpreters made from now on run instructions of ``kind`` (an ``Instruction`` subclass)
    with ``handler(interpreter, mesh, ins, state)``, in launch order, as they run every kind: it
    reads and writes ``state.buffers`` (``BufferId`` -> value; ``state.read(b)`` names a buffer
    that is not live), skips its work where ``interpreter.local[mesh]`` is false, and returns the
    arrays it launched. While compiling ahead (``state.compile_only``) values are shapes and it
    launches nothing. The instruction's own ``Instruction`` properties (``reads``, ``writes``,
    ``frees``, ...) are all the verifier, the live-byte prediction and the counters read of it.

    Raises:
      TypeError: ``kind`` is not an ``Instruction`` subclass.
      ValueError: ``kind`` has a handler already.
    """
    if not (isinstance(kind, type) and issubclass(kind, Instruction)):
        raise TypeError(f"register_handler: {kind!r} is not an Instruction subclass")
    if kind in _BUILT_IN or kind in HANDLERS:
        raise ValueError(f"register_handler: {kind.__name__} has a handler already")
    HANDLERS[kind] = handler


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
        self._kernels: dict[type, Callable[[Any, Sequence[StageExecutables], dict, Sequence[StageInputs | None], list],
                                           Launched]] = {
            RunForward: self._forward_kernel,
            RunBackward: self._backward_kernel,
            RunBackwardInput: self._backward_input_kernel,
            RunBackwardWeight: self._backward_weight_kernel,
        }
        self._handlers: dict[type, Callable[[int, Any, _State], Launched]] = {
            **{kind: self._compute for kind in self._kernels},
            RunFused: self._fused,
            Send: self._send,
            Recv: self._recv,
            Free: self._free,
            ReduceGradients: self._reduce_gradients,
            **{kind: functools.partial(handler, self) for kind, handler in HANDLERS.items()},
        }
        self._sequence: list[tuple[int, Instruction]] = program.launch_sequence()
        unknown = sorted({type(ins).__name__ for _, ins in self._sequence if type(ins) not in self._handlers})
        if unknown:
            raise TypeError(f"program: instructions of kinds {unknown} have no handler in the program interpreter")
        self._senders = tuple(senders(t.src) for t in program.transfers)
        self._fused_programs: dict[RunFused, _FusedProgram] = {}
        # The program's own instructions (held by it, so their ids are stable) to theirs.
        self._fused_by_instruction: dict[int, _FusedProgram] = {}
        # Per program (``id`` of its stable callable), its measured temporaries: measuring
        # compiles the program once more, so each is measured once, not at every metered step.
        self._temp_bytes: dict[int, int] = {}

    def run(self, inputs: Sequence[StageInputs | None], grads: list[list[jax.Array] | None],
            recorder: StepRecorder | None = None, meter: LiveBytesMeter | None = None) -> ProgramRun:
        """Runs every instruction; ``inputs`` and ``grads`` (zeros, donated) per stage, ``None`` where
        not local. ``recorder`` is told of every launch; ``meter`` samples what is held after each."""
        n = len(self.program.stages)
        # Metered, every program an instruction launches is measured too (its temporaries).
        temps = _ProgramTemps(self._temp_bytes) if meter is not None else None
        executables = self.executables if temps is None else [temps.watched(e) for e in self.executables]
        state = _State(inputs, grads, {}, {}, [0] * n, [0] * n, [0] * n, [0] * n, [], executables, temps)
        return self._walk(state, recorder, meter)

    def compile_ahead(self, inputs: Sequence[StageInputs | None], grads: list[list[Any] | None],
                      compiler: AheadOfTime) -> ProgramRun:
        """Queues every program the run launches here (stage passes, fused runs, gradient
        reductions, moves between stages on one mesh) on ``compiler``, launching nothing:
        ``inputs`` and ``grads`` are ``jax.ShapeDtypeStruct``s with shardings, each launch queues
        its program for its operands' and passes on its results (``compile_ahead.Pending``: the
        compiled program's types), each move passes on its destination's. The programs compile
        side by side, each once what it reads has compiled; the real run then finds every one
        compiled (JAX's cache is keyed by the same shapes and shardings). Returns the run's
        results and accumulated gradients as shapes."""
        n = len(self.program.stages)
        state = _State(inputs, grads, {}, {}, [0] * n, [0] * n, [0] * n, [0] * n, [],
                       [compiler.watched(e) for e in self.executables], compiler, compile_only=True)
        return self._walk(state, None, None)

    def _walk(self, state: _State, recorder: StepRecorder | None, meter: LiveBytesMeter | None) -> ProgramRun:
        inputs, grads = state.inputs, state.grads
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
            if self.local[mesh]:
                state.count(ins)
            if recorder is not None:
                recorder.launched(mesh, ins, launched, launch_time)
            if meter is not None:
                self._sample(meter, state, mesh, ins)
            if self.launch_window is not None and launched and not state.compile_only:
                # An execution's outputs are ready together: one array stands for the launch.
                unfinished.append((launched[0], ins))
                if len(unfinished) > self.launch_window:
                    self._wait(*unfinished.popleft(), state)
        results = {b: state.buffers[b] for b in self.program.results if b in state.buffers}
        return ProgramRun(results, state.grads, state.peak_live, state.peak_weight, state.arriving)

    def _sample(self, meter: LiveBytesMeter, state: _State, mesh: int, ins: Instruction) -> None:
        """What is held now: stage operands and accumulators resident, buffers and moves in flight
        (under the buffer they will be received into) as activations, and the temporaries of the
        programs ``ins`` launched on ``mesh`` (they run now)."""
        resident = [state.grads, *((i.fixed, i.batch) for i in state.inputs if i is not None)]
        activations = dict(state.buffers)
        for (k, m), value in state.in_flight.items():
            activations[received_buffer(self.program.transfers[k], m)] = value
        running = state.temps.take()
        meter.sample(resident, activations, None if running is None else (mesh, running, program_key(ins)))

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

    # -- compute ------------------------------------------------------------------
    #
    # One kernel per compute kind: reads its operands from ``buffers`` (and the stage's
    # ``inputs``, ``grads``), writes its results there, returns the arrays it launched. Called
    # with the program's buffers it launches the stage's programs; called while a fused program
    # is traced, with that program's values, it adds the stage's work to it.

    def _forward_kernel(self, ins: RunForward, executables: Sequence[StageExecutables], buffers: dict,
                        inputs: Sequence[StageInputs | None], grads: list) -> Launched:
        stage_inputs = inputs[ins.stage]
        outs, residuals = executables[ins.stage].forward(
            stage_inputs.fixed, stage_inputs.batch[ins.micro_batch] if stage_inputs.batch else (),
            [buffers[b] for b in ins.inputs])
        buffers.update(zip(ins.outputs, outs))
        buffers[ins.residuals] = residuals
        return (*outs, *residuals)

    def _backward_kernel(self, ins: RunBackward, executables: Sequence[StageExecutables], buffers: dict,
                         inputs: Sequence[StageInputs | None], grads: list) -> Launched:
        input_cts, grads[ins.stage] = executables[ins.stage].backward(
            buffers[ins.residuals], [buffers[b] for b in ins.cotangents], grads[ins.stage])
        buffers.update(zip(ins.input_cotangents, input_cts))
        return (*input_cts, *grads[ins.stage])

    def _backward_input_kernel(self, ins: RunBackwardInput, executables: Sequence[StageExecutables], buffers: dict,
                               inputs: Sequence[StageInputs | None], grads: list) -> Launched:
        executables = executables[ins.stage]
        residuals = buffers[ins.residuals]
        input_cts, computed = executables.backward_input(residuals, [buffers[b] for b in ins.cotangents])
        buffers.update(zip(ins.input_cotangents, input_cts))
        buffers[ins.weight_state] = executables.weight_state(residuals, computed)
        return (*input_cts, *computed)

    def _backward_weight_kernel(self, ins: RunBackwardWeight, executables: Sequence[StageExecutables], buffers: dict,
                                inputs: Sequence[StageInputs | None], grads: list) -> Launched:
        grads[ins.stage] = executables[ins.stage].backward_weight(buffers[ins.weight_state], grads[ins.stage])
        return tuple(grads[ins.stage])

    # -- handlers -------------------------------------------------------------

    def _compute(self, mesh: int, ins: Instruction, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        for b in ins.reads:
            state.read(b)  # a KeyError naming the buffer when it is not live
        wait_pending(state.remote, ins.reads, self.timeout_s, "pipeline transfers", lambda: f"waiting to launch {ins}")
        return self._kernels[type(ins)](ins, state.executables, state.buffers, state.inputs, state.grads)

    def _fused(self, mesh: int, ins: RunFused, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        wait_pending(state.remote, ins.inputs, self.timeout_s, "pipeline transfers", lambda: f"waiting to launch {ins}")
        program = self._fused_program(ins)
        stages = program.stages
        batches = [state.inputs[m.stage].batch[m.micro_batch] if state.inputs[m.stage].batch else ()
                   for m in ins.members if isinstance(m, RunForward)]
        run = program.run if state.temps is None else state.temps.watch(program.run)
        outputs, grads = run([state.inputs[s].fixed for s in stages], batches,
                                     [state.read(b) for b in ins.inputs], [state.grads[s] for s in ins.accumulates])
        state.buffers.update(zip(ins.outputs, outputs))
        for s, g in zip(ins.accumulates, grads):
            state.grads[s] = g
        for b in ins.dropped:
            state.buffers.pop(b, None)
        return (*jax.tree.leaves(outputs), *jax.tree.leaves(grads))

    def _fused_program(self, ins: RunFused) -> _FusedProgram:
        """The compiled program of ``ins``: one per shape of group (the same members a number of
        micro-batches later compute the same), built on first use; found by the instruction's
        identity after that (its shape's key costs the host more than the launch)."""
        program = self._fused_by_instruction.get(id(ins))
        if program is None:
            key = _shifted(ins, min(m.micro_batch for m in ins.members))
            if key not in self._fused_programs:
                self._fused_programs[key] = _FusedProgram(key, self)
            program = self._fused_by_instruction[id(ins)] = self._fused_programs[key]
        return program

    def _send(self, mesh: int, ins: Send, state: _State) -> Launched:
        transfer = self.program.transfers[ins.transfer]
        value = state.buffers.get(ins.buffer)
        if value is None:  # computed on a mesh of another process
            value = absent(transfer.shape, transfer.dtype, transfer.src)
        if state.compile_only:
            # What arrives: the value itself where it stays as it is (two stages on one mesh
            # alike), a program's result where the move is a program of its own (relaid out on
            # one mesh), else the value laid out as the destination says.
            move, here = self.moves[ins.transfer], ins.buffer in state.buffers
            if here and transfer.kind is TransferKind.LOCAL and transfer.src == transfer.dst:
                moved = value
            elif here and getattr(move, "jitted", None) is not None:
                moved = state.temps.watch(move)(value)
            else:
                moved = jax.ShapeDtypeStruct(transfer.shape, transfer.dtype, sharding=transfer.dst)
            state.in_flight[(ins.transfer, ins.micro_batch)] = moved
            return ()
        moved = state.in_flight[(ins.transfer, ins.micro_batch)] = self.moves[ins.transfer](value)
        return (moved,)

    def _recv(self, mesh: int, ins: Recv, state: _State) -> Launched:
        value = state.in_flight.pop((ins.transfer, ins.micro_batch))
        if not self.local[mesh]:
            return ()
        state.buffers[ins.buffer] = value
        transfer = self.program.transfers[ins.transfer]
        if self.watch and not state.compile_only:
            producer = self.program.edges[transfer.edge][0]
            what = "activation" if transfer.direction is Direction.ACTIVATION else "gradient"
            arrival = Arrival(
                value, f"{what} of act{producer}.{transfer.slot} stage {transfer.src_stage} -> {transfer.dst_stage}, "
                       f"micro-batch {ins.micro_batch}", self._senders[ins.transfer])
            state.arriving.append(arrival)
            if arrival.senders:
                state.remote[ins.buffer] = arrival
        return ()

    def _reduce_gradients(self, mesh: int, ins: ReduceGradients, state: _State) -> Launched:
        if not self.local[mesh]:
            return ()
        reducer = self.reducers[mesh] if not state.compile_only else state.temps.watch(self.reducers[mesh])
        reduced = reducer([state.grads[s] for s in ins.stages])
        for s, grads in zip(ins.stages, reduced):
            state.grads[s] = grads
        return tuple(g for grads in reduced for g in grads)

    def _free(self, mesh: int, ins: Free, state: _State) -> Launched:
        state.buffers.pop(ins.buffer, None)
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
    executables: Sequence[StageExecutables]
    temps: _ProgramTemps | AheadOfTime | None
    # Compiling ahead (``ProgramInterpreter.compile_ahead``): values are shapes, nothing runs.
    compile_only: bool = False
    # Received buffers other processes send here, until a launch reading them waited for them.
    remote: dict[BufferId, Arrival] = dataclasses.field(default_factory=dict)

    def read(self, buffer: BufferId) -> Any:
        """The live buffer ``buffer``; a ``KeyError`` naming it when it is not live."""
        try:
            return self.buffers[buffer]
        except KeyError:
            raise KeyError(f"{buffer} is not live") from None

    def count(self, ins: Instruction) -> None:
        """Per stage, the residuals and weight states ``ins`` leaves held (and, for a fused
        program, those it held inside), and the peaks of both."""
        counters = {BufferKind.RESIDUALS: (self.live, self.peak_live),
                    BufferKind.WEIGHT_STATE: (self.waiting, self.peak_weight)}
        for b in (*ins.writes, *ins.temporaries):
            if b.kind in counters:
                held, peak = counters[b.kind]
                held[b.index] += 1
                peak[b.index] = max(peak[b.index], held[b.index])
        for b in (*ins.frees, *ins.temporaries):
            if b.kind in counters:
                counters[b.kind][0][b.index] -= 1


class _LaunchHook:
    """Stands between a run and the programs it launches: ``watch(fn)`` is what the run calls
    instead of ``fn`` (a program made by ``on_mesh``)."""

    def watch(self, fn: Callable) -> Callable:
        raise NotImplementedError

    def watched(self, executables: StageExecutables) -> StageExecutables:
        """A stage's four passes, each watched."""
        return dataclasses.replace(executables, forward=self.watch(executables.forward),
                                   backward=self.watch(executables.backward),
                                   backward_input=self.watch(executables.backward_input),
                                   backward_weight=self.watch(executables.backward_weight))


class _ProgramTemps(_LaunchHook):
    """While a step is metered: the temporary bytes (per device) of the programs launched since
    the last ``take``, each program measured once (``on_mesh``'s ``temp_bytes``) into ``known``
    (the interpreter's, kept across steps)."""

    def __init__(self, known: dict[int, int]) -> None:
        self._launched: int | None = None
        self._known = known

    def watch(self, fn: Callable) -> Callable:
        def call(*args: Any) -> Any:
            if id(fn) not in self._known:
                self._known[id(fn)] = fn.temp_bytes(*args)
            self._launched = (self._launched or 0) + self._known[id(fn)]
            return fn(*args)

        return call

    def take(self) -> int | None:
        """The bytes launched since the last call; ``None`` when nothing was."""
        launched, self._launched = self._launched, None
        return launched


def _shifted(x: Any, base: int) -> Any:
    """``x`` (an instruction, or anything in one) with every micro-batch number less ``base``."""
    if isinstance(x, tuple):
        return tuple(_shifted(v, base) for v in x)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return dataclasses.replace(x, **{f.name: getattr(x, f.name) - base if f.name == "micro_batch"
                                         else _shifted(getattr(x, f.name), base)
                                         for f in dataclasses.fields(x)})
    return x


class _FusedProgram:
    """A ``RunFused``'s members as one jitted program: the interpreter's compute kernels traced
    in order on the program's own values, the local moves between them made inside it.

    ``run(fixed, batches, inputs, grads) -> (outputs, grads)``: per stage of its members (in
    ``stages`` order) the stage's per-step operands, per forward member its micro-batch
    operands (``()`` for a stage with none), the instruction's ``inputs``, the accumulators of
    its ``accumulates`` stages (donated); the instruction's ``outputs`` and the updated
    accumulators."""

    def __init__(self, ins: RunFused, interpreter: ProgramInterpreter) -> None:
        self.stages = tuple(sorted({m.stage for m in ins.members}))
        num_stages = len(interpreter.program.stages)
        kernels, transfers = interpreter._kernels, interpreter.program.transfers
        executables = [e.traceable() for e in interpreter.executables]

        def fused(fixed, batches, inputs, accumulators):
            buffers = dict(zip(ins.inputs, inputs))
            grads: list = [None] * num_stages
            for s, g in zip(ins.accumulates, accumulators):
                grads[s] = list(g)
            stage_inputs: list = [None] * num_stages
            batch = iter(batches)
            for s, f in zip(self.stages, fixed):
                stage_inputs[s] = StageInputs(tuple(f), {})
            pending = list(ins.moves)
            for member in ins.members:
                if isinstance(member, RunForward):
                    stage_inputs[member.stage].batch[member.micro_batch] = next(batch)
                kernels[type(member)](member, executables, buffers, stage_inputs, grads)
                for mv in [mv for mv in pending if mv.source in buffers]:
                    dst = transfers[mv.transfer].dst
                    buffers[mv.into] = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, dst),
                                                    buffers[mv.source])
                    pending.remove(mv)
            return [buffers[b] for b in ins.outputs], [grads[s] for s in ins.accumulates]

        self.run = on_mesh(jax.jit(fused, donate_argnums=(3,)), interpreter.executables[self.stages[0]].mesh,
                           interpreter.timeout_s)
