"""What the planners know of a train step, from the step itself: its loss traced (nothing runs)
and its tensor-parallel bytes as XLA compiles them (compiled, not run).

Tracing a step through meshpar's autodiff and compiling it as a program need the API and the
runtime, which the compiler may not import: this driver stays here. What it reads of the
trace and the program is the planning package's (``meshpar.passes.planning.profile_layers.
profile_loss``, ``meshpar.passes.planning.hlo_collectives.sized_by_program``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from meshpar.autodiff import tracing_pipeline
from meshpar.batch_arguments import batch_size
from meshpar.grad_call import find_grad_call
from meshpar.nnx_state import has_variables, partition_specs
from meshpar.passes.planning.hlo_collectives import sized_by_program
from meshpar.passes.planning.layer_profile import ModelProfile
from meshpar.passes.planning.profile_layers import AUTO_LAYERS, profile_loss
from meshpar.pipeshard_parallel import PipeshardParallel
from meshpar.passes.program.wire_format import leaf_dtype
from meshpar.step_compiler import compile_step

__all__ = ["compiled_tensor_parallel", "profile_step"]


def profile_step(fun: Callable, args: Sequence[Any], batch_argnums: Sequence[int], name: str = "model",
                 num_layers: int = AUTO_LAYERS) -> ModelProfile:
    """The layers of ``fun``'s loss, from one trace at the arguments' shapes (nothing runs):
    between its stage markers, or, when it has none, ``num_layers`` layers cut automatically
    (``profile_loss``)."""
    leaves, in_tree = jax.tree.flatten(tuple(args))
    size = batch_size(args, tuple(batch_argnums))
    abstract = [jax.ShapeDtypeStruct(np.shape(x), leaf_dtype(x)) for x in leaves]
    with tracing_pipeline():
        outer = jax.make_jaxpr(lambda *ls: fun(*jax.tree.unflatten(in_tree, ls)))(*abstract)
    grad = find_grad_call(getattr(fun, "__name__", "step"), outer, has_variables(tuple(args)))
    num_params = grad.params["num_diff"]
    specs = partition_specs(tuple(args))
    leaf_of = {v: i for i, v in enumerate(outer.jaxpr.invars)}
    sharded = [any(e is not None for e in (specs[leaf_of[v]] or ())) if v in leaf_of else False
               for v in grad.invars[:num_params]]
    return profile_loss(grad.params["loss_jaxpr"], num_params, size, sharded, name, num_layers)


def compiled_tensor_parallel(profile: ModelProfile, fun: Callable, args: Sequence[Any],
                             batch_argnums: Sequence[int], devices: Sequence[Any]) -> tuple[ModelProfile, float]:
    """``profile`` with its tensor-parallel bytes as XLA compiles them: the step is compiled
    (not run) as one program on a ``(1, len(devices))`` mesh, every parameter split over
    ``model`` as its flax partitioning names, and the collectives of its HLO size every
    layer's ``tp_bytes`` (``sized_by_program``). What compiling this layout warns of is not
    the user's plan's: it is not shown.

    Returns:
      The profile and the scale; unchanged (scale 1) on one device or when no parameter is
      split over ``model`` (no layer has ``tp_bytes``).

    Raises:
      TypeError: ``profile`` is not a ``ModelProfile``.
      ValueError: ``devices`` repeat.
    """
    if not isinstance(profile, ModelProfile):
        raise TypeError(f"profile: expected a ModelProfile, got {type(profile).__name__}")
    devices = tuple(devices)
    if len(set(devices)) != len(devices):
        raise ValueError(f"devices: expected distinct devices, got {list(devices)}")
    if len(devices) < 2 or not any(layer.tp_bytes for layer in profile.layers):
        return profile, 1.0
    mesh = jax.sharding.Mesh(np.array(devices).reshape(1, len(devices)), ("data", "model"))
    method = PipeshardParallel(num_micro_batches=1, stage_meshes=[mesh], cut_points=(), devices=tuple(devices),
                               batch_argnums=tuple(batch_argnums), single_program=True)
    leaves, in_tree = jax.tree.flatten(tuple(args))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = compile_step(fun, method, tuple(args), leaves, in_tree).executable
        hlo = program.lower(jax.tree.leaves(tuple(args))).compile().as_text()
    return sized_by_program(profile, hlo, len(devices))
