"""The one error every IR verifier raises, defined below every pass."""

from __future__ import annotations

__all__ = ["PlanVerificationError"]


class PlanVerificationError(AssertionError):
    """A pass produced IR that breaks an invariant; a bug, never bad input."""
