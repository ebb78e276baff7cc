"""Live bytes per device over a program, predicted (``simulation.live_bytes``) or measured
(``runtime.live_bytes_meter``): one record type for both."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from .pipeline_instructions import BufferKind, Instruction

__all__ = ["LiveBytes", "MemoryProfile", "program_key", "ProgramKey"]


ProgramKey = tuple[tuple[str, int], ...]


def program_key(ins: Instruction) -> ProgramKey:
    """What names the program an instruction runs, the same for every micro-batch: the kinds and
    stages of its tasks (``(("F", 0),)``; a fused program's several)."""
    return tuple((t.kind.value, t.where) for t in ins.tasks)


@dataclasses.dataclass(frozen=True)
class LiveBytes:
    """Per device id, the most bytes a step held at once: ``total`` (resident + activations at one
    instant), ``activations`` (the schedule's part alone, its own peak). ``source`` is
    ``"measured"`` or ``"predicted"``."""

    total: Mapping[int, int]
    activations: Mapping[int, int]
    source: str

    @property
    def peak_bytes(self) -> int:
        """The largest ``total`` over devices (0 with none)."""
        return max(self.total.values(), default=0)

    @property
    def peak_activation_bytes(self) -> int:
        """The largest ``activations`` over devices (0 with none)."""
        return max(self.activations.values(), default=0)


@dataclasses.dataclass(frozen=True)
class MemoryProfile:
    """What ``predict_live_bytes`` needs, per device of a mesh.

    Attributes:
      buffer_bytes: ``(kind, index, slot) -> bytes`` of one micro-batch's buffer of that kind at
        stage or edge ``index`` and output ``slot`` (``BufferId``'s meaning), on the mesh that holds it; a buffer not
        listed holds nothing here (e.g. an integer value's cotangent).
      resident_in_pipeline: per mesh, resident bytes while the pipeline program runs.
      resident_peak: per mesh, the most resident bytes at any point of the step.
      mesh_devices: per mesh, its device ids.
      state_from_residuals: per stage with a split backward, the bytes of its weight state
        that are arrays of its residuals (kept, not copied, when the residuals are freed).
      program_temp_bytes: per program (``program_key``), its temporaries per device while it runs.
    """

    buffer_bytes: Mapping[tuple[BufferKind, int, int], int]
    resident_in_pipeline: Sequence[int]
    resident_peak: Sequence[int]
    mesh_devices: Sequence[Sequence[int]]
    state_from_residuals: Mapping[int, int] = dataclasses.field(default_factory=dict)
    program_temp_bytes: Mapping[ProgramKey, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.mesh_devices)
        for name in ("resident_in_pipeline", "resident_peak"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"MemoryProfile.{name}: expected one per mesh ({n}), got {len(getattr(self, name))}")
        negative = [k for k, v in self.buffer_bytes.items() if v < 0]
        if negative:
            raise ValueError(f"MemoryProfile.buffer_bytes: negative bytes for {negative[0]}")
