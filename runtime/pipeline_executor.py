"""Runs a compiled pipeline step in five parts: place the inputs, run the program, reduce the
gradients, apply the updates, assemble the outputs.

Everything here was decided when the pipeline compiled: where each value
lives (``passes.step_layout``), what runs on each mesh in which order and
how each boundary value moves (``passes.pipeline_program``). Each move is
prepared once, at construction, so the hot path plans, compiles and looks up
nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.apply_split import ApplySplit, OuterRef
from meshpar.passes.edge_transfer import Direction, TransferKind
from meshpar.passes.pipeline_program import BufferKind, PipelineProgram
from meshpar.passes.stage_graph import StageGraph
from meshpar.passes.stage_parts import StageParts
from meshpar.passes.step_layout import StepLayout, ValueMove
from meshpar.runtime.coordination import wait_ready
from meshpar.runtime.placement import join, place, put
from meshpar.runtime.program_interpreter import ProgramInterpreter, StageInputs
from meshpar.runtime.remote import absent
from meshpar.runtime.stage_executables import compile_stage, on_mesh
from meshpar.runtime.step_trace import StepRecorder

__all__ = ["LAUNCH_WINDOW", "PipelineExecutable", "PrepareMove"]

# Unfinished launches a process keeps in flight with several processes
# (``ProgramInterpreter``'s launch_window): enough to run ahead into the next
# micro-batches, well under what XLA's CPU client holds before it blocks.
LAUNCH_WINDOW = 8

# (kind, shape, dtype, src, dst) -> a callable moving such a value from src to dst.
PrepareMove = Callable[[TransferKind, tuple, Any, NamedSharding, NamedSharding], Callable[[jax.Array], jax.Array]]


class PipelineExecutable:
    """A traced, split, scheduled and lowered train step, ready to run.

    Args:
      graph: forward stages of the loss.
      split: the gradient equation's operands and the per-mesh update.
      layout: where every value lives and the moves after the program.
      program: the per-mesh program and its transfers.
      parts: per stage, its forward and backward parts.
      meshes: one mesh per stage.
      micro_batch_size: examples per micro-batch.
      prepare_move: builds each move once, at construction.
      out_tree, out_avals: the step's output treedef, shapes and dtypes.
      timeout_s: how long a process waits, at the end of a step, for values
        other processes send it (multi-process runs only).
    """

    def __init__(
        self,
        graph: StageGraph,
        split: ApplySplit,
        layout: StepLayout,
        program: PipelineProgram,
        parts: Sequence[StageParts],
        meshes: Sequence[Mesh],
        micro_batch_size: int,
        prepare_move: PrepareMove,
        out_tree: Any,
        out_avals: Sequence[Any],
        timeout_s: float = 120.0,
    ) -> None:
        self.graph, self.split, self.layout, self.program = graph, split, layout, program
        self.schedule = program.schedule
        self.meshes = tuple(meshes)
        self.num_micro_batches = program.schedule.num_micro_batches
        self.micro_batch_size = micro_batch_size
        self.out_tree, self.out_avals = out_tree, tuple(out_avals)
        self.timeout_s = timeout_s
        me = jax.process_index()
        self.local = [any(d.process_index == me for d in m.devices.flat) for m in self.meshes]
        self._prepare_move = prepare_move
        self._prepared: dict[tuple, Callable[[jax.Array], jax.Array]] = {}
        in_ct = {t.edge: t.src for t in program.transfers if t.direction is Direction.COTANGENT}
        out_sh = {(t.src_stage, t.slot): t.src for t in program.transfers if t.direction is Direction.ACTIVATION}
        self.executables = [
            compile_stage(
                stage, parts[stage.index], program.stages[stage.index], layout.stage_operands[stage.index],
                [out_sh.get((stage.index, k), NamedSharding(self.meshes[stage.index], P()))
                 for k in range(len(stage.outputs))],
                [in_ct[e] for e in program.stages[stage.index].in_edges],
                self.meshes[stage.index], self.num_micro_batches,
            )
            for stage in graph.stages
        ]
        self.edges = graph.edges()
        # Per program.transfers entry, its prepared move.
        self.transfer_moves = tuple(self._move(t.kind, t.shape, t.dtype, t.src, t.dst) for t in program.transfers)
        several = jax.process_count() > 1
        self._interpreter = ProgramInterpreter(
            program, self.executables, self.transfer_moves, self.local, watch=several,
            launch_window=LAUNCH_WINDOW if several else None, timeout_s=timeout_s)
        self._fetches = {(s, op.position): self._prepare(op.fetch)
                         for s, ops in enumerate(layout.stage_operands) for op in ops if op.fetch}
        self._gradient_moves = [[self._prepare(mv) if mv else None for mv in moves] for moves in layout.gradient_moves]
        self._loss_moves = {mesh: self._prepare(mv) for mesh, mv in layout.loss_moves.items()}
        self._consts = {(s, op.position): put(split.consts[op.source.index], op.sharding)
                        for s, ops in enumerate(layout.stage_operands) for op in ops
                        if op.source.kind == "const" and self.local[s]}
        self._apply_fns = {a.mesh: self._compile_apply(a) for a in split.stages}
        # Per stage, its parameters' shapes and dtypes (Stage.param_inputs order).
        self._param_avals = [[a for r, a in zip(stage.inputs, stage.jaxpr.in_avals) if r.kind == "param"]
                             for stage in graph.stages]
        # Per stage, the most micro-batches whose forward residuals were alive
        # at once during the last step (what the schedule costs in memory), and
        # the most weight passes waiting at once; 0 on other processes' meshes.
        self.peak_live_activations: list[int] = [0] * graph.num_stages
        self.peak_weight_states: list[int] = [0] * graph.num_stages

    def _move(self, kind: TransferKind, shape: tuple, dtype: Any, src: NamedSharding, dst: NamedSharding):
        key = (kind, tuple(shape), np.dtype(dtype), src, dst)
        if key not in self._prepared:
            self._prepared[key] = self._prepare_move(kind, tuple(shape), np.dtype(dtype), src, dst)
        return self._prepared[key]

    def _prepare(self, move: ValueMove) -> Callable[[jax.Array], jax.Array]:
        return self._move(move.kind, move.shape, move.dtype, move.src, move.dst)

    def _compile_apply(self, apply) -> Callable:
        fn = core.jaxpr_as_fun(apply.jaxpr)
        targets = [self.layout.out_placements[j] for j in apply.outputs]

        def run(*args):
            outs = fn(*args)
            return [
                o if t is None or apply.mesh not in t.meshes else jax.lax.with_sharding_constraint(o, t.on(apply.mesh))
                for o, t in zip(outs, targets)
            ]

        return on_mesh(jax.jit(run), self.meshes[apply.mesh])

    def compiled_count(self) -> int:
        """Executables compiled so far: constant across steps after the first."""
        return sum(e.compiled_count() for e in self.executables) + sum(f._cache_size() for f in self._apply_fns.values())

    # -- the step -------------------------------------------------------------

    def __call__(self, leaves: Sequence[Any], recorder: StepRecorder | None = None) -> list[Any]:
        """One step on the flattened arguments; ``recorder`` (made for ``self.program`` and
        ``self.local``) times the program's instructions."""
        placed = [place(v, p) for v, p in zip(leaves, self.layout.in_placements)]
        inputs = self._stage_inputs(placed, leaves)
        run = self._interpreter.run(inputs, self._zero_grads(), recorder)
        self.peak_live_activations, self.peak_weight_states = run.peak_live_activations, run.peak_weight_states
        loss, param_grads = self._reduce(run)
        computed = self._apply_updates(placed, loss, param_grads)
        if run.arriving:
            wait_ready([v for v, _ in run.arriving], self.timeout_s, "pipeline transfers",
                       names=[w for _, w in run.arriving])
        return self._assemble_outputs(leaves, placed, loss, param_grads, computed)

    def _stage_inputs(self, placed: list[dict[int, jax.Array]], leaves: Sequence[Any]) -> list[StageInputs | None]:
        """Each stage's operands: placed leaves and constants, fetched parameters, and micro-batch
        slices sent straight from where the batch is to the stage that reads them."""
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
                elif op.source.kind == "const":
                    fixed.append(self._consts[(s, op.position)])
                else:
                    fixed.append(placed[op.source.index][s])
            if not self.local[s]:
                out.append(None)
                continue
            per_mb = [op for op in ops if op.per_micro_batch]
            batch = tuple(
                tuple(put(batches[op.source.index][m * size:(m + 1) * size], op.sharding) for op in per_mb)
                for m in range(M)
            ) if per_mb else ()
            out.append(StageInputs(tuple(fixed), batch))
        return out

    def _zero_grads(self) -> list[list[jax.Array] | None]:
        grads: list[list[jax.Array] | None] = []
        for stage, shardings, avals in zip(self.graph.stages, self.layout.grad_shardings, self._param_avals):
            if not self.local[stage.index]:
                grads.append(None)
                continue
            grads.append([jnp.zeros(a.shape, a.dtype, device=sh) for a, sh in zip(avals, shardings)])
        return grads

    def _reduce(self, run) -> tuple[jax.Array, dict[int, jax.Array]]:
        """The mean loss, and each parameter's gradient on its owner's mesh."""
        graph = self.graph
        loss_stage = graph.loss.index
        loss_aval = graph.stages[loss_stage].jaxpr.out_avals[graph.loss.slot]
        parts = [v for b, v in run.results.items() if b.kind is BufferKind.LOSS]
        if parts:
            loss = parts[0]
            for part in parts[1:]:
                loss = loss + part
            loss = loss / self.num_micro_batches
        else:
            loss = absent(loss_aval.shape, loss_aval.dtype, NamedSharding(self.meshes[loss_stage], P()))
        param_grads: dict[int, jax.Array] = {}
        for stage, gs, shardings, moves, avals in zip(
                graph.stages, run.grads, self.layout.grad_shardings, self._gradient_moves, self._param_avals):
            for n, k in enumerate(stage.param_inputs):
                g = gs[n] if gs is not None else absent(avals[n].shape, avals[n].dtype, shardings[n])
                if moves[n] is not None:
                    g = moves[n](g)
                owner_local = self.local[graph.param_owner(k)]
                param_grads[k] = g if k not in param_grads or not owner_local else param_grads[k] + g
        return loss, param_grads

    def _apply_updates(self, placed, loss: jax.Array, param_grads: dict[int, jax.Array]) -> dict[int, dict[int, jax.Array]]:
        # Every process joins the loss's moves before any update runs.
        loss_on = {self.graph.loss.index: loss}
        loss_on.update({mesh: move(loss) for mesh, move in self._loss_moves.items()})
        consts = self.split.consts

        def operand(ref: OuterRef, mesh: int) -> Any:
            if ref.kind == "grad":
                return param_grads[ref.index]
            if ref.kind == "loss":
                return loss_on[mesh]
            if ref.kind == "const":
                return consts[ref.index]
            arrays = placed[ref.index]
            return arrays[mesh] if mesh in arrays else next(iter(arrays.values()))

        computed: dict[int, dict[int, jax.Array]] = {}
        for apply in self.split.stages:
            if not self.local[apply.mesh]:
                continue
            outs = self._apply_fns[apply.mesh](*[operand(r, apply.mesh) for r in apply.inputs])
            for j, value in zip(apply.outputs, outs):
                computed.setdefault(j, {})[apply.mesh] = value
        return computed

    def _output_shardings(self, j: int, meshes: Sequence[int]) -> list[NamedSharding]:
        placement = self.layout.out_placements[j]
        return [placement.on(m) if placement and m in placement.meshes else NamedSharding(self.meshes[m], P())
                for m in meshes]

    def _assemble_outputs(self, leaves, placed, loss, param_grads, computed) -> list[Any]:
        split, results = self.split, []
        for j, source in enumerate(split.sources):
            if source is None:
                parts, meshes = computed.get(j, {}), split.producers[j]
                aval = self.out_avals[j]
                if len(meshes) == 1:
                    results.append(parts[meshes[0]] if meshes[0] in parts
                                   else absent(aval.shape, aval.dtype, self._output_shardings(j, meshes)[0]))
                else:
                    results.append(join([parts[m] for m in meshes if m in parts],
                                        self._output_shardings(j, meshes), aval.shape, aval.dtype))
            elif source.kind == "loss":
                results.append(loss)
            elif source.kind == "grad":
                results.append(param_grads[source.index])
            elif source.kind == "in":
                arrays = placed[source.index]
                if not arrays:  # a batch leaf returned as it came
                    results.append(leaves[source.index])
                elif len(arrays) == 1:
                    results.append(next(iter(arrays.values())))
                else:
                    meshes = sorted(arrays)
                    placement = self.layout.in_placements[source.index]
                    results.append(join([arrays[m] for m in meshes], [placement.on(m) for m in meshes],
                                        arrays[meshes[0]].shape, arrays[meshes[0]].dtype))
            elif source.kind == "const":
                results.append(split.consts[source.index])
            else:
                raise AssertionError(f"unexpected output source {source}")
        return results
