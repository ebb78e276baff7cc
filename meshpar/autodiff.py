"""``meshpar.grad`` / ``meshpar.value_and_grad``: JAX's, plus a marker for the pipeline compiler.

Outside ``meshpar.parallelize`` they are ``jax.grad`` / ``jax.value_and_grad``.
While ``parallelize`` traces a train step they bind one ``pipeline_grad``
primitive instead, which carries the loss function's jaxpr (stage markers
included) and stands for "loss, aux and gradients here": the compiler cuts
the loss into forward stages, derives their backward stages, runs them per
micro-batch, and keeps what comes before and after (the update) as
computations around the pipeline.

Micro-batching semantics (what the pipeline returns for a batch cut into M
micro-batches; the rules are ``meshpar.passes.pipeline.cutting.exact_micro_batching``'s):

- loss and gradients, ``reduction=None`` (the default): inferred by the compiler. A loss that
  is a sum over the batch rows, scaled by anything batch-independent (a mean, a weighted
  mean whose normaliser is computed from the batch, inside the loss function or outside it)
  micro-batches exactly: values of the batch alone (token counts, mask sums) are computed
  once on the whole batch, each micro-batch computes its share with the whole batch's
  normalisers, and the shares are summed: equal to ``jax.jit``. A loss that mixes rows after
  parameters enter (BatchNorm statistics, a max or softmax over the batch) cannot be; the
  step warns (``MicroBatchingWarning``) naming each such operation and its line, and
  averages per-micro-batch losses and gradients; ``exact=True`` makes that an error.
- ``reduction="mean"`` / ``"sum"``: per-micro-batch semantics, as named: each micro-batch
  is a batch of its own, and the step's loss and gradients are the mean (resp. sum) of the
  micro-batches'.
- aux (``has_aux=True``): each leaf is combined over micro-batches by an
  ``AuxReduction``: exactly where the loss is (a sum over rows: ``SUM`` of the shares; a
  value per row: ``CONCAT`` along dimension 0; a batch-independent value: ``LAST``), else by
  default ``CONCAT`` for leaves that carry the batch dimension, ``MEAN`` for floating leaves,
  ``SUM`` for integer ones and ``LAST`` for the rest (bools, keys). ``aux_reduction``
  overrides it per leaf (a pytree prefix of the aux).
- PRNG keys: with ``fold_rng=True`` (the default) every key the loss reads
  once per step (typed ``jax.random.key`` or a raw ``uint32`` key) is
  replaced, for micro-batch ``m``, by ``jax.random.fold_in(key, m)``, so
  micro-batches draw distinct randomness, the same in every run and process.
  ``fold_rng=False`` hands every micro-batch the same key.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from meshpar.grad_call import GradCall
from meshpar.nnx_state import has_variables
from meshpar.passes import jax_ir
from meshpar.passes.pipeline.cutting.micro_batching import REDUCTIONS, LossReduction
from meshpar.passes.pipeline.step_primitives import pipeline_grad_p
from meshpar.passes.program.step_values import AuxReduction

__all__ = ["AuxReduction", "LossTraced", "grad", "is_tracing_pipeline", "stop_at_loss", "value_and_grad",
           "tracing_pipeline"]

# Part of JAX's tracing caches' keys: a function (or a jit inside it) traced by plain jax.jit
# would otherwise be served to meshpar from the cache without its markers and meshpar's
# gradient, and one meshpar traced would be served to jax.jit with them.
_TRACING_PIPELINE = jax_ir.trace_context_flag(
    "meshpar_tracing_pipeline", "Set while meshpar traces a step: its markers and gradients bind their primitives.")


@contextlib.contextmanager
def tracing_pipeline() -> Iterator[None]:
    """While active, ``value_and_grad`` binds ``pipeline_grad_p`` instead of differentiating and
    ``mark_stage_boundary`` binds its marker."""
    with _TRACING_PIPELINE(True):
        yield


# Set while a trace needs only the gradient call (``stop_at_loss``).
_STOP_AT_LOSS: contextvars.ContextVar[bool] = contextvars.ContextVar("meshpar_stop_at_loss", default=False)


class LossTraced(BaseException):
    """Raised by ``value_and_grad`` under ``stop_at_loss`` once its call is traced: ``call`` is
    what the trace was for; the rest of the step (the update, its metrics) is not traced. Not
    an ``Exception``, as ``GeneratorExit`` is not: it ends the trace, and a step's own
    ``except Exception`` around its gradient call must not catch it."""

    def __init__(self, call: GradCall) -> None:
        super().__init__("the step's gradient call is traced")
        self.call = call


@contextlib.contextmanager
def stop_at_loss() -> Iterator[None]:
    """While active (inside ``tracing_pipeline``), ``value_and_grad`` raises ``LossTraced``
    instead of returning: the traces at other batch sizes read only the gradient call, and
    tracing the update after it in each took the main job's trace phase from 1.68 to 2.03 s."""
    token = _STOP_AT_LOSS.set(True)
    try:
        yield
    finally:
        _STOP_AT_LOSS.reset(token)


def is_tracing_pipeline() -> bool:
    """Whether ``meshpar.parallelize`` (or the planner) is tracing a step in this thread."""
    return bool(_TRACING_PIPELINE.value)


def _check_aux_reduction(aux_reduction: Any) -> None:
    for leaf in jax.tree.leaves(aux_reduction):
        if not isinstance(leaf, AuxReduction) and leaf not in {r.value for r in AuxReduction}:
            raise ValueError(f"aux_reduction: expected a pytree prefix of the aux whose leaves are one of "
                             f"{[r.value for r in AuxReduction]} or meshpar.AuxReduction, got {leaf!r}")


def _aux_reductions(aux_reduction: Any, aux: Any) -> tuple[AuxReduction | None, ...]:
    """Per aux leaf (``jax.tree.leaves`` order), its user-chosen reduction (``None``: the default
    for its kind). ``aux_reduction`` is a reduction for a whole subtree, or a dict naming some
    keys of a dict (the others keep their defaults), or a list/tuple as long as the aux's."""
    def spread(spec: Any, sub: Any, where: str) -> Any:
        if spec is None or isinstance(spec, (str, AuxReduction)):
            r = None if spec is None else AuxReduction(spec)
            return jax.tree.map(lambda _: r, sub, is_leaf=lambda x: x is None)
        if isinstance(spec, dict) and hasattr(sub, "keys"):
            unknown = set(spec) - set(sub.keys())
            if unknown:
                raise ValueError(f"aux_reduction: names {sorted(map(str, unknown))} at {where or 'the top'}, "
                                 f"which the aux does not have (it has {sorted(map(str, sub.keys()))})")
            return {k: spread(spec.get(k), sub[k], f"{where}[{k!r}]") for k in sub.keys()}
        if isinstance(spec, (list, tuple)) and isinstance(sub, (list, tuple)) and len(spec) == len(sub):
            return type(sub)(spread(a, b, f"{where}[{i}]") for i, (a, b) in enumerate(zip(spec, sub))) \
                if not hasattr(sub, "_fields") else type(sub)(*(spread(a, b, f"{where}[{i}]")
                                                                 for i, (a, b) in enumerate(zip(spec, sub))))
        raise ValueError(f"aux_reduction: at {where or 'the top'} expected a reduction name, or a dict / "
                         f"sequence shaped like the aux there, got {spec!r}")

    mirror = spread(aux_reduction, aux, "")
    return tuple(jax.tree.leaves(mirror, is_leaf=lambda x: x is None or isinstance(x, AuxReduction)))


def _owned(x: Any) -> Any:
    """An aux leaf as a value the loss function computes: one it merely passes through (an
    input, a constant) is copied, so the stage that ends the loss owns it."""
    return jnp.array(x, copy=True)


def value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
    *,
    reduction: str | LossReduction | None = None,
    aux_reduction: Any = None,
    fold_rng: bool = True,
    exact: bool = False,
) -> Callable[..., tuple[Any, Any]]:
    """Like ``jax.value_and_grad`` (same positional signature); the keywords say how a
    ``meshpar.parallelize``-d step combines micro-batches (module docstring).

    Args:
      fun, argnums, has_aux, holomorphic, allow_int, reduce_axes: as for JAX. Inside a
        pipeline the differentiated arguments must be step inputs (e.g. ``state.params``),
        ``holomorphic`` and ``allow_int`` are not supported.
      reduction: ``None``: inferred, exact where the loss allows (module docstring);
        ``"mean"`` or ``"sum"``: per-micro-batch semantics, the step's loss and gradients the
        mean (resp. sum) of the micro-batches'.
      aux_reduction: an ``AuxReduction`` (or its name) for the whole aux, or a dict naming
        some keys of an aux dict (nested as the aux is; unnamed keys keep their defaults),
        or a sequence as long as an aux tuple; ``None``: every leaf its default.
      fold_rng: fold each micro-batch's index into the PRNG keys the loss reads.
      exact: raise, when the step compiles, if its micro-batches cannot reproduce the whole
        batch's loss and gradients (instead of warning and combining per micro-batch).

    Returns:
      ``(loss, grads)``, or ``((loss, aux), grads)`` with ``has_aux``; ``grads`` is shaped
      like the argument (a tuple of them when ``argnums`` is a sequence).

    flax NNX: a differentiated argument holding ``nnx.Variable``s (an ``nnx.Module``) is
    differentiated as ``nnx.value_and_grad`` does it: ``grads`` is an ``nnx.State`` of its
    ``nnx.Param``s, and the other Variables the loss updates (``nnx.Dropout``'s ``Rngs``
    counter, ``nnx.BatchNorm``'s statistics) are set on the object afterwards::

        loss, grads = meshpar.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)

    In a pipeline those updates combine over micro-batches like aux values: floating ones by
    their mean, the others (counters, keys) as the last micro-batch's. Objects passed in
    non-differentiated positions are read, not updated.
    """
    if reduction is not None:
        # The API boundary: the name resolves here, once; the compiler takes the LossReduction.
        try:
            reduction = LossReduction.of(reduction, "reduction")
        except ValueError:
            raise ValueError(f"reduction: expected None (inferred, exact where possible) or one of {REDUCTIONS}, "
                             f"got {reduction!r}") from None
    if not isinstance(fold_rng, bool):
        raise TypeError(f"fold_rng: expected a bool, got {fold_rng!r}")
    if not isinstance(exact, bool):
        raise TypeError(f"exact: expected a bool, got {exact!r}")
    if exact and reduction is not None:
        raise ValueError(f"exact: True asks for the inferred, exact combination; reduction={reduction.value!r} "
                         f"asks for per-micro-batch semantics; pass one of them")
    _check_aux_reduction(aux_reduction)
    if aux_reduction is not None and not has_aux:
        raise ValueError("aux_reduction: given, but has_aux=False (the loss function returns no aux)")
    several = not isinstance(argnums, int)
    positions = tuple(argnums) if several else (argnums,)
    if not positions or not all(isinstance(a, int) and a >= 0 for a in positions) or len(set(positions)) != len(positions):
        raise ValueError(f"argnums: expected a non-negative int or a sequence of distinct ones, got {argnums!r}")
    plain = jax.value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, reduce_axes)

    def wrapped(*args: Any) -> tuple[Any, Any]:
        if max(positions) < len(args) and any(has_variables(args[a]) for a in positions):
            return _nnx_value_and_grad(fun, positions, several, has_aux, aux_reduction, reduction, fold_rng, exact,
                                       (holomorphic, allow_int, reduce_axes), args)
        if not is_tracing_pipeline():
            return plain(*args)
        return _pipeline_value_and_grad(fun, positions, several, has_aux, lambda: aux_reduction, reduction,
                                        fold_rng, exact, holomorphic or allow_int, args)

    return wrapped


def _pipeline_value_and_grad(fun: Callable[..., Any], positions: tuple[int, ...], several: bool, has_aux: bool,
                             aux_reduction_of: Callable[[], Any], reduction: LossReduction | None, fold_rng: bool,
                             exact: bool, unsupported: bool, args: tuple) -> tuple[Any, Any]:
    """``value_and_grad`` while ``parallelize`` traces: binds ``pipeline_grad_p``.
    ``aux_reduction_of`` gives the aux reduction spec once ``fun`` has been traced."""
    if unsupported:
        raise ValueError("value_and_grad: holomorphic and allow_int are not supported inside meshpar.parallelize")
    if max(positions) >= len(args):
        raise ValueError(f"argnums: {positions if several else positions[0]!r} for a call with {len(args)} "
                         f"positional arguments")
    diff = tuple(args[a] for a in positions)
    rest = [a for i, a in enumerate(args) if i not in positions]

    def loss_of(diff_args, *rest_args):
        call = list(rest_args)
        for a, d in sorted(zip(positions, diff_args)):
            call.insert(a, d)
        out = fun(*call)
        if not has_aux:
            return out, ()
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("value_and_grad: with has_aux=True the loss function must return (loss, aux)")
        return out[0], out[1]

    converted, consts = jax.closure_convert(lambda d: loss_of(d, *rest), diff)
    leaves, treedef = jax.tree.flatten(diff)
    aux_tree = None

    def flat(ls, cs):
        nonlocal aux_tree
        loss, aux = converted(jax.tree.unflatten(treedef, ls), *cs)
        aux_leaves, aux_tree = jax.tree.flatten(aux)
        return [loss, *aux_leaves]

    closed = jax.make_jaxpr(flat)(leaves, consts)
    loss_aval = closed.out_avals[0]
    if loss_aval.shape != () or not jnp.issubdtype(loss_aval.dtype, jnp.inexact):
        raise TypeError(f"value_and_grad: the loss function must return one floating scalar, got {loss_aval}")
    passed = {k for k, v in enumerate(closed.jaxpr.outvars[1:]) if not _computed(closed.jaxpr, v)}
    if passed:
        closed = jax.make_jaxpr(
            lambda ls, cs: [o if k == 0 or k - 1 not in passed else _owned(o) for k, o in enumerate(flat(ls, cs))]
        )(leaves, consts)
    reductions = _aux_reductions(aux_reduction_of(), jax.tree.unflatten(aux_tree, [0] * aux_tree.num_leaves))
    if len(reductions) != aux_tree.num_leaves:
        raise ValueError(f"aux_reduction: gives {len(reductions)} leaf reductions for {aux_tree.num_leaves} aux leaves")
    # Operands: the differentiated leaves first, then the jaxpr's own
    # constants and the closed-over values, all as plain inputs so the
    # compiler can cut the loss anywhere.
    jaxpr = closed.jaxpr
    n = len(leaves)
    reordered = jax_ir.Jaxpr(
        constvars=(),
        invars=[*jaxpr.invars[:n], *jaxpr.constvars, *jaxpr.invars[n:]],
        outvars=jaxpr.outvars,
        eqns=jaxpr.eqns,
        effects=jaxpr.effects,
        debug_info=jax_ir.DebugInfo(
            "meshpar.value_and_grad", getattr(fun, "__name__", "loss"),
            tuple(f"arg{i}" for i in range(len(jaxpr.invars) + len(jaxpr.constvars))),
            ("loss", *(f"aux{k}" for k in range(aux_tree.num_leaves))),
        ),
    )
    operands = [*leaves, *closed.consts, *consts]
    params = dict(loss_jaxpr=jax_ir.ClosedJaxpr(reordered, ()), num_diff=n, num_aux=aux_tree.num_leaves,
                  aux_reductions=reductions, reduction=reduction, fold_rng=fold_rng, exact=exact)
    if _STOP_AT_LOSS.get():
        raise LossTraced(GradCall(params, tuple(jax.typeof(x) for x in operands)))
    outs = pipeline_grad_p.bind(*operands, **params)
    value, aux, grads = outs[0], outs[1:1 + aux_tree.num_leaves], outs[1 + aux_tree.num_leaves:]
    grads = jax.tree.unflatten(treedef, grads)
    grads = grads if several else grads[0]
    if has_aux:
        return (value, jax.tree.unflatten(aux_tree, aux)), grads
    return value, grads


def _nnx_value_and_grad(fun: Callable[..., Any], positions: tuple[int, ...], several: bool, has_aux: bool,
                        aux_reduction: Any, reduction: LossReduction | None, fold_rng: bool, exact: bool,
                        jax_options: tuple, args: tuple) -> tuple[Any, Any]:
    """``value_and_grad`` of a loss over NNX objects, as ``nnx.value_and_grad`` computes it: the
    gradient with respect to each differentiated object's ``nnx.Param``s (an ``nnx.State``), and
    the object's other Variables the loss updates (a dropout stream's counter, BatchNorm
    statistics) set on it afterwards. In a pipeline those updates are aux values combined over
    micro-batches: floating ones averaged (BatchNorm statistics, as for linen), others (counters,
    keys) the last micro-batch's, which is the one step's update."""
    from flax import nnx

    parts = [nnx.split(args[a], nnx.Param, ...) if has_variables(args[a]) else (None, args[a], None)
             for a in positions]
    params = tuple(p for _, p, _ in parts)
    rests = tuple(r for _, _, r in parts)
    rest_leaves, rest_tree = jax.tree.flatten(rests)
    changed: list[tuple[int, ...]] = []

    def functional(params: tuple, rests: tuple, *others: Any) -> tuple[Any, Any]:
        # Variables made anew at this trace level: NNX refuses updates to a Variable of another.
        params, rests = jax.tree.map(lambda x: x, (params, rests))
        # Read before the call: merged objects hold these very Variables, which the loss updates.
        before = jax.tree.leaves(rests)
        objects = [p if g is None else nnx.merge(g, p, r) for (g, _, _), p, r in zip(parts, params, rests)]
        call = list(others)
        for a, obj in sorted(zip(positions, objects)):
            call.insert(a, obj)
        out = fun(*call)
        loss, aux = out if has_aux else (out, ())
        if has_aux and not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError("value_and_grad: with has_aux=True the loss function must return (loss, aux)")
        after = jax.tree.leaves(tuple(None if g is None else nnx.state(o, nnx.Not(nnx.Param))
                                      for (g, _, _), o in zip(parts, objects)))
        changed.append(tuple(i for i, (b, a) in enumerate(zip(before, after)) if b is not a))
        return loss, (aux, [after[i] for i in changed[-1]])

    def aux_reduction_of() -> tuple[Any, list[AuxReduction]]:
        updates = [rest_leaves[i] for i in changed[-1]]
        return aux_reduction, [AuxReduction.MEAN if jnp.issubdtype(jnp.result_type(u), jnp.floating)
                               else AuxReduction.LAST for u in updates]

    others = tuple(x for i, x in enumerate(args) if i not in positions)
    holomorphic, allow_int, reduce_axes = jax_options
    if is_tracing_pipeline():
        (value, (aux, updates)), grads = _pipeline_value_and_grad(
            functional, (0,), False, True, aux_reduction_of, reduction, fold_rng, exact,
            holomorphic or allow_int, (params, rests, *others))
    else:
        (value, (aux, updates)), grads = jax.value_and_grad(
            functional, 0, True, holomorphic, allow_int, reduce_axes)(params, rests, *others)
    new_leaves = list(rest_leaves)
    for i, u in zip(changed[-1], updates, strict=True):
        new_leaves[i] = u
    for a, (g, _, _), rest in zip(positions, parts, jax.tree.unflatten(rest_tree, new_leaves)):
        if g is not None:
            nnx.update(args[a], rest)
    grads = grads if several else grads[0]
    return ((value, aux), grads) if has_aux else (value, grads)


def _computed(jaxpr: jax_ir.Jaxpr, v: jax_ir.Atom) -> bool:
    return isinstance(v, jax_ir.Var) and any(v in e.outvars for e in jaxpr.eqns)


def grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    holomorphic: bool = False,
    allow_int: bool = False,
    reduce_axes: Sequence[Any] = (),
    *,
    reduction: str | LossReduction | None = None,
    aux_reduction: Any = None,
    fold_rng: bool = True,
    exact: bool = False,
) -> Callable[..., Any]:
    """Like ``jax.grad``: ``grads``, or ``(grads, aux)`` with ``has_aux``; see ``value_and_grad``."""
    vg = value_and_grad(fun, argnums, has_aux, holomorphic, allow_int, reduce_axes,
                        reduction=reduction, aux_reduction=aux_reduction, fold_rng=fold_rng, exact=exact)

    def run(*args: Any) -> Any:
        value, grads = vg(*args)
        return (grads, value[1]) if has_aux else grads

    return run
