"""Forward/backward parts of a stage, and the B/W split of its backward."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshpar
from meshpar.passes import jax_ir
from meshpar.passes.pipeline.cutting.stage_graph import Ref, Stage, split_stages
from meshpar.passes.program.step_values import RefKind
from meshpar.passes.program.stage_kernel import StageParts
from meshpar.passes.pipeline.cutting.stage_parts import stage_parts, verify_stage_parts
from meshpar.passes.verification import PlanVerificationError

F32 = jnp.float32
act, param, inp = (lambda k=0, slot=0: Ref(RefKind.ACT, k, slot)), (lambda k=0: Ref(RefKind.PARAM, k)), (lambda k=0: Ref(RefKind.INPUT, k))


def _stage(fun, refs, shapes, index=1):
    """A Stage from a Python function of its inputs (each a float32 shape or a ShapeDtypeStruct)."""
    specs = [s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(s, F32) for s in shapes]
    closed = jax.make_jaxpr(lambda *a: tuple(fun(*a)))(*specs)
    return Stage(index, closed, tuple(refs), tuple(Ref(RefKind.ACT, index, k) for k in range(len(closed.out_avals))))


def _values(avals, seed):
    rng = np.random.default_rng(seed)
    out = []
    for a in avals:
        if a.dtype == jax.dtypes.float0:
            out.append(np.zeros(a.shape, jax.dtypes.float0))
        elif jnp.issubdtype(a.dtype, jnp.integer):
            out.append(rng.integers(0, 5, a.shape).astype(a.dtype))
        else:
            out.append(rng.normal(size=a.shape).astype(a.dtype))
    return out


def _run(closed, *args):
    return jax.jit(jax_ir.jaxpr_as_fun(closed))(*args)


def _mlp(x, w, b, y):
    return [jnp.tanh(x @ w + b) * y, jnp.sum(w)]


def _scan(x, w):
    def body(h, _):
        return jnp.tanh(h @ w), jnp.sum(h)

    return jax.lax.scan(body, x, None, length=3)


def _first(w, x):
    return [jnp.tanh(x @ w)]


def _acts_only(x, z):
    return [jnp.sin(x) * z, x]


def _identity(x, w, s):
    # x's cotangent is an output cotangent itself (twice), s's and part of w's are zeros.
    return [x, x + w, x * 2.0, jnp.zeros_like(s)]


def _nested_jit(x, w):
    return [jax.jit(lambda x, w: jnp.sin(x * w))(x, w)]


def _int_act(x, i, w):
    return [x * w, i + 1]


CASES = {
    "mlp": (_mlp, [act(), param(0), param(1), inp()], [(2, 4), (4, 4), (4,), (2, 4)]),
    "scan": (_scan, [act(), param()], [(2, 4), (4, 4)]),
    "first": (_first, [param(), inp()], [(4, 4), (2, 4)]),
    "acts_only": (_acts_only, [act(0), act(0, 1)], [(3,), (3,)]),
    "identity": (_identity, [act(), param(0), param(1)], [(4,), (4,), ()]),
    "nested_jit": (_nested_jit, [act(), param()], [(4,), (4,)]),
    "int_act": (_int_act, [act(), act(0, 1), param()], [(4,), jax.ShapeDtypeStruct((4,), jnp.int32), (4,)]),
}


def _splitter_stages():
    """The three stages meshpar's own splitter cuts from a marked loss."""
    def loss(params, x, y):
        h = jnp.tanh(x @ params[0] + params[1])
        meshpar.mark_stage_boundary()
        h = jax.nn.relu(h @ params[2]) + h
        meshpar.mark_stage_boundary()
        return jnp.mean((h @ params[3] - y) ** 2)

    rng = np.random.default_rng(0)
    params = [rng.normal(size=s).astype(np.float32) for s in [(4, 8), (8,), (8, 8), (8, 2)]]
    x, y = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(3, 2)).astype(np.float32)
    closed = jax.make_jaxpr(lambda *a: loss(a[:4], *a[4:]))(*params, x, y)
    return split_stages(closed, len(params)).stages


SPLIT = _splitter_stages()
STAGES = {name: _stage(f, refs, shapes) for name, (f, refs, shapes) in CASES.items()}
STAGES.update({f"split{s.index}": s for s in SPLIT})


@pytest.fixture(scope="module", params=sorted(STAGES))
def built(request):
    stage = STAGES[request.param]
    parts = stage_parts(stage)
    verify_stage_parts(stage, parts)
    return request.param, stage, parts


def _reference_vjp(name, stage, args, cts):
    """Cotangents of the act then param inputs, by jax.vjp of the Python function (or the stage jaxpr)."""
    fun = CASES[name][0] if name in CASES else jax_ir.jaxpr_as_fun(stage.jaxpr)
    diff = [i for i, r in enumerate(stage.inputs) if r.kind in (RefKind.ACT, RefKind.PARAM)
            and jnp.issubdtype(stage.jaxpr.in_avals[i].dtype, jnp.inexact)]
    floating = [k for k, a in enumerate(stage.jaxpr.out_avals) if jnp.issubdtype(a.dtype, jnp.inexact)]

    def f(*d):
        full = list(args)
        for i, v in zip(diff, d):
            full[i] = v
        outs = fun(*full)
        return tuple(outs[k] for k in floating)

    _, vjp = jax.vjp(f, *[args[i] for i in diff])
    grads = dict(zip(diff, vjp(tuple(cts))))
    order = [i for i in diff if stage.inputs[i].kind is RefKind.ACT] + [i for i in diff if stage.inputs[i].kind is RefKind.PARAM]
    return [grads[i] for i in order]


def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        if g.dtype != jax.dtypes.float0:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_forward_and_backward_match_jax(built):
    name, stage, parts = built
    args = _values(stage.jaxpr.in_avals, seed=1)
    outs = _run(parts.forward, *[args[i] for i in (*parts.diff_inputs, *parts.other_inputs)])
    _close(outs[:parts.num_outputs], _run(stage.jaxpr, *args))
    cts = _values([stage.jaxpr.out_avals[k].to_tangent_aval() for k in parts.diff_outputs], seed=2)
    grads = _run(parts.backward, *outs[parts.num_outputs:], *cts)
    _close(grads, _reference_vjp(name, stage, args, cts))


def test_split_is_bit_exact_without_recomputation(built):
    _, stage, parts = built
    args = _values(stage.jaxpr.in_avals, seed=3)
    outs = _run(parts.forward, *[args[i] for i in (*parts.diff_inputs, *parts.other_inputs)])
    residuals = outs[parts.num_outputs:]
    cts = _values([stage.jaxpr.out_avals[k].to_tangent_aval() for k in parts.diff_outputs], seed=4)
    whole = _run(parts.backward, *residuals, *cts)
    b_out = _run(parts.backward_input, *residuals, *cts)
    n_act = parts.num_act_cotangents
    assert len(b_out) == n_act + parts.num_weight_state
    w_out = _run(parts.backward_weight, *b_out[n_act:])
    assert len(whole) == len(b_out[:n_act]) + len(w_out)
    for got, want in zip([*b_out[:n_act], *w_out], whole):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # No equation is in both parts, and together they are the backward's (none recomputed).
    b_ids = [id(e) for e in parts.backward_input.jaxpr.eqns]
    w_ids = [id(e) for e in parts.backward_weight.jaxpr.eqns]
    bwd_ids = [id(e) for e in parts.backward.jaxpr.eqns]
    assert not set(b_ids) & set(w_ids)
    assert sorted(b_ids + w_ids, key=bwd_ids.index) == bwd_ids


def test_weight_work_is_delayed_to_w():
    mlp = stage_parts(STAGES["mlp"])
    # The weight gradient's matmul is in W only; B keeps the one for the input cotangent.
    dots = lambda c: sum(e.primitive.name == "dot_general" for e in c.jaxpr.eqns)  # noqa: E731
    assert (dots(mlp.backward_input), dots(mlp.backward_weight)) == (1, 1)
    # B forwards the residual W needs (the input activation) as weight state.
    forwarded = mlp.forwarded_state
    assert len(forwarded) == mlp.num_weight_state and forwarded.count(None) == 1
    b_in, w_in = mlp.backward_input.jaxpr.invars, mlp.backward_weight.jaxpr.invars
    assert all(k is None or b_in[k] is w_in[s] for s, k in enumerate(forwarded))
    # The first stage has no activation cotangents: B only forwards, W does the work.
    for name in ("first", "split0"):
        first = stage_parts(STAGES[name])
        assert first.num_act_cotangents == 0 and not first.backward_input.jaxpr.eqns
        assert None not in first.forwarded_state
        assert first.backward_weight.jaxpr.eqns
    # A stage without parameters has nothing to delay.
    acts_only = stage_parts(STAGES["acts_only"])
    assert acts_only.num_weight_state == 0 and not acts_only.backward_weight.jaxpr.eqns
    assert acts_only.backward_weight.in_avals == [] and acts_only.backward_weight.out_avals == []


def test_counts_and_positions():
    parts = stage_parts(STAGES["mlp"])
    assert (parts.diff_inputs, parts.other_inputs, parts.act_inputs, parts.param_inputs) == ((0, 1, 2), (3,), (0,), (1, 2))
    assert (parts.num_outputs, parts.num_act_cotangents, parts.num_param_cotangents) == (2, 1, 2)
    assert len(parts.backward.in_avals) == parts.num_residuals + parts.num_outputs
    # Integer activations are inputs like any other, not differentiated; integer outputs and
    # outputs nobody differentiates get no cotangent (no float0 value exists anywhere).
    ints = stage_parts(STAGES["int_act"])
    assert (ints.diff_inputs, ints.other_inputs, ints.act_inputs, ints.diff_outputs) == ((0, 2), (1,), (0,), (0,))
    assert not any(a.dtype == jax.dtypes.float0 for p in (ints.backward, ints.forward) for a in (*p.in_avals, *p.out_avals))
    aux_only = stage_parts(STAGES["mlp"], diff_outputs=(0,))
    assert len(aux_only.backward.in_avals) == aux_only.num_residuals + 1
    # Order is act cotangents then param ones, whatever the input order.
    stage = _stage(lambda w, x: [x * w], [param(), act()], [(3,), (2, 3)])
    parts = stage_parts(stage)
    assert (parts.act_inputs, parts.param_inputs) == ((1,), (0,))
    assert [a.shape for a in parts.backward.out_avals] == [(2, 3), (3,)]


def _tampered(parts: StageParts) -> list[StageParts]:
    b, w = parts.backward_input, parts.backward_weight
    fewer = jax_ir.ClosedJaxpr(b.jaxpr.replace(outvars=b.jaxpr.outvars[:-1]), b.consts)
    twice = jax_ir.ClosedJaxpr(b.jaxpr.replace(eqns=[*b.jaxpr.eqns, *w.jaxpr.eqns], outvars=b.jaxpr.outvars), b.consts)
    return [
        dataclasses.replace(parts, backward_input=w, backward_weight=b),
        dataclasses.replace(parts, num_weight_state=parts.num_weight_state + 1),
        dataclasses.replace(parts, backward_input=fewer),
        dataclasses.replace(parts, backward_input=twice),
        dataclasses.replace(parts, diff_inputs=parts.diff_inputs[::-1]),
        dataclasses.replace(parts, num_residuals=parts.num_residuals - 1),
        dataclasses.replace(parts, backward=parts.forward),
    ]


def test_verify_rejects_tampered_parts():
    stage = STAGES["mlp"]
    parts = stage_parts(stage)
    verify_stage_parts(stage, parts)
    for bad in _tampered(parts):
        with pytest.raises(PlanVerificationError, match="stage 1 parts"):
            verify_stage_parts(stage, bad)
    with pytest.raises(PlanVerificationError, match="input positions"):
        verify_stage_parts(STAGES["first"], parts)
