"""The programs around the pipeline, compiled while the compiler still plans the pipeline.

Compiling a step starts with Python on one thread: tracing the step, then the passes, the
longest of which trace each stage's replicas and parts (``plan_data_replicas``,
``stage_parts``). XLA compiles on other threads (it releases the GIL), so a core sat idle
meanwhile, and every program then compiled at once after the last pass. The step program
around the pipeline (the optimizer update, a global norm's parts) needs nothing of the
pipeline's plan, so the compiler lowers it first (``passes.pipeline_driver``), and
``EarlyPrograms.start`` queues its programs on the step's ``AheadOfTime`` at once, from the
shapes and shardings its instructions fix. The executable then launches these very programs
(``ready``), and its own walk before the first step (``PipelineExecutable.compile_ahead``, on
the same ``AheadOfTime``) finds each queued already: a program compiles once.

A value whose type this walk cannot tell yet (the loss and aux values the pipeline combines,
values moved packed, the pieces of split stacked leaves) is unknown, and the programs reading it
are left to ``compile_ahead`` as before: starting early only saves time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from meshpar.passes.program.step_instructions import (
    PlaceInputs, ReduceGradient, RunCompute, RunMove, SplitStackedLeaves, StepInstruction, StepProgram,
)
from meshpar.passes.program.step_values import OuterKind, OuterRef
from meshpar.runtime.around_pipeline import compute_program, moved_shape
from meshpar.runtime.compile_ahead import AheadOfTime, beside_python_pool
from meshpar.runtime.coordination import owns_a_device_of
from meshpar.runtime.placing_inputs import placed_shapes
from meshpar.runtime.step_ahead import queue_program, shaped_value

__all__ = ["EarlyPrograms"]


class EarlyPrograms:
    """The programs of a step program's ``RunCompute``s, made and queued on ``compiler`` as
    soon as the compiler has lowered the step, for a step called with the flattened arguments
    ``leaves`` (each program's wait for other processes bounded by ``timeout_s``).

    Attributes:
      compiler: where they compile, on threads beside the compiler's Python
        (``compile_ahead.beside_python_pool``); the executable's ``compile_ahead`` walks the
        rest of the step on it, on the whole pool, so nothing compiles twice.
    """

    def __init__(self, leaves: Sequence[Any], timeout_s: float) -> None:
        # Beside the compiler's own Python, which goes on tracing the stages meanwhile.
        self.compiler = AheadOfTime(beside_python_pool())
        self._leaves, self._timeout_s = leaves, timeout_s
        self._programs: dict[RunCompute, Callable] = {}

    def ready(self, ins: StepInstruction) -> Callable | None:
        """The program made here for ``ins`` (a ``RunCompute`` of the step started), or ``None``."""
        return self._programs.get(ins) if isinstance(ins, RunCompute) else None

    def start(self, step: StepProgram, meshes: Sequence[Mesh], stage_mesh: Sequence[int]) -> None:
        """Makes the program of every computation of ``step`` on a mesh (of ``meshes``) of this
        process, and queues those whose operands' types it can tell
        (``compile_ahead.AheadOfTime``); stage ``s`` runs on mesh ``stage_mesh[s]``."""
        walk = _Shapes(step, meshes, stage_mesh, self._leaves)
        kinds: dict[type, Callable[[Any, _Shapes], None]] = {
            SplitStackedLeaves: _split, PlaceInputs: _place, RunCompute: self._compute, RunMove: _move,
            ReduceGradient: _gradient}
        for ins in step:
            kinds.get(type(ins), _unknown)(ins, walk)

    def _compute(self, ins: RunCompute, walk: _Shapes) -> None:
        if not walk.local[ins.mesh]:
            return
        program = self._programs[ins] = compute_program(ins, walk.meshes[ins.mesh], self._timeout_s)
        outs = queue_program(self.compiler, program, *[walk.value(r, ins.mesh) for r in ins.inputs])
        if outs is not None:
            walk.values.update({(ref, ins.mesh): o for ref, o in zip(ins.outputs, outs)})


class _Shapes:
    """The step's values as shapes (``jax.ShapeDtypeStruct`` or ``compile_ahead.Pending``), as far
    as they are known before the pipeline is planned: ``values[(ref, mesh)]`` (absent:
    unknown); the input leaves ``leaves`` (``None`` once not followed) and, per leaf, per mesh,
    its type once placed (``placed``)."""

    def __init__(self, step: StepProgram, meshes: Sequence[Mesh], stage_mesh: Sequence[int],
                 leaves: Sequence[Any] | None) -> None:
        self.step, self.meshes, self.stage_mesh, self.leaves = step, tuple(meshes), tuple(stage_mesh), leaves
        self.local = [owns_a_device_of(m) for m in meshes]
        self.values: dict[tuple[OuterRef, int], Any] = {}
        self.placed: list[dict[int, Any]] = []

    def value(self, ref: OuterRef, mesh: int) -> Any:
        """``ref`` on ``mesh`` as the step reads it (``StepState.value``); ``None``: unknown."""
        return shaped_value(ref, mesh, self.placed, self.step.consts, self.values)


def _split(ins: SplitStackedLeaves, walk: _Shapes) -> None:
    walk.leaves = None  # the leaves' pieces: not followed (as ``compile_ahead`` does not)


def _place(ins: PlaceInputs, walk: _Shapes) -> None:
    if walk.leaves is not None:
        walk.placed = placed_shapes(walk.leaves, ins)


def _move(ins: RunMove, walk: _Shapes) -> None:
    # One value arrives laid out as the move's destination; values moved packed are unpacked by a
    # program ``compile_ahead`` compiles: unknown here.
    moved = walk.value(ins.values[0], ins.src)
    if ins.unpacked or moved is None:
        _unknown(ins, walk)
    else:
        walk.values[(ins.values[0], ins.dst)] = moved_shape(ins, moved)


def _gradient(ins: ReduceGradient, walk: _Shapes) -> None:
    # As ``micro_batch_results.gradient_ahead`` walks it: the gradient as the pipeline leaves it
    # on its stage's mesh (the parameter's dtype, the layout's sharding: what the stage's
    # programs declare), then as its move lays it out on the owner's mesh; unknown where the
    # stage is another process's. A second stage's adds into the first's, laid out alike.
    g = None
    if walk.local[walk.stage_mesh[ins.stage]]:
        g = (jax.ShapeDtypeStruct(ins.aval.shape, ins.aval.dtype, sharding=ins.sharding) if ins.move is None
             else jax.ShapeDtypeStruct(ins.move.shape, ins.move.dtype, sharding=ins.move.dst))
    key = (OuterRef(OuterKind.GRAD, ins.param), ins.mesh)
    if not ins.adds or g is None:
        walk.values[key] = g


def _unknown(ins: StepInstruction, walk: _Shapes) -> None:
    for located in ins.writes:
        walk.values.pop(located, None)
