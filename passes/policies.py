"""Policies the user names by a string, resolved to an enum member once, at the API.

A policy is a choice among fixed behaviours (how gradients reduce, how a value crosses meshes,
how p2p hops are dispatched): the user passes its name (``gradient_reduction="per_step"``), the
API module resolves it with ``Policy.of`` (an error naming the argument and the choices), and
everything past the API holds the member and asks it, never a string, what to do. Choices that
are open to extension (resharding strategies, balancers, schedules) are registries of objects
instead (``STRATEGIES``, ``BALANCERS``, ``SCHEDULES``), resolved the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import Any, TypeVar

__all__ = ["Policy"]

P = TypeVar("P", bound="Policy")


class Policy(enum.Enum):
    """An enum of policies, each member's value the name a user writes.

    Invariants: ``str(member)`` is that name (messages and ``describe()`` read as the user wrote
    it); ``of`` accepts a member or its name and nothing else.
    """

    @classmethod
    def of(cls: type[P], value: Any, arg: str, among: Collection[P] | None = None) -> P:
        """``value`` as a member: the member itself, or the member named ``value``; one of
        ``among`` (default: any member).

        Raises:
          ValueError: ``"{arg}: expected one of (...), got {value!r}"``, listing ``among``'s names.
        """
        allowed = tuple(cls) if among is None else tuple(among)
        member = value if isinstance(value, cls) else cls._value2member_map_.get(value) if isinstance(value, str) \
            else None
        if member not in allowed:
            raise ValueError(f"{arg}: expected one of {tuple(m.value for m in allowed)}, got {value!r}")
        return member

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The names a user may write, in declaration order."""
        return tuple(m.value for m in cls)

    def __str__(self) -> str:
        return self.value
