"""The handlers of the step's outputs: ``AssembleOutputs`` (each output from its ``OutputSource``:
a literal, a constant, an input returned as placed, a value on one mesh, or copies on several
meshes joined into one array) and ``ShareOutputs`` (small outputs copied onto every process,
``shared_outputs``)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from meshpar.passes.program.step_instructions import AssembleOutputs, ShareOutputs
from meshpar.passes.program.step_values import OuterKind
from meshpar.runtime.coordination import wait_arrivals
from meshpar.runtime.placement import join
from meshpar.runtime.shared_outputs import OutputSharer
from meshpar.runtime.step_state import StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS"]


def assemble_outputs(ex: StepExecutable, ins: AssembleOutputs, ready: None, state: StepState) -> None:
    results: list[Any] = []
    on_one_mesh: dict[int, int] = {}
    values = state.values
    for j, source in enumerate(ins.outputs):
        ref = source.ref
        if ref.kind is OuterKind.IN:
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
            # A computed value on its mesh (a new parameter, an optimizer state): looked up
            # directly, the common case; another process's, a stand-in (``StepState.value``).
            key = (ref, source.meshes[0])
            results.append(values[key] if key in values else state.value(ref, source.meshes[0], source.shardings[0]))
            on_one_mesh[j] = source.meshes[0]
        elif ref.kind is OuterKind.LITERAL:
            results.append(jnp.asarray(source.literal, ex.out_avals[j].dtype))
        elif ref.kind is OuterKind.CONST:
            results.append(state.program.consts[ref.index])
        else:
            aval = ex.out_avals[j]
            results.append(join([values[(ref, m)] for m in source.meshes if (ref, m) in values], source.union,
                                aval.shape, aval.dtype))
    state.outputs = state.assembled = results
    state.on_one_mesh = on_one_mesh


def share_outputs(ex: StepExecutable, ins: ShareOutputs, sharer: OutputSharer, state: StepState) -> None:
    state.outputs, arriving = sharer(state.outputs)
    if arriving:
        wait_arrivals(arriving, ex.timeout_s, "shared outputs", "receiving this step's shared outputs")


HANDLERS = {AssembleOutputs: StepHandler(assemble_outputs),
            ShareOutputs: StepHandler(share_outputs, lambda ex, ins: OutputSharer(ins))}
