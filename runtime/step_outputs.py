"""The handlers of the step's outputs: ``AssembleOutputs`` (each output from its ``OutputSource``:
a literal, a constant, an input returned as placed, a value on one mesh, or copies on several
meshes joined into one array) and ``ShareOutputs`` (small outputs copied onto every process,
``shared_outputs``)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from meshpar.passes.program.step_instructions import AssembleOutputs, ShareOutputs
from meshpar.passes.program.step_values import OuterKind
from meshpar.runtime.coordination import wait_arrivals
from meshpar.runtime.placement import join
from meshpar.runtime.shared_outputs import OutputSharer
from meshpar.runtime.step_state import StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS"]


class Assembly:
    """What assembling needs, decided once per program: the outputs that are one mesh's computed
    value (the common case: a new parameter, an optimizer state), looked up together by one C
    call, and the others, assembled one by one (an input returned as it came, a literal, a
    constant, copies on several meshes joined)."""

    def __init__(self, ex: StepExecutable, ins: AssembleOutputs) -> None:
        sources = ins.outputs
        self.count = len(sources)
        self.single = [j for j, o in enumerate(sources) if o.ref.kind is not OuterKind.IN and len(o.meshes) == 1]
        self.keys = [(sources[j].ref, sources[j].meshes[0]) for j in self.single]
        # ``itemgetter`` of one key returns the value, not a 1-tuple.
        self.lookup = operator.itemgetter(*self.keys) if len(self.keys) > 1 else None
        self.stand_ins = [sources[j].shardings[0] for j in self.single]
        self.on_one_mesh = {j: sources[j].meshes[0] for j in self.single}
        self.others = [(j, o) for j, o in enumerate(sources) if j not in self.on_one_mesh]

    def single_values(self, state: StepState) -> Sequence[Any]:
        """The one-mesh outputs' values, in ``single``'s order; another process's, a stand-in
        (``StepState.value``)."""
        values = state.values
        if self.lookup is not None:
            try:
                return self.lookup(values)
            except KeyError:
                pass
        return [values[key] if key in values else state.value(key[0], key[1], stand_in)
                for key, stand_in in zip(self.keys, self.stand_ins)]


def assemble_outputs(ex: StepExecutable, ins: AssembleOutputs, assembly: Assembly, state: StepState) -> None:
    results: list[Any] = [None] * assembly.count
    for j, value in zip(assembly.single, assembly.single_values(state)):
        results[j] = value
    values = state.values
    for j, source in assembly.others:
        ref = source.ref
        if ref.kind is OuterKind.IN:
            arrays = state.placed[ref.index]
            if not arrays:  # a batch leaf returned as it came
                results[j] = state.leaves[ref.index]
            elif len(arrays) == 1:
                results[j] = next(iter(arrays.values()))
            else:
                ms = sorted(arrays)
                results[j] = join([arrays[m] for m in ms], source.placed_as.union, arrays[ms[0]].shape,
                                  arrays[ms[0]].dtype)
        elif ref.kind is OuterKind.LITERAL:
            results[j] = jnp.asarray(source.literal, ex.out_avals[j].dtype)
        elif ref.kind is OuterKind.CONST:
            results[j] = state.program.consts[ref.index]
        else:
            aval = ex.out_avals[j]
            results[j] = join([values[(ref, m)] for m in source.meshes if (ref, m) in values], source.union,
                              aval.shape, aval.dtype)
    state.outputs = state.assembled = results
    state.on_one_mesh = assembly.on_one_mesh


def share_outputs(ex: StepExecutable, ins: ShareOutputs, sharer: OutputSharer, state: StepState) -> None:
    state.outputs, arriving = sharer(state.outputs)
    if arriving:
        wait_arrivals(arriving, ex.timeout_s, "shared outputs", "receiving this step's shared outputs")


HANDLERS = {AssembleOutputs: StepHandler(assemble_outputs, Assembly),
            ShareOutputs: StepHandler(share_outputs, lambda ex, ins: OutputSharer(ins))}
