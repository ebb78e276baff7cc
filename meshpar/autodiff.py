"""``meshpar.grad`` / ``meshpar.value_and_grad``: JAX's, plus a marker for the pipeline compiler.

Outside ``meshpar.parallelize`` they are ``jax.grad`` / ``jax.value_and_grad``.
While ``parallelize`` traces a train step they bind one ``pipeline_grad``
primitive instead, which carries the loss function's jaxpr (stage markers
included) and stands for "loss and gradients here": the compiler cuts the
loss into forward stages, derives their backward stages, and keeps what comes
after (the optimizer update) as the apply-gradient computation.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax._src import core
from jax._src import linear_util as lu

__all__ = ["grad", "value_and_grad", "pipeline_grad_p", "tracing_pipeline"]

_state = threading.local()


@contextlib.contextmanager
def tracing_pipeline() -> Iterator[None]:
    """While active, ``value_and_grad`` binds ``pipeline_grad_p`` instead of differentiating."""
    previous = getattr(_state, "active", False)
    _state.active = True
    try:
        yield
    finally:
        _state.active = previous


pipeline_grad_p = core.Primitive("meshpar_pipeline_grad")
pipeline_grad_p.multiple_results = True


@pipeline_grad_p.def_abstract_eval
def _abstract_eval(*avals: core.AbstractValue, loss_jaxpr: core.ClosedJaxpr, num_diff: int) -> list:
    return [loss_jaxpr.out_avals[0], *avals[:num_diff]]


@pipeline_grad_p.def_impl
def _impl(*args: Any, loss_jaxpr: core.ClosedJaxpr, num_diff: int) -> list:
    # Evaluating the traced step directly (no pipeline): plain value_and_grad.
    def loss(diff, rest):
        return core.jaxpr_as_fun(loss_jaxpr)(*diff, *rest)[0]

    value, grads = jax.value_and_grad(loss)(list(args[:num_diff]), list(args[num_diff:]))
    return [value, *grads]


def value_and_grad(fun: Callable[..., Any], argnums: int = 0) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad(fun)`` for a scalar loss of its first argument.

    Inside a ``meshpar.parallelize``-d step the loss must be a mean over the
    batch: the step's gradient is the mean of the micro-batches' gradients.
    """
    if argnums != 0:
        raise ValueError(f"argnums: meshpar differentiates the first argument only, got {argnums}")

    def wrapped(params: Any, *args: Any) -> tuple[Any, Any]:
        if not getattr(_state, "active", False):
            return jax.value_and_grad(fun)(params, *args)
        converted, consts = jax.closure_convert(lambda p: fun(p, *args), params)
        leaves, treedef = jax.tree.flatten(params)
        closed = jax.make_jaxpr(lambda ls, cs: converted(jax.tree.unflatten(treedef, ls), *cs))(leaves, consts)
        if len(closed.out_avals) != 1 or closed.out_avals[0].shape != ():
            raise TypeError(
                f"value_and_grad: the loss function must return one scalar, got {closed.out_avals}"
            )
        # Operands: the differentiated leaves first, then the jaxpr's own
        # constants and the closed-over values, all as plain inputs so the
        # compiler can cut the loss anywhere.
        jaxpr = closed.jaxpr
        n = len(leaves)
        reordered = core.Jaxpr(
            constvars=(),
            invars=[*jaxpr.invars[:n], *jaxpr.constvars, *jaxpr.invars[n:]],
            outvars=jaxpr.outvars,
            eqns=jaxpr.eqns,
            effects=jaxpr.effects,
            debug_info=lu.DebugInfo(
                "meshpar.value_and_grad", getattr(fun, "__name__", "loss"),
                tuple(f"arg{i}" for i in range(len(jaxpr.invars) + len(jaxpr.constvars))), ("loss",),
            ),
        )
        value, *grads = pipeline_grad_p.bind(
            *leaves, *closed.consts, *consts, loss_jaxpr=core.ClosedJaxpr(reordered, ()), num_diff=n
        )
        return value, jax.tree.unflatten(treedef, grads)

    return wrapped


def grad(fun: Callable[..., Any], argnums: int = 0) -> Callable[..., Any]:
    """Like ``jax.grad``; see ``value_and_grad``."""
    vg = value_and_grad(fun, argnums)
    return lambda *args: vg(*args)[1]
