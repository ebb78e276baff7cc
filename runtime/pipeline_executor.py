"""Runs a compiled pipeline step: its step program (``passes.program.step_instructions``), one
handler per instruction kind, the pipeline program in its middle (``program_interpreter``).

The executable is built from what the compiler verified and nothing else: the step program,
whose every instruction carries what it needs (placements, one feed per stage operand, the moves
around the pipeline, the outputs' sources, the stacked leaves' splits and joins), the pipeline
program, the move table, and the stage kernels. Each move, stage program and helper program
is prepared once, at construction, so the hot path plans, compiles and looks up nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.passes import jax_ir
from meshpar.passes.program.batch_rows import GlobalBatchPlacement
from meshpar.passes.program.devices import device_key, planner_ids
from meshpar.passes.program.moves import MoveKey, MoveTable
from meshpar.passes.program.pipeline_instructions import PipelineProgram, ReduceGradients
from meshpar.passes.program.stage_kernel import StageKernel
from meshpar.passes.program.step_instructions import (
    AssembleOutputs, AwaitArrivals, CombineMicroBatches, FeedConstant, FeedValue, FetchParameter, FoldKey,
    JoinStackedLeaves, MoveMicroBatches, PlaceInputs, ReduceGradient, RunCompute, RunMove, RunPipeline, ShareOutputs,
    SliceMicroBatches, SplitStackedLeaves, StepProgram,
)
from meshpar.passes.program.step_values import AuxReduction, OuterKind, OuterRef
from meshpar.passes.program.wire_format import from_wire
from meshpar.runtime.compile_ahead import AheadOfTime, wait_deferred
from meshpar.runtime.coordination import (
    Arrival, agree, owns_a_device_of, raise_lost_peer, senders, wait_arrivals, wait_pending, wait_ready,
)
from meshpar.runtime.flat_values import flatten, unflatten
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.move_handlers import Move, prepare_move
from meshpar.runtime.placement import join, micro_batch_view, on_meshes, place, put
from meshpar.runtime.program_interpreter import ProgramInterpreter, ProgramRun, StageInputs
from meshpar.runtime.remote import absent
from meshpar.runtime.shared_outputs import OutputSharer
from meshpar.runtime.stacked_leaves import StackedLeaves
from meshpar.runtime.stage_executables import compile_stage, on_mesh
from meshpar.runtime.step_ahead import compile_step_ahead
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
        self.executables = [compile_stage(k, timeout_s) for k in kernels]
        self._kernels = tuple(kernels)
        # How many programs ``compile_ahead`` compiled; ``None`` until it has run.
        self.compiled_ahead: int | None = None
        # Per program.transfers entry, its prepared move.
        self.transfer_moves = tuple(self._move(t.move_key) for t in program.transfers)
        several = jax.process_count() > 1
        if several:
            # The transfer programs compile on the pool (``compile_ahead.deferred_compile``):
            # done before this process launches anything.
            wait_deferred()
            self._connect_meshes()
        reducers = {mesh: self._reducer(mesh, [kernels[s].accumulation for s in ins.stages])
                    for mesh, instructions in enumerate(program.instructions)
                    for ins in instructions if isinstance(ins, ReduceGradients)}
        self._interpreter = ProgramInterpreter(
            program, self.executables, self.transfer_moves, reducers, self.mesh_local, watch=several,
            launch_window=LAUNCH_WINDOW if several else None, timeout_s=timeout_s)
        # Per mesh here, its stages and the one program making their gradient accumulators.
        self._accumulators = []
        for mesh in range(len(self.meshes)):
            stages = [s for s, m in enumerate(self.home) if m == mesh and self.local[s]]
            if stages:
                self._accumulators.append(
                    (stages, _accumulator_maker([kernels[s].accumulation.accumulators for s in stages])))
        # What each step instruction runs, prepared once (by the instruction's identity).
        self._ready: dict[int, Any] = {}
        # Per CombineMicroBatches instruction (by id), its program on its mesh.
        self._combiners: dict[int, tuple[Callable, Callable | None]] = {}
        # The last step's outputs that live on one mesh, weakly (the caller owns them): per
        # output leaf, (the array, its mesh) or None; and, per input leaf, the output leaf whose
        # array, handed back as the next step's input, placing returned as it was (_place_inputs).
        self._returned: list[tuple[weakref.ref, int] | None] = []
        self._passes_through: dict[int, int] | None = None
        self._compute_fns: list[Callable] = []
        self.stacked_leaves: StackedLeaves | None = None
        self.peak_live_activations: list[int] = [0] * len(kernels)
        self.peak_weight_states: list[int] = [0] * len(kernels)
        preparers: dict[type, Callable[[Any], None]] = {
            SplitStackedLeaves: self._prepare_stacked,
            PlaceInputs: self._prepare_placing,
            RunCompute: self._prepare_compute,
            RunMove: self._prepare_move,
            FetchParameter: self._prepare_fetch,
            FeedConstant: self._prepare_constant,
            SliceMicroBatches: self._prepare_slicing,
            MoveMicroBatches: self._prepare_micro_batch_moves,
            ReduceGradient: self._prepare_gradient,
            ShareOutputs: self._prepare_sharing,
        }
        for ins in step:
            if type(ins) in preparers:
                preparers[type(ins)](ins)
        self._handlers: dict[type, Callable[[Any, _StepState], None]] = {
            SplitStackedLeaves: self._split_stacked,
            PlaceInputs: self._place_inputs,
            RunCompute: self._run_compute,
            RunMove: self._run_move,
            FetchParameter: self._fetch_parameter,
            FeedValue: self._feed_value,
            FeedConstant: self._feed_constant,
            FoldKey: self._fold_key,
            SliceMicroBatches: self._slice_micro_batches,
            MoveMicroBatches: self._move_micro_batches,
            RunPipeline: self._run_pipeline,
            CombineMicroBatches: self._combine_micro_batches,
            ReduceGradient: self._reduce_gradient,
            AwaitArrivals: self._await_arrivals,
            AssembleOutputs: self._assemble_outputs,
            ShareOutputs: self._share_outputs,
            JoinStackedLeaves: self._join_stacked,
        }
        # Checked here, once, so the step's hot path looks each handler up unchecked.
        unknown = sorted({type(ins).__name__ for ins in step if type(ins) not in self._handlers})
        if unknown:
            raise TypeError(f"step: instructions of kinds {unknown} have no handler in the pipeline executor")

    def _move(self, key: MoveKey) -> Move:
        """The prepared move of ``key``: one per distinct move, built at construction."""
        if key not in self._prepared:
            self._prepared[key] = prepare_move(self.moves.of(key), self.timeout_s)
        return self._prepared[key]

    # -- preparing the step's instructions ---------------------------------------

    def _prepare_stacked(self, ins: SplitStackedLeaves) -> None:
        self.stacked_leaves = StackedLeaves(ins.pieces, dict(ins.held), dict(ins.gathered), self._move)

    def _prepare_placing(self, ins: PlaceInputs) -> None:
        # Per global batch leaf placed by moves, its placement and its prepared moves.
        self._ready[id(ins)] = {p.leaf: (p, [self._move(k) for k in p.moves]) for p in ins.global_batches}

    def _prepare_compute(self, ins: RunCompute) -> None:
        fn = jax_ir.jaxpr_as_fun(ins.jaxpr)
        targets = ins.output_shardings

        def run(*args):
            outs = fn(*args)
            return [o if t is None else jax.lax.with_sharding_constraint(o, t) for o, t in zip(outs, targets)]

        self._ready[id(ins)] = on_mesh(jax.jit(run), self.meshes[ins.mesh], self.timeout_s)
        self._compute_fns.append(self._ready[id(ins)])

    def _prepare_move(self, ins: RunMove) -> None:
        move = self._move(ins.via.move_key)
        if not ins.unpacked:
            self._ready[id(ins)] = (move, None, None)
            return
        avals = [self.step_program.avals[r] for r in ins.values]
        # Packing relays values out over their mesh: collectives where it spans processes.
        self._ready[id(ins)] = (move, on_mesh(_packer(ins.via.src), ins.via.src.mesh, self.timeout_s),
                                on_mesh(_unpacker(avals, ins.unpacked), ins.unpacked[0].mesh, self.timeout_s))

    def _prepare_fetch(self, ins: FetchParameter) -> None:
        self._ready[id(ins)] = self._move(ins.via.move_key)

    def _prepare_constant(self, ins: FeedConstant) -> None:
        if self.local[ins.stage]:
            self._ready[id(ins)] = put(self.step_program.consts[ins.const], ins.sharding)

    def _prepare_slicing(self, ins: SliceMicroBatches) -> None:
        if self.local[ins.stage]:
            self._ready[id(ins)] = _slicer(ins.sharding, ins.num_micro_batches)

    def _prepare_micro_batch_moves(self, ins: MoveMicroBatches) -> None:
        # Every process joins each move of a global batch, whichever stage reads it.
        self._ready[id(ins)] = tuple(self._move(k) for k in ins.batch.moves)

    def _prepare_gradient(self, ins: ReduceGradient) -> None:
        if ins.move is not None:
            self._ready[id(ins)] = self._move(ins.move.move_key)

    def _prepare_sharing(self, ins: ShareOutputs) -> None:
        self._ready[id(ins)] = OutputSharer(ins)

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
        (``data_replicas.StageAccumulation.reduced``)."""

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
        """Executables compiled so far: constant across steps after the first."""
        return (sum(e.compiled_count() for e in self.executables)
                + sum(jax_ir.compiled_count(f.jitted) for f in self._compute_fns))

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
        inputs: list[StageInputs | None] = []
        grads: list[list[Any] | None] = []
        for kernel, local in zip(self._kernels, self.local):
            if not local:
                inputs.append(None)
                grads.append(None)
                continue
            avals = kernel.in_avals

            def shaped(o):
                return jax.ShapeDtypeStruct(avals[o.position].shape, avals[o.position].dtype, sharding=o.sharding)

            fixed = tuple(map(shaped, kernel.fixed_operands))
            batch = tuple(map(shaped, kernel.batch_operands))
            inputs.append(StageInputs(fixed, tuple(batch for _ in range(self.num_micro_batches)) if batch else ()))
            grads.append([jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                          for a in kernel.accumulation.accumulators])
        compiler = AheadOfTime()
        compile_step_ahead(self, compiler, leaves, inputs, grads)
        count = compiler.finish()
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
        state = _StepState(leaves, recorder, meter, arrivals)
        if meter is not None:
            meter.around(state.held)
        timed = recorder is not None and recorder.serialize
        for ins in self.step_program:
            start = time.perf_counter() if timed else 0.0
            self._handlers[type(ins)](ins, state)
            if timed and not isinstance(ins, RunPipeline):
                # Serialized: the work around the pipeline, each instruction alone.
                wait_ready([a for a in jax.tree.leaves(state.held()) if isinstance(a, jax.Array) and not a.is_deleted()],
                           self.timeout_s, f"the serialized step (after: {ins})")
                recorder.outside_pipeline(time.perf_counter() - start)
            if meter is not None:
                meter.sample()
        # Outputs that sharing or joining replaced are not the arrays assembled on their mesh.
        assembled = state.on_one_mesh
        self._returned = [(weakref.ref(out), assembled[j]) if j in assembled and out is state.assembled[j] else None
                          for j, out in enumerate(state.outputs)]
        return state.outputs

    # -- handlers -------------------------------------------------------------

    def _split_stacked(self, ins: SplitStackedLeaves, state: _StepState) -> None:
        state.leaves = self.stacked_leaves.split(state.leaves, self.timeout_s)

    def _join_stacked(self, ins: JoinStackedLeaves, state: _StepState) -> None:
        state.outputs = self.stacked_leaves.join(state.outputs, self.timeout_s)

    def _place_inputs(self, ins: PlaceInputs, state: _StepState) -> None:
        """Each input leaf on the meshes of its placement. A leaf that is the array the last step
        returned at an output that, handed back before, placing returned as it was (a train
        state passed back as the step returned it) is used as it is: one identity check instead
        of placing it."""
        moved, returned, passes = self._ready[id(ins)], self._returned, self._passes_through
        placed: list[dict[int, jax.Array]] = []
        for i, (v, p) in enumerate(zip(state.leaves, ins.placements)):
            j = passes.get(i) if passes is not None else None
            if j is not None and returned[j] is not None and returned[j][0]() is v:
                placed.append({returned[j][1]: v})
            elif i in moved:
                placed.append(self._place_global_batch(i, v, *moved[i], state))
            else:
                placed.append(place(v, p, f"step input leaf {i}"))
        if passes is None and returned:
            # Once, on the first step fed a previous step's outputs: where placing returned such
            # an array as it was, later steps skip placing it (deterministic: the same program
            # makes that output, laid out alike, every step).
            at = {id(r[0]()): j for j, r in enumerate(returned) if r is not None}
            self._passes_through = {}
            for i, (v, d) in enumerate(zip(state.leaves, placed)):
                j = at.get(id(v))
                if j is not None and returned[j][0]() is v and len(d) == 1 and d.get(returned[j][1]) is v:
                    self._passes_through[i] = j
        state.placed = placed

    def _place_global_batch(self, i: int, leaf: jax.Array, batch: GlobalBatchPlacement, moves: Sequence[Move],
                            state: _StepState) -> dict[int, jax.Array]:
        """Global batch leaf ``i`` on each mesh of its placement, by its planned moves (every
        process joins each); what other processes send here is awaited by what reads it."""
        if leaf.sharding != batch.source:
            raise ValueError(f"batch leaf {i}: laid out as {leaf.sharding}, but the step was compiled for "
                             f"{batch.source}")
        arrays = [move(leaf) for move in moves]
        meshes = batch.placement.meshes
        placed = on_meshes(arrays[0], batch.placement) if batch.union else dict(zip(meshes, arrays))
        sending = senders(batch.source)
        for m, array in placed.items():
            if sending and self.mesh_local[m]:
                arrival = Arrival(array, f"batch leaf {i} moved whole to mesh {m}", sending)
                state.arrivals.append(arrival)
                state.remote[(OuterRef(OuterKind.IN, i), m)] = arrival
        return placed

    def _run_compute(self, ins: RunCompute, state: _StepState) -> None:
        mesh = ins.mesh
        if self.mesh_local[mesh]:
            wait_pending(state.remote, [(r, mesh) for r in ins.inputs], self.timeout_s, "moves around the pipeline",
                         lambda: f"launching the program on mesh {mesh} that computes "
                                 f"{', '.join(map(str, ins.outputs))}")
            outs = self._ready[id(ins)](*[self._value(r, mesh, state) for r in ins.inputs])
            state.values.update({(ref, mesh): o for ref, o in zip(ins.outputs, outs)})

    def _run_move(self, ins: RunMove, state: _StepState) -> None:
        # Every process joins the move, whether or not it holds either end.
        via = ins.via
        move, pack, unpack = self._ready[id(ins)]
        if pack is None:
            moved = state.values[(ins.values[0], ins.dst)] = move(
                self._value(ins.values[0], ins.src, state, via.src))
            arrival = self._note_arrival(ins, moved, state.arrivals)
            if arrival is not None:
                state.remote[(ins.values[0], ins.dst)] = arrival
            return
        if self.mesh_local[ins.src]:
            vector = pack(*[self._value(r, ins.src, state) for r in ins.values])
        else:
            vector = absent(via.shape, via.dtype, via.src)
        moved = move(vector)
        arrival = self._note_arrival(ins, moved, state.arrivals)
        if self.mesh_local[ins.dst]:
            if arrival is not None:  # unpacking launches a program reading it
                wait_arrivals([arrival], self.timeout_s, "moves around the pipeline", f"unpacking {arrival.what}")
            state.values.update({(r, ins.dst): v for r, v in zip(ins.values, unpack(moved))})

    # Feeds: each fills one stage operand, ``state.operands[(stage, position)]`` (one value, or a
    # list of one per micro-batch); one that moves values runs on every process.

    def _fetch_parameter(self, ins: FetchParameter, state: _StepState) -> None:
        value = self._ready[id(ins)](state.placed[ins.leaf][ins.owner])
        self._feeding(value, ins.via.src, ins.stage, f"parameter in{ins.leaf} fetched", state)
        state.operands[(ins.stage, ins.position)] = value

    def _feed_value(self, ins: FeedValue, state: _StepState) -> None:
        if self.local[ins.stage]:
            state.operands[(ins.stage, ins.position)] = self._value(ins.value, ins.mesh, state)
            if (ins.value, ins.mesh) in state.remote:
                state.feeding.append(state.remote.pop((ins.value, ins.mesh)))

    def _feed_constant(self, ins: FeedConstant, state: _StepState) -> None:
        if self.local[ins.stage]:
            state.operands[(ins.stage, ins.position)] = self._ready[id(ins)]

    def _fold_key(self, ins: FoldKey, state: _StepState) -> None:
        if self.local[ins.stage]:
            wait_pending(state.remote, [(ins.key, ins.mesh)], self.timeout_s, "moves around the pipeline",
                         lambda: f"folding key {ins.key}")
            state.operands[(ins.stage, ins.position)] = _FOLD_ALL(self._value(ins.key, ins.mesh, state),
                                                                  ins.num_micro_batches)

    def _slice_micro_batches(self, ins: SliceMicroBatches, state: _StepState) -> None:
        if not self.local[ins.stage]:
            return
        if ins.unplaced:
            leaf = state.leaves[ins.value.index]
            on_devices = isinstance(leaf, jax.Array) and leaf.is_fully_addressable and jax.process_count() == 1
            leaf = leaf if on_devices else np.asarray(leaf)
        else:
            leaf = self._value(ins.value, ins.mesh, state)
        stacked = put(leaf.reshape(ins.num_micro_batches, ins.micro_batch_size, *leaf.shape[1:]), ins.stacked,
                      f"stage {ins.stage}'s operand {ins.position} ({ins.value})")
        state.operands[(ins.stage, ins.position)] = self._ready[id(ins)](stacked)

    def _move_micro_batches(self, ins: MoveMicroBatches, state: _StepState) -> None:
        batch = ins.batch
        leaf = state.leaves[batch.leaf]
        if leaf.sharding != batch.source:
            raise ValueError(f"batch leaf {batch.leaf}: laid out as {leaf.sharding}, but the step "
                             f"was compiled for {batch.source}")
        column = [move(micro_batch_view(leaf, rows, ins.micro_batch_size))
                  for rows, move in zip(batch.rows, self._ready[id(ins)])]
        for m, (rows, moved) in enumerate(zip(batch.rows, column)):
            self._feeding(moved, rows.sharding, ins.stage, f"micro-batch {m} of batch leaf {batch.leaf}", state)
        state.operands[(ins.stage, ins.position)] = column

    def _run_pipeline(self, ins: RunPipeline, state: _StepState) -> None:
        # The stages' fetched parameters and micro-batches other processes send here, arrived
        # before any stage program reading them is launched (``coordination.wait_pending`` says why).
        if state.feeding:
            wait_arrivals(state.feeding, self.timeout_s, "stage operands", "starting the pipeline")
        state.inputs = self._stage_inputs(state.operands)
        state.run = self._interpreter.run(state.inputs, self._zero_grads(), state.recorder, state.meter)
        state.arrivals += state.run.arriving
        self.peak_live_activations = state.run.peak_live_activations
        self.peak_weight_states = state.run.peak_weight_states

    def _combine_micro_batches(self, ins: CombineMicroBatches, state: _StepState) -> None:
        if not self.mesh_local[ins.mesh]:
            return
        parts = [state.run.results[b] for b in ins.buffers]
        combine, relay = self._combiner_for(ins, len(parts))
        combined = from_wire(combine(parts), ins.aval)
        state.values[(ins.value, ins.mesh)] = combined if relay is None else relay(combined)

    def _combiner_for(self, ins: CombineMicroBatches, count: int) -> tuple[Callable, Callable | None]:
        """The program combining ``count`` micro-batches' values of ``ins`` on its mesh, and the
        one relaying the result out over it (``None``: none), made once (and compiled ahead)."""
        if id(ins) not in self._combiners:
            mesh = self.meshes[ins.mesh]
            # Relaying the combined value out over its mesh is a program of its own (collectives
            # where the mesh spans processes), launched as every program on the mesh is.
            relay = None if ins.sharding is None else on_mesh(jax.jit(lambda x: x, out_shardings=ins.sharding), mesh,
                                                              self.timeout_s)
            self._combiners[id(ins)] = (on_mesh(_combiner(ins.how, count, ins.per_replica), mesh, self.timeout_s),
                                        relay)
        return self._combiners[id(ins)]

    def _reduce_gradient(self, ins: ReduceGradient, state: _StepState) -> None:
        grads = state.run.grads[ins.stage]
        g = grads[ins.position] if grads is not None else absent(ins.aval.shape, ins.aval.dtype, ins.sharding)
        key = (OuterRef(OuterKind.GRAD, ins.param), ins.mesh)
        if ins.move is not None:
            g = self._ready[id(ins)](g)
            sending = senders(ins.sharding)
            if sending and self.mesh_local[ins.mesh]:
                arrival = Arrival(g, f"{ins}", sending)
                state.arrivals.append(arrival)
                if key in state.values:  # the sum launches a program reading it
                    wait_arrivals([arrival], self.timeout_s, "gradients moved home", f"adding {ins}")
                else:
                    state.remote[key] = arrival
        state.values[key] = g if key not in state.values or not self.mesh_local[ins.mesh] else state.values[key] + g

    def _await_arrivals(self, ins: AwaitArrivals, state: _StepState) -> None:
        if state.run.arriving:
            wait_arrivals(state.run.arriving, self.timeout_s, "pipeline transfers",
                          "waiting for them at the end of a step")

    def _assemble_outputs(self, ins: AssembleOutputs, state: _StepState) -> None:
        results = []
        on_one_mesh: dict[int, int] = {}
        for j, source in enumerate(ins.outputs):
            ref = source.ref
            if ref.kind is OuterKind.LITERAL:
                results.append(jnp.asarray(source.literal, self.out_avals[j].dtype))
            elif ref.kind is OuterKind.CONST:
                results.append(self.step_program.consts[ref.index])
            elif ref.kind is OuterKind.IN:
                arrays = state.placed[ref.index]
                if not arrays:  # a batch leaf returned as it came
                    results.append(state.leaves[ref.index])
                elif len(arrays) == 1:
                    results.append(next(iter(arrays.values())))
                else:
                    ms = sorted(arrays)
                    results.append(join([arrays[m] for m in ms], source.placed_as.union, arrays[ms[0]].shape,
                                        arrays[ms[0]].dtype))
            elif len(source.meshes) == 1:
                results.append(self._value(ref, source.meshes[0], state, source.shardings[0]))
                on_one_mesh[j] = source.meshes[0]
            else:
                aval = self.out_avals[j]
                results.append(join([state.values[(ref, m)] for m in source.meshes if (ref, m) in state.values],
                                    source.union, aval.shape, aval.dtype))
        state.outputs = state.assembled = results
        state.on_one_mesh = on_one_mesh

    def _share_outputs(self, ins: ShareOutputs, state: _StepState) -> None:
        state.outputs, arriving = self._ready[id(ins)](state.outputs)
        if arriving:
            wait_arrivals(arriving, self.timeout_s, "shared outputs", "receiving this step's shared outputs")

    # -- values ---------------------------------------------------------------

    def _value(self, ref: OuterRef, mesh: int, state: _StepState, stand_in: NamedSharding | None = None) -> Any:
        """``ref`` on ``mesh``, where the step put it; on another process's mesh, an array with no
        shards here laid out as ``stand_in`` (the sharding of what reads it)."""
        if ref.kind is OuterKind.IN:
            arrays = state.placed[ref.index]
            return arrays[mesh] if mesh in arrays else next(iter(arrays.values()))
        if ref.kind is OuterKind.CONST:
            return self.step_program.consts[ref.index]
        if (ref, mesh) in state.values:
            return state.values[(ref, mesh)]
        aval = self.step_program.avals[ref]
        return absent(aval.shape, aval.dtype, stand_in)

    @staticmethod
    def _note_arrival(ins: RunMove, moved: jax.Array, arrivals: list[Arrival]) -> Arrival | None:
        """Adds ``moved`` to ``arrivals`` when other processes send it here, and returns it."""
        sending = senders(ins.via.src)
        if owns_a_device_of(ins.via.dst.mesh) and sending:
            names = ", ".join(map(str, ins.values))
            arrivals.append(Arrival(moved, f"{names} moved from mesh {ins.src} to mesh {ins.dst}", sending))
            return arrivals[-1]
        return None

    def _feeding(self, value: jax.Array, source: NamedSharding, stage: int, what: str, state: _StepState) -> None:
        """Notes ``value``, an operand of ``stage`` moved from ``source``, when it is this process's
        and other processes send it: the pipeline starts once it has arrived."""
        sending = senders(source)
        if sending and self.local[stage]:
            state.feeding.append(Arrival(value, f"{what} for stage {stage}", sending))


    def _stage_inputs(self, operands: dict[tuple[int, int], Any]) -> list[StageInputs | None]:
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

    def _zero_grads(self) -> list[list[jax.Array] | None]:
        """Per stage here, its gradient accumulators (``data_replicas.Accumulator``), zero: made
        by one program per mesh (the step donates them, so each step makes its own)."""
        grads: list[list[jax.Array] | None] = [None] * len(self.executables)
        for stages, make in self._accumulators:
            for s, zeros in zip(stages, make()):
                grads[s] = zeros
        return grads


@dataclasses.dataclass
class _StepState:
    """What one step has made so far: the placed inputs, the values computed or moved around the
    pipeline (``(ref, mesh)`` -> array), the stages' inputs, the pipeline's run, the outputs."""

    leaves: Sequence[Any]
    recorder: StepRecorder | None
    meter: LiveBytesMeter | None
    arrivals: list[Arrival]
    placed: list[dict[int, jax.Array]] = dataclasses.field(default_factory=list)
    values: dict[tuple[OuterRef, int], jax.Array] = dataclasses.field(default_factory=dict)
    # Per (stage, position), the operand a feed made: one value, or one per micro-batch.
    operands: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)
    inputs: list[StageInputs | None] = dataclasses.field(default_factory=list)
    run: ProgramRun | None = None
    outputs: list[Any] = dataclasses.field(default_factory=list)
    # The outputs as assembled, and which of them are one mesh's array (by output leaf: the mesh).
    assembled: list[Any] = dataclasses.field(default_factory=list)
    on_one_mesh: dict[int, int] = dataclasses.field(default_factory=dict)
    # Values other processes send here, by (ref, mesh), until a program reading them waited.
    remote: dict[tuple[OuterRef, int], Arrival] = dataclasses.field(default_factory=dict)
    # Stage operands other processes send here (fetches, micro-batches), awaited before the pipeline.
    feeding: list[Arrival] = dataclasses.field(default_factory=list)

    def held(self) -> list[Any]:
        """Every array (or nested list of arrays) this step holds outside the pipeline program."""
        held: list[Any] = [list(self.leaves), [list(p.values()) for p in self.placed], list(self.values.values()),
                           list(self.operands.values()), self.outputs]
        if self.run is not None:
            held += [list(self.run.results.values()), self.run.grads]
        return held


@functools.lru_cache(maxsize=None)
def _combiner(how: AuxReduction, count: int, per_replica: bool) -> Callable[[list[jax.Array]], jax.Array]:
    """One program combining ``count`` micro-batches' values as ``how`` says (each first over its
    replicas, with ``per_replica``)."""

    def combine(parts: list[jax.Array]) -> jax.Array:
        if per_replica:
            parts = [_combine_leading(part, how) for part in parts]
        return _combine(parts, how)

    return jax.jit(combine)


def _combine(parts: Sequence[jax.Array], how: AuxReduction) -> jax.Array:
    """Per-micro-batch values of one result combined as ``how`` says, on their mesh."""
    if how is AuxReduction.LAST:
        return parts[-1]
    if how is AuxReduction.CONCAT:
        return jnp.concatenate(parts, axis=0)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total / len(parts) if how is AuxReduction.MEAN else total


def _combine_leading(values: jax.Array, how: AuxReduction) -> jax.Array:
    """One value per replica (the leading dimension) combined as ``how`` combines micro-batches'."""
    if how is AuxReduction.LAST:
        return values[-1]
    return values.mean(0) if how is AuxReduction.MEAN else values.sum(0)


def _piece_aval(aval: Any, bounds: tuple[int, ...], p: int) -> jax.ShapeDtypeStruct:
    """Piece ``p`` of a leaf split at ``bounds``."""
    return jax.ShapeDtypeStruct((bounds[p + 1] - bounds[p], *aval.shape[1:]), aval.dtype)


def _packer(sharding: NamedSharding) -> Callable:
    """Values of one dtype, flattened into one vector with ``sharding`` (on their mesh)."""
    return jax.jit(lambda *xs: flatten(xs), out_shardings=sharding)


def _unpacker(avals: Sequence[Any], shardings: Sequence[NamedSharding]) -> Callable:
    """A packed vector back into values shaped ``avals``, each with its sharding."""
    return jax.jit(lambda v: unflatten(v, avals), out_shardings=list(shardings))


def _accumulator_maker(plans: Sequence[Sequence[Any]]) -> Callable[[], list[list[jax.Array]]]:
    """One program making the zero accumulators of several stages of one mesh (per stage, its
    ``data_replicas.Accumulator``s), each with its sharding."""
    shapes = [[(a.shape, a.dtype) for a in accumulators] for accumulators in plans]
    shardings = [[a.sharding for a in accumulators] for accumulators in plans]
    return jax.jit(lambda: [[jnp.zeros(shape, dtype) for shape, dtype in stage] for stage in shapes],
                   out_shardings=shardings)


def _slicer(sharding: NamedSharding, num_micro_batches: int) -> Callable:
    """One program cutting a value shaped ``[M, micro-batch, ...]`` (each micro-batch already where
    the stage reads it) into the M micro-batches, each laid out as ``sharding``."""
    return jax.jit(lambda x: [x[m] for m in range(num_micro_batches)], out_shardings=[sharding] * num_micro_batches)


def _fold_all(key: jax.Array, num_micro_batches: int) -> list[jax.Array]:
    """``key`` folded with each micro-batch index: micro-batch ``m`` draws from ``fold_in(key, m)``."""
    return [jax.random.fold_in(key, m) for m in range(num_micro_batches)]


_FOLD_ALL = jax.jit(_fold_all, static_argnums=1)
