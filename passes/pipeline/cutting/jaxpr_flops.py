"""The arithmetic of a jaxpr: FLOPs (2mnk per matmul, one per output element elsewhere) and
operations, nested bodies counted (a scan's times its length). What the cost model prices a
stage's compute by, and what cuts layers of balanced work."""

from __future__ import annotations

import numpy as np
from jax.extend.core.primitives import scan_p

from ... import jax_ir

__all__ = ["eqn_flops", "jaxpr_flops", "jaxpr_ops"]


def _size(aval: jax_ir.AbstractValue) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def eqn_flops(eqn: jax_ir.JaxprEqn) -> float:
    """FLOPs of one run of ``eqn`` (its nested bodies counted)."""
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * int(np.prod([lhs[d] for d in contract], dtype=np.int64))
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * int(np.prod(rhs[1:], dtype=np.int64))
    inner = list(jax_ir.nested_jaxprs(eqn))
    if inner:
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        return trips * sum(jaxpr_flops(j) for j in inner)
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: jax_ir.Jaxpr | jax_ir.ClosedJaxpr) -> float:
    """Floating-point operations of one run: 2mnk per matmul, one per output element elsewhere,
    nested bodies counted (a scan's times its length)."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jax_ir.ClosedJaxpr) else jaxpr
    return float(sum(eqn_flops(e) for e in jaxpr.eqns))


def jaxpr_ops(jaxpr: jax_ir.Jaxpr | jax_ir.ClosedJaxpr) -> float:
    """Operations one run executes: every equation once, nested bodies counted (a scan's times
    its length), the call equations themselves not."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, jax_ir.ClosedJaxpr) else jaxpr
    total = 0.0
    for e in jaxpr.eqns:
        inner = list(jax_ir.nested_jaxprs(e))
        if inner:
            total += (e.params.get("length", 1) if e.primitive is scan_p else 1) * sum(jaxpr_ops(j) for j in inner)
        else:
            total += 1.0
    return total
