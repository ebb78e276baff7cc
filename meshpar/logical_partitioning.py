"""flax logical partitioning in a ``meshpar.parallelize``-d step, and the warnings for a model
axis that shards nothing.

flax names a parameter's dimensions either by mesh axes (``nn.with_partitioning(init, (None,
"model"))``) or by logical names (``nn.with_logical_partitioning(init, ("embed", "mlp"))``,
NNX Variables whose ``out_sharding`` names logical axes) that ``nn.logical_axis_rules`` map to
mesh axes. The rules in force for a step are ``PipeshardParallel.logical_axis_rules`` when
given, else those active (``nn.logical_axis_rules``) when the step is called; ``rules_in_force``
makes the former the latter while the step is planned, traced and laid out, so the parameters'
layout (``partition_specs``), flax's own constraints in the traced step and NNX's
``nnx.get_partition_spec`` all read the same rules. A logical name without a rule is
replicated, as flax does.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax.extend.core.primitives import sharding_constraint_p
from jax.sharding import Mesh

from meshpar.passes import jax_ir

if TYPE_CHECKING:
    from meshpar.passes.pipeline_driver import CompiledPipeline

__all__ = ["LogicalRules", "check_logical_axis_rules", "mesh_named", "rules_in_force", "warn_unused_model_axis",
           "warn_without_rules"]

# ``(logical name, mesh axis | mesh axes | None)`` pairs, in flax's order of precedence.
LogicalRules = tuple[tuple[str, str | tuple[str, ...] | None], ...]

_EXAMPLE = "[('embed', None), ('mlp', 'model'), ('batch', 'data')]"


def check_logical_axis_rules(rules: Any) -> LogicalRules | None:
    """``rules`` (``PipeshardParallel.logical_axis_rules``) as a tuple of pairs, or ``None``.

    Raises:
      ValueError: ``rules`` is not a sequence of ``(logical name, mesh axis or None)`` pairs
        (a mesh axis may be a tuple of axis names), naming ``logical_axis_rules``.
    """
    if rules is None:
        return None
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise ValueError(f"logical_axis_rules: expected a sequence of (logical name, mesh axis or None) pairs, "
                         f"e.g. {_EXAMPLE}, got {rules!r}")
    checked = []
    for rule in rules:
        if isinstance(rule, (str, bytes)) or not isinstance(rule, Sequence) or len(rule) != 2:
            raise ValueError(f"logical_axis_rules: expected (logical name, mesh axis or None) pairs, e.g. "
                             f"{_EXAMPLE}, got the entry {rule!r}")
        name, axes = rule
        if not isinstance(name, str) or not name:
            raise ValueError(f"logical_axis_rules: the logical name of {tuple(rule)!r} must be a non-empty str, "
                             f"e.g. ('mlp', 'model')")
        if isinstance(axes, Sequence) and not isinstance(axes, str):
            axes = tuple(axes)
        if not (axes is None or (isinstance(axes, str) and axes)
                or (isinstance(axes, tuple) and axes and all(isinstance(a, str) and a for a in axes))):
            raise ValueError(f"logical_axis_rules: the mesh axis of {tuple(rule)!r} must be a mesh axis name, a "
                             f"tuple of them, or None (replicated), e.g. ('mlp', 'model') or ('embed', None)")
        checked.append((name, axes))
    return tuple(checked)


@contextlib.contextmanager
def rules_in_force(rules: LogicalRules | None) -> Iterator[None]:
    """``rules`` active (``nn.logical_axis_rules``) inside; ``None`` leaves the caller's rules."""
    if rules is None:
        yield
        return
    with nn.logical_axis_rules(rules):
        yield


def _is_box(x: Any) -> bool:
    return isinstance(x, nn.Partitioned)


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def mesh_named(args: Any) -> Any:
    """``args`` with each linen ``nn.LogicallyPartitioned`` box's logical names replaced by the
    mesh axes the rules map them to (the box's own ``rules`` when it has them, else the active
    ``nn.logical_axis_rules``, as the box's ``unbox`` constrains it); names without a rule
    become ``None`` (replicated)."""

    def rename(x: Any) -> Any:
        if not isinstance(x, nn.LogicallyPartitioned):
            return x
        rules = x.rules if x.rules is not None else nn.get_logical_axis_rules()
        return x.replace(names=tuple(nn.logical_to_mesh_axes(x.names, rules)))

    return jax.tree.map(rename, args, is_leaf=_is_box)


def _names(spec: Sequence[Any]) -> set[str]:
    """The axis names a partition spec's entries name (``None`` and ``P.UNCONSTRAINED`` none)."""
    return {n for e in spec for n in ((e,) if isinstance(e, str) else e if isinstance(e, (tuple, list)) else ())}


def warn_without_rules(args: Any, meshes: Sequence[Mesh]) -> bool:
    """Warns once, naming the parameters, when no ``nn.logical_axis_rules`` are active while
    some parameter of ``args`` is annotated with logical names: a linen ``nn.LogicallyPartitioned``
    box without its own rules, or an NNX Variable without ``sharding_rules`` whose
    ``out_sharding`` names an axis that none of ``meshes`` has (nor the names ``data`` and
    ``model``, which mean the meshes' axes). flax replicates such a parameter. Returns whether
    it warned."""
    if nn.get_logical_axis_rules():
        return False
    mesh_axes = {"data", "model", *(a for mesh in meshes for a in mesh.axis_names)}
    found = jax.tree_util.tree_flatten_with_path(args, is_leaf=lambda x: _is_box(x) or _is_variable(x))[0]
    unmapped = [f"args{jax.tree_util.keystr(path)}" for path, x in found if _needs_rules(x, mesh_axes)]
    if not unmapped:
        return False
    one = len(unmapped) == 1
    shown = ", ".join(unmapped[:3]) + (f" and {len(unmapped) - 3} more" if len(unmapped) > 3 else "")
    warnings.warn(f"meshpar: {shown} {'is' if one else 'are'} annotated with logical axis names, but no logical "
                  f"axis rules are active, so {'it is' if one else 'they are'} replicated; pass "
                  f"PipeshardParallel(logical_axis_rules=[...]) or wrap the call in "
                  f"`with nn.logical_axis_rules([...]):` (e.g. {_EXAMPLE})", stacklevel=4)
    return True


def _needs_rules(x: Any, mesh_axes: set[str]) -> bool:
    """Whether ``x`` is a box or Variable whose names only its own or the active rules can map."""
    if isinstance(x, nn.LogicallyPartitioned):
        return x.rules is None and bool(_names(x.names))
    if _is_variable(x):
        metadata = x.get_metadata()
        return not metadata.get("sharding_rules") and bool(_names(metadata.get("out_sharding") or ()) - mesh_axes)
    return False


def _constrains_over(jaxpr: jax_ir.Jaxpr, axis: str) -> bool:
    """Whether ``jaxpr`` (or a jaxpr nested in it) has a sharding constraint naming ``axis``."""
    # A sharding without a spec (not a NamedSharding) names no mesh axis.
    return any((eqn.primitive is sharding_constraint_p and axis in _names(getattr(eqn.params["sharding"], "spec", ())))
               or any(_constrains_over(inner, axis) for inner in jax_ir.nested_jaxprs(eqn)) for eqn in jaxpr.eqns)


def warn_unused_model_axis(pipeline: CompiledPipeline, model_axis: str) -> None:
    """Warns, naming ``model_axis``, when some of ``pipeline``'s meshes has that axis above 1 but
    no parameter is sharded over it and no stage constrains a value over it (a
    ``with_sharding_constraint`` of activations): its devices would only repeat each other's
    work."""
    size = max(mesh.shape.get(model_axis, 1) for mesh in pipeline.meshes)
    if size <= 1 or any(model_axis in _names(s.spec) for stage in pipeline.layout.grad_shardings for s in stage):
        return
    if any(_constrains_over(stage.jaxpr.jaxpr, model_axis) for stage in pipeline.graph.stages):
        return
    mesh = next(m for m in pipeline.meshes if m.shape.get(model_axis, 1) == size)
    devices = int(np.prod(list(mesh.shape.values())))
    warnings.warn(f"meshpar: the stage meshes' {model_axis!r} axis has {size} devices but no parameter is sharded "
                  f"over it, so its devices only repeat each other's work; annotate parameters with "
                  f"nn.with_partitioning / nn.with_logical_partitioning (and logical_axis_rules) or use "
                  f"stage_mesh_shape=({devices}, 1)", stacklevel=4)
