"""What a step instruction launches, as the check that every process launches alike reads it
(``lowering.launch_sequences``): programs on a mesh, planned moves, single copies between two
devices, and the pipeline program's own launches. A step instruction lists its own
(``StepInstruction.launches``), so that check names no instruction kind."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Union

from .moves import MoveKey

__all__ = ["DeviceCopy", "Launch", "LaunchSink", "MoveLaunch", "PipelineLaunches", "ProgramLaunch"]


class LaunchSink(Protocol):
    """What records launches (``lowering.launch_sequences``'s walk)."""

    def on_mesh(self, mesh: int, what: str) -> None:
        """A program on mesh ``mesh``, named ``what``."""

    def move(self, key: MoveKey, what: str) -> None:
        """The planned move ``key``, named ``what``."""

    def transfer(self, what: str, src: Any, dst: Any) -> None:
        """One ``jax.device_put`` from device ``src`` to device ``dst``, named ``what``."""

    def pipeline(self) -> None:
        """The pipeline program's launches, in its one order."""


@dataclasses.dataclass(frozen=True)
class ProgramLaunch:
    """A program on mesh ``mesh``; ``what`` names it."""

    mesh: int
    what: str

    def issue(self, sink: LaunchSink) -> None:
        sink.on_mesh(self.mesh, self.what)


@dataclasses.dataclass(frozen=True)
class MoveLaunch:
    """The planned move ``key`` (its programs and hops, as planned); ``what`` names it."""

    key: MoveKey
    what: str

    def issue(self, sink: LaunchSink) -> None:
        sink.move(self.key, self.what)


@dataclasses.dataclass(frozen=True)
class DeviceCopy:
    """One ``jax.device_put`` of a single-device array from device ``src`` to ``dst``."""

    what: str
    src: Any
    dst: Any

    def issue(self, sink: LaunchSink) -> None:
        sink.transfer(self.what, self.src, self.dst)


@dataclasses.dataclass(frozen=True)
class PipelineLaunches:
    """The pipeline program's launches (``PipelineProgram.launch_sequence``)."""

    def issue(self, sink: LaunchSink) -> None:
        sink.pipeline()


Launch = Union[ProgramLaunch, MoveLaunch, DeviceCopy, PipelineLaunches]
