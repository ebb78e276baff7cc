"""Runs a compiled pipeline step: its step program (``passes.program.step_instructions``), one
handler per instruction kind (``step_handlers``), the pipeline program in its middle
(``program_interpreter``).

The executable is built from what the compiler verified and nothing else: the step program,
whose every instruction carries what it needs (placements, one feed per stage operand, the moves
around the pipeline, the outputs' sources, the stacked leaves' splits and joins), the pipeline
program, the move table, and the stage kernels. It holds what the handlers share (the meshes,
which are this process's, the prepared moves, the stage programs, the pipeline's interpreter)
and runs the handlers in order; each handler's ``prepare`` builds its moves and programs once,
at construction, so the hot path plans, compiles and looks up nothing.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.passes import jax_ir
from meshpar.passes.program.devices import device_key, planner_ids
from meshpar.passes.program.moves import MoveKey, MoveTable
from meshpar.passes.program.pipeline_instructions import PipelineProgram, ReduceGradients
from meshpar.passes.program.stage_kernel import StageKernel
from meshpar.passes.program.step_instructions import JoinStackedLeaves, RunPipeline, StepProgram
from meshpar.runtime.compile_ahead import AheadOfTime, wait_deferred
from meshpar.runtime.early_programs import EarlyPrograms
from meshpar.runtime.frozen_heap import frozen_heap
from meshpar.runtime.coordination import Arrival, agree, owns_a_device_of, raise_lost_peer, wait_ready
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.move_handlers import Move, prepare_move
from meshpar.runtime.program_interpreter import ProgramInterpreter, StageInputs
from meshpar.runtime.stacked_leaves import StackedLeaves
from meshpar.runtime.stage_executables import compile_stage, on_mesh
from meshpar.runtime.step_ahead import compile_step_ahead
from meshpar.runtime.step_handlers import STEP_HANDLERS
from meshpar.runtime.step_state import StepState
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["LAUNCH_WINDOW", "PipelineExecutable"]

# Unfinished launches a process keeps in flight with several processes
# (``ProgramInterpreter``'s launch_window): enough to run ahead into the next
# micro-batches, well under what XLA's CPU client holds before it blocks.
LAUNCH_WINDOW = 8


class PipelineExecutable:
    """A compiled train step, ready to run.

    Args:
      step: the step program this runs (every instruction carries what it needs).
      program: the pipeline program in its middle.
      moves: every planned move (each prepared once, here, by its executor's handler).
      kernels: per stage, what its stage programs compile from.
      out_tree, out_avals: the step's output treedef, shapes and dtypes.
      timeout_s: how long a process waits, at the end of a step, for values
        other processes send it (multi-process runs only).
      description: what ``describe()`` returns (``passes.pipeline.describe_pipeline``).
      early: the programs around the pipeline made (and queued to compile) while the compiler
        ran (``runtime.early_programs``): this launches those, and compiles the rest ahead on
        the same queue.
    """

    def __init__(
        self,
        step: StepProgram,
        program: PipelineProgram,
        moves: MoveTable,
        kernels: Sequence[StageKernel],
        out_tree: Any,
        out_avals: Sequence[Any],
        timeout_s: float = 120.0,
        description: str = "",
        early: EarlyPrograms | None = None,
    ) -> None:
        self.step_program, self.program, self.moves = step, program, moves
        self.description = description
        self.home = program.stage_mesh
        on = {self.home[k.stage]: k.mesh for k in kernels}
        self.meshes = tuple(on[m] for m in range(len(program.instructions)))
        # Ids distinct across platforms: the meshes may be on a GPU and on the host.
        self.device_ids = planner_ids(*(m.devices.flat for m in self.meshes))
        self.mesh_devices = tuple(tuple(self.device_ids[device_key(d)] for d in m.devices.flat) for m in self.meshes)
        self.stage_meshes = tuple(k.mesh for k in kernels)
        self.num_micro_batches = program.num_micro_batches
        self.out_tree = out_tree
        joins = [ins for ins in step if isinstance(ins, JoinStackedLeaves)]
        pieces = joins[0].pieces if joins else None
        self.out_avals = tuple(out_avals) if pieces is None else tuple(
            out_avals[j] if p is None else _piece_aval(out_avals[j], pieces.outputs[j], p)
            for j, p in pieces.piece_outputs())
        # Per leaf of the user's arguments, where the step keeps it between calls.
        self.leaf_shardings = step.leaf_shardings
        self.timeout_s = timeout_s
        # Per mesh (a mesh may host several stages), and per stage: whether a device of it is
        # this process's.
        self.mesh_local = [owns_a_device_of(m) for m in self.meshes]
        self.local = [self.mesh_local[m] for m in self.home]
        self._prepared: dict[MoveKey, Move] = {}
        self._early = early
        self.executables = [compile_stage(k, timeout_s) for k in kernels]
        self._kernels = tuple(kernels)
        # How many programs ``compile_ahead`` compiled; ``None`` until it has run.
        self.compiled_ahead: int | None = None
        # Per program.transfers entry, its prepared move.
        self.transfer_moves = tuple(self.move(t.move_key) for t in program.transfers)
        several = jax.process_count() > 1
        if several:
            # The transfer programs compile on the pool (``compile_ahead.deferred_compile``):
            # done before this process launches anything.
            wait_deferred()
            self._connect_meshes()
        reducers = {mesh: self._reducer(mesh, [kernels[s].accumulation for s in ins.stages])
                    for mesh, instructions in enumerate(program.instructions)
                    for ins in instructions if isinstance(ins, ReduceGradients)}
        self.interpreter = ProgramInterpreter(
            program, self.executables, self.transfer_moves, reducers, self.mesh_local, watch=several,
            launch_window=LAUNCH_WINDOW if several else None, timeout_s=timeout_s)
        # Per mesh here, its stages and the one program making their gradient accumulators.
        self._accumulators = []
        for mesh in range(len(self.meshes)):
            stages = [s for s, m in enumerate(self.home) if m == mesh and self.local[s]]
            if stages:
                self._accumulators.append(
                    (stages, _accumulator_maker([kernels[s].accumulation.accumulators for s in stages])))
        self.stacked_leaves: StackedLeaves | None = None
        self.peak_live_activations: list[int] = [0] * len(kernels)
        self.peak_weight_states: list[int] = [0] * len(kernels)
        # Checked here, once, so the step's hot path looks no handler up.
        unknown = sorted({type(ins).__name__ for ins in step if type(ins) not in STEP_HANDLERS})
        if unknown:
            raise TypeError(f"step: instructions of kinds {unknown} have no handler (runtime.step_handlers)")
        # Per step instruction, in order: its handler's run and what its prepare made, once.
        self._runs: list[tuple[Any, Callable, Any]] = []
        self._ready: dict[int, Any] = {}
        for ins in step:
            handler = STEP_HANDLERS[type(ins)]
            ready = early.ready(ins) if early is not None else None
            if ready is None and handler.prepare is not None:
                ready = handler.prepare(self, ins)
            self._ready[id(ins)] = ready
            self._runs.append((ins, handler.run, ready))

    def move(self, key: MoveKey) -> Move:
        """The prepared move of ``key``: one per distinct move, built at construction."""
        if key not in self._prepared:
            self._prepared[key] = prepare_move(self.moves.of(key), self.timeout_s)
        return self._prepared[key]

    def ready(self, ins: Any) -> Any:
        """What step instruction ``ins``'s handler prepared for it (``StepHandler.prepare``)."""
        return self._ready[id(ins)]

    def _connect_meshes(self) -> None:
        """Every collective group of each mesh spanning processes, connected once, mesh by mesh.

        XLA:CPU connects the devices of a collective group across processes (a gloo context)
        at the first collective over it, a rendezvous that gives up after 30 s. Inside a step
        the processes of a mesh run far apart by design (each runs ahead to the next value it
        waits for), so a first collective there can time out while a peer is held up elsewhere
        (measured on a mesh whose data axis spans hosts: BENCHMARKS.md). Here every process of
        the mesh is at the same point.
        """
        for mesh, local in zip(self.meshes, self.mesh_local):
            if not local or len({d.process_index for d in mesh.devices.flat}) == 1:
                continue
            ones = jnp.ones(mesh.devices.shape, jnp.float32, device=NamedSharding(mesh, P(*mesh.axis_names)))
            # Reducing over each axis alone, then over all of them, touches every group a
            # stage program, a move or a gradient reduction on this mesh can use.
            sums = [on_mesh(jax.jit(functools.partial(jnp.sum, axis=axes), out_shardings=NamedSharding(mesh, P())),
                            mesh, self.timeout_s)(ones) for axes in [*range(ones.ndim), None]]
            wait_ready(sums, self.timeout_s, f"connecting the devices of mesh {dict(mesh.shape)} across processes")

    def _reducer(self, mesh: int, plans: Sequence[Any]) -> Callable:
        """The accumulators of stages reduced on ``mesh`` (per stage, its ``StageAccumulation``):
        replicas' partial sums summed over the data axis (one all-reduce for all of them), each
        cast to its parameter's dtype and laid out as its gradient is read
        (``stage_kernel.StageAccumulation.reduced``)."""

        def reduce_gradients(grads):
            return [[(g.sum(0) if plan.replicas is not None else g).astype(dtype) for g, (_, dtype) in
                     zip(accumulators, plan.reduced)] for accumulators, plan in zip(grads, plans)]

        shardings = [[sharding for sharding, _ in plan.reduced] for plan in plans]
        # Not donated: a (D, *param) accumulator cannot hold its (*param) sum, and the step drops
        # the accumulators right after.
        return on_mesh(jax.jit(reduce_gradients, out_shardings=shardings), self.meshes[mesh], self.timeout_s)

    def describe(self) -> str:
        """Stages, meshes, shardings, each move's executor and plan, and the schedule."""
        return self.description

    def compiled_count(self) -> int:
        """Executables compiled so far, of the stage programs and of the programs the step's
        handlers prepared (``on_mesh``'s): constant across steps after the first."""
        prepared = jax.tree.leaves(list(self._ready.values()), is_leaf=lambda x: hasattr(x, "jitted"))
        return (sum(e.compiled_count() for e in self.executables)
                + sum(jax_ir.compiled_count(f.jitted) for f in prepared if hasattr(f, "jitted")))

    def compile_ahead(self, leaves: Sequence[Any] | None = None) -> int:
        """Compiles every program the pipeline launches on this process (each stage's passes,
        fused runs, gradient reductions) before anything runs, from the shapes and shardings
        the compiler gave its operands, and, given the step's flattened arguments ``leaves``,
        the programs around it whose operands' types follow from them (``runtime.step_ahead``).
        The programs compile side by side (``runtime.compile_ahead``), as do the transfer
        programs the moves prepared; then, with several processes, every process meets the
        others once (bounded by ``timeout_s``). So no process compiles while values are on
        their way to or from it (a process compiling a program while its peers' transfers wait
        on it was a known cause of hangs; marin-community/marin#7655). The first call does this
        itself; afterwards it returns at once. Returns how many programs it compiled."""
        if self.compiled_ahead is not None:
            return self.compiled_ahead
        # The stages' operands as shapes, fed as the feeds would feed them.
        operands: dict[tuple[int, int], Any] = {}
        grads: list[list[Any] | None] = []
        for kernel, local in zip(self._kernels, self.local):
            if not local:
                grads.append(None)
                continue
            for o in kernel.operands:
                aval = kernel.in_avals[o.position]
                shaped = jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=o.sharding)
                operands[(kernel.stage, o.position)] = [shaped] * self.num_micro_batches if o.per_micro_batch else shaped
            grads.append([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                          for a in kernel.accumulation.accumulators])
        # The programs around the pipeline started compiling while the compiler ran, on ``early``'s;
        # the rest compile on the whole pool.
        compiler = self._early.compiler if self._early is not None else AheadOfTime()
        compiler.compile_on(None)
        with frozen_heap():
            compile_step_ahead(self, compiler, leaves, self.stage_inputs(operands), grads)
            count = compiler.finish()
        self._early = None  # its programs are compiled, and held by the handlers that launch them
        wait_deferred()
        if jax.process_count() > 1:
            agree("pipeline/compiled_ahead", {"stages": len(self._kernels)}, list(range(jax.process_count())),
                  timeout_s=self.timeout_s, what="compiling the pipeline's programs before its first step")
        self.compiled_ahead = count
        return count

    # -- the step -------------------------------------------------------------

    def __call__(self, leaves: Sequence[Any], recorder: StepRecorder | None = None,
                 meter: LiveBytesMeter | None = None) -> list[Any]:
        """One step on the flattened arguments; ``recorder`` (made for ``self.program`` and
        ``self.mesh_local``) times the program's instructions, ``meter`` (made for
        ``self.mesh_devices``) samples the bytes held after each instruction.

        Raises:
          PeerLostError: a value another process was sending here failed in transit (that
            process exited, or the connection to it broke), naming both.
          CoordinationError: values other processes send here did not arrive within
            ``timeout_s``, naming the first and the processes that did not deliver.
        """
        arrivals: list[Arrival] = []
        self.compile_ahead(leaves)
        try:
            return self._step(leaves, recorder, meter, arrivals)
        except jax.errors.JaxRuntimeError as e:
            # The program's own transfers are named where they are waited for; this names the
            # moves around the pipeline, whose failures surface in what reads them.
            raise_lost_peer(e, arrivals, "pipeline transfers", "running a step")

    def _step(self, leaves: Sequence[Any], recorder: StepRecorder | None, meter: LiveBytesMeter | None,
              arrivals: list[Arrival]) -> list[Any]:
        """The step program, one handler per instruction; ``arrivals`` collects what other
        processes send here as it goes."""
        state = StepState(self.step_program, leaves, recorder, meter, arrivals)
        if meter is not None:
            meter.around(state.held)
        timed = recorder is not None and recorder.serialize
        for ins, run, ready in self._runs:
            start = time.perf_counter() if timed else 0.0
            run(self, ins, ready, state)
            if timed and not isinstance(ins, RunPipeline):
                # Serialized: the work around the pipeline, each instruction alone.
                wait_ready([a for a in jax.tree.leaves(state.held()) if isinstance(a, jax.Array) and not a.is_deleted()],
                           self.timeout_s, f"the serialized step (after: {ins})")
                recorder.outside_pipeline(time.perf_counter() - start)
            if meter is not None:
                meter.sample()
        for note in state.at_end:
            note(state)
        return state.outputs

    def stage_inputs(self, operands: dict[tuple[int, int], Any]) -> list[StageInputs | None]:
        """Per stage here, its operands as its programs take them (``StageKernel.fixed_operands``,
        then per micro-batch its ``batch_operands``); ``None`` for another process's stage."""
        out: list[StageInputs | None] = []
        for kernel, local in zip(self._kernels, self.local):
            if not local:
                out.append(None)
                continue
            s = kernel.stage
            fixed = tuple(operands[(s, o.position)] for o in kernel.fixed_operands)
            columns = [operands[(s, o.position)] for o in kernel.batch_operands]
            batch = tuple(tuple(c[m] for c in columns) for m in range(self.num_micro_batches)) if columns else ()
            out.append(StageInputs(fixed, batch))
        return out

    def operand_aval(self, stage: int, position: int) -> Any:
        """The type stage ``stage``'s program takes operand ``position`` as (one micro-batch's)."""
        return self._kernels[stage].in_avals[position]

    def accumulator_programs(self) -> list[Callable[[], list[list[jax.Array]]]]:
        """Per mesh here, the program making its stages' zero accumulators (``zero_grads``)."""
        return [make for _, make in self._accumulators]

    def zero_grads(self) -> list[list[jax.Array] | None]:
        """Per stage here, its gradient accumulators (``stage_kernel.Accumulator``), zero: made
        by one program per mesh (the step donates them, so each step makes its own)."""
        grads: list[list[jax.Array] | None] = [None] * len(self.executables)
        for stages, make in self._accumulators:
            for s, zeros in zip(stages, make()):
                grads[s] = zeros
        return grads


def _piece_aval(aval: Any, bounds: tuple[int, ...], p: int) -> jax.ShapeDtypeStruct:
    """Piece ``p`` of a leaf split at ``bounds``."""
    return jax.ShapeDtypeStruct((bounds[p + 1] - bounds[p], *aval.shape[1:]), aval.dtype)


def _accumulator_maker(plans: Sequence[Sequence[Any]]) -> Callable[[], list[list[jax.Array]]]:
    """One program making the zero accumulators of several stages of one mesh (per stage, its
    ``stage_kernel.Accumulator``s), each with its sharding."""
    shapes = [[(a.shape, a.dtype) for a in accumulators] for accumulators in plans]
    shardings = [[a.sharding for a in accumulators] for accumulators in plans]
    return jax.jit(lambda: [[jnp.zeros(shape, dtype) for shape, dtype in stage] for stage in shapes],
                   out_shardings=shardings)
