"""What the automatic planners know of a model: one ``LayerProfile`` per layer (the span between
two candidate cut points), in order.

Layers are the unit every planner partitions into contiguous stages. Figures are per example
(one row of the batch) where they scale with the batch, so a planner can price any micro-batch
size; parameter and optimizer bytes are per whole layer. ``boundary_bytes`` is what crosses the
cut after the layer, per example (the activation a pipeline edge moves there).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["LayerProfile", "CrossingValue", "ModelProfile"]


@dataclasses.dataclass(frozen=True)
class LayerProfile:
    """One layer's costs.

    Attributes:
      flops: forward floating-point operations per example (backward is priced as twice this).
      param_bytes: bytes of the layer's parameters.
      optimizer_bytes: bytes of its optimizer state (Adam: twice ``param_bytes`` in float32).
      activation_bytes: bytes per example its backward keeps alive from its forward.
      boundary_bytes: bytes per example of the values crossing the cut after it.
      tp_bytes: bytes per example a tensor-parallel layer all-reduces in its forward (Megatron:
        two all-reduces of the hidden state per transformer layer); the backward moves as much.
      num_ops: operations its forward program runs (each device of a mesh runs every one);
        what small layers cost where launching an operation, not computing it, dominates.
      splits_over_model: whether a mesh's model axis splits the layer (its parameters are
        partitioned over it): its FLOPs, parameters, optimizer state and activations then
        divide over the axis; otherwise every device of a model-axis row holds and runs all
        of them, repeating each other's work.
    """

    flops: float
    param_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    boundary_bytes: float
    tp_bytes: float = 0.0
    num_ops: float = 0.0
    splits_over_model: bool = True

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self)[:-1]:
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{field.name}: expected a non-negative number, got {value!r}")
        if not isinstance(self.splits_over_model, bool):
            raise ValueError(f"splits_over_model: expected a bool, got {self.splits_over_model!r}")


@dataclasses.dataclass(frozen=True)
class CrossingValue:
    """A value layer ``producer`` computes and later layers ``consumers`` read: a pipeline edge
    wherever a cut separates them (a skip connection crosses several cuts, moving once)."""

    producer: int
    consumers: tuple[int, ...]
    bytes_per_example: float


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    """A model as its planners see it: ``layers`` in pipeline order.

    Attributes:
      layers: at least one.
      batch_size: the global batch (examples per step).
      name: for reports.
      values: the values crossing between layers, when known (a traced model); else each
        layer's ``boundary_bytes`` goes to the next layer only (a chain).
      auto_layers: the layers were cut automatically (``passes.layer_clustering``) into this
        many, the model having no stage markers; ``None``: they are the model's own.
    """

    layers: tuple[LayerProfile, ...]
    batch_size: int
    name: str = "model"
    values: tuple[CrossingValue, ...] = ()
    auto_layers: int | None = None

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("layers: a model has at least one layer")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size: expected a positive integer, got {self.batch_size!r}")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @classmethod
    def uniform(cls, num_layers: int, layer: LayerProfile, batch_size: int, name: str = "model") -> ModelProfile:
        """``num_layers`` copies of ``layer`` (a transformer's blocks)."""
        return cls(tuple([layer] * num_layers), batch_size, name)

    def crossing(self) -> tuple[CrossingValue, ...]:
        """The values crossing between layers: ``values``, or the chain of boundaries."""
        if self.values:
            return self.values
        return tuple(CrossingValue(k, (k + 1,), layer.boundary_bytes) for k, layer in enumerate(self.layers[:-1]))

    def span(self, start: int, stop: int) -> Sequence[LayerProfile]:
        """Layers ``start`` up to ``stop`` (exclusive): one candidate stage."""
        return self.layers[start:stop]
