"""``@compiler_pass``: marks a function as a pass of the compiler (or its driver).

The runtime interprets what passes made and runs none of them (``tests/test_layering.py``
checks that no runtime module imports a marked function), so a pass is marked where it is
defined and the rule needs no list of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

__all__ = ["compiler_pass", "is_compiler_pass"]

F = TypeVar("F", bound=Callable)


def compiler_pass(fn: F) -> F:
    """Marks ``fn`` as a compiler pass; returns it unchanged."""
    fn.__compiler_pass__ = True  # type: ignore[attr-defined]
    return fn


def is_compiler_pass(obj: object) -> bool:
    """Whether ``obj`` was marked by ``compiler_pass``."""
    return bool(getattr(obj, "__compiler_pass__", False))
