"""Pass: split what the train step does around the gradient into per-mesh programs.

The traced step is ``outer``: a jaxpr over the flattened (state, batch)
leaves with one ``meshpar_pipeline_grad`` equation. Everything else (in
practice the optimizer update) is placed by colouring: parameter leaf ``k``
and its gradient belong to the mesh of the stage that owns the parameter, the
loss to the last stage's mesh, and an equation takes the colour of its inputs.
Equations with no colour (step counters, learning-rate schedules) are
recomputed on every mesh that needs them, which is cheap and saves a
transfer. An equation mixing two meshes' values (global-norm clipping) is
rejected: it would need a cross-mesh reduction.
"""

from __future__ import annotations

import dataclasses

from jax._src import core
from jax._src import linear_util as lu

__all__ = ["OuterRef", "ApplyStage", "ApplySplit", "split_apply", "GradCallError"]

GRAD = "meshpar_pipeline_grad"


class GradCallError(ValueError):
    """The step's use of ``meshpar.value_and_grad`` cannot be pipelined."""


@dataclasses.dataclass(frozen=True, order=True)
class OuterRef:
    """A value of the traced step: ``in`` (step input leaf), ``const``, ``loss`` or ``grad`` (leaf)."""

    kind: str
    index: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.index}"


@dataclasses.dataclass(frozen=True)
class ApplyStage:
    """The part of the step that runs on one mesh after the gradients are complete.

    ``jaxpr(*inputs) -> values of outer outputs ``outputs`` (indices into the
    step's flattened outputs).
    """

    mesh: int
    jaxpr: core.ClosedJaxpr
    inputs: tuple[OuterRef, ...]
    outputs: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class ApplySplit:
    """Where every output of the step comes from.

    Attributes:
      stages: one per mesh that has work after the gradient (may be empty).
      param_inputs: for parameter leaf ``k``, the step input leaf it is.
      loss_inputs: for each other operand of the loss, its ``OuterRef``.
      sources: for output ``j``, an ``OuterRef`` it passes through, or
        ``None`` when apply stages compute it (``producers[j]`` says which).
      producers: output index -> meshes whose apply stage computes it.
      consts: the step's closed-over constants.
    """

    stages: tuple[ApplyStage, ...]
    param_inputs: tuple[int, ...]
    loss_inputs: tuple[OuterRef, ...]
    sources: tuple[OuterRef | None, ...]
    producers: dict[int, tuple[int, ...]]
    consts: tuple


def _ref_of_operand(v, invar_index, const_index) -> OuterRef | None:
    if isinstance(v, core.Literal):
        return None
    if v in invar_index:
        return OuterRef("in", invar_index[v])
    if v in const_index:
        return OuterRef("const", const_index[v])
    return None


def split_apply(outer: core.ClosedJaxpr, owner_of_param, loss_mesh: int, num_meshes: int) -> tuple[core.JaxprEqn, ApplySplit]:
    """Finds the gradient equation and splits the rest by mesh.

    Args:
      outer: the traced step.
      owner_of_param: ``k -> mesh`` for each parameter leaf.
      loss_mesh: the mesh computing the loss.
      num_meshes: how many meshes.

    Returns:
      The gradient equation and the split.

    Raises:
      GradCallError: no or several ``meshpar.value_and_grad`` calls, inputs
        of the loss computed inside the step, or an update mixing meshes.
    """
    jaxpr = outer.jaxpr
    grads = [e for e in jaxpr.eqns if e.primitive.name == GRAD]
    if len(grads) != 1:
        raise GradCallError(
            f"the step must call meshpar.value_and_grad (or meshpar.grad) exactly once, found {len(grads)} calls"
        )
    (grad_eqn,) = grads
    invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
    const_index = {v: i for i, v in enumerate(jaxpr.constvars)}
    num_diff = grad_eqn.params["num_diff"]
    param_inputs = []
    for k, v in enumerate(grad_eqn.invars[:num_diff]):
        ref = _ref_of_operand(v, invar_index, const_index)
        if ref is None or ref.kind != "in":
            raise GradCallError(
                f"parameter leaf {k} of the differentiated function is computed inside the step; "
                f"differentiate with respect to the step's inputs directly (e.g. state.params)"
            )
        param_inputs.append(ref.index)
    loss_inputs = []
    for k, v in enumerate(grad_eqn.invars[num_diff:]):
        ref = _ref_of_operand(v, invar_index, const_index)
        if ref is None:
            raise GradCallError(
                f"input {k} of the loss function is computed inside the step before the gradient; "
                f"compute it inside the loss function instead, so its stage can own it"
            )
        loss_inputs.append(ref)

    # Colour every value: the mesh it lives on, or None (shared).
    colour: dict[core.Var, int | None] = {}
    param_set = {jaxpr.invars[i]: owner_of_param(k) for k, i in enumerate(param_inputs)}
    colour.update(param_set)
    colour[grad_eqn.outvars[0]] = loss_mesh
    for k, v in enumerate(grad_eqn.outvars[1:]):
        colour[v] = owner_of_param(k)
    eqn_colour: dict[int, int | None] = {}
    for n, e in enumerate(jaxpr.eqns):
        if e is grad_eqn:
            continue
        found = {colour[v] for v in e.invars if isinstance(v, core.Var) and colour.get(v) is not None}
        if len(found) > 1:
            raise GradCallError(
                f"`{e.primitive.name}` in the update combines values of meshes {sorted(found)} "
                f"(e.g. global-norm clipping); meshpar updates each parameter on its own mesh"
            )
        c = found.pop() if found else None
        eqn_colour[n] = c
        for v in e.outvars:
            colour[v] = c

    producer = {v: n for n, e in enumerate(jaxpr.eqns) for v in e.outvars}
    needed: list[set[int]] = [set() for _ in range(num_meshes)]

    def pull(mesh: int, n: int) -> None:
        if n in needed[mesh]:
            return
        needed[mesh].add(n)
        for v in jaxpr.eqns[n].invars:
            m = producer.get(v) if isinstance(v, core.Var) else None
            if m is not None and jaxpr.eqns[m] is not grad_eqn:
                pull(mesh, m)

    for n, c in eqn_colour.items():
        if c is not None:
            pull(c, n)
    sources: list[OuterRef | None] = []
    producers: dict[int, tuple[int, ...]] = {}
    for j, v in enumerate(jaxpr.outvars):
        ref = _ref_of_operand(v, invar_index, const_index)
        if ref is None and v is grad_eqn.outvars[0]:
            ref = OuterRef("loss")
        elif ref is None and v in grad_eqn.outvars:
            ref = OuterRef("grad", grad_eqn.outvars.index(v) - 1)
        if ref is not None or isinstance(v, core.Literal):
            sources.append(ref if ref is not None else OuterRef("literal", j))
            continue
        sources.append(None)
        n = producer[v]
        meshes = tuple(m for m in range(num_meshes) if n in needed[m])
        if not meshes:  # shared and needed by no mesh: the first mesh computes it
            pull(0, n)
            meshes = (0,)
        producers[j] = meshes

    stages = []
    for mesh in range(num_meshes):
        eqns = [e for n, e in enumerate(jaxpr.eqns) if n in needed[mesh]]
        outs = [j for j, ms in producers.items() if mesh in ms]
        if not eqns and not outs:
            continue
        defined = {v for e in eqns for v in e.outvars}
        reads: dict[core.Var, None] = {}
        for e in eqns:
            for v in e.invars:
                if isinstance(v, core.Var) and v not in defined:
                    reads.setdefault(v)
        inputs = []
        for v in reads:
            ref = _ref_of_operand(v, invar_index, const_index)
            if ref is None:
                k = grad_eqn.outvars.index(v)
                ref = OuterRef("loss") if k == 0 else OuterRef("grad", k - 1)
            inputs.append(ref)
        inner = core.Jaxpr(
            constvars=(),
            invars=list(reads),
            outvars=[jaxpr.outvars[j] for j in outs],
            eqns=eqns,
            effects=core.join_effects(*(e.effects for e in eqns)),
            debug_info=lu.DebugInfo(
                "meshpar apply", f"update on mesh {mesh}", tuple(map(str, inputs)), tuple(f"out{j}" for j in outs)
            ),
        )
        core.check_jaxpr(inner)
        stages.append(ApplyStage(mesh, core.ClosedJaxpr(inner, ()), tuple(inputs), tuple(outs)))
    split = ApplySplit(tuple(stages), tuple(param_inputs), tuple(loss_inputs), tuple(sources), producers, tuple(outer.consts))
    return grad_eqn, split
