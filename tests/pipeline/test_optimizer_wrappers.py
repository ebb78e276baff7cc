"""Optimizer wrappers that put the whole update under one conditional (optax.MultiSteps,
optax.apply_if_finite, nested, around global-norm clipping, or under a user's lax.cond) under
meshpar.parallelize, against jax.jit: equal results, every parameter and optimizer-state leaf on
its stage's mesh after each step, and only one-element values crossing meshes around the
pipeline. Then the conditional-splitting pass (passes.split_conditionals) and the step split it
feeds, without meshes: rewritten jaxprs evaluate to what the originals do."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax.training import train_state

import meshpar
from meshpar.autodiff import tracing_pipeline
from meshpar.passes import jax_ir
from meshpar.passes.pipeline.cutting.split_conditionals import cut_cond, inline_fixed_calls, split_cond
from meshpar.passes.pipeline.cutting.stage_graph import Ref, split_stages
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.pipeline.cutting.step_split import OuterCompute, split_step
from meshpar.passes.program.step_values import OuterKind
from pipeline_models import TwoStages, assert_trees_close

METHOD = meshpar.PipeshardParallel(num_micro_batches=4, num_stages=2, stage_mesh_shape=(2, 2))
GOOD, NAN = "good", "nan"


def _batch(seed, nan=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 6)).astype(np.float32)
    if nan:
        x[3, 2] = np.nan  # one example: every gradient leaf of both stages becomes NaN
    return {"x": x, "y": rng.standard_normal((16, 4)).astype(np.float32)}


def _step(state, batch):
    def loss_fn(params):
        return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

    loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def _adam():
    return optax.adam(1e-2, eps=1e-5)


def _clipped_adam():
    return optax.chain(optax.clip_by_global_norm(0.05), _adam())


def _state(model, tx):
    params = model.init(jax.random.key(0), _batch(0)["x"][:1])["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)


WRAPPERS = {
    "multi_steps": (lambda: optax.MultiSteps(_adam(), every_k_schedule=2), [GOOD] * 4),
    "apply_if_finite": (lambda: optax.apply_if_finite(_adam(), 3), [GOOD, NAN, GOOD]),
    "apply_if_finite_of_multi_steps": (lambda: optax.apply_if_finite(optax.MultiSteps(_adam(), 2), 3),
                                       [GOOD, NAN, GOOD, GOOD]),
    "multi_steps_of_clipping": (lambda: optax.MultiSteps(_clipped_adam(), 2), [GOOD] * 4),
    "apply_if_finite_of_clipping": (lambda: optax.apply_if_finite(_clipped_adam(), 3), [GOOD, NAN, GOOD]),
}


def _stage_of_leaf(path, params_paths):
    """The stage of the parameter whose path ends ``path`` (an optimizer state mirrors the
    parameter tree under its own prefix), or None for a leaf mirroring no parameter."""
    for stage, p in params_paths:
        if tuple(path[-len(p):]) == tuple(p):
            return stage
    return None


def _assert_on_stage_meshes(state, compiled):
    meshes = [set(m.devices.flat) for m in compiled.meshes]
    params_paths = [(compiled.graph.param_owner(k), p)
                    for k, (p, _) in enumerate(jax.tree_util.tree_leaves_with_path(state.params))]
    for tree in (state.params, state.opt_state):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            stage = _stage_of_leaf(path, params_paths)
            where = set(leaf.sharding.device_set)
            if stage is None:
                # Step counts and flags: scalars, kept on meshes of the step.
                assert leaf.shape == () and where <= meshes[0] | meshes[1], jax.tree_util.keystr(path)
            else:
                assert where == meshes[stage], f"{jax.tree_util.keystr(path)} is not on stage {stage}'s mesh"


def _moved_shapes(describe):
    """Every value ``describe()`` lists as crossing meshes around the pipeline: (dtype, shape)."""
    lines = [ln for ln in describe.splitlines() if ln.strip().startswith(("before the pipeline:", "after it:"))]
    return [(d, tuple(int(n) for n in s.split(",") if n)) for ln in lines
            for d, s in re.findall(r"\b(\w+)\[([\d,]*)\]", ln.split(";", 1)[1] if ";" in ln else "")]


@pytest.mark.parametrize("wrapper", [pytest.param(w, marks=pytest.mark.slow) if w.endswith("_of_clipping") else w
                                     for w in WRAPPERS])
def test_wrapped_updates_match_jit_stay_on_stage_meshes_and_move_only_scalars(wrapper):
    make_tx, kinds = WRAPPERS[wrapper]
    state = _state(TwoStages(), make_tx())
    parallel = meshpar.parallelize(_step, method=METHOD)
    reference = jax.jit(_step)
    ref, par = state, state
    for n, kind in enumerate(kinds):
        batch = _batch(n, nan=kind == NAN)
        ref, ref_loss = reference(ref, batch)
        par, par_loss = parallel(par, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
        assert_trees_close(par.params, ref.params)
        assert_trees_close(par.opt_state, ref.opt_state)
        _assert_on_stage_meshes(par, parallel.get_compiled(par, batch))
    assert not jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), ref.params, state.params)), "no update ran"
    if NAN in kinds:
        assert int(ref.opt_state.total_notfinite) == 1, "the non-finite step must be skipped"
    executable = parallel.get_executable(par, _batch(0))
    moved = _moved_shapes(executable.describe())
    assert all(int(np.prod(shape)) == 1 for _, shape in moved), moved
    compiled = parallel.get_compiled(par, _batch(0))
    assert all(int(np.prod(compiled.split.avals[v].shape)) == 1 for m in compiled.split.moved() for v in m.values)


def test_apply_if_finite_sends_mesh_1s_finiteness_flags_and_the_predicate_back():
    batch = _batch(0)
    state = _state(TwoStages(), optax.apply_if_finite(_adam(), 3))
    split = meshpar.parallelize(_step, method=METHOD).get_compiled(state, batch).split
    moves = split.moved()
    assert [(m.src, m.dst, len(m.values)) for m in moves] == [(1, 0, 2), (0, 1, 1)]
    assert [str(split.avals[v].dtype) for m in moves for v in m.values] == ["bool", "bool", "int32"]
    # One update per mesh: the parameters' updates of each stage run where the stage is.
    assert sorted(c.mesh for c in split.after if isinstance(c, OuterCompute)
                  if any(e.primitive.name == "cond" for e in c.jaxpr.jaxpr.eqns)) == [0, 1]


class _ScaledStages(nn.Module):
    """Two stages, each with a scalar parameter."""

    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x)) * self.param("scale0", nn.initializers.ones, ())
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(h) * self.param("scale1", nn.initializers.ones, ())


def test_a_users_cond_around_apply_if_finite_splits_and_scalar_parameters_stay_on_their_stage():
    def step(state, batch):
        def loss_fn(params):
            return jnp.mean((state.apply_fn({"params": params}, batch["x"]) - batch["y"]) ** 2)

        loss, grads = meshpar.value_and_grad(loss_fn)(state.params)
        # The update, finiteness flags combined from both meshes included, under the user's cond.
        new = jax.lax.cond(loss < 100.0, lambda s, g: s.apply_gradients(grads=g), lambda s, g: s, state, grads)
        return new, loss

    state = _state(_ScaledStages(), optax.apply_if_finite(_adam(), 3))
    parallel = meshpar.parallelize(step, method=METHOD)
    ref, par = state, state
    for n, kind in enumerate([GOOD, NAN, GOOD]):
        batch = _batch(n, nan=kind == NAN)
        ref, ref_loss = jax.jit(step)(ref, batch)
        par, par_loss = parallel(par, batch)
        np.testing.assert_allclose(float(par_loss), float(ref_loss), rtol=1e-5)
        assert_trees_close(par.params, ref.params)
        assert_trees_close(par.opt_state, ref.opt_state)
        _assert_on_stage_meshes(par, parallel.get_compiled(par, batch))
    split = parallel.get_compiled(par, _batch(0)).split
    assert split.moved() and all(int(np.prod(split.avals[v].shape)) == 1 for m in split.moved() for v in m.values)


# -- the pass, without meshes ---------------------------------------------------------------


def _random_args(avals, seed):
    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        if np.issubdtype(a.dtype, np.floating):
            out.append(rng.standard_normal(a.shape).astype(a.dtype))
        elif a.dtype == np.bool_:
            out.append(rng.random(a.shape) < 0.5)
        else:
            out.append(rng.integers(0, 3, a.shape).astype(a.dtype))
    return out


def _one_element(v):
    return isinstance(v, jax_ir.Literal) or int(np.prod(v.aval.shape)) <= 1


def _owners(e, owner):
    return [owner.get(v) if isinstance(v, jax_ir.Var) else None for v in e.invars]


def _split_all(jaxpr, owner):
    """``jaxpr`` with constant conds inlined and every cond cut and split as the step split does
    it; a cond's results belong to the mesh of its label, other values to their inputs' one mesh
    (a value of several meshes' or no mesh's values to none). Also, per cond, its label and the
    meshes of the operands it reads that are not one element."""
    jaxpr = inline_fixed_calls(jaxpr)
    eqns, conds = [], []
    for eqn in jaxpr.eqns:
        work = [eqn]
        while work:
            e = work.pop()
            cut = cut_cond(e, _owners(e, owner))
            if cut is not None:
                work.extend(reversed(cut))
                continue
            for part, label in split_cond(e, _owners(e, owner)) or [(e, None)]:
                read = {owner.get(v) for v in part.invars if isinstance(v, jax_ir.Var)} - {None}
                if label is not None:
                    conds.append((label, {owner.get(v) for v in part.invars if not _one_element(v)} - {None}))
                meshes = read if label is None else label
                owner.update((v, next(iter(meshes)) if len(meshes) == 1 else None) for v in part.outvars)
                eqns.append(part)
    return jaxpr.replace(eqns=eqns), conds


def _evaluate_equal(closed, rewritten, args):
    expected = jax_ir.eval_jaxpr(closed.jaxpr, closed.consts, *args)
    actual = jax_ir.eval_jaxpr(rewritten, closed.consts, *args)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)


PARAMS = {"a": {"w": jnp.ones((3, 4)), "b": jnp.ones(4)}, "z": {"w": jnp.ones((4, 2)), "b": jnp.ones(2)}}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_split_wrapper_updates_evaluate_like_the_original(wrapper):
    tx = WRAPPERS[wrapper][0]()
    state = tx.init(PARAMS)

    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    closed = jax.make_jaxpr(update)(PARAMS, state, PARAMS)
    n = len(jax.tree.leaves(PARAMS))
    invars = closed.jaxpr.invars
    # Parameters and gradients of "a" on mesh 0, of "z" on mesh 1; the optimizer state on none.
    mesh_of_leaf = [0, 0, 1, 1]
    owner = {**{invars[k]: mesh_of_leaf[k] for k in range(n)}, **{invars[-n + k]: mesh_of_leaf[k] for k in range(n)}}
    rewritten, conds = _split_all(closed.jaxpr, owner)
    jax_ir.check_jaxpr(rewritten)
    for label, meshes in conds:
        assert meshes <= label and len(label) <= 1, (label, meshes)
    if wrapper.startswith("apply_if_finite"):
        assert {frozenset({0}), frozenset({1})} <= {label for label, _ in conds}, "one conditional per mesh"
    avals = [v.aval for v in invars]
    for seed in range(3):
        args = _random_args(avals, seed)
        if seed == 1:  # a non-finite gradient: apply_if_finite takes its other branch
            args[-1] = np.full_like(args[-1], np.nan)
        _evaluate_equal(closed, rewritten, args)


def test_split_groups_outputs_by_the_meshes_they_read_and_keeps_a_mixed_group_whole():
    def f(index, a0, b0, a1, b1, s0, s1, count):
        def branch(k):
            def run(a0, b0, a1, b1, s0, s1, count):
                mixed = jnp.sum(a0) + jnp.sum(a1)
                return a0 * s1 + k, b0 - a0, a1 + b1 * s1, s1 * (k + 1), mixed, count + k, s0 * s1

            return run

        return jax.lax.switch(index, [branch(0), branch(1), branch(2)], a0, b0, a1, b1, s0, s1, count)

    vec, scalar = jnp.ones(5), jnp.float32(2.0)
    closed = jax.make_jaxpr(f)(jnp.int32(0), vec, vec, vec, vec, scalar, scalar, jnp.int32(0))
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    index, a0, b0, a1, b1, s0, s1, count = closed.jaxpr.invars
    owners = {a0: 0, b0: 0, a1: 1, b1: 1, s0: 0, s1: 1}
    parts = split_cond(cond, _owners(cond, owners))
    # Mesh 1's scalar is free to move to mesh 0's part, but its own update stays on mesh 1; a
    # count of no mesh and a product of both meshes' scalars belong to no mesh.
    outputs = {label: sorted(map(cond.outvars.index, p.outvars)) for p, label in parts}
    assert outputs == {frozenset(): [5, 6], frozenset({0}): [0, 1], frozenset({0, 1}): [4], frozenset({1}): [2, 3]}
    assert all(p.invars[0] is cond.invars[0] for p, _ in parts)
    operands = {label: set(p.invars[1:]) for p, label in parts}
    assert operands[frozenset({0})] == {a0, b0, s1} and operands[frozenset({1})] == {a1, b1, s1}
    rewritten = closed.jaxpr.replace(eqns=[p for e in closed.jaxpr.eqns
                                           for p, _ in (split_cond(e, _owners(e, owners)) or [(e, None)])])
    jax_ir.check_jaxpr(rewritten)
    for k in range(3):
        _evaluate_equal(closed, rewritten, [np.int32(k), *_random_args([v.aval for v in closed.jaxpr.invars[1:]], k)])


def test_a_cut_separates_a_global_norm_into_per_mesh_sums_then_per_mesh_updates():
    def f(index, g0, h0, g1, mu0):
        def clip(g0, h0, g1, mu0):
            norm = jnp.sqrt(jnp.sum(g0 ** 2) + jnp.sum(h0 ** 2) + jnp.sum(g1 ** 2))
            scale = jnp.minimum(1.0, 0.5 / norm)
            return g0 * scale, h0 * scale, g1 * scale, mu0 * 0.9 + g0 * scale, norm

        def keep(g0, h0, g1, mu0):
            return g0, h0, g1, mu0, jnp.float32(0.0)

        return jax.lax.cond(index > 0, clip, keep, g0, h0, g1, mu0)

    vec = jnp.ones(4)
    closed = jax.make_jaxpr(f)(jnp.int32(0), vec, vec, vec, vec)
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    _, g0, h0, g1, mu0 = closed.jaxpr.invars
    owners = {g0: 0, h0: 0, g1: 1}
    # Every output depends on both meshes' gradients through the norm: no grouping separates them.
    assert split_cond(cond, _owners(cond, owners)) == [(cond, frozenset({0, 1}))]
    first, second = cut_cond(cond, _owners(cond, owners))
    assert first.invars[0] is second.invars[0] is cond.invars[0] and second.outvars == cond.outvars
    assert all(int(np.prod(v.aval.shape)) == 1 for v in first.outvars)
    first_parts = split_cond(first, _owners(first, owners))
    assert [label for _, label in first_parts] == [frozenset({0}), frozenset({1})]
    for p, label in first_parts:
        owners.update((v, next(iter(label))) for v in p.outvars)
    assert cut_cond(second, _owners(second, owners)) is None, "one cut leaves nothing combined"
    second_parts = split_cond(second, _owners(second, owners))
    # The norm, returned, is recomputed from the moved sums by no mesh's part.
    assert {label: sorted(map(cond.outvars.index, p.outvars)) for p, label in second_parts} == {
        frozenset(): [4], frozenset({0}): [0, 1, 3], frozenset({1}): [2]}
    rewritten = closed.jaxpr.replace(eqns=[*closed.jaxpr.eqns[:-1], *(p for p, _ in first_parts),
                                           *(p for p, _ in second_parts)])
    jax_ir.check_jaxpr(rewritten)
    for k in range(2):
        _evaluate_equal(closed, rewritten, [np.int32(k), *_random_args([v.aval for v in closed.jaxpr.invars[1:]], k)])


def test_a_cond_of_one_mesh_and_an_effectful_cond_stay_whole():
    def f(index, a, b):
        return jax.lax.cond(index > 0, lambda a, b: (a + b, a - b), lambda a, b: (a, b), a, b)

    closed = jax.make_jaxpr(f)(jnp.int32(0), jnp.ones(3), jnp.ones(3))
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    assert split_cond(cond, [None, 1, 1]) == [(cond, frozenset({1}))]
    assert split_cond(closed.jaxpr.eqns[0], [None, None]) is None  # not a cond

    def g(index, a, b):
        def loud(a, b):
            jax.debug.print("{}", a)
            return a, b

        return jax.lax.cond(index > 0, loud, lambda a, b: (a, b), a, b)

    effectful = jax.make_jaxpr(g)(jnp.int32(0), jnp.ones(3), jnp.ones(3))
    (cond,) = [e for e in effectful.jaxpr.eqns if e.primitive.name == "cond"]
    assert split_cond(cond, [None, 0, 1]) is None


def test_constant_conds_are_inlined_recursively_and_others_kept():
    def f(x, y, index):
        inner = lambda x, y: jax.lax.cond(True, lambda x, y: (x * 2, y), lambda x, y: (x, y + 1), x, y)
        x2, y2 = jax.lax.cond(False, lambda x, y: (y, x), inner, x, y)
        return jax.lax.cond(index > 0, lambda v: v + 1, lambda v: v - 1, x2), y2, y

    closed = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3), jnp.int32(1))
    inlined = inline_fixed_calls(closed.jaxpr)
    jax_ir.check_jaxpr(inlined)
    conds = [e for e in inlined.eqns if e.primitive.name == "cond"]
    assert len(conds) == 1 and not isinstance(conds[0].invars[0], jax_ir.Literal)
    assert inlined.outvars[1] is closed.jaxpr.invars[1], "a branch passing an operand through returns it"
    for k in range(2):
        _evaluate_equal(closed, inlined, [*_random_args([v.aval for v in closed.jaxpr.invars[:2]], k), np.int32(k)])
    assert inline_fixed_calls(inlined) is inlined


# -- the step split over a traced step, without meshes ----------------------------------------


def _traced_split(tx):
    args = (_state(TwoStages(), tx), _batch(0))
    with tracing_pipeline():
        outer = jax.make_jaxpr(_step)(*args)
    (grad,) = [e for e in outer.jaxpr.eqns if e.primitive.name == "meshpar_pipeline_grad"]
    graph = split_stages(grad.params["loss_jaxpr"], grad.params["num_diff"])
    readers = [graph.consumers(Ref(RefKind.INPUT, k)) for k in range(graph.num_inputs)]
    split = split_step(outer, graph.param_owner, graph.loss.index, [r.index for r in graph.aux],
                       graph.num_stages, readers, [None] * len(outer.jaxpr.outvars))
    return outer, grad, split, jax.tree.leaves(args)


def _run_original(outer, grad, inputs, pipeline_results):
    """The traced step with the pipeline's results given in place of its gradient equation."""
    jaxpr = outer.jaxpr
    given = jaxpr.replace(invars=[*jaxpr.invars, *grad.outvars], eqns=[e for e in jaxpr.eqns if e is not grad])
    return jax_ir.eval_jaxpr(given, outer.consts, *inputs, *pipeline_results)


def _run_split(split, inputs, pipeline_results):
    """The split's computations in order, meshes ignored (the verifier checks them)."""
    values = {(OuterKind.LOSS, 0): pipeline_results[0]}
    values |= {(OuterKind.GRAD, k): g for k, g in enumerate(pipeline_results[1:])}
    read = lambda ref: (inputs[ref.index] if ref.kind is OuterKind.IN
                        else split.consts[ref.index] if ref.kind is OuterKind.CONST
                        else values[(ref.kind, ref.index)])
    for step in (*split.before, *split.after):
        if isinstance(step, OuterCompute):
            outs = jax_ir.eval_jaxpr(step.jaxpr.jaxpr, step.jaxpr.consts, *map(read, step.inputs))
            values.update(((r.kind, r.index), o) for r, o in zip(step.outputs, outs))
    return [read(ref) if ref.kind is not OuterKind.LITERAL else split.literals[ref.index] for ref, _ in split.outputs]


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_step_split_of_wrapped_updates_computes_the_traced_step_and_moves_only_scalars(wrapper):
    outer, grad, split, inputs = _traced_split(WRAPPERS[wrapper][0]())
    assert all(int(np.prod(split.avals[v].shape)) == 1 for m in split.moved() for v in m.values)
    avals = [v.aval for v in grad.outvars]
    for seed in range(2):
        results = [jnp.asarray(a) for a in _random_args(avals, seed)]
        if seed == 1:
            results[-1] = jnp.full_like(results[-1], jnp.nan)
        for a, e in zip(_run_split(split, inputs, results), _run_original(outer, grad, inputs, results)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=1e-6, atol=1e-6)
