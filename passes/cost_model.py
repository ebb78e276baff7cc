"""A simple cost model of pipeline tasks: FLOPs of a jaxpr, bytes over a link.

Estimates, not measurements: they rank choices (how long to delay a weight
pass) before anything runs. The simulator refines them with measured
durations.
"""

from __future__ import annotations

import numpy as np
from jax._src import core

from .stage_graph import subjaxprs

__all__ = ["DEVICE_FLOPS", "jaxpr_flops", "compute_seconds", "transfer_seconds"]

# Sustained FLOP/s of one device, by platform: orders of magnitude, enough to
# compare a stage's compute with its transfers.
DEVICE_FLOPS = {"cpu": 2e10, "gpu": 1e14, "tpu": 1e14}


def _size(aval: core.AbstractValue) -> int:
    return int(np.prod(getattr(aval, "shape", ()), dtype=np.int64))


def _eqn_flops(eqn: core.JaxprEqn) -> float:
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * int(np.prod([lhs[d] for d in contract], dtype=np.int64))
    if name == "conv_general_dilated":
        rhs = eqn.invars[1].aval.shape
        return 2.0 * _size(eqn.outvars[0].aval) * int(np.prod(rhs[1:], dtype=np.int64))
    inner = list(subjaxprs(eqn))
    if inner:
        trips = eqn.params.get("length", 1) if name == "scan" else 1
        return trips * sum(jaxpr_flops(j) for j in inner)
    return float(sum(_size(v.aval) for v in eqn.outvars))


def jaxpr_flops(jaxpr: core.Jaxpr | core.ClosedJaxpr) -> float:
    """Floating-point operations of one run: 2mnk per matmul, one per output element elsewhere,
    nested bodies counted (a scan's times its length)."""
    jaxpr = jaxpr.jaxpr if isinstance(jaxpr, core.ClosedJaxpr) else jaxpr
    return float(sum(_eqn_flops(e) for e in jaxpr.eqns))


def compute_seconds(flops: float, num_devices: int, platform: str) -> float:
    """``flops`` spread over ``num_devices`` devices of ``platform``."""
    return flops / (DEVICE_FLOPS.get(platform, DEVICE_FLOPS["gpu"]) * max(num_devices, 1))


def transfer_seconds(num_bytes: int, bandwidth: float) -> float:
    """``num_bytes`` over a link of ``bandwidth`` bytes/s."""
    return num_bytes / bandwidth
