"""The supervised train step a flax user writes, ready for ``meshpar.parallelize``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import meshpar

__all__ = ["supervised_step"]


def supervised_step(loss_of_output: Callable[[Any, Any], Any]) -> Callable[[Any, dict], tuple[Any, Any]]:
    """``train_step(state, batch) -> (state, loss)`` for a flax ``TrainState``: the mean of
    ``loss_of_output(state.apply_fn(params, batch["x"]), batch["y"])``, differentiated with
    ``meshpar.value_and_grad`` and applied with the state's optimizer. The same function runs
    under ``jax.jit``."""
    if not callable(loss_of_output):
        raise TypeError(f"loss_of_output: expected a function (predictions, targets) -> loss, "
                        f"got {type(loss_of_output).__name__}")

    def train_step(state, batch):
        def loss_fn(params):
            return loss_of_output(state.apply_fn(params, batch["x"]), batch["y"])

        loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return train_step
