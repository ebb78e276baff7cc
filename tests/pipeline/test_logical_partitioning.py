"""flax logical partitioning under meshpar.parallelize: parameters named by logical axes
(``nn.with_logical_partitioning``, NNX ``out_sharding`` with ``sharding_rules``) shard over the
stage meshes' model axis as ``nn.logical_axis_rules`` map them, given as a context around the
call or as ``PipeshardParallel(logical_axis_rules=...)``; the step equals jax.jit / nnx.jit on
one device; the warnings for missing rules and for a model axis that shards nothing."""

import warnings

import jax
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

import meshpar
from examples.train_step import supervised_step
from pipeline_models import TwoStages, assert_trees_close, make_state, mse, run_both

RULES = [("embed", None), ("mlp", "model"), ("batch", "data")]
# What RULES make of the two kernels' ("embed", "mlp") and ("mlp", "embed").
HIDDEN_SPEC, OUT_SPEC = (None, "model"), ("model", None)


def _method(**kw):
    return meshpar.PipeshardParallel(num_micro_batches=2, num_stages=2, stage_mesh_shape=(2, 2), **kw)


def _batch(n=16, d=6, k=4):
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((n, d)).astype(np.float32), "y": rng.standard_normal((n, k)).astype(np.float32)}


def _spec(x):
    """``x``'s partition spec padded with ``None`` to its rank (jax drops trailing ``None``s)."""
    spec = tuple(x.sharding.spec)
    return spec + (None,) * (x.ndim - len(spec))


class _Logical(nn.Module):
    """Two stages whose kernels name logical axes: ("embed", "mlp"), then ("mlp", "embed")."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        meshpar.mark_stage_boundary()
        return nn.Dense(4, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")))(nn.gelu(h))


def _meshpar_warnings(shown):
    return [str(w.message) for w in shown if str(w.message).startswith("meshpar:")]


@pytest.mark.parametrize("given", ["context", "argument"])
def test_logical_rules_shard_mlp_over_model_and_the_step_equals_jit(given):
    """As a context, or as the argument (which overrides a conflicting context)."""
    batch = _batch()
    state = make_state(_Logical(), batch["x"][:1])
    method = _method() if given == "context" else _method(logical_axis_rules=RULES)
    # The context the argument overrides maps the other name to "model".
    context = RULES if given == "context" else [("embed", "model"), ("mlp", None)]
    with nn.logical_axis_rules(context), warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        ref_state, par_state, parallel = run_both(supervised_step(mse), state, batch, method, steps=3)
    assert _meshpar_warnings(shown) == []
    assert_trees_close(par_state.params, ref_state.params, rtol=1e-4, atol=1e-4)
    assert_trees_close(par_state.opt_state, ref_state.opt_state, rtol=1e-4, atol=1e-4)
    params = par_state.params["params"]
    # The state comes back as it was given: boxed, with its logical names.
    for layer, names, spec in (("Dense_0", ("embed", "mlp"), HIDDEN_SPEC), ("Dense_1", ("mlp", "embed"), OUT_SPEC)):
        kernel = params[layer]["kernel"]
        assert isinstance(kernel, nn.LogicallyPartitioned) and kernel.names == names
        assert _spec(kernel.value) == spec, layer
        assert _spec(par_state.opt_state[0].mu["params"][layer]["kernel"].value) == spec, layer
        assert _spec(params[layer]["bias"]) == (None,)
    text = parallel.get_executable(par_state, batch).describe()
    assert text.count("1 sharded over 'model'") == 2


def test_logical_names_without_any_rules_warn_naming_the_parameters_and_are_replicated():
    batch = _batch()
    state = make_state(_Logical(), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=_method())
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        compiled = parallel.get_compiled(state, batch)
    [message] = _meshpar_warnings(shown)
    # Two kernels, and their two Adam moments each.
    assert message.startswith("meshpar: args[0].params['params']['Dense_0']['kernel'], "
                              "args[0].params['params']['Dense_1']['kernel'], "
                              "args[0].opt_state[0].mu['params']['Dense_0']['kernel'] and 3 more are annotated with "
                              "logical axis names, but no logical axis rules are active, so they are replicated")
    assert "logical_axis_rules=" in message and "nn.logical_axis_rules" in message
    assert all(e is None for stage in compiled.layout.grad_shardings for s in stage for e in s.spec)


class _ShardedActivations(nn.Module):
    """No annotated parameter, but stage 0 constrains its activations over "model"."""

    @nn.compact
    def __call__(self, x):
        h = jax.lax.with_sharding_constraint(nn.Dense(16)(x), P("data", "model"))
        meshpar.mark_stage_boundary()
        return nn.Dense(4)(h)


def test_a_model_axis_that_no_parameter_shards_over_warns_naming_it():
    batch = _batch()
    state = make_state(TwoStages(), batch["x"][:1])
    parallel = meshpar.parallelize(supervised_step(mse), method=_method())
    with pytest.warns(UserWarning, match=r"meshpar: the stage meshes' 'model' axis has 2 devices but no parameter is "
                                         r"sharded over it.*nn.with_logical_partitioning \(and logical_axis_rules\) "
                                         r"or use stage_mesh_shape=\(4, 1\)"):
        parallel.get_executable(state, batch)
    # Activations constrained over the axis use it: no warning.
    # Initialised under a mesh, which the constraint needs outside the parallelized step.
    with jax.set_mesh(Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))):
        state = make_state(_ShardedActivations(), batch["x"][:2])
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        meshpar.parallelize(supervised_step(mse), method=_method()).get_executable(state, batch)
    assert _meshpar_warnings(shown) == []


@pytest.mark.parametrize("rules, wrong", [
    ("mlp", "got 'mlp'"),
    ([("mlp",)], "got the entry \\('mlp',\\)"),
    ([(1, "model")], "logical name of \\(1, 'model'\\)"),
    ([("mlp", 3)], "mesh axis of \\('mlp', 3\\)"),
])
def test_bad_logical_axis_rules_name_the_argument(rules, wrong):
    with pytest.raises(ValueError, match=f"logical_axis_rules: .*{wrong}"):
        meshpar.PipeshardParallel(logical_axis_rules=rules)


def test_logical_axis_rules_are_kept_as_pairs():
    rules = [["mlp", "model"], ("heads", ["model", "data"]), ("embed", None)]
    method = meshpar.PipeshardParallel(logical_axis_rules=rules)
    assert method.logical_axis_rules == (("mlp", "model"), ("heads", ("model", "data")), ("embed", None))
    hash(method)


class _NnxLogical(nnx.Module):
    def __init__(self, rngs, **metadata):
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(6, 16, kernel_init=nnx.with_partitioning(init, ("embed", "mlp"), **metadata),
                                 rngs=rngs)
        self.out = nnx.Linear(16, 4, kernel_init=nnx.with_partitioning(init, ("mlp", "embed"), **metadata), rngs=rngs)

    def __call__(self, x):
        h = nnx.gelu(self.hidden(x))
        meshpar.mark_stage_boundary()
        return self.out(h)


def _nnx_model(**metadata):
    # Annotations kept as metadata: no mesh is needed to build it (meshpar places it).
    with nnx.use_eager_sharding(False):
        model = _NnxLogical(nnx.Rngs(0), **metadata)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)


def _nnx_step(model, optimizer, batch):
    loss, grads = meshpar.value_and_grad(lambda m: mse(m(batch["x"]), batch["y"]))(model)
    optimizer.update(model, grads)
    return loss


@pytest.mark.parametrize("given", ["argument", "variable"])
def test_nnx_logical_out_sharding_shards_over_model_and_the_step_equals_nnx_jit(given):
    """Rules as the argument, or as the Variables' own ``sharding_rules`` metadata."""
    batch = _batch()
    metadata = {"sharding_rules": tuple(RULES)} if given == "variable" else {}
    (model, optimizer), (ref_model, ref_optimizer) = _nnx_model(**metadata), _nnx_model(**metadata)
    method = _method(batch_argnums=(2,), **({"logical_axis_rules": RULES} if given == "argument" else {}))
    step = meshpar.parallelize(_nnx_step, method=method)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        for _ in range(3):
            loss = step(model, optimizer, batch)
            ref_loss = nnx.jit(_nnx_step)(ref_model, ref_optimizer, batch)
            np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert _meshpar_warnings(shown) == []
    assert_trees_close(nnx.state(model, nnx.Param), nnx.state(ref_model, nnx.Param), rtol=1e-4, atol=1e-4)
    assert _spec(model.hidden.kernel[...]) == HIDDEN_SPEC and _spec(model.out.kernel[...]) == OUT_SPEC
    assert _spec(optimizer.opt_state[0].mu["hidden"]["kernel"][...]) == HIDDEN_SPEC
