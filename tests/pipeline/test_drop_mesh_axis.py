"""passes.pipeline.placing.drop_mesh_axis: a traced step's sharding annotations without one mesh axis."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.pipeline.placing.drop_mesh_axis import drop_mesh_axis, spec_without


def test_spec_without_drops_the_axis_from_every_dimension():
    assert spec_without(P("data", "model"), "data") == P(None, "model")
    assert spec_without(P(("data", "model"), None), "data") == P("model", None)
    assert spec_without(P(("pipe", "data", "model")), "data") == P(("pipe", "model"))
    assert spec_without(P("model"), "data") == P("model")
    assert spec_without(P(), "data") == P()


def _shardings(closed):
    """Every NamedSharding an equation carries, nested jaxprs included, in order."""
    found = []

    def walk(value):
        if isinstance(value, NamedSharding):
            found.append(value)
        elif isinstance(value, jax.extend.core.ClosedJaxpr):
            for e in value.jaxpr.eqns:
                for v in e.params.values():
                    walk(v)
        elif isinstance(value, jax.extend.core.Jaxpr):
            for e in value.eqns:
                for v in e.params.values():
                    walk(v)
        elif isinstance(value, tuple):
            for v in value:
                walk(v)

    walk(closed)
    return found


def test_drop_mesh_axis_rewrites_constraints_in_nested_jits_and_keeps_the_values():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))

    @jax.jit
    def inner(x):
        return jax.lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P("data", "model")))

    def f(x):
        y = jax.lax.with_sharding_constraint(x + 1, NamedSharding(mesh, P(("data", "model"), None)))
        return inner(y).sum(0)

    closed = jax.make_jaxpr(f)(jnp.ones((4, 4)))
    before = [s.spec for s in _shardings(closed)]
    assert P("data", "model") in before and P(("data", "model"), None) in before
    dropped = drop_mesh_axis(closed, "data")
    after = [s.spec for s in _shardings(dropped)]
    assert len(after) == len(before)
    assert after == [spec_without(s, "data") for s in before]
    assert not any("data" in str(s) for s in after)
    x = np.arange(16, dtype=np.float32).reshape(4, 4)
    np.testing.assert_array_equal(jax.extend.core.jaxpr_as_fun(dropped)(x)[0], f(x))
