"""A jaxpr whose sharding annotations no longer name one mesh axis, and one to run manual over it.

A stage run as data-parallel replicas (``data_replicas``) runs its per-replica parts inside a
``shard_map`` manual over the data axis, each device computing its own replica. A replica's
values are its own, so the user's constraints that shard them over ``P("data", ...)`` must
name that axis nowhere (a constraint may not name a manual axis). Dropping the axis from each
annotation keeps everything else the user asked for (the model axis, unconstrained dims).
JAX 0.10 also records in every equation the mesh it was traced under and enters it again to
evaluate it, so ``manual_mesh_axis`` marks the axis manual there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

from ...compiler_pass import compiler_pass
from ... import jax_ir

__all__ = ["drop_mesh_axis", "manual_mesh_axis", "spec_without"]


def spec_without(spec: P, axis: str) -> P:
    """``spec`` with ``axis`` removed from every dimension (a dimension left with no axis is
    ``None``)."""
    entries = []
    for entry in spec:
        if isinstance(entry, tuple):
            kept = tuple(a for a in entry if a != axis)
            entries.append(kept if len(kept) > 1 else (kept[0] if kept else None))
        else:
            entries.append(None if entry == axis else entry)
    return P(*entries)


def _manual(mesh: Mesh | AbstractMesh, axis: str) -> AbstractMesh:
    abstract = mesh.abstract_mesh
    if abstract.empty or axis not in abstract.axis_names:
        return abstract
    return abstract.update_axis_types({axis: AxisType.Manual})


class _Rewrite:
    """One rewrite of a jaxpr's equation parameters (``leaf`` on each value that is not a jaxpr
    or a tuple), and with ``ctx_mesh`` of its context meshes and of the shardings its values'
    types carry, nested jaxprs included."""

    def __init__(self, leaf: Callable[[Any], Any], ctx_mesh: Callable[[AbstractMesh], AbstractMesh] | None) -> None:
        self.leaf, self.ctx_mesh = leaf, ctx_mesh

    def var(self, v: jax_ir.Atom, env: dict[jax_ir.Var, jax_ir.Var]) -> jax_ir.Atom:
        """``v`` with its type's sharding rewritten (JAX evaluates a scan's stacked results into
        buffers of its body's result types: their meshes must be the context's)."""
        if self.ctx_mesh is None or isinstance(v, jax_ir.Literal):
            return v
        if v not in env:
            sharding = getattr(v.aval, "sharding", None)
            new = self.leaf(sharding) if isinstance(sharding, NamedSharding) else sharding
            if new is sharding:
                env[v] = v
            else:
                aval = v.aval.update(sharding=new)
                env[v] = jax_ir.DropVar(aval) if isinstance(v, jax_ir.DropVar) else jax_ir.Var(aval)
        return env[v]

    def param(self, value: Any) -> Any:
        if isinstance(value, jax_ir.ClosedJaxpr):
            return jax_ir.ClosedJaxpr(self.jaxpr(value.jaxpr), value.consts)
        if isinstance(value, jax_ir.Jaxpr):
            return self.jaxpr(value)
        if isinstance(value, tuple):
            items = [self.param(v) for v in value]
            if all(a is b for a, b in zip(items, value)):
                return value  # untouched, named tuples (gather's dimension numbers) keep their type
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return self.leaf(value)

    def jaxpr(self, jaxpr: jax_ir.Jaxpr) -> jax_ir.Jaxpr:
        env: dict[jax_ir.Var, jax_ir.Var] = {}
        eqns = []
        for e in jaxpr.eqns:
            params = {k: self.param(v) for k, v in e.params.items()}
            if self.ctx_mesh is None:
                eqns.append(e.replace(params=params))
                continue
            # Evaluating an equation enters the mesh it was traced under: inside the shard_map
            # that mesh must have the axis manual, as the values' types do.
            e = e.replace(params=params, invars=[self.var(v, env) for v in e.invars],
                          outvars=[self.var(v, env) for v in e.outvars])
            eqns.append(jax_ir.with_context_mesh(e, self.ctx_mesh))
        if self.ctx_mesh is None:
            return jaxpr.replace(eqns=eqns)
        return jaxpr.replace(eqns=eqns, constvars=[self.var(v, env) for v in jaxpr.constvars],
                             invars=[self.var(v, env) for v in jaxpr.invars],
                             outvars=[self.var(v, env) for v in jaxpr.outvars])

    def __call__(self, closed: jax_ir.ClosedJaxpr) -> jax_ir.ClosedJaxpr:
        return jax_ir.ClosedJaxpr(self.jaxpr(closed.jaxpr), closed.consts)


@compiler_pass
def drop_mesh_axis(closed: jax_ir.ClosedJaxpr, axis: str) -> jax_ir.ClosedJaxpr:
    """``closed`` with ``axis`` dropped from every ``NamedSharding`` its equations carry (sharding
    constraints, nested ``jit`` in/out shardings), nested jaxprs included."""

    def leaf(value: Any) -> Any:
        if isinstance(value, NamedSharding):
            return NamedSharding(value.mesh, spec_without(value.spec, axis), memory_kind=value.memory_kind)
        return value

    return _Rewrite(leaf, None)(closed)


@compiler_pass
def manual_mesh_axis(closed: jax_ir.ClosedJaxpr, axis: str) -> jax_ir.ClosedJaxpr:
    """``closed`` to be evaluated inside a ``shard_map`` manual over ``axis`` (the replicas of
    ``data_replicas``): every equation's recorded context mesh, every nested jit's and every
    sharding's mesh with ``axis`` manual, nested jaxprs included."""

    def leaf(value: Any) -> Any:
        if isinstance(value, (Mesh, AbstractMesh)):
            return _manual(value, axis)
        if isinstance(value, NamedSharding):
            return NamedSharding(_manual(value.mesh, axis), value.spec, memory_kind=value.memory_kind)
        return value

    return _Rewrite(leaf, lambda mesh: _manual(mesh, axis))(closed)
