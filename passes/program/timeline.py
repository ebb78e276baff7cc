"""A program's timeline, simulated or recorded: lanes, events, and one per schedule task."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

from .tasks import Task

__all__ = ["Lane", "LaneKind", "Timeline", "timeline_of", "TimelineEvent"]


class LaneKind(enum.Enum):
    COMPUTE = "compute"
    LINK = "link"


@dataclasses.dataclass(frozen=True, order=True)
class Lane:
    """``COMPUTE`` lanes are mesh ``src`` (``dst`` is ``None``); ``LINK`` lanes carry transfers
    from mesh ``src`` to mesh ``dst``."""

    kind: LaneKind
    src: int
    dst: int | None = None

    def __post_init__(self) -> None:
        if (self.kind is LaneKind.LINK) != (self.dst is not None):
            raise ValueError(f"Lane: a {self.kind.value} lane {'needs' if self.kind is LaneKind.LINK else 'has no'} dst")

    def __str__(self) -> str:
        return f"mesh {self.src}" if self.kind is LaneKind.COMPUTE else f"link {self.src} -> {self.dst}"

    def sort_key(self) -> tuple[int, int, int]:
        """Meshes in order, each followed by the links out of it."""
        return (self.src, 0 if self.kind is LaneKind.COMPUTE else 1, -1 if self.dst is None else self.dst)


@dataclasses.dataclass(frozen=True)
class TimelineEvent:
    """``task`` ran on ``lane`` from ``start`` to ``end`` seconds (after the step began, once in a
    ``Timeline``)."""

    task: Task
    lane: Lane
    start: float
    end: float

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(f"TimelineEvent {self.task}: ends at {self.end} before it starts at {self.start}")


@dataclasses.dataclass(frozen=True)
class Timeline:
    """Events of one step, by start time; ``source`` says where they came from ("simulated",
    "measured", ...) and titles the trace. ``origin`` is the clock reading time 0 stands for
    (``time.perf_counter()`` when measured: one monotonic clock shared by every process of a
    machine, so timelines of several processes line up by it)."""

    events: tuple[TimelineEvent, ...]
    source: str
    origin: float = 0.0

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0) - min((e.start for e in self.events), default=0.0)

    def lanes(self) -> list[Lane]:
        return sorted({e.lane for e in self.events}, key=Lane.sort_key)


def timeline_of(events: Sequence[TimelineEvent], source: str) -> Timeline:
    """A ``Timeline`` of ``events`` sorted by start, shifted so the first starts at 0 (the
    ``origin``)."""
    t0 = min((e.start for e in events), default=0.0)
    shifted = sorted((dataclasses.replace(e, start=e.start - t0, end=e.end - t0) for e in events),
                     key=lambda e: (e.start, e.lane.sort_key()))
    return Timeline(tuple(shifted), source, t0)
