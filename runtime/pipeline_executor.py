"""Runs a compiled pipeline step: its step program (``passes.pipeline.step_program``), one
handler per instruction kind, the pipeline program in its middle (``program_interpreter``).

Everything here was decided when the pipeline compiled: where each value lives
(``passes.pipeline.step_layout``), how micro-batches combine and where each gradient is
reduced (``step_program``), what runs on each mesh in which order (``pipeline_program``) and
how each value moves (``plan_moves``). Each move is prepared once, at construction, so the
hot path plans, compiles and looks up nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from meshpar.passes import jax_ir
from meshpar.passes.model.devices import device_key, planner_ids
from meshpar.passes.pipeline.edge_transfer import Direction, MoveKey
from meshpar.passes.pipeline.micro_batching import AuxReduction
from meshpar.passes.pipeline.pipeline_passes import CompiledPipeline
from meshpar.passes.pipeline.pipeline_program import ReduceGradients
from meshpar.passes.pipeline.step_program import (
    AssembleOutputs, AwaitArrivals, CombineMicroBatches, FeedStages, PlaceInputs, ReduceGradient, RunCompute, RunMove,
    RunPipeline,
)
from meshpar.passes.pipeline.step_split import OuterCompute, OuterKind, OuterMove, OuterRef
from meshpar.passes.pipeline.wire_format import from_wire
from meshpar.runtime.coordination import (Arrival, owns_a_device_of, raise_lost_peer, senders, wait_arrivals,
                                         wait_ready)
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.move_handlers import Move, prepare_move
from meshpar.runtime.placement import join, place, put
from meshpar.runtime.program_interpreter import ProgramInterpreter, ProgramRun, StageInputs
from meshpar.runtime.remote import absent
from meshpar.runtime.stacked_leaves import StackedLeaves
from meshpar.runtime.stage_executables import compile_stage, on_mesh
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["LAUNCH_WINDOW", "PipelineExecutable"]

# Unfinished launches a process keeps in flight with several processes
# (``ProgramInterpreter``'s launch_window): enough to run ahead into the next
# micro-batches, well under what XLA's CPU client holds before it blocks.
LAUNCH_WINDOW = 8


class PipelineExecutable:
    """A traced, split, scheduled and lowered train step, ready to run.

    Args:
      compiled: every IR the compiler made (``passes.pipeline.pipeline_passes.CompiledPipeline``):
        the step program this runs, the pipeline program in its middle, the stages' parts, the
        layout and the planned moves (each prepared once, here, by its executor's handler).
      out_tree, out_avals: the step's output treedef, shapes and dtypes.
      timeout_s: how long a process waits, at the end of a step, for values
        other processes send it (multi-process runs only).
      description: what ``describe()`` returns (``passes.pipeline.describe_pipeline``).
    """

    def __init__(
        self,
        compiled: CompiledPipeline,
        out_tree: Any,
        out_avals: Sequence[Any],
        timeout_s: float = 120.0,
        description: str = "",
    ) -> None:
        graph, split, layout, program = compiled.graph, compiled.split, compiled.layout, compiled.program
        parts, meshes, moves, micro_batching = compiled.parts, compiled.meshes, compiled.moves, compiled.micro_batching
        step_program, micro_batch_size = compiled.step, compiled.micro_batch_size
        self.graph, self.split, self.layout, self.program = graph, split, layout, program
        self.step_program = step_program
        self.description = description
        self.schedule = program.schedule
        self.meshes = tuple(meshes)
        # Ids distinct across platforms: the meshes may be on a GPU and on the host.
        self.device_ids = planner_ids(*(m.devices.flat for m in self.meshes))
        self.mesh_devices = tuple(tuple(self.device_ids[device_key(d)] for d in m.devices.flat) for m in self.meshes)
        self.home = program.schedule.stage_mesh
        self.stage_meshes = tuple(self.meshes[m] for m in self.home)
        self.num_micro_batches = program.schedule.num_micro_batches
        self.micro_batch_size = micro_batch_size
        self.out_tree = out_tree
        pieces = compiled.leaf_pieces
        self.out_avals = tuple(out_avals) if pieces is None else tuple(
            out_avals[j] if p is None else _piece_aval(out_avals[j], pieces.outputs[j], p)
            for j, p in pieces.piece_outputs())
        self.timeout_s = timeout_s
        self.micro_batching = micro_batching
        # Per mesh (a mesh may host several stages), and per stage: whether a device of it is
        # this process's.
        self.mesh_local = [owns_a_device_of(m) for m in self.meshes]
        self.local = [self.mesh_local[m] for m in self.home]
        self.moves = moves
        self._prepared: dict[MoveKey, Move] = {}
        in_ct = {t.edge: t.src for t in program.transfers if t.direction is Direction.COTANGENT}
        self.executables = [
            compile_stage(
                stage, parts[stage.index], program.stages[stage.index], layout.stage_operands[stage.index],
                compiled.stage_output_shardings[stage.index],
                [in_ct[e] for e in program.stages[stage.index].cotangent_in_edges],
                self.stage_meshes[stage.index], micro_batching.loss_seed,
                compiled.gradients.stages[stage.index],
            )
            for stage in graph.stages
        ]
        self.gradients = compiled.gradients
        self.edges = graph.edges()
        # Per program.transfers entry, its prepared move.
        self.transfer_moves = tuple(self._move(t.move_key) for t in program.transfers)
        several = jax.process_count() > 1
        if several:
            self._connect_meshes()
        reducers = {mesh: self._reducer(mesh, ins.stages) for mesh, instructions in enumerate(program.instructions)
                    for ins in instructions if isinstance(ins, ReduceGradients)}
        self._interpreter = ProgramInterpreter(
            program, self.executables, self.transfer_moves, reducers, self.mesh_local, watch=several,
            launch_window=LAUNCH_WINDOW if several else None, timeout_s=timeout_s)
        self._fetches = {(s, op.position): self._move(op.fetch.move_key)
                         for s, ops in enumerate(layout.stage_operands) for op in ops if op.fetch}
        # Per ReduceGradient instruction with a move (by identity, as the step program holds it),
        # the move of its gradient to the owner's mesh.
        self._gradient_moves = {id(ins): self._move(ins.move.move_key) for ins in step_program
                                if isinstance(ins, ReduceGradient) and ins.move is not None}
        self._outer_moves = {mv: self._move(vm.move_key) for mv, vm in layout.outer_moves.items()}
        # Stacked leaves held as per-stage pieces: split on the way in, joined on the way out.
        self.stacked_leaves = None if pieces is None else StackedLeaves(
            pieces, compiled.stacked_arrays, compiled.gathered_arrays, self._move)
        # Per move around the pipeline, the other processes sending it (to name them if it fails).
        self._outer_senders = {mv: senders(vm.src) for mv, vm in layout.outer_moves.items()}
        self._consts = {(s, op.position): put(split.consts[op.source.index], op.sharding)
                        for s, ops in enumerate(layout.stage_operands) for op in ops
                        if op.source.kind is OuterKind.CONST and self.local[s]}
        self._compute_fns = {id(c): self._compile_compute(c) for c in (*split.before, *split.after)
                             if isinstance(c, OuterCompute)}
        self._folds = {s: jax.jit(_fold_all, static_argnums=1) for s in range(graph.num_stages)}
        # Per per-micro-batch operand of a stage here: the sharding its whole value is placed
        # with (micro-batches leading, each laid out as the stage reads it) and the program
        # cutting it into the micro-batches.
        self._slicers = {(s, op.position): _slicer(op.sharding, self.num_micro_batches)
                         for s, ops in enumerate(layout.stage_operands) if self.local[s]
                         for op in ops if op.per_micro_batch and not op.fold_key}
        # Per mesh here, its stages and the one program making their gradient accumulators.
        self._accumulators = []
        for mesh in range(len(self.meshes)):
            stages = [s for s, m in enumerate(self.home) if m == mesh and self.local[s]]
            if stages:
                plans = [compiled.gradients.stages[s].accumulators for s in stages]
                self._accumulators.append((stages, _accumulator_maker(plans)))
        packed = [mv for mv in split.moved() if len(mv.values) > 1]
        self._packs = {mv: _packer(layout.outer_moves[mv].src) for mv in packed}
        self._unpacks = {mv: _unpacker([split.avals[r] for r in mv.values],
                                       [layout.value_shardings[(r, mv.dst)] for r in mv.values]) for mv in packed}
        # Per stage, the most micro-batches whose forward residuals were alive
        # at once during the last step (what the schedule costs in memory), and
        # the most weight passes waiting at once; 0 on other processes' meshes.
        self.peak_live_activations: list[int] = [0] * graph.num_stages
        self.peak_weight_states: list[int] = [0] * graph.num_stages
        self._handlers: dict[type, Callable[[Any, _StepState], None]] = {
            PlaceInputs: self._place_inputs,
            RunCompute: self._run_compute,
            RunMove: self._run_move,
            FeedStages: self._feed_stages,
            RunPipeline: self._run_pipeline,
            CombineMicroBatches: self._combine_micro_batches,
            ReduceGradient: self._reduce_gradient,
            AwaitArrivals: self._await_arrivals,
            AssembleOutputs: self._assemble_outputs,
        }

    def _move(self, key: MoveKey) -> Move:
        """The prepared move of ``key``: one per distinct move, built at construction."""
        if key not in self._prepared:
            self._prepared[key] = prepare_move(self.moves.of(key), self.timeout_s)
        return self._prepared[key]

    def _compile_compute(self, compute: OuterCompute) -> Callable:
        fn = jax_ir.jaxpr_as_fun(compute.jaxpr)
        targets = [self.layout.value_shardings.get((ref, compute.mesh)) for ref in compute.outputs]

        def run(*args):
            outs = fn(*args)
            return [o if t is None else jax.lax.with_sharding_constraint(o, t) for o, t in zip(outs, targets)]

        return on_mesh(jax.jit(run), self.meshes[compute.mesh])

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
                            mesh)(ones) for axes in [*range(ones.ndim), None]]
            wait_ready(sums, self.timeout_s, f"connecting the devices of mesh {dict(mesh.shape)} across processes")

    def _reducer(self, mesh: int, stages: Sequence[int]) -> Callable:
        """``stages``' accumulators reduced on ``mesh``: replicas' partial sums summed
        over the data axis (one all-reduce for all of them), each cast to its parameter's dtype
        and laid out as its gradient is read (``data_replicas.StageAccumulation.reduced``)."""
        plans = [self.gradients.stages[s] for s in stages]

        def reduce_gradients(grads):
            return [[(g.sum(0) if plan.replicas is not None else g).astype(dtype) for g, (_, dtype) in
                     zip(accumulators, plan.reduced)] for accumulators, plan in zip(grads, plans)]

        shardings = [[sharding for sharding, _ in plan.reduced] for plan in plans]
        # Not donated: a (D, *param) accumulator cannot hold its (*param) sum, and the step drops
        # the accumulators right after.
        return on_mesh(jax.jit(reduce_gradients, out_shardings=shardings), self.meshes[mesh])

    def describe(self) -> str:
        """Stages, meshes, shardings, each move's executor and plan, and the schedule."""
        return self.description

    def compiled_count(self) -> int:
        """Executables compiled so far: constant across steps after the first."""
        return (sum(e.compiled_count() for e in self.executables)
                + sum(jax_ir.compiled_count(f.jitted) for f in self._compute_fns.values()))

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
        try:
            if self.stacked_leaves is None:
                return self._step(leaves, recorder, meter, arrivals)
            outputs = self._step(self.stacked_leaves.split(leaves, self.timeout_s), recorder, meter, arrivals)
            return self.stacked_leaves.join(outputs, self.timeout_s)
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
                jax.block_until_ready([a for a in jax.tree.leaves(state.held())
                                       if isinstance(a, jax.Array) and not a.is_deleted()])
                recorder.outside_pipeline(time.perf_counter() - start)
            if meter is not None:
                meter.sample()
        return state.outputs

    # -- handlers -------------------------------------------------------------

    def _place_inputs(self, ins: PlaceInputs, state: _StepState) -> None:
        state.placed = [place(v, p) for v, p in zip(state.leaves, self.layout.in_placements)]

    def _run_compute(self, ins: RunCompute, state: _StepState) -> None:
        compute = ins.compute
        if self.mesh_local[compute.mesh]:
            outs = self._compute_fns[id(compute)](*[self._value(r, compute.mesh, state) for r in compute.inputs])
            state.values.update({(ref, compute.mesh): o for ref, o in zip(compute.outputs, outs)})

    def _run_move(self, ins: RunMove, state: _StepState) -> None:
        # Every process joins the move, whether or not it holds either end.
        step, vm = ins.move, self.layout.outer_moves[ins.move]
        move = self._outer_moves[step]
        if len(step.values) == 1:
            moved = state.values[(step.values[0], step.dst)] = move(
                self._value(step.values[0], step.src, state, vm.src))
            self._note_arrival(step, moved, state.arrivals)
            return
        if self.mesh_local[step.src]:
            vector = self._packs[step](*[self._value(r, step.src, state) for r in step.values])
        else:
            vector = absent(vm.shape, vm.dtype, vm.src)
        moved = move(vector)
        self._note_arrival(step, moved, state.arrivals)
        if self.mesh_local[step.dst]:
            state.values.update({(r, step.dst): v for r, v in zip(step.values, self._unpacks[step](moved))})

    def _feed_stages(self, ins: FeedStages, state: _StepState) -> None:
        state.inputs = self._stage_inputs(state)

    def _run_pipeline(self, ins: RunPipeline, state: _StepState) -> None:
        state.run = self._interpreter.run(state.inputs, self._zero_grads(), state.recorder, state.meter)
        state.arrivals += state.run.arriving
        self.peak_live_activations = state.run.peak_live_activations
        self.peak_weight_states = state.run.peak_weight_states

    def _combine_micro_batches(self, ins: CombineMicroBatches, state: _StepState) -> None:
        if not self.mesh_local[ins.mesh]:
            return
        parts = [state.run.results[b] for b in ins.buffers]
        combined = from_wire(_combiner(ins.how, len(parts), ins.per_replica)(parts), ins.aval)
        state.values[(ins.value, ins.mesh)] = combined if ins.sharding is None else jax.device_put(combined,
                                                                                                   ins.sharding)

    def _reduce_gradient(self, ins: ReduceGradient, state: _StepState) -> None:
        grads = state.run.grads[ins.stage]
        g = grads[ins.position] if grads is not None else absent(ins.aval.shape, ins.aval.dtype, ins.sharding)
        if ins.move is not None:
            g = self._gradient_moves[id(ins)](g)
        key = (OuterRef(OuterKind.GRAD, ins.param), ins.mesh)
        state.values[key] = g if key not in state.values or not self.mesh_local[ins.mesh] else state.values[key] + g

    def _await_arrivals(self, ins: AwaitArrivals, state: _StepState) -> None:
        if state.run.arriving:
            wait_arrivals(state.run.arriving, self.timeout_s, "pipeline transfers", "waiting for them at the end of a step")

    def _assemble_outputs(self, ins: AssembleOutputs, state: _StepState) -> None:
        results = []
        for j, (ref, meshes) in enumerate(self.split.outputs):
            if ref.kind is OuterKind.LITERAL:
                results.append(jnp.asarray(self.split.literals[j], self.out_avals[j].dtype))
            elif ref.kind is OuterKind.CONST:
                results.append(self.split.consts[ref.index])
            elif ref.kind is OuterKind.IN:
                arrays = state.placed[ref.index]
                if not arrays:  # a batch leaf returned as it came
                    results.append(state.leaves[ref.index])
                elif len(arrays) == 1:
                    results.append(next(iter(arrays.values())))
                else:
                    ms = sorted(arrays)
                    placement = self.layout.in_placements[ref.index]
                    results.append(join([arrays[m] for m in ms], [placement.on(m) for m in ms],
                                        arrays[ms[0]].shape, arrays[ms[0]].dtype))
            elif len(meshes) == 1:
                results.append(self._value(ref, meshes[0], state, ins.shardings[j][0]))
            else:
                aval = self.out_avals[j]
                results.append(join([state.values[(ref, m)] for m in meshes if (ref, m) in state.values],
                                    ins.shardings[j], aval.shape, aval.dtype))
        state.outputs = results

    # -- values ---------------------------------------------------------------

    def _value(self, ref: OuterRef, mesh: int, state: _StepState, stand_in: NamedSharding | None = None) -> Any:
        """``ref`` on ``mesh``, where the layout put it; on another process's mesh, an array with no
        shards here laid out as ``stand_in`` (the sharding of what reads it)."""
        if ref.kind is OuterKind.IN:
            arrays = state.placed[ref.index]
            return arrays[mesh] if mesh in arrays else next(iter(arrays.values()))
        if ref.kind is OuterKind.CONST:
            return self.split.consts[ref.index]
        if (ref, mesh) in state.values:
            return state.values[(ref, mesh)]
        aval = self.split.avals[ref]
        return absent(aval.shape, aval.dtype, stand_in)

    def _note_arrival(self, step: OuterMove, moved: jax.Array, arrivals: list[Arrival]) -> None:
        """Adds ``moved`` to ``arrivals`` when other processes send it here."""
        if self.mesh_local[step.dst] and self._outer_senders[step]:
            names = ", ".join(map(str, step.values))
            arrivals.append(Arrival(moved, f"{names} moved from mesh {step.src} to mesh {step.dst}",
                                    self._outer_senders[step]))

    def _stage_inputs(self, state: _StepState) -> list[StageInputs | None]:
        """Each stage's operands: placed leaves, constants and values computed before the pipeline,
        fetched parameters, micro-batch slices sent straight from where the batch is to the stage
        that reads them, and keys folded with each micro-batch's index."""
        placed, leaves = state.placed, state.leaves
        size, M = self.micro_batch_size, self.num_micro_batches
        batches = {}
        for i, leaf in enumerate(leaves):
            if not self.layout.in_placements[i].meshes:
                on_devices = isinstance(leaf, jax.Array) and leaf.is_fully_addressable and jax.process_count() == 1
                batches[i] = leaf if on_devices else np.asarray(leaf)
        out: list[StageInputs | None] = []
        for s, ops in enumerate(self.layout.stage_operands):
            fixed = []
            for op in ops:
                if op.per_micro_batch:
                    continue
                if op.fetch is not None:
                    # Every process joins the move, whether or not it owns stage s.
                    owner = self.layout.in_placements[op.source.index].meshes[0]
                    fixed.append(self._fetches[(s, op.position)](placed[op.source.index][owner]))
                elif not self.local[s]:
                    continue
                elif op.source.kind is OuterKind.CONST:
                    fixed.append(self._consts[(s, op.position)])
                else:
                    fixed.append(self._value(op.source, self.home[s], state))
            if not self.local[s]:
                out.append(None)
                continue
            per_mb = [op for op in ops if op.per_micro_batch]
            columns = []
            for op in per_mb:
                if op.fold_key:
                    columns.append(self._folds[s](self._value(op.source, self.home[s], state), M))
                    continue
                if op.source.kind is OuterKind.IN and op.source.index in batches:
                    leaf = batches[op.source.index]
                else:
                    leaf = self._value(op.source, self.home[s], state)
                # The whole value placed once, micro-batch-major, then cut by one program.
                stacked, unstack = self._slicers[(s, op.position)]
                columns.append(unstack(put(leaf.reshape(M, size, *leaf.shape[1:]), stacked)))
            batch = tuple(tuple(c[m] for c in columns) for m in range(M)) if per_mb else ()
            out.append(StageInputs(tuple(fixed), batch))
        return out

    def _zero_grads(self) -> list[list[jax.Array] | None]:
        """Per stage here, its gradient accumulators (``data_replicas.Accumulator``), zero: made
        by one program per mesh (the step donates them, so each step makes its own)."""
        grads: list[list[jax.Array] | None] = [None] * len(self.gradients.stages)
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
    inputs: list[StageInputs | None] = dataclasses.field(default_factory=list)
    run: ProgramRun | None = None
    outputs: list[Any] = dataclasses.field(default_factory=list)

    def held(self) -> list[Any]:
        """Every array (or nested list of arrays) this step holds outside the pipeline program."""
        held: list[Any] = [list(self.leaves), [list(p.values()) for p in self.placed], list(self.values.values()),
                           [(i.fixed, i.batch) for i in self.inputs if i is not None], self.outputs]
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
    return jax.jit(lambda *xs: jnp.concatenate([jnp.ravel(x) for x in xs]), out_shardings=sharding)


def _unpacker(avals: Sequence[Any], shardings: Sequence[NamedSharding]) -> Callable:
    """A packed vector back into values shaped ``avals``, each with its sharding."""
    sizes = np.cumsum([int(np.prod(a.shape, dtype=np.int64)) for a in avals])[:-1]
    return jax.jit(lambda v: [part.reshape(a.shape) for part, a in zip(jnp.split(v, sizes), avals)],
                   out_shardings=list(shardings))


def _accumulator_maker(plans: Sequence[Sequence[Any]]) -> Callable[[], list[list[jax.Array]]]:
    """One program making the zero accumulators of several stages of one mesh (per stage, its
    ``data_replicas.Accumulator``s), each with its sharding."""
    shapes = [[(a.shape, a.dtype) for a in accumulators] for accumulators in plans]
    shardings = [[a.sharding for a in accumulators] for accumulators in plans]
    return jax.jit(lambda: [[jnp.zeros(shape, dtype) for shape, dtype in stage] for stage in shapes],
                   out_shardings=shardings)


def _slicer(sharding: NamedSharding, num_micro_batches: int) -> tuple[NamedSharding, Callable]:
    """For a per-micro-batch operand read with ``sharding``: the sharding of its whole value
    shaped ``[M, micro-batch, ...]`` (each micro-batch already where the stage reads it), and
    one program cutting that into the M micro-batches."""
    stacked = NamedSharding(sharding.mesh, P(None, *sharding.spec))
    return stacked, jax.jit(lambda x: [x[m] for m in range(num_micro_batches)],
                            out_shardings=[sharding] * num_micro_batches)


def _fold_all(key: jax.Array, num_micro_batches: int) -> list[jax.Array]:
    """``key`` folded with each micro-batch index: micro-batch ``m`` draws from ``fold_in(key, m)``."""
    return [jax.random.fold_in(key, m) for m in range(num_micro_batches)]
