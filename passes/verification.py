"""The one error every IR verifier raises, defined below every pass, and how deep verifiers go.

Every verifier checks its pass's invariants (shapes, wiring, counts) always. Type-checking a
whole jaxpr with JAX's checker is deeper and costs a fifth of tracing a step (0.4 of 2.1 s on
the main job), so it runs when deep verification is on: ``MESHPAR_VERIFY=full`` in the
environment (the test suite sets it) or JAX's own ``jax_enable_checks``. A jaxpr a pass broke
still fails when it is lowered; deep verification names the pass instead.
"""

from __future__ import annotations

import os
from typing import Any

import jax

from .policies import Policy

__all__ = ["PlanVerificationError", "VerificationDepth", "deep_verification", "type_check"]


class PlanVerificationError(AssertionError):
    """A pass produced IR that breaks an invariant; a bug, never bad input."""


class VerificationDepth(Policy):
    """How deep verifiers go (``MESHPAR_VERIFY``)."""

    INVARIANTS = "invariants"  # each pass's invariants (the default)
    FULL = "full"  # and JAX's type check of each whole jaxpr a pass made


def deep_verification() -> bool:
    """Whether verifiers also type-check whole jaxprs (module doc).

    Raises:
      ValueError: ``MESHPAR_VERIFY`` is set to something else than ``invariants`` or ``full``.
    """
    depth = VerificationDepth.of(os.environ.get("MESHPAR_VERIFY", "invariants"), "MESHPAR_VERIFY")
    return depth is VerificationDepth.FULL or bool(jax.config.jax_enable_checks)


def type_check(jaxpr: Any, what: str) -> None:
    """JAX's type check of ``jaxpr`` (a ``jax.extend.core.Jaxpr``) under deep verification.

    Raises:
      PlanVerificationError: ``what`` does not type-check, with JAX's reason.
    """
    if not deep_verification():
        return
    from jax.extend.core import check_jaxpr

    try:
        check_jaxpr(jaxpr)
    except Exception as e:
        raise PlanVerificationError(f"{what} does not type-check: {e}") from e
