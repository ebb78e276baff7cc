"""The programs around the pipeline, compiled ahead with its stages (``PipelineExecutable.compile_ahead``).

A step launches programs besides the stages' passes: the work before and after the pipeline
(``RunCompute``: the optimizer update, a global norm's parts), the per-micro-batch slicing of a
batch operand, the zero gradient accumulators, the combining of the micro-batches' losses, the
packing of values moved together. Unless compiled ahead, each compiles when the first step
reaches it, one after another. ``compile_step_ahead`` walks the step program as the executor's
handlers run it, with shapes for values (``compile_ahead.AheadOfTime``): each instruction's
operands' types follow from where the step places its inputs (the step's own leaves give
their shapes, dtypes and weak types), from the compiled programs' results and from the moves'
destinations; each program whose operands are all known is queued, and compiles side by side
with the stages' passes. A value whose type the walk cannot tell (after a stacked leaf's split,
a key's fold, a value on another process's mesh) is unknown, and the programs reading it
compile in the first step as before: the walk only saves compile time, it changes nothing
the step runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from meshpar.passes.program.step_instructions import (
    CombineMicroBatches, PlaceInputs, ReduceGradient, RunCompute, RunMove, RunPipeline, SliceMicroBatches,
    SplitStackedLeaves,
)
from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.passes.program.wire_format import is_key
from meshpar.runtime.compile_ahead import AheadOfTime, NotCompiledAhead
from meshpar.runtime.program_interpreter import ProgramRun, StageInputs

__all__ = ["compile_step_ahead"]


def compile_step_ahead(executable: Any, compiler: AheadOfTime, leaves: Sequence[Any] | None,
                       inputs: list[StageInputs | None], grads: list[list[Any] | None]) -> ProgramRun:
    """Queues on ``compiler`` the pipeline's programs (``ProgramInterpreter.compile_ahead`` with
    the stages' ``inputs`` and ``grads`` as shapes) and, given the step's flattened arguments
    ``leaves``, every program around it whose operands' types the walk can tell. Returns the
    pipeline's run as shapes."""
    walk = _Walk(executable, compiler, leaves)
    for ins in executable.step_program:
        if isinstance(ins, RunPipeline):
            walk.run = executable.interpreter.compile_ahead(inputs, grads, compiler)
            if leaves is not None:
                walk.accumulators()
        elif leaves is not None and type(ins) in walk.handlers:
            walk.handlers[type(ins)](ins)
    return walk.run


def _dtype(x: Any) -> Any:
    if hasattr(x, "dtype") and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return x.dtype
    return jax.dtypes.canonicalize_dtype(x.dtype if hasattr(x, "dtype") else np.result_type(x))


class _Walk:
    """The step program's values as shapes: ``values[(ref, mesh)]`` and ``placed[leaf][mesh]``
    (``jax.ShapeDtypeStruct`` or ``compile_ahead.Pending``; absent: unknown)."""

    def __init__(self, executable: Any, compiler: AheadOfTime, leaves: Sequence[Any] | None) -> None:
        self.ex, self.compiler, self.leaves = executable, compiler, leaves
        self.values: dict[tuple[OuterRef, int], Any] = {}
        self.placed: list[dict[int, Any]] = []
        self.run: ProgramRun | None = None
        self.handlers = {
            SplitStackedLeaves: self.split_stacked,
            PlaceInputs: self.place_inputs,
            SliceMicroBatches: self.slice_micro_batches,
            RunCompute: self.run_compute,
            RunMove: self.run_move,
            CombineMicroBatches: self.combine,
            ReduceGradient: self.reduce_gradient,
        }

    def program(self, fn: Any, *args: Any) -> Any:
        """``fn``'s results for ``args`` (``None``: unknown, or not compiled ahead); ``fn`` made
        by ``on_mesh``, or a plain ``jax.jit``."""
        if any(a is None for a in jax.tree.leaves(args, is_leaf=lambda x: x is None)):
            return None
        jitted = getattr(fn, "jitted", fn)
        try:
            return self.compiler.program(jitted, *args, mesh=getattr(fn, "mesh", None), optional=True)
        except NotCompiledAhead:
            return None

    def value(self, ref: OuterRef, mesh: int) -> Any:
        """``ref`` on ``mesh`` as the executor's ``_value`` reads it; ``None``: unknown."""
        if ref.kind is OuterKind.IN:
            if ref.index >= len(self.placed):
                return None
            arrays = self.placed[ref.index]
            return arrays.get(mesh, next(iter(arrays.values()), None))
        if ref.kind is OuterKind.CONST:
            return self.ex.step_program.consts[ref.index]
        return self.values.get((ref, mesh))

    # -- instructions --------------------------------------------------------------------

    def split_stacked(self, ins: SplitStackedLeaves) -> None:
        self.leaves = None  # the leaves' pieces: not followed

    def place_inputs(self, ins: PlaceInputs) -> None:
        if self.leaves is None:
            return
        moved = self.ex.ready(ins).moved
        for i, (leaf, placement) in enumerate(zip(self.leaves, ins.placements)):
            # ``put`` keeps a jax.Array's weak type (one array per mesh); a view of one array
            # over several meshes, or host data, is not weak.
            weak = bool(getattr(leaf, "weak_type", False)) and placement.union is None and i not in moved
            self.placed.append({m: jax.ShapeDtypeStruct(np.shape(leaf), _dtype(leaf), sharding=placement.on(m),
                                                        weak_type=weak) for m in placement.meshes})

    def slice_micro_batches(self, ins: SliceMicroBatches) -> None:
        # The slicing program: the whole value placed ``[M, micro-batch, ...]``.
        if self.ex.local[ins.stage]:
            aval = self.ex._kernels[ins.stage].in_avals[ins.position]
            self.program(self.ex.ready(ins),
                         jax.ShapeDtypeStruct((ins.num_micro_batches, *aval.shape), aval.dtype, sharding=ins.stacked))

    def accumulators(self) -> None:
        for _, make in self.ex._accumulators:
            self.program(make)

    def run_compute(self, ins: RunCompute) -> None:
        if not self.ex.mesh_local[ins.mesh]:
            return
        outs = self.program(self.ex.ready(ins), *[self.value(r, ins.mesh) for r in ins.inputs])
        if outs is not None:
            self.values.update({(ref, ins.mesh): o for ref, o in zip(ins.outputs, outs)})

    def run_move(self, ins: RunMove) -> None:
        via = ins.via
        move, pack, unpack = self.ex.ready(ins)
        if pack is None:
            value = self.value(ins.values[0], ins.src)
            if value is not None and getattr(move, "jitted", None) is not None:
                self.program(move, value)
            weak = bool(getattr(value, "weak_type", False))
            self.values[(ins.values[0], ins.dst)] = jax.ShapeDtypeStruct(via.shape, via.dtype, sharding=via.dst,
                                                                         weak_type=weak)
            return
        if self.ex.mesh_local[ins.src]:
            self.program(pack, *[self.value(r, ins.src) for r in ins.values])
        if self.ex.mesh_local[ins.dst]:
            outs = self.program(unpack, jax.ShapeDtypeStruct(via.shape, via.dtype, sharding=via.dst))
            if outs is not None:
                self.values.update({(r, ins.dst): v for r, v in zip(ins.values, outs)})

    def combine(self, ins: CombineMicroBatches) -> None:
        if not self.ex.mesh_local[ins.mesh] or self.run is None:
            return
        parts = [self.run.results.get(b) for b in ins.buffers]
        combine, relay = self.ex.ready(ins)
        combined = self.program(combine, parts)
        if combined is None or is_key(ins.aval):
            return
        self.values[(ins.value, ins.mesh)] = combined if relay is None else self.program(relay, combined)

    def reduce_gradient(self, ins: ReduceGradient) -> None:
        grads = self.run.grads[ins.stage] if self.run is not None else None
        g = grads[ins.position] if grads is not None else None
        key = (OuterRef(OuterKind.GRAD, ins.param), ins.mesh)
        if g is not None and ins.move is not None:
            move = self.ex.ready(ins)
            if getattr(move, "jitted", None) is not None:
                self.program(move, g)
            g = jax.ShapeDtypeStruct(ins.move.shape, ins.move.dtype, sharding=ins.move.dst)
        # A second stage's gradient adds into the first's (laid out alike).
        if not ins.adds:
            self.values[key] = g
        elif g is None:
            self.values[key] = None
