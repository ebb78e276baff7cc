"""flax NNX objects in a ``meshpar.parallelize``-d step, with ``nnx.jit``'s semantics.

A step may take NNX objects (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``) among its
arguments and update their ``nnx.Variable``s in place, as an ``nnx.jit`` step does
(``optimizer.update(model, grads)``, a dropout stream's counter, BatchNorm statistics). NNX
objects are pytrees, so the step is traced on copies of them; ``returning_updates`` makes the
traced step also return every Variable leaf it replaced, and ``write_back`` sets those values on
the caller's objects after the step ran. The step stays functional for the compiler: an update
is an output whose counterpart (``compile_pipeline``'s ``counterparts``) is the input leaf it
replaces, placed where that input lives.

Invariants: a Variable flattens to its value's leaves, in place among its object's leaves, so
leaf ``i`` of the arguments is the same Variable's value before and after the step; the step
may not add or remove attributes (the arguments' tree structure is the same after it), and may
not assign a new array to an attribute that is not a Variable (NNX keeps state in Variables).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

from meshpar.logical_partitioning import mesh_named

__all__ = ["NnxStateError", "StateUpdates", "has_variables", "partition_specs", "returning_updates", "write_back"]


class NnxStateError(ValueError):
    """A step updates NNX objects in a way ``parallelize`` cannot return (module doc)."""


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def has_variables(tree: Any) -> bool:
    """Whether ``tree`` holds any ``nnx.Variable`` (an NNX object, or a State of one)."""
    return any(_is_variable(x) for x in jax.tree.leaves(tree, is_leaf=_is_variable))


def _variable_of_leaf(tree: Any) -> list[nnx.Variable | None]:
    """Per leaf of ``tree`` (``jax.tree.leaves`` order), the Variable holding it, or ``None``."""
    owners: list[nnx.Variable | None] = []
    for x in jax.tree.leaves(tree, is_leaf=_is_variable):
        owners.extend([x] * len(jax.tree.leaves(x)) if _is_variable(x) else [None])
    return owners


def check_distinct_variables(args: tuple, name: str) -> None:
    """Raises when one Variable is reachable twice from the arguments: as pytrees, its two
    places would be updated as two values."""
    seen: dict[int, int] = {}
    for i, arg in enumerate(args):
        for var in jax.tree.leaves(arg, is_leaf=_is_variable):
            if _is_variable(var):
                if id(var) in seen:
                    raise ValueError(
                        f"{name}: the same nnx.{type(var).__name__} is reachable from arguments {seen[id(var)]} "
                        f"and {i}; meshpar.parallelize passes NNX objects as pytrees, so shared Variables "
                        f"would be updated apart. Pass each object once (e.g. the model, and an "
                        f"nnx.Optimizer(model, tx, wrt=nnx.Param) that does not hold it)")
                seen[id(var)] = i


def partition_specs(args: Any) -> list[jax.sharding.PartitionSpec | None]:
    """Per leaf of ``args``, the partitioning its flax metadata names (linen's
    ``nn.with_partitioning`` and ``nn.with_logical_partitioning`` boxes, NNX's
    ``nnx.with_partitioning`` Variables; ``P()`` for an unannotated array, ``None`` for a
    non-array leaf). Logical names are mapped to mesh axes by the active
    ``nn.logical_axis_rules`` (``meshpar.logical_partitioning``), for NNX together with a
    Variable's ``sharding_rules``, as flax maps them."""
    import flax.linen as nn

    P = jax.sharding.PartitionSpec

    def flat(specs: Any) -> list:
        return jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P) or x is None)

    linen, nnx_specs = flat(nn.get_partition_spec(mesh_named(args))), flat(nnx.get_partition_spec(args))
    if len(linen) != len(nnx_specs):
        raise AssertionError(f"flax partition specs: linen reads {len(linen)} leaves, nnx {len(nnx_specs)}")
    return [a if a not in (None, P()) else b for a, b in zip(linen, nnx_specs)]


@dataclasses.dataclass(frozen=True)
class StateUpdates:
    """Which argument leaves a traced step replaced: ``leaves[k]`` is the flattened argument
    leaf that the step's update output ``k`` replaces."""

    leaves: tuple[int, ...]


def returning_updates(fun: Callable[..., Any], in_tree: Any, name: str,
                      record: list[StateUpdates]) -> Callable[..., tuple[Any, tuple]]:
    """``fun`` as a function of the arguments' leaves returning ``(outputs, updates)``: the
    values of the Variable leaves it replaced, in leaf order. Each trace appends what it found
    to ``record``.

    Raises (while tracing):
      NnxStateError: the step changed its arguments' structure, or replaced a leaf that no
        Variable holds; the message names ``name`` and the leaf.
    """

    def traced(*leaves: Any) -> tuple[Any, tuple]:
        args = jax.tree.unflatten(in_tree, leaves)
        owners = _variable_of_leaf(args)
        out = fun(*args)
        after, tree = jax.tree.flatten(args)
        if tree != in_tree:
            raise NnxStateError(f"{name}: the step changed the structure of its NNX arguments (added or removed an "
                                f"attribute or Variable); meshpar.parallelize, like nnx.jit, can only update "
                                f"existing Variables in place")
        changed = tuple(i for i, (a, b) in enumerate(zip(leaves, after)) if a is not b)
        for i in changed:
            if owners[i] is None:
                path = jax.tree_util.keystr(jax.tree_util.tree_flatten_with_path(args)[0][i][0])
                raise NnxStateError(f"{name}: the step assigned a new value to args{path}, which no nnx.Variable "
                                    f"holds; keep state that a step updates in an nnx.Variable, or return it")
        record.append(StateUpdates(changed))
        return out, tuple(after[i] for i in changed)

    return traced


def write_back(args: tuple, updates: StateUpdates, values: Sequence[Any]) -> None:
    """Sets each replaced leaf's new value on the caller's Variable that holds it."""
    owners = _variable_of_leaf(args)
    leaves = jax.tree.leaves(args)
    new: dict[int, dict[int, Any]] = {}
    for i, value in zip(updates.leaves, values, strict=True):
        new.setdefault(id(owners[i]), {})[i] = value
    for i, var in enumerate(owners):
        if var is None or id(var) not in new:
            continue
        changes = new.pop(id(var))
        # A Variable's leaves are consecutive, from leaf i on: rebuild its value from them.
        own, tree = jax.tree.flatten(var.get_raw_value())
        var.set_value(jax.tree.unflatten(tree, [changes.get(i + k, leaves[i + k]) for k in range(len(own))]))

