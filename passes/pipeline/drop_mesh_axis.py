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

from typing import Any

from jax._src import core
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec as P

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


def _sharding_without(sharding: NamedSharding, axis: str) -> NamedSharding:
    return NamedSharding(sharding.mesh, spec_without(sharding.spec, axis), memory_kind=sharding.memory_kind)


def _param_without(value: Any, axis: str) -> Any:
    if isinstance(value, NamedSharding):
        return _sharding_without(value, axis)
    if isinstance(value, core.ClosedJaxpr):
        return core.ClosedJaxpr(_jaxpr_without(value.jaxpr, axis), value.consts)
    if isinstance(value, core.Jaxpr):
        return _jaxpr_without(value, axis)
    if isinstance(value, tuple):
        items = [_param_without(v, axis) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value  # untouched, named tuples (gather's dimension numbers) keep their type
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _jaxpr_without(jaxpr: core.Jaxpr, axis: str) -> core.Jaxpr:
    eqns = [e.replace(params={k: _param_without(v, axis) for k, v in e.params.items()}) for e in jaxpr.eqns]
    return jaxpr.replace(eqns=eqns)


def _manual(mesh: Mesh | AbstractMesh, axis: str) -> AbstractMesh:
    abstract = mesh.abstract_mesh
    if abstract.empty or axis not in abstract.axis_names:
        return abstract
    return abstract.update_axis_types({axis: AxisType.Manual})


def _param_manual(value: Any, axis: str) -> Any:
    if isinstance(value, (Mesh, AbstractMesh)):
        return _manual(value, axis)
    if isinstance(value, NamedSharding):
        return NamedSharding(_manual(value.mesh, axis), value.spec, memory_kind=value.memory_kind)
    if isinstance(value, core.ClosedJaxpr):
        return core.ClosedJaxpr(_jaxpr_manual(value.jaxpr, axis), value.consts)
    if isinstance(value, core.Jaxpr):
        return _jaxpr_manual(value, axis)
    if isinstance(value, tuple):
        items = [_param_manual(v, axis) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    return value


def _jaxpr_manual(jaxpr: core.Jaxpr, axis: str) -> core.Jaxpr:
    eqns = []
    for e in jaxpr.eqns:
        ctx = e.ctx
        # Evaluating an equation enters the mesh it was traced under (JAX 0.10): inside the
        # shard_map that mesh must have the axis manual, as the values' types do.
        ctx = core.JaxprEqnContext._create(ctx.compute_type, ctx.threefry_partitionable,
                                           _manual(ctx.cur_abstract_mesh, axis), ctx.remove_size_one_mesh_axis,
                                           ctx.xla_metadata)
        eqns.append(e.replace(params={k: _param_manual(v, axis) for k, v in e.params.items()}, ctx=ctx))
    return jaxpr.replace(eqns=eqns)


def drop_mesh_axis(closed: core.ClosedJaxpr, axis: str) -> core.ClosedJaxpr:
    """``closed`` with ``axis`` dropped from every ``NamedSharding`` its equations carry (sharding
    constraints, nested ``jit`` in/out shardings), nested jaxprs included."""
    return core.ClosedJaxpr(_jaxpr_without(closed.jaxpr, axis), closed.consts)


def manual_mesh_axis(closed: core.ClosedJaxpr, axis: str) -> core.ClosedJaxpr:
    """``closed`` to be evaluated inside a ``shard_map`` manual over ``axis`` (the replicas of
    ``data_replicas``): every equation's recorded context mesh, every nested jit's and every
    sharding's mesh with ``axis`` manual, nested jaxprs included."""
    return core.ClosedJaxpr(_jaxpr_manual(closed.jaxpr, axis), closed.consts)
