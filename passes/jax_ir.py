"""JAX's internals, all in one place: every type, primitive and hook meshpar reads or builds of
JAX's IR, taken from ``jax.extend`` where JAX exports it and from ``jax._src`` only where it
does not. No other module of meshpar imports ``jax._src`` (``tests/test_layering.py``).

Supported: JAX 0.10.2 through 0.12. Where versions differ this module adapts them at import
time, naming the version in a comment, so the rest of meshpar reads one IR:

- ``ClosedJaxpr`` / ``Jaxpr``: JAX 0.11 merged them into one class (a jaxpr carries its
  ``consts``, and ``closed.jaxpr`` is ``closed`` itself). meshpar builds closed jaxprs with
  ``ClosedJaxpr(jaxpr, consts)`` and reads ``closed.jaxpr`` / ``closed.consts``, which both
  versions accept. Code telling a nested closed jaxpr from an open one tests ``ClosedJaxpr``
  first (on 0.11+ every jaxpr is one).
- Scan parameters: JAX 0.11 replaced ``num_consts`` / ``num_carry`` by flat trees
  (``ft_in``, ``ft_out``); ``scan_operand_counts`` reads either.
- Call primitives: JAX 0.11 replaced ``call_p`` / ``closed_call_p`` by ``eval_jaxpr_p``
  (``jax.extend.core.primitives`` still names it ``closed_call_p``); ``call_body`` reads the
  body of any call of the running JAX, ``inline_requested`` says whether a jit call asked to
  be inlined (0.10 inlined those while tracing; 0.11+ keeps them until lowering).
- Dead-code rules: JAX 0.12 gave them a ``live_inputs`` argument; ``dce_rule`` hides it.
- Equation contexts: JAX 0.11 added ``cur_layout_mode``, 0.12 ``no_collectives``;
  ``with_context_mesh`` rebuilds a context from its own fields, whatever they are.
- Tracing caches: ``trace_context_flag`` adds a flag to their keys (``config.bool_state``'s
  ``include_in_trace_context``, the same in 0.10.2 to 0.12).
- A thread's JAX context: ``ThreadContext`` carries the thread-local settings JAX's caches key
  on (its flags, ``config.config_states``, and the context managers' settings named in
  ``_CONTEXT_SETTINGS``: in ``config`` in 0.10.2, the meshes' in ``mesh`` in 0.12) to another
  thread.
- Cluster detection: ``ClusterEnv.auto_detect_unset_distributed_params`` takes
  ``(coordinator_address, num_processes, process_id, local_device_ids,
  cluster_detection_method, initialization_timeout)`` in 0.10.2 to 0.12 (older JAX lacked the
  last two); ``detect_distributed_params`` calls it by those names and reads the launchers
  from ``ClusterEnv._cluster_types``.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
from jax.core import AbstractValue, Atom, ShapedArray, eval_jaxpr
from jax.extend import source_info_util
from jax.extend.core import (
    ClosedJaxpr,
    DebugInfo,
    DropVar,
    Effect,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    Var,
    check_jaxpr,
    jaxpr_as_fun,
    new_jaxpr_eqn,
    no_effects,
)
from jax.extend.core import primitives as prims

# What jax.extend does not export (JAX 0.10.2 to 0.12): effect registries, transformation rule
# tables, dead-code elimination, the PRNG's key-wrapping primitive, the concrete context mesh,
# equation contexts, trace-context flags, a thread's settings, the launchers JAX detects, and the
# distributed runtime's and backend's state.
from jax._src import clusters as _clusters
from jax._src import config as _config
from jax._src import core as _core
from jax._src import distributed as _distributed
from jax._src import effects as _effects
from jax._src import mesh as _mesh
from jax._src import xla_bridge as _xla_bridge
from jax._src.interpreters import ad as _ad
from jax._src.interpreters import batching as _batching
from jax._src.interpreters import mlir as _mlir
from jax._src.interpreters import partial_eval as _pe
from jax._src.random.prng import random_wrap_p

__all__ = [
    "AbstractValue", "Atom", "ClosedJaxpr", "DebugInfo", "DropVar", "Effect", "Jaxpr", "JaxprEqn", "Literal",
    "Primitive", "ShapedArray", "ThreadContext", "Var", "backends_are_initialized", "bind_equation", "call_body",
    "check_jaxpr", "cluster_launchers", "compiled_count", "concrete_mesh", "cross_host_transfer_settings",
    "dce_jaxpr", "dce_rule", "detect_distributed_params", "distributed_client", "distributed_params",
    "eval_jaxpr", "inline_requested", "jaxpr_as_fun", "join_effects", "nested_jaxprs", "new_jaxpr_eqn",
    "new_source_info", "no_effects", "random_wrap_p", "register_effect_type", "register_primitive_rules",
    "scan_operand_counts", "staged_fun", "trace_context_flag", "typematch", "user_frames", "with_context_mesh",
]

join_effects: Callable[..., Effects] = _core.join_effects
typematch: Callable[[AbstractValue, AbstractValue], bool] = _core.typematch
new_source_info = source_info_util.new_source_info


def user_frames(traceback: Any) -> Iterator[Any]:
    """The frames of an equation's traceback outside JAX, innermost first."""
    from jax._src import source_info_util as _source_info

    return _source_info.user_frames(traceback)


# Every call primitive of the running JAX, with the parameter holding its body. On JAX 0.10
# call_p and closed_call_p are two primitives; on 0.11+ both names are eval_jaxpr_p.
_CALL_BODY_PARAM: dict[Primitive, str] = {prims.jit_p: "jaxpr", prims.closed_call_p: "call_jaxpr",
                                          prims.call_p: "call_jaxpr"}


def call_body(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The body ``eqn`` calls, if it is a call (``jax.jit``, or a closed call: ``eval_jaxpr``
    on JAX 0.11+); else None. Its operands are the body's inputs, its results the body's."""
    param = _CALL_BODY_PARAM.get(eqn.primitive)
    if param is None:
        return None
    body = eqn.params[param]
    return body if isinstance(body, ClosedJaxpr) else ClosedJaxpr(body, ())


def nested_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The open jaxprs nested in ``eqn``'s parameters (scan, cond, while and call bodies)."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


def inline_requested(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` is a ``jax.jit`` call its author asked to inline (``inline=True``): JAX
    0.10 inlined those while tracing; 0.11+ keeps the call (``Inline.JAX_LATE``) until lowering."""
    if eqn.primitive is not prims.jit_p:
        return False
    inline = eqn.params.get("inline")
    return inline is True or getattr(inline, "name", None) in ("JAX_EARLY", "JAX_LATE")


def staged_fun(closed: ClosedJaxpr) -> Callable[..., list[Any]]:
    """``closed`` as a function, as ``jaxpr_as_fun`` makes it, but called while a program is being
    traced (``jax.jit``, a ``shard_map`` body) it copies ``closed``'s equations into that program
    as they are, as JAX inlines a nested ``jax.jit(..., inline=True)``
    (``partial_eval.inline_jaxpr_into_trace``, the same in 0.10.2 to 0.12). ``jaxpr_as_fun``
    binds each equation again; on JAX 0.10.2 that (each one's abstract evaluation and sharding
    rules) was most of the time the main job's runtime programs took to trace. Called otherwise
    (eagerly, under ``vmap`` or ``grad``) it is ``jaxpr_as_fun``."""
    evaluate = jaxpr_as_fun(closed)

    def call(*args: Any) -> list[Any]:
        trace = _core.trace_ctx.trace
        if not isinstance(trace, _pe.DynamicJaxprTrace):
            return evaluate(*args)
        source_info = source_info_util.current()
        tracers = [trace.to_jaxpr_tracer(a, source_info) for a in args]
        outs = _pe.inline_jaxpr_into_trace(trace, source_info, closed.jaxpr, closed.consts, *tracers)
        return [trace.to_jaxpr_tracer(x, source_info) for x in outs]

    return call


def scan_operand_counts(eqn: JaxprEqn) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a scan equation: its operands are that many constants,
    that many carries, then the scanned ones; its results the carries, then the stacked ones."""
    params = eqn.params
    if "num_consts" in params:  # JAX 0.10
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()  # JAX 0.11+: flat trees of (consts, carry, xs)
    return len(consts), len(carry)


def dce_jaxpr(jaxpr: Jaxpr, used_outputs: bool | list[bool], instantiate: bool | list[bool] = False
              ) -> tuple[Jaxpr, list[bool]]:
    """JAX's dead-code elimination: ``jaxpr`` computing only the used outputs, and which inputs
    it still reads."""
    return _pe.dce_jaxpr(jaxpr, used_outputs, instantiate)


# JAX 0.12 gave dead-code rules a second argument, which inputs are live (all of them here).
_DCE_RULES_TAKE_LIVE_INPUTS = "live_inputs" in inspect.signature(_pe.dce_jaxpr).parameters


def dce_rule(primitive: Primitive) -> Callable[[list[bool], JaxprEqn], tuple[list[bool], JaxprEqn | None]]:
    """JAX's dead-code rule for equations of ``primitive``: ``(used_outputs, eqn) -> (used_inputs,
    new_eqn or None)``."""
    rule = _pe.dce_rules[primitive]
    if not _DCE_RULES_TAKE_LIVE_INPUTS:
        return rule
    return lambda used_outputs, eqn: rule(used_outputs, [True] * len(eqn.invars), eqn)


def register_effect_type(effect_type: type) -> None:
    """Lets equations with effects of ``effect_type`` be lowered and sit inside control flow,
    ``remat``, custom derivatives, and survive partial evaluation."""
    for registry in (_effects.lowerable_effects, _effects.control_flow_allowed_effects,
                     _effects.remat_allowed_effects, _effects.custom_derivatives_allowed_effects,
                     _effects.partial_eval_kept_effects):
        registry.add_type(effect_type)


def register_primitive_rules(primitive: Primitive, jvp: Callable[..., Any], batch: Callable[..., Any],
                             lowering: Callable[..., Any]) -> None:
    """Registers ``primitive``'s differentiation, batching and MLIR lowering rules."""
    _ad.primitive_jvps[primitive] = jvp
    _batching.primitive_batchers[primitive] = batch
    _mlir.register_lowering(primitive, lowering)


def bind_equation(eqn: JaxprEqn, invals: list[Any]) -> Any:
    """Evaluates ``eqn`` on ``invals`` as ``eval_jaxpr`` would: inside the context it was traced
    in, with its parameters as its primitive binds them."""
    with eqn.ctx.manager:
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))


# The fields of an equation context, in the order its constructor takes them: the class's slots
# on every supported version (0.10: 5, 0.11: + cur_layout_mode, 0.12: + no_collectives).
_CONTEXT_FIELDS = tuple(s for s in _core.JaxprEqnContext.__slots__ if s not in ("configs", "__weakref__"))


def with_context_mesh(eqn: JaxprEqn, mesh: Callable[[Any], Any]) -> JaxprEqn:
    """``eqn`` with the abstract mesh recorded in its context replaced by ``mesh(old)``:
    evaluating an equation enters that mesh again."""
    ctx = eqn.ctx
    fields = []
    for name in _CONTEXT_FIELDS:
        value = getattr(ctx, name)
        if name == "cur_abstract_mesh":
            value = mesh(value)
        elif name == "xla_metadata" and value is not None:
            value = tuple(sorted(value.items()))  # the constructor interns its arguments: hashable
        fields.append(value)
    return eqn.replace(ctx=_core.JaxprEqnContext._create(*fields))


def trace_context_flag(name: str, help: str) -> Any:
    """A thread-local boolean that is part of JAX's tracing caches' keys (as ``jax_enable_x64``
    is): a function traced with the flag set is traced again, not served from a cache, with it
    unset, and the other way round. ``with flag(True):`` sets it; ``flag.value`` reads it."""
    return _config.bool_state(name, False, help, include_in_trace_context=True)


# JAX's thread-local settings besides its flags: the meshes ``jax.set_mesh`` (the abstract one,
# and the concrete one in ``device_context``) and ``with mesh:`` enter, ``compute_on``'s, XLA
# metadata's, Pallas' interpret mode's. JAX 0.10.2 to 0.12 name them so; 0.10.2 keeps them all in
# ``config``, 0.12 the abstract mesh's and ``device_context`` in ``mesh`` (one missing is skipped).
_CONTEXT_SETTINGS = ("mesh_context_manager", "abstract_mesh_context_manager", "device_context",
                     "compute_on_context_manager", "xla_metadata_context_manager",
                     "pallas_tpu_interpret_mode_context_manager")


def _thread_settings() -> list[Any]:
    settings = list(_config.config_states.values())
    for name in _CONTEXT_SETTINGS:
        found = [getattr(module, name) for module in (_config, _mesh) if hasattr(module, name)]
        settings += [found[0]] if found else []
    settings.append(_core.axis_env_state)
    return settings


class ThreadContext:
    """The JAX context of the thread that made it (every thread-local setting it changed: the
    mesh ``jax.set_mesh`` entered, ``jax.enable_x64(...)`` and the other configuration context
    managers), entered on another thread by ``with``. JAX's tracing, lowering and compilation
    caches key on these settings (``config.trace_context``): a program compiled on a thread
    without them is found by none of this thread's calls that miss the outer caches (operands
    typed alike but spelled otherwise, as ``P()`` and ``P(None, None)``) and compiles again.
    ``with`` gives whether the thread's cache key is now the maker's (a setting JAX keeps no
    list of, a ``jax.make_user_context``, is not carried)."""

    __slots__ = ("_values", "_key", "_previous")

    def __init__(self) -> None:
        unset = _config.config_ext.unset
        self._values = [(s, v) for s in _thread_settings() if (v := s.get_local()) is not unset]
        self._key = _config.trace_context()
        self._previous: list[tuple[Any, Any]] = []

    def __enter__(self) -> bool:
        for setting, value in self._values:
            self._previous.append((setting, setting.swap_local(value)))
            hook = getattr(setting, "_update_thread_local_hook", None)
            if hook is not None:
                hook(value)
        return _config.trace_context() == self._key

    def __exit__(self, *exc: Any) -> None:
        unset = _config.config_ext.unset
        while self._previous:
            setting, previous = self._previous.pop()
            setting.set_local(previous)
            hook = getattr(setting, "_update_thread_local_hook", None)
            if hook is not None:
                hook(None if previous is unset else previous)


def concrete_mesh() -> Any:
    """The concrete mesh ``jax.set_mesh`` has entered, or an empty one."""
    return _mesh.get_concrete_mesh()


def compiled_count(jitted: Any) -> int:
    """How many executables a ``jax.jit``-ed function has compiled (its cache's size)."""
    return jitted._cache_size()


def distributed_client() -> Any:
    """The distributed runtime's key-value client, or ``None`` in a single-process run."""
    return _distributed.global_state.client


def distributed_params() -> tuple[str, int, int] | None:
    """``(coordinator_address, num_processes, process_id)`` this process joined its job with
    through ``jax.distributed.initialize``, or ``None`` when it has not."""
    state = _distributed.global_state
    if state.client is None:
        return None
    return state.coordinator_address or "", state.num_processes, state.process_id


def cluster_launchers() -> dict[str, tuple[str | None, bool, bool]]:
    """The launchers JAX's cluster detection knows, by class name in the order it tries them:
    ``(cluster_detection_method, present, opt_in_only)`` for each. The method is the name
    ``cluster_detection_method`` picks it by (``None`` where JAX gives it none, as Kubernetes'
    in 0.10.2); ``present`` whether this process's environment looks launched by it (an
    opt-in one, mpi4py's, only says whether it is installed); ``opt_in_only`` whether JAX
    tries it only when named."""
    return {env.__name__: (env.name or None, bool(env.is_env_present()), bool(env.opt_in_only_method))
            for env in _clusters.ClusterEnv._cluster_types}


def detect_distributed_params(
    coordinator_address: str | None,
    num_processes: int | None,
    process_id: int | None,
    local_device_ids: list[int] | None,
    cluster_detection_method: str | None,
    initialization_timeout: int,
) -> tuple[str | None, int | None, int | None, list[int] | None]:
    """What ``jax.distributed.initialize`` would join with: each of the four that is ``None``
    filled as JAX fills it, from ``JAX_COORDINATOR_ADDRESS`` / ``JAX_LOCAL_DEVICE_IDS`` and then
    from the first launcher JAX detects (or the one ``cluster_detection_method`` names; JAX's
    ``"deactivate"`` skips detection). Still ``None`` where nothing gave it. Finding the
    coordinator may talk to the launcher (mpi4py broadcasts it from rank 0, Kubernetes asks its
    API server, waiting up to ``initialization_timeout``), so every process must call this."""
    # JAX 0.10.2 to 0.12 read these two variables in State.initialize, before detecting.
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None
    if local_device_ids is None and (env_ids := os.environ.get("JAX_LOCAL_DEVICE_IDS")):
        local_device_ids = [int(i) for i in env_ids.split(",")]
    if cluster_detection_method == "deactivate" or None not in (
            coordinator_address, num_processes, process_id, local_device_ids):
        return coordinator_address, num_processes, process_id, local_device_ids
    address, count, index, local = _clusters.ClusterEnv.auto_detect_unset_distributed_params(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id,
        local_device_ids=local_device_ids, cluster_detection_method=cluster_detection_method,
        initialization_timeout=initialization_timeout)
    return address, count, index, None if local is None else list(local)


def backends_are_initialized() -> bool:
    """Whether JAX's backends have started in this process."""
    return _xla_bridge.backends_are_initialized()


def cross_host_transfer_settings() -> tuple[bool, bool, str]:
    """``(native, forced_over_network, socket_address)``: whether the backend moves arrays across
    hosts itself, whether JAX is told to use its transfer server anyway, and that server's
    address (empty when none is set)."""
    native = bool(getattr(_xla_bridge.get_backend(), "supports_cross_host_transfers", False))
    return (native, bool(_xla_bridge.FORCE_DCN_CROSS_HOST_TRANSFERS.value),
            _xla_bridge.CROSS_HOST_TRANSFER_SOCKET_ADDRESS.value or "")
