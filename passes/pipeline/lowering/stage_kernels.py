"""Pass: each stage's compute, as the runtime compiles it: its parts and every sharding they meet.

A ``StageKernel`` is what ``runtime.stage_executables.compile_stage`` jits into a stage's
forward, backward, input and weight passes, and nothing else: the stage's types and which
inputs are activations, its parts (``stage_parts``), its wiring to the program's buffers
(``StageIO``), its non-activation operands (``KernelOperand``: position, sharding, whether
read per micro-batch; not where they come from, which the step program's feeds say), the shardings its
outputs and input cotangents leave with (their transfers'), its mesh, the loss seed and how
its gradients accumulate (``data_replicas``). With the step program, the pipeline program and
the move table it is the whole hand-off from the compiler to the runtime.
"""

from __future__ import annotations

from collections.abc import Sequence

from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from ...compiler_pass import compiler_pass
from ...program.moves import Direction
from ...program.pipeline_instructions import PipelineProgram
from ...program.stage_kernel import KernelOperand, StageKernel, StageParts
from ...program.step_values import RefKind
from ...verification import PlanVerificationError
from ..cutting.stage_graph import StageGraph
from ..placing.data_replicas import DataReplicas
from ..placing.step_layout import StepLayout

__all__ = ["stage_kernels", "verify_stage_kernels"]


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
        operands = tuple(KernelOperand(o.position, o.sharding, o.per_micro_batch) for o in layout.stage_operands[s])
        acts = tuple(k for k, r in enumerate(stage.inputs) if r.kind is RefKind.ACT)
        kernels.append(StageKernel(s, tuple(stage.jaxpr.in_avals), tuple(stage.jaxpr.out_avals), acts, parts[s], io,
                                   operands, outputs, tuple(cotangent_of[e] for e in io.cotangent_in_edges), mesh,
                                   loss_seed, gradients.stages[s]))
    return tuple(kernels)


def verify_stage_kernels(kernels: Sequence[StageKernel], program: PipelineProgram) -> None:
    """One kernel per stage of ``program``, in order, each taking every input once (an activation
    or an operand), on one mesh with its outputs and input cotangents laid out there, and as many
    of them as its ``StageIO`` wires.

    Raises:
      PlanVerificationError: naming the stage.
    """
    if [k.stage for k in kernels] != list(range(len(program.stages))):
        raise PlanVerificationError("the stage kernels are not one per stage, in order")
    for k in kernels:
        s = k.stage
        positions = sorted([*k.act_inputs, *(op.position for op in k.operands)])
        if positions != list(range(len(k.in_avals))):
            raise PlanVerificationError(f"stage {s}'s kernel does not take each of its {len(k.in_avals)} inputs once "
                                        f"as an activation or an operand")
        if k.io != program.stages[s]:
            raise PlanVerificationError(f"stage {s}'s kernel is wired otherwise than its program")
        replicas = k.accumulation.replicas if k.accumulation is not None else None
        if replicas is not None and k.parts is not replicas.parts:
            raise PlanVerificationError(f"stage {s} runs as replicas, but its kernel's parts are not a replica's")
        if len(k.output_shardings) != len(k.out_avals) or len(k.input_cotangent_shardings) != len(
                k.io.cotangent_in_edges):
            raise PlanVerificationError(f"stage {s}'s kernel has not one sharding per output and input cotangent")
        elsewhere = [sh for sh in (*k.output_shardings, *k.input_cotangent_shardings, *(op.sharding for op in k.operands))
                     if sh.mesh != k.mesh]
        if elsewhere:
            raise PlanVerificationError(f"stage {s}'s kernel lays out a value on another mesh than its own")
