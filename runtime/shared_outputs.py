"""Running a ``ShareOutputs``: small outputs copied from the process holding them onto every process.

Under ``jax.jit`` a loss is readable on every process; in a pipeline it is computed on the last
stage's mesh, whose devices may all belong to other processes. Every process builds, per shared
output, an array over all the step's devices shaped ``(devices, *shape)``: the block on the
output's source device is its copy there, every other block zeros made once. One program over
those devices picks each output's source block, replicated: a cross-process gather that every
process joins, in the step's order, and that returns the value bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.pipeline.lowering.step_program import ShareOutputs

__all__ = ["OutputSharer"]


class OutputSharer:
    """``sharer(outputs) -> outputs`` with each of ``ins.outputs`` replaced by its copy replicated
    on ``ins.devices`` (a ``jax.Array`` every process can read, as ``float(loss)``)."""

    def __init__(self, ins: ShareOutputs) -> None:
        mesh = Mesh(np.array(ins.devices), ("devices",))
        self._blocks = NamedSharding(mesh, P("devices"))
        replicated = NamedSharding(mesh, P())
        self._outputs = ins.outputs
        self._count = len(ins.devices)
        me = jax.process_index()
        self._local = [(k, d) for k, d in enumerate(ins.devices) if d.process_index == me]
        # The blocks other than the source's: zeros, made once (nothing in a step writes them).
        self._zeros = [{d: jax.device_put(np.zeros((1, *o.shape), o.dtype), d) for k, d in self._local
                        if k != o.source} for o in ins.outputs]
        sources = [o.source for o in ins.outputs]
        self._pick = jax.jit(lambda *stacked: [x[k] for x, k in zip(stacked, sources)],
                             out_shardings=[replicated] * len(sources))

    def __call__(self, outputs: Sequence[Any]) -> list[Any]:
        stacked = []
        for shared, zeros in zip(self._outputs, self._zeros):
            value = outputs[shared.output]
            blocks = [zeros[d] if k != shared.source else _shard_on(value, d)[None] for k, d in self._local]
            stacked.append(jax.make_array_from_single_device_arrays(
                (self._count, *shared.shape), self._blocks, blocks, dtype=shared.dtype))
        result = list(outputs)
        for shared, value in zip(self._outputs, self._pick(*stacked)):
            result[shared.output] = value
        return result


def _shard_on(value: jax.Array, device: Any) -> jax.Array:
    """``value``'s copy on ``device`` (a replicated value has one on each of its devices)."""
    for shard in value.addressable_shards:
        if shard.device == device:
            return shard.data
    raise ValueError(f"value: expected a copy on {device}, its devices are {sorted(value.sharding.device_set, key=str)}")
