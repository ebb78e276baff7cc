"""Running a ``ShareOutputs``: small outputs copied onto the step's output devices.

Under ``jax.jit`` a loss is readable on every process, and two outputs combine; in a pipeline
each is computed on its stage's mesh, whose devices may all belong to other processes. Each
shared output's copy on its source device is copied point to point (a cross-process
``jax.device_put``, as the moves' hops) onto the step's output devices, one per process; each
process then holds one array, replicated over those devices, whose local copy it reads. Every
process joins every copy in the same order (JAX numbers cross-process transfers by a
per-process counter). No collective: a
collective launched while a peer still waits for this process's sends can block the device
those sends need (measured on the emulated cluster: a gather here hung the step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from meshpar.passes.program.shardings import device_sharding
from meshpar.passes.program.step_instructions import ShareOutputs
from meshpar.runtime.coordination import Arrival
from meshpar.runtime.remote import absent

__all__ = ["OutputSharer"]


class OutputSharer:
    """``sharer(outputs) -> (outputs, arriving)``: each of ``ins.outputs`` replaced by its copy
    replicated over the step's output devices (a ``jax.Array`` every process can read, as
    ``float(loss)``, and that combines with the others), and this process's copies on their way
    from another process. The step waits for those before it returns: a sender may leave (its
    last step done) before a reader here pulled its copy."""

    def __init__(self, ins: ShareOutputs) -> None:
        me = jax.process_index()
        self._outputs = ins.outputs
        self._replicated = [NamedSharding(Mesh(np.array(o.devices), ("outputs",)), P()) for o in ins.outputs]
        self._targets = [[(d, device_sharding(d), d.process_index == me) for d in o.devices] for o in ins.outputs]
        self._sources = [device_sharding(o.source) for o in ins.outputs]
        self._owner = [o.source.process_index == me for o in ins.outputs]
        # Every copy between this process's own devices: no transfer to number alike on other
        # processes, so all of them go in one batched ``jax.device_put``.
        self._local = all(self._owner) and all(here for targets in self._targets for _, _, here in targets)

    def __call__(self, outputs: Sequence[Any]) -> tuple[list[Any], list[Arrival]]:
        if self._local:
            return self._share_locally(outputs), []
        result, arriving = list(outputs), []
        for k, shared in enumerate(self._outputs):
            value = outputs[shared.output]
            if not value.sharding.is_fully_replicated:
                # An output the compiler could not see the layout of (a value a program returns
                # sharded, as flax partitions it) stays where it is; every process sees the same
                # global sharding, so every process skips it alike.
                continue
            owner = self._owner[k]
            source = _copy_on(value, shared.source) if owner else absent(shared.shape, shared.dtype,
                                                                          self._sources[k])
            # Every process knows the output's devices (its sharding is global), so every process
            # skips the same targets and numbers the same transfers.
            held = value.sharding.device_set
            mine = []
            for device, sharding, here in self._targets[k]:
                if device in held:
                    # A copy the output already has there: no transfer.
                    if here:
                        mine.append(_copy_on(value, device))
                    continue
                if not (owner or here) and device.process_index == shared.source.process_index:
                    # A copy inside another process: no cross-process transfer for this one to join.
                    continue
                moved = jax.device_put(source, sharding)
                if here:
                    mine.append(moved)
                    if not owner:
                        arriving.append(Arrival(moved, f"output {shared.output} shared from {shared.source}",
                                                (shared.source.process_index,)))
            result[shared.output] = jax.make_array_from_single_device_arrays(
                shared.shape, self._replicated[k], mine, dtype=shared.dtype)
        return result, arriving

    def _share_locally(self, outputs: Sequence[Any]) -> list[Any]:
        result = list(outputs)
        shared = [(o.output, sharding) for o, sharding in zip(self._outputs, self._replicated)
                  if outputs[o.output].sharding.is_fully_replicated]
        if shared:
            moved = jax.device_put([outputs[j] for j, _ in shared], [sharding for _, sharding in shared])
            for (j, _), value in zip(shared, moved):
                result[j] = value
        return result


def _copy_on(value: jax.Array, device: Any) -> jax.Array:
    """``value``'s copy on ``device`` (a replicated value has one on each of its devices)."""
    for shard in value.addressable_shards:
        if shard.device == device:
            return shard.data
    raise ValueError(f"value: expected a copy on {device}, its devices are {sorted(value.sharding.device_set, key=str)}")
