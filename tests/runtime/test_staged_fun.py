"""``jax_ir.staged_fun``: the runtime's programs copy a part's equations into the program they
trace, instead of binding each again (``jaxpr_as_fun``), and compute the same."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive

from meshpar.passes import jax_ir


def _counted_primitive():
    """An identity primitive that counts its bindings: tracing through it binds it once each time."""
    calls = []

    class Counted(Primitive):
        def bind(self, *args, **params):
            calls.append(args)
            return super().bind(*args, **params)

    prim = Counted("counted_identity")
    prim.def_abstract_eval(lambda x: x)
    return prim, calls


def test_a_staged_jaxpr_is_copied_into_the_program_not_evaluated_again():
    prim, calls = _counted_primitive()
    x = jnp.ones((4, 3), jnp.float32)
    closed = jax.make_jaxpr(lambda x: [prim.bind(jnp.sin(x)) * 2.0])(x)
    assert len(calls) == 1
    staged = jax.make_jaxpr(jax_ir.staged_fun(closed))(x)
    assert len(calls) == 1  # copied: no equation bound again
    assert [(e.primitive, e.params, [v.aval for v in e.outvars]) for e in staged.jaxpr.eqns] == [
        (e.primitive, e.params, [v.aval for v in e.outvars]) for e in closed.jaxpr.eqns]
    jax.make_jaxpr(jax_ir.jaxpr_as_fun(closed))(x)
    assert len(calls) == 2  # evaluated: each equation bound again


def _step(w, x):
    h = jax.jit(lambda a, b: jnp.tanh(a @ b))(x, w)
    total, hs = jax.lax.scan(lambda c, r: (c + r.sum(), r * c), 0.0, h)
    return [hs + jnp.arange(3.0), total]


def test_a_staged_jaxpr_computes_what_it_evaluates_to_traced_or_not():
    rng = np.random.default_rng(0)
    w, x = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((5, 3), (4, 5)))
    closed = jax.make_jaxpr(_step)(w, x)
    want = jax.jit(_step)(w, x)
    staged = jax_ir.staged_fun(closed)
    for got in (jax.jit(staged)(w, x), staged(w, x)):  # traced, and eagerly (evaluated)
        for g, r in zip(got, want):
            np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    # Under transformations other than staging it evaluates the jaxpr, as JAX's own rules do.
    xs = jnp.stack([x, 2 * x])
    batched = jax.jit(jax.vmap(staged, in_axes=(None, 0)))(w, xs)
    for g, r in zip(batched, jax.vmap(_step, in_axes=(None, 0))(w, xs)):
        np.testing.assert_allclose(g, r, rtol=1e-6, atol=1e-6)
    grad = jax.jit(jax.grad(lambda w: staged(w, x)[1]))(w)
    np.testing.assert_allclose(grad, jax.grad(lambda w: _step(w, x)[1])(w), rtol=1e-5, atol=1e-6)
