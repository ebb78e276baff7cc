"""Pass: split what the train step does around the gradient into per-mesh computations and moves.

The traced step is ``outer``: a jaxpr over the flattened (state, batch) leaves at the whole
batch's shapes, with one ``pipeline_grad_p`` equation (the pipeline). Every other
equation runs either before the pipeline (it computes an operand of the loss function: a
token count, a derived key) or after it (the update, metrics).

Placement is by colouring. Parameter leaf ``k`` and its gradient belong to the mesh of the
stage that owns the parameter, the loss and each aux value to the stage computing it, and an
equation takes the colour of its inputs. An equation whose inputs have no colour (step
counters, learning-rate schedules, values of the batch) is computed by every mesh that needs
its result, which is cheap and saves a transfer. An equation combining several meshes' values
(global-norm clipping, a global norm logged, any reduction over all parameters) runs on the
mesh of its largest input; the other inputs move there, typically scalars: per-mesh partial
results, a scalar combine, and the result sent back to whichever mesh reads it next.
A conditional is split first (``split_conditionals``): an optimizer wrapper's cond around the
whole update becomes one cond per mesh, reading the same predicate, which crosses with any
scalars the branches combine (a global norm's partial sums); a part reading only scalars and
values of no mesh is computed, like an uncoloured equation, by every mesh that needs its results.

Computations are grouped by mesh and by *level*: a phase runs level by level, every mesh's
computation of the level, then the moves out of it, packed into one transfer per pair of meshes
and dtype. An equation runs at the latest level its readers allow (one before a reader across a
move, else its mesh's last level), which is never before the moves on its longest input path
have brought its inputs: a mesh runs one program per level it waits at. Every process walks the
same steps in the same order, so moves never deadlock.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any, Union

import numpy as np

from ... import jax_ir
from ...compiler_pass import compiler_pass
from ...program.step_values import OuterKind, OuterRef
from ...program.wire_format import is_key
from ..step_primitives import pipeline_grad_p
from .split_conditionals import cut_cond, inline_fixed_calls, split_cond
from .stage_graph import first_user_frame, user_location

__all__ = ["OuterCompute", "OuterMove", "StepSplit", "split_step", "verify_step_split", "GradCallError"]


class GradCallError(ValueError):
    """The step's use of ``meshpar.value_and_grad`` cannot be pipelined."""


@dataclasses.dataclass(frozen=True)
class OuterCompute:
    """``jaxpr(*inputs) -> outputs`` on mesh ``mesh``."""

    mesh: int
    jaxpr: jax_ir.ClosedJaxpr
    inputs: tuple[OuterRef, ...]
    outputs: tuple[OuterRef, ...]


@dataclasses.dataclass(frozen=True)
class OuterMove:
    """``values`` move from mesh ``src`` to mesh ``dst`` as one transfer: several values (of one
    dtype, never gradients) travel packed into one vector, so a global norm's per-parameter
    partial sums cross once, not once each."""

    values: tuple[OuterRef, ...]
    src: int
    dst: int


OuterStep = Union[OuterCompute, OuterMove]


@dataclasses.dataclass(frozen=True)
class StepSplit:
    """Where every value of the step comes from, and the steps that make it.

    Attributes:
      param_inputs: for differentiated leaf ``k``, the step input leaf it is.
      loss_operands: for each other operand of the loss function, its ``OuterRef``.
      before, after: the steps before and after the pipeline, in the order every process runs them.
      outputs: for step output ``j``, its ``OuterRef`` and the meshes holding it (empty for
        inputs, constants and literals, which the runtime returns as they are).
      input_needs: per step input leaf, the meshes whose computations read it whole.
      homes: each coloured value's mesh (loss, aux, grad and coloured ``value`` refs).
      avals: every ``value``, ``loss``, ``aux`` and ``grad`` ref's aval.
      consts: the step's closed-over constants.
      literals: output index -> the literal it returns.
      origins: each moved ``value`` ref, where the step's code computed it (``traced_at``), to
        name it in ``describe()``.
    """

    param_inputs: tuple[int, ...]
    loss_operands: tuple[OuterRef, ...]
    before: tuple[OuterStep, ...]
    after: tuple[OuterStep, ...]
    outputs: tuple[tuple[OuterRef, tuple[int, ...]], ...]
    input_needs: tuple[frozenset[int], ...]
    homes: dict[OuterRef, int]
    avals: dict[OuterRef, jax_ir.AbstractValue]
    consts: tuple
    literals: dict[int, Any] = dataclasses.field(default_factory=dict)
    origins: dict[OuterRef, str] = dataclasses.field(default_factory=dict)

    def moved(self) -> tuple[OuterMove, ...]:
        return tuple(s for s in (*self.before, *self.after) if isinstance(s, OuterMove))


def _nbytes(aval: jax_ir.AbstractValue) -> int:
    return int(np.prod(aval.shape, dtype=np.int64)) * getattr(aval.dtype, "itemsize", 4)


class _Planner:
    """Demand-driven placement of the outer equations (module docstring)."""

    def __init__(self, jaxpr: jax_ir.Jaxpr, grad_eqn: jax_ir.JaxprEqn, ref_of: dict[jax_ir.Var, OuterRef],
                 colour: dict[jax_ir.Var, int | None], producer: dict[jax_ir.Var, int]) -> None:
        self.jaxpr, self.grad_eqn, self.ref_of, self.colour, self.producer = jaxpr, grad_eqn, ref_of, colour, producer
        self.instances: dict[tuple[int, int], str] = {}  # (eqn, mesh) -> phase
        self.moves: dict[tuple[OuterRef, int, int], str] = {}
        self.input_needs: dict[int, set[int]] = {}
        self.phase = "before"

    def need(self, v: jax_ir.Atom, mesh: int) -> None:
        if isinstance(v, jax_ir.Literal):
            return
        ref = self.ref_of[v]
        if ref.kind is OuterKind.IN:
            self.input_needs.setdefault(ref.index, set()).add(mesh)
            return
        if ref.kind is OuterKind.CONST:
            return
        home = self.colour.get(v)
        if ref.kind is OuterKind.VALUE:
            self.compute(self.producer[v], mesh if home is None else home)
        if home is not None and home != mesh:
            self.moves.setdefault((ref, home, mesh), self.phase)

    def compute(self, n: int, mesh: int) -> None:
        if (n, mesh) in self.instances:
            return
        self.instances[(n, mesh)] = self.phase
        for v in self.jaxpr.eqns[n].invars:
            self.need(v, mesh)


def _param_inputs(jaxpr: jax_ir.Jaxpr, grad_eqn: jax_ir.JaxprEqn) -> list[int]:
    """For each differentiated leaf, the step input leaf it is.

    Raises:
      GradCallError: a differentiated leaf is computed inside the step.
    """
    position = {v: i for i, v in enumerate(jaxpr.invars)}
    param_inputs = []
    for k, v in enumerate(grad_eqn.invars[:grad_eqn.params["num_diff"]]):
        if not isinstance(v, jax_ir.Var) or v not in position:
            raise GradCallError(
                f"parameter leaf {k} of the differentiated function is computed inside the step "
                f"(meshpar.value_and_grad at {user_location(grad_eqn)}); differentiate with respect to the step's "
                f"inputs directly (e.g. state.params)"
            )
        param_inputs.append(position[v])
    return param_inputs


def _colour(jaxpr: jax_ir.Jaxpr, grad_eqn: jax_ir.JaxprEqn, colour: dict[jax_ir.Var, int | None]) -> jax_ir.Jaxpr:
    """Colours every equation's results in ``colour`` (module docstring), which holds the
    parameters' and the pipeline's colours; returns ``jaxpr`` with each conditional over
    several meshes' values cut and split into conditionals of one mesh each where it can be
    (``split_conditionals``), every result defined once, as in ``jaxpr``."""
    eqns: list[jax_ir.JaxprEqn] = []
    for eqn in jaxpr.eqns:
        if eqn is grad_eqn:
            eqns.append(eqn)
            continue
        work = [eqn]
        while work:
            e = work.pop()
            owners = [colour.get(v) if isinstance(v, jax_ir.Var) else None for v in e.invars]
            cut = cut_cond(e, owners)
            if cut is not None:
                work.extend(reversed(cut))  # the first before the second, which reads its results
                continue
            for part, label in split_cond(e, owners) or [(e, None)]:
                if label is None or len(label) > 1:
                    c = _largest_input_mesh(part, colour)
                else:
                    # A conditional's part of one mesh's values (or scalars) runs there; one of
                    # shared scalars and values of no mesh runs wherever its results are needed.
                    c = next(iter(label), None)
                colour.update((v, c) for v in part.outvars)
                eqns.append(part)
    return jaxpr.replace(eqns=eqns)


def _largest_input_mesh(e: jax_ir.JaxprEqn, colour: dict[jax_ir.Var, int | None]) -> int | None:
    """Where ``e``'s largest coloured input is (the lower mesh on ties), None if it has none:
    where several meshes' values meet, the fewest bytes move."""
    coloured = [(v, colour[v]) for v in e.invars if isinstance(v, jax_ir.Var) and colour.get(v) is not None]
    if not coloured:
        return None
    return min(coloured, key=lambda vc: (-_nbytes(vc[0].aval), vc[1]))[1]


@compiler_pass
def split_step(outer: jax_ir.ClosedJaxpr, param_owner: Callable[[int], int], loss_mesh: int,
               aux_meshes: Sequence[int], num_meshes: int, loss_readers: Sequence[Sequence[int]],
               counterparts: Sequence[int | None]) -> StepSplit:
    """Splits ``outer`` around its gradient equation (module docstring).

    Args:
      outer: the traced step, at the whole batch's shapes.
      param_owner: ``k -> mesh`` for each differentiated leaf.
      loss_mesh, aux_meshes: the meshes computing the loss and each aux leaf.
      num_meshes: how many meshes.
      loss_readers: per non-differentiated loss operand, the stages that read it whole.
      counterparts: per step output, the input leaf it replaces in the state, if any: an
        uncoloured new value (a step counter) is computed on the meshes that read the old
        one, so the next step moves nothing (else on mesh 0).

    Raises:
      GradCallError: no or several gradient equations, or a differentiated leaf computed
        inside the step, naming the user's source line.
    """
    jaxpr = inline_fixed_calls(outer.jaxpr)
    grads = [e for e in jaxpr.eqns if e.primitive is pipeline_grad_p]
    if len(grads) != 1:
        raise GradCallError(
            f"the step must call meshpar.value_and_grad (or meshpar.grad) exactly once, found {len(grads)} calls"
        )
    (grad_eqn,) = grads
    num_diff, num_aux = grad_eqn.params["num_diff"], grad_eqn.params["num_aux"]
    param_inputs = _param_inputs(jaxpr, grad_eqn)
    colour: dict[jax_ir.Var, int | None] = {}
    for k, i in enumerate(param_inputs):
        colour[jaxpr.invars[i]] = param_owner(k)
    for k, v in enumerate(grad_eqn.outvars):
        colour[v] = loss_mesh if k == 0 else aux_meshes[k - 1] if k <= num_aux else param_owner(k - 1 - num_aux)
    jaxpr = _colour(jaxpr, grad_eqn, colour)
    ref_of: dict[jax_ir.Var, OuterRef] = {}
    for i, v in enumerate(jaxpr.invars):
        ref_of[v] = OuterRef(OuterKind.IN, i)
    for i, v in enumerate(jaxpr.constvars):
        ref_of[v] = OuterRef(OuterKind.CONST, i)
    producer: dict[jax_ir.Var, int] = {}
    counter = 0
    for n, e in enumerate(jaxpr.eqns):
        for k, v in enumerate(e.outvars):
            if e is grad_eqn:
                ref_of[v] = (OuterRef(OuterKind.LOSS) if k == 0 else OuterRef(OuterKind.AUX, k - 1) if k <= num_aux
                             else OuterRef(OuterKind.GRAD, k - 1 - num_aux))
            else:
                ref_of[v] = OuterRef(OuterKind.VALUE, counter)
                counter += 1
                producer[v] = n
    consts = list(outer.consts)
    loss_operands = []
    for v in grad_eqn.invars[num_diff:]:
        if isinstance(v, jax_ir.Literal):  # a Python or numpy scalar the loss closes over
            loss_operands.append(OuterRef(OuterKind.CONST, len(consts)))
            consts.append(v.val)
        else:
            loss_operands.append(ref_of[v])

    planner = _Planner(jaxpr, grad_eqn, ref_of, colour, producer)
    for v, readers in zip(grad_eqn.invars[num_diff:], loss_readers):
        for s in readers:
            planner.need(v, s)
    planner.phase = "after"
    outputs: list[tuple[OuterRef, tuple[int, ...]] | None] = [None] * len(jaxpr.outvars)
    owner_of_leaf = {i: param_owner(k) for k, i in enumerate(param_inputs)}
    # Coloured outputs first: the updates they need fix where the old state is read.
    for uncoloured in (False, True):
        for j, v in enumerate(jaxpr.outvars):
            if isinstance(v, jax_ir.Literal) or ref_of[v].kind in (OuterKind.IN, OuterKind.CONST):
                outputs[j] = (OuterRef(OuterKind.LITERAL, j) if isinstance(v, jax_ir.Literal) else ref_of[v], ())
                continue
            home = colour.get(v)
            if (home is None) != uncoloured:
                continue
            if home is not None:
                meshes: tuple[int, ...] = (home,)
            else:
                old = counterparts[j]
                where = set(planner.input_needs.get(old, ())) | ({owner_of_leaf[old]} if old in owner_of_leaf else set())
                meshes = tuple(sorted(where)) or (0,)
            for m in meshes:
                planner.need(v, m)
            outputs[j] = (ref_of[v], meshes)

    avals = {ref_of[v]: v.aval for e in jaxpr.eqns for v in e.outvars}
    homes = {ref_of[v]: c for v, c in colour.items() if c is not None and ref_of[v].kind is not OuterKind.IN}
    levels = {phase: _levels(jaxpr, planner, ref_of, phase) for phase in ("before", "after")}
    group_of = {key: (phase, lvl) for phase, lv in levels.items() for key, lvl in lv.items()}
    # A value leaves its group when it is moved, read by the pipeline or returned, or read by
    # another group on its mesh.
    escaping = {(ref, src) for ref, src, _ in planner.moves}
    escaping |= {(ref_of[v], m) for v in (*grad_eqn.invars, *jaxpr.outvars) if isinstance(v, jax_ir.Var)
                 for m in range(num_meshes)}
    for (n, mesh), group in group_of.items():
        for v in jaxpr.eqns[n].invars:
            if isinstance(v, jax_ir.Var) and v in producer and group_of.get((producer[v], mesh)) != group:
                escaping.add((ref_of[v], mesh))
    steps = {phase: _phase_steps(jaxpr, planner, ref_of, phase, levels[phase], escaping, num_meshes, avals)
             for phase in ("before", "after")}
    needs = tuple(frozenset(planner.input_needs.get(i, ())) for i in range(len(jaxpr.invars)))
    literals = {j: v.val for j, v in enumerate(jaxpr.outvars) if isinstance(v, jax_ir.Literal)}
    moved = {ref for ref, _, _ in planner.moves if ref.kind is OuterKind.VALUE}
    origins = {ref_of[v]: traced_at(e) for e in jaxpr.eqns for v in e.outvars if ref_of[v] in moved}
    split = StepSplit(tuple(param_inputs), tuple(loss_operands), steps["before"], steps["after"], tuple(outputs),
                      needs, homes, avals, tuple(consts), literals, origins)
    verify_step_split(split, num_meshes)
    return split


def traced_at(eqn: jax_ir.JaxprEqn) -> str:
    """Where the step's code computed ``eqn``'s results: the innermost function outside JAX, flax
    and meshpar (``first_user_frame``), and, when that is an installed library's (optax's
    ``tree_norm``), the line of the user's own code calling into it. Paths are relative to
    their ``sys.path`` entry, as imports name them."""
    frames = [(f.file_name, f.start_line, f.function_name) for f in jax_ir.user_frames(eqn.source_info.traceback)]
    installed = tuple({os.path.join(sysconfig.get_paths()[k], "") for k in ("purelib", "platlib")})
    innermost = first_user_frame(frames)
    own_code = first_user_frame(f for f in frames if not os.path.abspath(f[0]).startswith(installed))
    roots = sorted((os.path.join(os.path.abspath(p or os.curdir), "") for p in sys.path), key=len, reverse=True)

    def short(location: str) -> str:
        root = next((r for r in roots if location.startswith(r)), "")
        return location[len(root):]

    if own_code in (innermost, "unknown location"):
        return short(innermost)
    return f"{short(innermost)} called from {short(own_code)}"


def _moves(planner: _Planner, phase: str) -> list[tuple[OuterRef, int, int]]:
    return sorted(key for key, p in planner.moves.items() if p == phase)


def _levels(jaxpr: jax_ir.Jaxpr, planner: _Planner, ref_of: dict[jax_ir.Var, OuterRef], phase: str
            ) -> dict[tuple[int, int], int]:
    """Each of the phase's (equation, mesh) instances' level: as late as its readers allow
    (``_latest_levels``), never before its inputs can be there (``_earliest_levels``)."""
    return _latest_levels(jaxpr, planner, ref_of, phase, _earliest_levels(jaxpr, planner, ref_of, phase))


def _earliest_levels(jaxpr: jax_ir.Jaxpr, planner: _Planner, ref_of: dict[jax_ir.Var, OuterRef], phase: str
                     ) -> dict[tuple[int, int], int]:
    """Each of the phase's (equation, mesh) instances' earliest level: the moves on its longest
    input path."""
    level: dict[tuple[int, int], int] = {}
    produced_at: dict[tuple[OuterRef, int], int] = {}
    move_into = {(ref, dst): src for ref, src, dst in _moves(planner, phase)}

    def available(v: jax_ir.Atom, mesh: int) -> int:
        if isinstance(v, jax_ir.Literal):
            return 0
        ref = ref_of[v]
        if (ref, mesh) in produced_at:
            return produced_at[(ref, mesh)]
        if (ref, mesh) in move_into:
            return produced_at.get((ref, move_into[(ref, mesh)]), -1) + 1
        return 0  # an input, a constant, or made earlier (the pipeline, the phase before)

    meshes_of: dict[int, list[int]] = {}
    for (n, mesh), p in sorted(planner.instances.items()):
        if p == phase:
            meshes_of.setdefault(n, []).append(mesh)
    for n, e in enumerate(jaxpr.eqns):
        for mesh in meshes_of.get(n, ()):
            lvl = max((available(v, mesh) for v in e.invars), default=0)
            level[(n, mesh)] = lvl
            for v in e.outvars:
                produced_at[(ref_of[v], mesh)] = lvl
    return level


def _latest_levels(jaxpr: jax_ir.Jaxpr, planner: _Planner, ref_of: dict[jax_ir.Var, OuterRef], phase: str,
                   earliest: dict[tuple[int, int], int]) -> dict[tuple[int, int], int]:
    """Each instance's latest level: that of its earliest reader on its mesh, one before the
    earliest reader of a value it sends to another mesh, else the last level its mesh computes
    at. Work that feeds no move joins the program reading its results, so a mesh runs one
    program per level it waits at: placed as early as possible instead, an update's half that
    needs no global norm (Adam's decayed moments, a copy of the whole optimizer state) was a
    program of its own on every mesh, written out and read back by the next, and its kernels
    compiled twice. A latest level is never before the earliest (the readers' earliest levels
    are at least their producers', plus one across a move)."""
    last: dict[int, int] = {}
    for (_, mesh), lvl in earliest.items():
        last[mesh] = max(last.get(mesh, lvl), lvl)
    move_into = {(ref, dst): src for ref, src, dst in _moves(planner, phase)}
    producer = planner.producer
    bound: dict[tuple[int, int], int] = {}
    level: dict[tuple[int, int], int] = {}
    for (n, mesh) in sorted(earliest, reverse=True):  # readers before what they read
        level[(n, mesh)] = lvl = min(bound.get((n, mesh), last[mesh]), last[mesh])
        for v in jaxpr.eqns[n].invars:
            if not isinstance(v, jax_ir.Var) or v not in producer:
                continue
            p = producer[v]
            if (p, mesh) in earliest:
                bound[(p, mesh)] = min(bound.get((p, mesh), lvl), lvl)
            elif (ref_of[v], mesh) in move_into and (p, move_into[(ref_of[v], mesh)]) in earliest:
                at = (p, move_into[(ref_of[v], mesh)])
                bound[at] = min(bound.get(at, lvl - 1), lvl - 1)
    return level


def _phase_steps(jaxpr: jax_ir.Jaxpr, planner: _Planner, ref_of: dict[jax_ir.Var, OuterRef], phase: str,
                 level: dict[tuple[int, int], int], escaping: set[tuple[OuterRef, int]],
                 num_meshes: int, avals: dict[OuterRef, jax_ir.AbstractValue]) -> tuple[OuterStep, ...]:
    """The phase's computations grouped by (level, mesh), each level followed by the moves out of it."""
    produced_at = {(ref_of[v], mesh): lvl for (n, mesh), lvl in level.items() for v in jaxpr.eqns[n].outvars}
    moves = _moves(planner, phase)
    steps: list[OuterStep] = []
    top = max([*level.values(), -1])
    for lvl in range(-1, top + 1):
        for mesh in range(num_meshes):
            group = [n for n in range(len(jaxpr.eqns)) if level.get((n, mesh)) == lvl]
            if group:
                steps.append(_compute(jaxpr, group, mesh, lvl, ref_of, escaping))
        packed: dict[tuple, list[OuterRef]] = {}
        for ref, src, dst in moves:
            if produced_at.get((ref, src), -1) == lvl:
                # A gradient keeps its parameter's sharding: it moves alone.
                alone = ref.kind is OuterKind.GRAD or is_key(avals[ref])
                packed.setdefault((src, dst, ref) if alone else (src, dst, str(avals[ref].dtype)), []).append(ref)
        steps.extend(OuterMove(tuple(refs), key[0], key[1]) for key, refs in packed.items())
    return tuple(steps)


def _compute(jaxpr: jax_ir.Jaxpr, group: list[int], mesh: int, lvl: int, ref_of: dict[jax_ir.Var, OuterRef],
             escaping: set[tuple[OuterRef, int]]) -> OuterCompute:
    eqns = [jaxpr.eqns[n] for n in group]
    defined = {v for e in eqns for v in e.outvars}
    reads: dict[jax_ir.Var, None] = {}
    for e in eqns:
        for v in e.invars:
            if isinstance(v, jax_ir.Var) and v not in defined:
                reads.setdefault(v)
    outs = [v for e in eqns for v in e.outvars if (ref_of[v], mesh) in escaping]
    inputs = tuple(ref_of[v] for v in reads)
    inner = jax_ir.Jaxpr(
        constvars=(), invars=list(reads), outvars=outs, eqns=eqns,
        effects=jax_ir.join_effects(*(e.effects for e in eqns)),
        debug_info=jax_ir.DebugInfo("meshpar step", f"mesh {mesh} level {lvl}", tuple(map(str, inputs)),
                                    tuple(str(ref_of[v]) for v in outs)),
    )
    return OuterCompute(mesh, jax_ir.ClosedJaxpr(inner, ()), inputs, tuple(ref_of[v] for v in outs))


def verify_step_split(split: StepSplit, num_meshes: int) -> None:
    """Every computation type-checks and reads only values available on its mesh by then (step
    inputs and constants anywhere, pipeline results on their homes, earlier computations'
    outputs on their mesh, moved values after their move); every move leaves a mesh that
    holds its value; every output is on the meshes it claims.

    Raises:
      PlanVerificationError: naming the step and the value.
    """
    from ...verification import PlanVerificationError, type_check

    have: set[tuple[OuterRef, int]] = set()

    def walk(steps: Sequence[OuterStep], phase: str) -> None:
        for step in steps:
            if isinstance(step, OuterCompute):
                type_check(step.jaxpr.jaxpr, f"{phase}: computation on mesh {step.mesh}")
                if not 0 <= step.mesh < num_meshes:
                    raise PlanVerificationError(f"{phase}: computation on mesh {step.mesh} of {num_meshes}")
                for ref in step.inputs:
                    if ref.kind not in (OuterKind.IN, OuterKind.CONST) and (ref, step.mesh) not in have:
                        raise PlanVerificationError(f"{phase}: mesh {step.mesh} reads {ref} before it is there")
                have.update((ref, step.mesh) for ref in step.outputs)
            else:
                for value in step.values:
                    if (value, step.src) not in have:
                        raise PlanVerificationError(f"{phase}: {value} moves from mesh {step.src}, which does not hold it")
                if len({str(split.avals[v].dtype) for v in step.values}) > 1:
                    raise PlanVerificationError(f"{phase}: values of several dtypes packed into one move: {step}")
                have.update((value, step.dst) for value in step.values)

    walk(split.before, "before the pipeline")
    for ref, mesh in split.homes.items():
        if ref.kind in (OuterKind.LOSS, OuterKind.AUX, OuterKind.GRAD):
            have.add((ref, mesh))
    walk(split.after, "after the pipeline")
    for j, (ref, meshes) in enumerate(split.outputs):
        for m in meshes:
            if (ref, m) not in have:
                raise PlanVerificationError(f"output {j} ({ref}) is not on mesh {m} after the step")
