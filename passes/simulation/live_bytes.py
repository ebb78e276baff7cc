"""Bytes of live buffers per device in a pipeline step: measured by the runtime, predicted here.

A step holds two kinds of bytes on each device:

- **resident**: what the step holds whatever the schedule: its inputs as placed
  (parameters, optimizer state, the batch and its micro-batch slices), the
  gradient accumulators, and the values computed around the pipeline (the
  reduced gradients, the updated parameters and optimizer state);
- **activations**: what the schedule decides: per micro-batch, each stage's
  outputs kept until sent, its forward residuals kept for its backward, the
  weight pass's state, cotangents, and every value received or in flight to a
  mesh.

Besides both, a running program needs its **temporaries** (XLA's memory analysis of the
compiled program: what it allocates inside, a fused program's residuals among them). They
count in the total (what the allocator sees) while it runs, in neither kind.

The runtime (``runtime.live_bytes_meter``) samples both after every
instruction it launches, from the arrays it holds (each array's bytes on a
device: its shard's, or all of it where replicated), and keeps per device the
most of each it saw and the most of their sum: ``LiveBytes``. It also keeps
a ``MemoryProfile``: the per-device bytes of one micro-batch's buffer of each
kind, per stage or edge, and the resident bytes per mesh.

``predict_live_bytes`` predicts the same peaks from the profile and the
program's launch order: buffers appear where the instruction making them is
launched (a moved value at its ``Send``, on the receiving mesh) and go at
their ``Free`` (a weight state's arrays that are its stage's residuals count once, with
the residuals until they are freed, then with the state); the per-device total is the larger of the resident bytes
while the pipeline runs plus the activation peak, and the resident peak
(outside the pipeline, where old and new parameters are both held), each raised by the
temporaries of the programs running at that point. Bytes are
per device of a mesh; devices of one mesh hold the same shard sizes, so a
mesh's prediction stands for each of its devices.
"""

from __future__ import annotations

from ..program.live_bytes import LiveBytes, MemoryProfile, program_key
from ..program.pipeline_instructions import BufferId, BufferKind, PipelineProgram, received_buffer

__all__ = ["predict_live_bytes"]


def predict_live_bytes(program: PipelineProgram, profile: MemoryProfile) -> LiveBytes:
    """The per-device peaks of one run of ``program`` (module doc), from ``profile``.

    Raises:
      ValueError: ``profile`` has not one entry per mesh of ``program``.
    """
    num_meshes = len(program.instructions)
    if len(profile.mesh_devices) != num_meshes:
        raise ValueError(f"profile: expected {num_meshes} meshes as the program has, got {len(profile.mesh_devices)}")
    size, shared = profile.buffer_bytes, profile.state_from_residuals
    live: dict[tuple[BufferId, int], int] = {}  # (buffer, mesh) -> bytes per device
    held = [0] * num_meshes
    peak = [0] * num_meshes
    peak_running = [0] * num_meshes  # activations held plus a running program's temporaries

    def add(buffer: BufferId, mesh: int, nbytes: int) -> None:
        live[(buffer, mesh)] = live.get((buffer, mesh), 0) + nbytes
        held[mesh] += nbytes
        peak[mesh] = max(peak[mesh], held[mesh])

    def bytes_of(buffer: BufferId) -> int:
        return size.get((buffer.kind, buffer.index, buffer.slot), 0)

    def free(buffer: BufferId, mesh: int) -> None:
        nbytes = live.pop((buffer, mesh), 0)
        if buffer.kind is BufferKind.RESIDUALS:
            # What the weight state took of them stays, now counted with it.
            state = (BufferId(BufferKind.WEIGHT_STATE, buffer.index, buffer.micro_batch), mesh)
            if state in live:
                kept = min(nbytes, shared.get(buffer.index, 0))
                live[state] += kept
                nbytes -= kept
        held[mesh] -= nbytes

    def new_bytes(buffer: BufferId, mesh: int) -> int:
        nbytes = bytes_of(buffer)
        if buffer.kind is BufferKind.WEIGHT_STATE and (
                BufferId(BufferKind.RESIDUALS, buffer.index, buffer.micro_batch), mesh) in live:
            # Its residuals are still held: the arrays the state shares with them are not new.
            nbytes = max(0, nbytes - shared.get(buffer.index, 0))
        return nbytes

    home = program.stage_mesh
    for mesh, ins in program.launch_sequence():
        for b in ins.frees:
            free(b, mesh)
        for b in ins.writes:
            if (b, mesh) not in live:  # a received value was counted on its mesh at its send
                add(b, mesh, new_bytes(b, mesh))
        for transfer, m in ins.sends:
            dst = received_buffer(program.transfers[transfer], m)
            add(dst, home[program.transfers[transfer].dst_stage], bytes_of(dst))
        temp = profile.program_temp_bytes.get(program_key(ins), 0) if ins.tasks else 0
        peak_running[mesh] = max(peak_running[mesh], held[mesh] + temp)
    total, activations = {}, {}
    for m, devices in enumerate(profile.mesh_devices):
        mesh_total = max(profile.resident_in_pipeline[m] + max(peak[m], peak_running[m]), profile.resident_peak[m])
        for d in devices:
            total[d], activations[d] = mesh_total, peak[m]
    return LiveBytes(total, activations, "predicted")
