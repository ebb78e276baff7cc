"""Pass: each stage's compute, as the runtime compiles it: its parts and every sharding they meet.

A ``StageKernel`` is what ``runtime.stage_executables.compile_stage`` jits into a stage's
forward, backward, input and weight passes, and nothing else: the stage (its jaxpr's types
and which inputs are activations), its parts (``stage_parts``), its wiring to the program's
buffers (``StageIO``), its non-activation operands (``StageOperand``), the shardings its
outputs and input cotangents leave with (their transfers'), its mesh, the loss seed and how
its gradients accumulate (``data_replicas``). With the step program, the pipeline program and
the move table it is the whole hand-off from the compiler to the runtime.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ...compiler_pass import compiler_pass
from ...verification import PlanVerificationError
from ..placing.data_replicas import DataReplicas, StageAccumulation
from ..placing.edge_transfer import Direction
from .pipeline_program import PipelineProgram, StageIO
from ..cutting.stage_graph import Stage, StageGraph
from ..cutting.stage_parts import StageParts
from ..placing.step_layout import StageOperand, StepLayout

__all__ = ["StageKernel", "stage_kernels", "verify_stage_kernels"]


@dataclasses.dataclass(frozen=True)
class StageKernel:
    """One stage's compute on its mesh (module doc).

    Attributes:
      stage: the forward stage (its jaxpr's input and output types, which inputs are activations).
      parts: its forward, backward, input and weight passes.
      io: how its passes meet the program's buffers.
      operands: its non-activation inputs, in input order.
      output_shardings: per output slot, the sharding it leaves with (its first move's source,
        else replicated on the mesh).
      input_cotangent_shardings: per activation input with a cotangent (``StageIO.cotangent_in_edges``),
        the sharding that cotangent leaves with.
      mesh: the mesh running it.
      loss_seed: the loss's cotangent (the reduction's weight: ``1 / M`` for a mean).
      accumulation: how its gradients accumulate and reduce.
    """

    stage: Stage
    parts: StageParts
    io: StageIO
    operands: tuple[StageOperand, ...]
    output_shardings: tuple[NamedSharding, ...]
    input_cotangent_shardings: tuple[NamedSharding, ...]
    mesh: Mesh
    loss_seed: float
    accumulation: StageAccumulation


@compiler_pass
def stage_kernels(graph: StageGraph, parts: Sequence[StageParts], program: PipelineProgram, layout: StepLayout,
                  meshes: Sequence[Mesh], loss_seed: float, gradients: DataReplicas) -> tuple[StageKernel, ...]:
    """Every stage's ``StageKernel``, stage ``s`` on ``meshes[program.stage_mesh[s]]``."""
    home = program.stage_mesh
    leaving = {(t.src_stage, t.slot): t.src for t in program.transfers if t.direction is Direction.ACTIVATION}
    cotangent_of = {t.edge: t.src for t in program.transfers if t.direction is Direction.COTANGENT}
    kernels = []
    for stage in graph.stages:
        s, mesh = stage.index, meshes[home[stage.index]]
        io = program.stages[s]
        outputs = tuple(leaving.get((s, k), NamedSharding(mesh, P())) for k in range(len(stage.outputs)))
        kernels.append(StageKernel(stage, parts[s], io, layout.stage_operands[s], outputs,
                                   tuple(cotangent_of[e] for e in io.cotangent_in_edges), mesh, loss_seed,
                                   gradients.stages[s]))
    return tuple(kernels)


def verify_stage_kernels(kernels: Sequence[StageKernel], program: PipelineProgram) -> None:
    """One kernel per stage of ``program``, in order, each on one mesh with its outputs and input
    cotangents laid out there, and as many of them as its ``StageIO`` wires.

    Raises:
      PlanVerificationError: naming the stage.
    """
    if [k.stage.index for k in kernels] != list(range(len(program.stages))):
        raise PlanVerificationError("the stage kernels are not one per stage, in order")
    for k in kernels:
        s = k.stage.index
        if k.io != program.stages[s]:
            raise PlanVerificationError(f"stage {s}'s kernel is wired otherwise than its program")
        if len(k.output_shardings) != len(k.stage.outputs) or len(k.input_cotangent_shardings) != len(
                k.io.cotangent_in_edges):
            raise PlanVerificationError(f"stage {s}'s kernel has not one sharding per output and input cotangent")
        elsewhere = [sh for sh in (*k.output_shardings, *k.input_cotangent_shardings, *(op.sharding for op in k.operands))
                     if sh.mesh != k.mesh]
        if elsewhere:
            raise PlanVerificationError(f"stage {s}'s kernel lays out a value on another mesh than its own")
