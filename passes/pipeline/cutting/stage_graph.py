"""Pass: cut the loss function's jaxpr at stage markers into forward stages.

Input: the ``loss_jaxpr`` carried by ``meshpar.value_and_grad`` (operands:
the differentiated parameter leaves, then every other input). Output: a
``StageGraph``: one forward ``Stage`` per segment between markers, each a
closed jaxpr from the values it reads to the values later stages (or the
loss) read. Backward stages are the VJPs of these forward stages, so they
read exactly the cotangents of a stage's outputs and produce those of its
inputs: the transposed markers.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
from jax.extend.core.primitives import cond_p, remat_p, scan_p, while_p

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.step_values import RefKind
from ..step_primitives import stage_boundary_p

__all__ = ["MarkerGrouping", "Ref", "Stage", "StageGraph", "StageMarkerError", "count_markers", "first_user_frame",
           "is_differentiable", "split_stages", "user_location", "verify_stage_graph"]


class StageMarkerError(ValueError):
    """A stage marker where the compiler cannot cut, or too few of them."""


@dataclasses.dataclass(frozen=True, order=True)
class Ref:
    """Names a value of the loss function.

    ``kind`` is ``PARAM`` (differentiated leaf ``index``), ``INPUT`` (other operand
    ``index``) or ``ACT`` (a value computed by stage ``index`` and numbered ``slot`` among
    that stage's outputs).
    """

    kind: RefKind
    index: int
    slot: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}{self.index}" + (f".{self.slot}" if self.kind is RefKind.ACT else "")


@dataclasses.dataclass(frozen=True)
class Stage:
    """A forward stage: ``jaxpr(*inputs) -> outputs``.

    Attributes:
      index: position in the pipeline.
      jaxpr: closed jaxpr with ``len(inputs)`` inputs and ``len(outputs)`` outputs.
      inputs: what each jaxpr input is.
      outputs: ``Ref(RefKind.ACT, index, k)`` for output ``k``.
    """

    index: int
    jaxpr: jax_ir.ClosedJaxpr
    inputs: tuple[Ref, ...]
    outputs: tuple[Ref, ...]

    @property
    def param_inputs(self) -> tuple[int, ...]:
        return tuple(r.index for r in self.inputs if r.kind is RefKind.PARAM)


@dataclasses.dataclass(frozen=True)
class MarkerGrouping:
    """Which of a loss's stage markers cut it, chosen by ``marker_grouping.group_markers`` (defined
    here, beside the ``StageGraph`` that records it, so that pass can import this module).

    Invariants (``verify_marker_grouping``): ``cut_points`` are increasing marker numbers in
    ``[0, len(locations))``, one fewer than the stages asked for; ``segment_costs`` has one
    entry per segment, ``len(locations) + 1``, each non-negative.

    Attributes:
      cut_points: the markers that cut (0-based, in program order): ``split_stages``' ``cuts``.
      locations: per marker, where the user's code called it (``user_location``).
      segment_costs: per segment between consecutive markers (and before the first, after the
        last), its estimated forward + backward FLOPs per micro-batch.
    """

    cut_points: tuple[int, ...]
    locations: tuple[str, ...]
    segment_costs: tuple[float, ...]

    @property
    def stage_costs(self) -> tuple[float, ...]:
        """Per stage, the summed costs of the segments it groups."""
        bounds = [0, *(c + 1 for c in self.cut_points), len(self.segment_costs)]
        return tuple(float(sum(self.segment_costs[a:b])) for a, b in zip(bounds, bounds[1:]))

    def summary(self) -> str:
        """One line: how many markers, which cut and where, and the stages' costs."""
        cuts = ", ".join(f"{c} ({self.locations[c]})" for c in self.cut_points)
        costs = ", ".join(f"{c:.3g}" for c in self.stage_costs)
        return (f"stage markers: {len(self.locations)} in the model; cuts at markers {cuts}, balanced by "
                f"estimated flops (forward + backward): stage costs [{costs}]")


@dataclasses.dataclass(frozen=True)
class StageGraph:
    """Forward stages of a loss and where its value comes from.

    Attributes:
      stages: in pipeline order.
      num_params, num_inputs: operand counts of the loss function.
      loss: the ``act`` value that is the loss.
      aux: the ``act`` value of each aux leaf the loss function returns (per micro-batch).
      marker_grouping: which of the model's markers cut, where the compiler chose them from
        more than the stages needed (``marker_grouping``); ``None``: no choice was made.
      forward_only: the stages of a step without a gradient (``forward_step``): it has no
        parameters and no value has a cotangent.
    """

    stages: tuple[Stage, ...]
    num_params: int
    num_inputs: int
    loss: Ref
    aux: tuple[Ref, ...] = ()
    marker_grouping: MarkerGrouping | None = None
    forward_only: bool = False

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def consumers(self, ref: Ref) -> tuple[int, ...]:
        return tuple(s.index for s in self.stages if ref in s.inputs)

    def param_owner(self, k: int) -> int:
        """The first stage that reads parameter leaf ``k`` (its home mesh)."""
        users = self.consumers(Ref(RefKind.PARAM, k))
        return users[0] if users else self.num_stages - 1

    def differentiated_slots(self, s: int) -> tuple[int, ...]:
        """Stage ``s``'s output slots that have a cotangent: floating values that are the loss
        or that later stages read (aux-only outputs and integer, bool or key values have none,
        and in a ``forward_only`` graph none has)."""
        if self.forward_only:
            return ()
        stage = self.stages[s]
        return tuple(
            k for k, (r, aval) in enumerate(zip(stage.outputs, stage.jaxpr.out_avals))
            if is_differentiable(aval) and (r == self.loss or self.consumers(r))
        )

    def edges(self) -> tuple[tuple[int, int, Ref], ...]:
        """(producer, consumer, value) for every activation crossing stages."""
        return tuple(
            (r.index, s.index, r) for s in self.stages for r in s.inputs if r.kind is RefKind.ACT
        )


def is_differentiable(aval: jax_ir.AbstractValue) -> bool:
    """Whether a value of ``aval`` has a (non-``float0``) cotangent: floating dtypes only."""
    return not jax.dtypes.issubdtype(aval.dtype, jax.dtypes.extended) and jnp.issubdtype(aval.dtype, jnp.inexact)


def _find_nested_marker(jaxpr: jax_ir.Jaxpr) -> bool:
    return any(
        e.primitive is stage_boundary_p or any(_find_nested_marker(j) for j in jax_ir.nested_jaxprs(e))
        for e in jaxpr.eqns
    )


# Per primitive holding a marker in its body, how to move the marker out.
_NESTED_MARKER_FIX = {
    scan_p: "mark between scanned groups instead (two nn.scan / lax.scan stacks with a marker between them "
            "cut there), or unroll that loop",
    remat_p: "call it between rematerialized blocks (nn.remat / jax.checkpoint), not inside one",
    cond_p: "move the marker out of the cond (lax.cond / nn.cond)",
    while_p: "move the marker out of the while loop (lax.while_loop / fori_loop), or unroll it",
}
_NESTED_MARKER_DEFAULT_FIX = "move the marker out of the nested function (e.g. a jax.jit), or call it unjitted"

_OWN_DIRS = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__,))


def first_user_frame(frames: Iterable[tuple[str, int, str]]) -> str:
    """``file:line (function)`` of the first of ``frames`` (``(file, line, function)``, innermost
    first) outside JAX, flax and meshpar: flax's own frames, e.g. ``nn.scan``'s, say nothing
    about the user's model."""
    import flax

    # The API package's directory, found without importing it (the compiler sits below it).
    api = importlib.util.find_spec("meshpar").origin
    own = (*_OWN_DIRS, *(os.path.dirname(os.path.abspath(f)) + os.sep for f in (api, flax.__file__, jax.__file__)))
    for file_name, line, function in frames:
        if not os.path.abspath(file_name).startswith(own):
            return f"{file_name}:{line} ({function})"
    return "unknown location"


def user_location(eqn: jax_ir.JaxprEqn) -> str:
    """Where in the user's code ``eqn`` was traced (``first_user_frame``)."""
    return first_user_frame((f.file_name, f.start_line, f.function_name)
                            for f in jax_ir.user_frames(eqn.source_info.traceback))


def count_markers(loss_jaxpr: jax_ir.ClosedJaxpr) -> int:
    """How many top-level stage markers ``loss_jaxpr`` has (candidate cut points)."""
    return sum(e.primitive is stage_boundary_p for e in loss_jaxpr.jaxpr.eqns)


@compiler_pass
def split_stages(loss_jaxpr: jax_ir.ClosedJaxpr, num_params: int, cuts: Sequence[int] | None = None) -> StageGraph:
    """Cuts ``loss_jaxpr`` at its top-level stage markers: all of them, or only the markers
    numbered ``cuts`` (0-based, in program order; the others then join their neighbours).

    Raises:
      StageMarkerError: a marker inside a control-flow or call body (scan,
        cond, while, a nested jit), naming where in the user's code.
    """
    jaxpr = loss_jaxpr.jaxpr
    for eqn in jaxpr.eqns:
        if eqn.primitive is not stage_boundary_p and any(_find_nested_marker(j) for j in jax_ir.nested_jaxprs(eqn)):
            raise StageMarkerError(
                f"mark_stage_boundary() is called inside a `{eqn.primitive.name}` body at {user_location(eqn)}; "
                f"meshpar can only cut straight-line code between stages: "
                f"{_NESTED_MARKER_FIX.get(eqn.primitive, _NESTED_MARKER_DEFAULT_FIX)}"
            )
    num_markers = count_markers(loss_jaxpr)
    if cuts is not None and (len(set(cuts)) != len(cuts) or not all(0 <= c < num_markers for c in cuts)):
        raise StageMarkerError(f"cut_points: expected distinct marker numbers in [0, {num_markers}), got {list(cuts)}")
    cutting = set(range(num_markers)) if cuts is None else set(cuts)
    segments: list[list[jax_ir.JaxprEqn]] = [[]]
    marker = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive is stage_boundary_p:
            if marker in cutting:
                segments.append([])
            marker += 1
        else:
            segments[-1].append(eqn)

    ref_of: dict[jax_ir.Var, Ref] = {}
    for k, v in enumerate(jaxpr.invars):
        ref_of[v] = Ref(RefKind.PARAM, k) if k < num_params else Ref(RefKind.INPUT, k - num_params)
    stage_of: dict[jax_ir.Var, int] = {}
    for s, eqns in enumerate(segments):
        for e in eqns:
            for v in e.outvars:
                stage_of[v] = s

    # Which values each segment reads from outside itself.
    reads: list[list[jax_ir.Var]] = []
    for s, eqns in enumerate(segments):
        seen: dict[jax_ir.Var, None] = {}
        for e in eqns:
            for v in e.invars:
                if isinstance(v, jax_ir.Var) and stage_of.get(v) != s:
                    seen.setdefault(v)
        reads.append(list(seen))
    loss_var, aux_vars = jaxpr.outvars[0], jaxpr.outvars[1:]
    if not isinstance(loss_var, jax_ir.Var) or loss_var not in stage_of:
        raise StageMarkerError("the loss is a constant or an input; there is nothing to pipeline")
    if not all(isinstance(v, jax_ir.Var) and v in stage_of for v in aux_vars):
        raise StageMarkerError("an aux output of the loss function is not computed by it "
                               "(meshpar.value_and_grad copies such leaves; was the jaxpr built elsewhere?)")

    exported: list[list[jax_ir.Var]] = [[] for _ in segments]
    for s in range(len(segments)):
        wanted = {v for t in range(s + 1, len(segments)) for v in reads[t] if stage_of.get(v) == s}
        wanted.update(v for v in (loss_var, *aux_vars) if stage_of[v] == s)
        exported[s] = [v for e in segments[s] for v in e.outvars if v in wanted]
        for k, v in enumerate(exported[s]):
            ref_of[v] = Ref(RefKind.ACT, s, k)

    stages = []
    for s, eqns in enumerate(segments):
        invars = reads[s]
        inner = jax_ir.Jaxpr(
            constvars=(),
            invars=invars,
            outvars=exported[s],
            eqns=eqns,
            effects=jax_ir.join_effects(*(e.effects for e in eqns)),
            debug_info=jax_ir.DebugInfo(
                "meshpar stage", f"forward stage {s}",
                tuple(str(ref_of[v]) for v in invars), tuple(str(ref_of[v]) for v in exported[s]),
            ),
        )
        stages.append(
            Stage(
                index=s,
                jaxpr=jax_ir.ClosedJaxpr(inner, ()),
                inputs=tuple(ref_of[v] for v in invars),
                outputs=tuple(ref_of[v] for v in exported[s]),
            )
        )
    graph = StageGraph(tuple(stages), num_params, len(jaxpr.invars) - num_params, ref_of[loss_var],
                       tuple(ref_of[v] for v in aux_vars))
    verify_stage_graph(graph)
    return graph


def verify_stage_graph(graph: StageGraph) -> None:
    """Every stage's jaxpr type-checks; activations flow forward only; the loss is a scalar.

    Raises:
      AssertionError subclass ``PlanVerificationError`` on a broken invariant.
    """
    from ...verification import PlanVerificationError, type_check

    for stage in graph.stages:
        type_check(stage.jaxpr.jaxpr, f"stage {stage.index}")
        for r in stage.inputs:
            if r.kind is RefKind.ACT and not r.index < stage.index:
                raise PlanVerificationError(f"stage {stage.index} reads {r} from a later stage")
        if len(stage.inputs) != len(stage.jaxpr.in_avals) or len(stage.outputs) != len(stage.jaxpr.out_avals):
            raise PlanVerificationError(f"stage {stage.index}: refs do not match its jaxpr's signature")
    if graph.forward_only and graph.num_params:
        raise PlanVerificationError(f"a forward-only graph has {graph.num_params} differentiated parameters")
    loss_stage = graph.stages[graph.loss.index]
    aval = loss_stage.jaxpr.out_avals[graph.loss.slot]
    if aval.shape != ():
        raise PlanVerificationError(f"the loss must be a scalar, got {aval}")
