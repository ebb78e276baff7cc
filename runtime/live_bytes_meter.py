"""Measures the bytes of live buffers a step holds on each device (``passes.simulation.live_bytes``).

The executor and the program interpreter call ``sample`` after every
instruction they launch, with the arrays they hold at that moment: the
resident ones (inputs as placed, gradient accumulators, values around the
pipeline) and, inside the pipeline program, its buffers by ``BufferId``
(moves in flight under the buffer they will be received into). An array
counts on each device holding a piece of it, with that piece's bytes (its
shard's, or the whole array where replicated), once however many references
hold it; a donated (deleted) array counts nothing. What is counted is what
the runtime holds a reference to: an array is allocated from its launch,
which is when it is sampled, and released when the last reference goes.

CPU devices report no allocator statistics (``Device.memory_stats()`` is
``None`` on the CPU client), so the references are what can be measured on
every platform. A program's scratch space, which no reference holds, is added from XLA's
memory analysis of the compiled program (its temporaries) while the program runs: what the
allocator sees, on the devices of the program's mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jax

from meshpar.passes.program.devices import DeviceKey, device_key
from meshpar.passes.program.live_bytes import LiveBytes, MemoryProfile, ProgramKey
from meshpar.passes.program.pipeline_instructions import BufferId, BufferKind

__all__ = ["LiveBytesMeter", "device_bytes"]


def device_bytes(array: Any, ids: Mapping[DeviceKey, int] | None = None) -> dict[int, int]:
    """Device id -> bytes of ``array`` on it, for this process's devices (``{}`` for anything
    not a live ``jax.Array``). With ``ids``, devices are numbered by it and devices it does not
    number are left out (an array on another platform's device of the same id is not here)."""
    if not isinstance(array, jax.Array) or array.is_deleted():
        return {}
    sharding = array.sharding
    size = math.prod(array.shape)
    if size == 0:
        return {}
    piece = array.nbytes * math.prod(sharding.shard_shape(array.shape)) // size
    if ids is None:
        return {d.id: piece for d in sharding.addressable_devices}
    return {ids[device_key(d)]: piece for d in sharding.addressable_devices if device_key(d) in ids}


def _arrays(value: Any) -> Iterable[Any]:
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _arrays(v)
    else:
        yield value


def _unseen(value: Any, seen: set[int], ids: Mapping[DeviceKey, int] | None) -> Iterable[dict[int, int]]:
    """Per array of ``value`` not in ``seen`` (added to it), its bytes per device: an array held
    by several references counts once. Not cached by identity: a cache would keep every sampled
    array alive, and the step would then hold memory it frees when not measured."""
    for array in _arrays(value):
        if id(array) not in seen:
            seen.add(id(array))
            yield device_bytes(array, ids)


class LiveBytesMeter:
    """Per device, the peak resident, activation and total bytes over the samples of one step.

    Args:
      mesh_devices: per mesh of the program, its device ids (to report resident bytes per mesh).
      device_ids: the id of each device (``planner_ids`` over the meshes: distinct across
        platforms); ``None``: the devices' own ids.
    """

    def __init__(self, mesh_devices: Sequence[Sequence[int]], device_ids: Mapping[DeviceKey, int] | None = None
                 ) -> None:
        self.mesh_devices = tuple(tuple(m) for m in mesh_devices)
        self._ids = device_ids
        self._mesh_of = {d: m for m, devices in enumerate(self.mesh_devices) for d in devices}
        self._held_around: Callable[[], Iterable[Any]] = tuple
        self._total: dict[int, int] = {}
        self._activations: dict[int, int] = {}
        self._buffer_bytes: dict[tuple[Any, int, int], int] = {}
        self._shared: dict[int, int] = {}
        self._resident_in_pipeline = [0] * len(self.mesh_devices)
        self._resident_peak = [0] * len(self.mesh_devices)
        self._program_temps: dict[ProgramKey, int] = {}

    def around(self, held: Callable[[], Iterable[Any]]) -> None:
        """What the step holds outside the pipeline program: read at every sample (the
        executor's placed inputs, values and outputs, as they are then)."""
        self._held_around = held

    def sample(self, resident: Iterable[Any] = (), activations: Mapping[BufferId, Any] | None = None,
               running: tuple[int, int, ProgramKey] | None = None) -> None:
        """One sample: ``resident`` arrays (and nested lists of them) besides what ``around``
        returns; ``activations`` the pipeline program's buffers (``None`` outside it);
        ``running``: ``(mesh, bytes, program)``, the temporaries per device of the programs just
        launched on ``mesh`` (running now), counted in each of its devices' total."""
        seen: set[int] = set()
        per_device: dict[int, int] = {}
        for value in (*self._held_around(), *resident):
            for sizes in _unseen(value, seen, self._ids):
                for d, n in sizes.items():
                    per_device[d] = per_device.get(d, 0) + n
        by_mesh = [0] * len(self.mesh_devices)
        for d, n in per_device.items():
            m = self._mesh_of.get(d)
            if m is not None:
                by_mesh[m] = max(by_mesh[m], n)
        for m, n in enumerate(by_mesh):
            self._resident_peak[m] = max(self._resident_peak[m], n)
            if activations is not None:
                self._resident_in_pipeline[m] = max(self._resident_in_pipeline[m], n)
        acts: dict[int, int] = {}
        activations = activations or {}
        for buffer, value in activations.items():
            if buffer.kind is BufferKind.WEIGHT_STATE:
                self._note_shared(buffer, value, activations)
        for buffer, value in activations.items():
            largest = 0
            for sizes in _unseen(value, seen, self._ids):
                for d, n in sizes.items():
                    acts[d] = acts.get(d, 0) + n
                largest += max(sizes.values(), default=0)
            key = (buffer.kind, buffer.index, buffer.slot)
            self._buffer_bytes[key] = max(self._buffer_bytes.get(key, 0), largest)
        temps: dict[int, int] = {}
        if running is not None:
            mesh, nbytes, program = running
            temps = dict.fromkeys(self.mesh_devices[mesh], nbytes)
            self._program_temps[program] = max(self._program_temps.get(program, 0), nbytes)
        for d in {*per_device, *acts, *temps}:
            total = per_device.get(d, 0) + acts.get(d, 0) + temps.get(d, 0)
            self._total[d] = max(self._total.get(d, 0), total)
            self._activations[d] = max(self._activations.get(d, 0), acts.get(d, 0))

    def _note_shared(self, state: BufferId, value: Any, activations: Mapping[BufferId, Any]) -> None:
        """The bytes of weight state ``state`` that are arrays of its residuals, while both are held."""
        residuals = activations.get(BufferId(BufferKind.RESIDUALS, state.index, state.micro_batch))
        if residuals is None:
            return
        ids = {id(a) for a in _arrays(residuals)}
        shared = sum(max(device_bytes(a, self._ids).values(), default=0) for a in _arrays(value) if id(a) in ids)
        self._shared[state.index] = max(self._shared.get(state.index, 0), shared)

    def live_bytes(self) -> LiveBytes:
        """The measured peaks so far (this process's devices)."""
        return LiveBytes(dict(self._total), dict(self._activations), "measured")

    def profile(self) -> MemoryProfile:
        """The per-buffer and resident bytes seen, for ``passes.simulation.live_bytes.predict_live_bytes``."""
        return MemoryProfile(dict(self._buffer_bytes), tuple(self._resident_in_pipeline), tuple(self._resident_peak),
                             self.mesh_devices, dict(self._shared), dict(self._program_temps))
