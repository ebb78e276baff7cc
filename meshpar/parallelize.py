"""``@meshpar.parallelize``: run a train step as an MPMD pipeline over stage meshes.

The options are ``meshpar.pipeshard_parallel``'s, tracing and compiling one step is
``meshpar.step_compiler``'s; here is the decorated step: its cache of compiled steps per
input structure, calls, ``trace()``, and planning an ``"auto"`` method on the first call.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from meshpar.logical_partitioning import rules_in_force, warn_unused_model_axis, warn_without_rules
from meshpar.nnx_state import write_back
from meshpar.passes.pipeline_driver import CompiledPipeline
from meshpar.passes.simulation.timeline import write_chrome_trace
from meshpar.pipeshard_parallel import AUTO, PipeshardParallel
from meshpar.runtime.pipeline_executor import PipelineExecutable
from meshpar.runtime.spmd_step import SpmdStep
from meshpar.runtime.frozen_heap import frozen_heap
from meshpar.runtime.live_bytes_meter import LiveBytesMeter
from meshpar.runtime.step_trace import StepRecorder, StepTrace
from meshpar.passes.program.wire_format import leaf_dtype
from meshpar.step_compiler import CompiledStep, compile_step

__all__ = ["AUTO", "PipeshardParallel", "parallelize", "ParallelizedStep"]


def parallelize(fun: Callable | None = None, *, method: PipeshardParallel = PipeshardParallel()) -> Any:
    """Decorates a train step ``(state, batch, ...) -> outputs`` to run as a pipeline.

    The step calls ``meshpar.value_and_grad`` (or ``meshpar.grad``) once on a
    loss whose model calls ``meshpar.mark_stage_boundary()`` between stages;
    that module's docstring states how micro-batches combine (loss reduction,
    aux, PRNG keys). The rest of the step runs once per step at the whole
    batch's shapes, each value on the mesh of the parameters it derives from.
    Returns a callable taking and returning the same pytrees; state arrays
    stay sharded on their stage meshes between calls. Its ``trace(path,
    *args)`` runs one step the same way and also records when each task ran,
    written to ``path`` as a Chrome / Perfetto trace (``ParallelizedStep.trace``).
    """
    if fun is None:
        return functools.partial(parallelize, method=method)
    if not isinstance(method, PipeshardParallel):
        raise TypeError(f"method: expected meshpar.PipeshardParallel, got {type(method).__name__}")
    return ParallelizedStep(fun, method)


def _signature(x: Any, batch: bool) -> tuple[Any, ...]:
    """``x``'s shape and the dtype JAX gives it; a ``jax.Array``'s are its own (already
    canonical), read without ``leaf_dtype``'s checks (a step has hundreds of leaves). A global
    batch (a ``batch`` leaf spanning processes) adds its sharding: the step moves each
    micro-batch from where its rows lie. Other leaves' shardings compile nothing: the step
    places each as it lies when laid out as the step keeps it, and refuses it otherwise
    (``runtime.placement.put``); keying on them would compile the step again for the state its
    first call returned, which spans processes where the host-made state did not."""
    if isinstance(x, jax.Array):
        _ARRAY_TYPES.add(type(x))
        return (x.shape, x.dtype, x.sharding) if batch and not x.is_fully_addressable else (x.shape, x.dtype)
    return np.shape(x), leaf_dtype(x)


# The concrete types ``_signature`` found to be ``jax.Array``s: a leaf of one of them is keyed by
# its shape and dtype without ``isinstance(x, jax.Array)``, a Python-level check per leaf.
_ARRAY_TYPES: set[type] = set()


def _signatures(leaves: list, batch: frozenset[int]) -> tuple[tuple[Any, ...], ...]:
    """Every leaf's ``_signature``, a batch leaf's (those of ``batch``) as one."""
    arrays = _ARRAY_TYPES
    sig = [(x.shape, x.dtype) if type(x) in arrays else _signature(x, False) for x in leaves]
    for i in batch:
        sig[i] = _signature(leaves[i], True)
    return tuple(sig)


class ParallelizedStep:
    """The decorated step: compiles on first call per input structure, then runs."""

    def __init__(self, fun: Callable, method: PipeshardParallel) -> None:
        self.fun = fun
        self.method = method
        # What meshpar.plan_parallelism chose, once an "auto" method has been planned.
        self.plan: Any = None
        self._cache: dict[Any, CompiledStep] = {}
        # Per input structure, its batch leaves' numbers (found once per structure).
        self._batch_leaves: dict[Any, frozenset[int]] = {}
        self._direct: CompiledStep | None = None
        functools.update_wrapper(self, fun)

    def __call__(self, *args: Any) -> Any:
        direct = self._direct
        if direct is not None:
            # The last step compiled as one program placing its own inputs: jax.jit checks the
            # leaves' shapes and placements in C++, as it does for jax.jit of the step.
            leaves, in_tree = jax.tree.flatten(args)
            if in_tree == direct.in_tree:
                outputs = direct.run_as_given(leaves)
                if outputs is not None:
                    return self._outputs(args, direct, outputs)
        leaves, compiled = self._lookup(args)
        self._direct = compiled if compiled.run_as_given is not None else None
        return self._outputs(args, compiled, compiled.executable(leaves))

    @staticmethod
    def _outputs(args: tuple, compiled: CompiledStep, leaves: list) -> Any:
        """The step's outputs from the executable's; a step over NNX objects has its updates
        written to their Variables, as ``nnx.jit`` does."""
        out = jax.tree.unflatten(compiled.executable.out_tree, leaves)
        if compiled.updates is None:
            return out
        own, values = out
        write_back(args, compiled.updates, values)
        return own

    def trace(self, path: str, *args: Any, serialize: bool = False) -> tuple[Any, StepTrace]:
        """Runs one step like calling this, recording when each task of the pipeline ran and the
        bytes of the buffers it held on each device.

        Writes the step's measured ``Timeline`` to ``path`` as a Chrome / Perfetto trace (open
        it at https://ui.perfetto.dev); with several processes, process ``i`` records what it
        observes (its meshes' compute, the transfers it receives, its devices' bytes) and
        writes ``<stem>.p<i><ext>`` with pid ``i``. A step that compiles (the first per input
        structure) is timed with its compilation: trace a later one.

        Args:
          path: the trace file; its directory must exist.
          args: the step's arguments, as for a call.
          serialize: run each instruction alone, waiting for it before launching the next:
            isolated durations per task instead of the step as it overlaps
            (``runtime.step_trace``).

        Returns:
          The step's outputs, as a call returns them, and a ``StepTrace``: the timeline (times
          in seconds from the first task's start), the peak live bytes per device
          (``live_bytes``: parameters, optimizer state, gradients, residuals, activations in
          flight and received values, sampled after every instruction) and the profile that
          predicts them (``passes.simulation.live_bytes``).

        Raises:
          ValueError: ``path`` is not a file path in an existing directory (before running).
        """
        if not isinstance(path, str) or not path or os.path.isdir(path) \
                or not os.path.isdir(os.path.dirname(path) or "."):
            raise ValueError(f"path: expected a file path in an existing directory, got {path!r}")
        leaves, compiled = self._lookup(args)
        executable = compiled.executable
        if isinstance(executable, SpmdStep):
            raise ValueError("trace: this step has one stage and one micro-batch and runs as one SPMD program, "
                             "which has no pipeline tasks to time; pass PipeshardParallel(single_program=False)")
        meter = LiveBytesMeter(executable.mesh_devices, executable.device_ids)
        with StepRecorder(executable.program, executable.mesh_local, serialize, self.method.timeout_s) as recorder:
            outputs = jax.block_until_ready(executable(leaves, recorder, meter))
            timeline = recorder.timeline()
        process = jax.process_index()
        if jax.process_count() > 1:
            stem, ext = os.path.splitext(path)
            path = f"{stem}.p{process}{ext}"
        write_chrome_trace(path, timeline, process)
        return self._outputs(args, compiled, outputs), StepTrace(timeline, meter.live_bytes(), meter.profile(),
                                                                 recorder.outside_pipeline_s)

    def compile(self, *args: Any) -> PipelineExecutable | SpmdStep:
        """Compiles the step for these arguments without running it, as
        ``jax.jit(step).lower(*args).compile()`` does: traces and cuts it, plans and prepares
        every move, and compiles every program its pipeline launches (``compile_ahead``); with
        several processes every process calls it, and they meet once when all have compiled.
        A first call then starts training at once. Returns the executable."""
        leaves, compiled = self._lookup(args)
        executable = compiled.executable
        if isinstance(executable, PipelineExecutable):
            executable.compile_ahead(leaves)
        return executable

    def get_executable(self, *args: Any) -> PipelineExecutable | SpmdStep:
        """The compiled pipeline for these arguments (compiling it if needed).

        A step over flax NNX objects returns its own outputs and then the Variable values it
        updated (``meshpar.nnx_state``): calling the step writes them back."""
        return self._lookup(args)[1].executable

    def get_compiled(self, *args: Any) -> CompiledPipeline:
        """The compiler's IRs for these arguments (compiling them if needed): the stage graph,
        the step split and layout, the schedule, the programs and the planned moves, as
        ``describe()`` reads them. ``.pass_names`` lists the compiler's passes that ran and
        ``.ir_after(name)`` shows the IR a pass made, as it stood right after it."""
        return self._lookup(args)[1].pipeline

    def _lookup(self, args: tuple) -> tuple[list, CompiledStep]:
        """``args``' leaves, and the compiled step for their structure and shapes (compiled on
        the first call with them)."""
        leaves, in_tree = jax.tree.flatten(args)
        batch = self._batch_leaves.get(in_tree)
        if batch is None:
            argnums = self.method.batch_argnums
            flags = [i in argnums for i, arg in enumerate(in_tree.children()) for _ in range(arg.num_leaves)]
            batch = self._batch_leaves[in_tree] = frozenset(k for k, b in enumerate(flags) if b)
        key = (in_tree, _signatures(leaves, batch))
        if key not in self._cache:
            # Planning, tracing and the layout all read flax's logical axis rules: the method's
            # when it names them, else the caller's.
            with rules_in_force(self.method.logical_axis_rules), frozen_heap():
                if self.method.planned:
                    self._plan(args)
                self.method.check_devices()
                compiled = compile_step(self.fun, self.method, args, leaves, in_tree)
                if not warn_without_rules(args, compiled.pipeline.meshes):
                    warn_unused_model_axis(compiled.pipeline, self.method.model_axis)
            self._cache[key] = compiled
        return leaves, self._cache[key]

    def _plan(self, args: tuple) -> None:
        """Replaces the ``"auto"`` arguments with ``meshpar.plan_parallelism``'s choice for ``args``."""
        from meshpar.planning import plan_parallelism

        m = self.method
        self.plan = plan_parallelism(
            self.fun, *args, devices=m.devices, cluster=m.cluster, batch_argnums=m.batch_argnums,
            num_stages=None if m.num_stages in (AUTO, None) else m.num_stages,
            num_micro_batches=None if m.num_micro_batches == AUTO else m.num_micro_batches,
            schedules=(m.schedule,), gradient_reduction=m.gradient_reduction)
        self.method = self.plan.method_with(m)
        print(f"meshpar.parallelize({getattr(self.fun, '__name__', 'step')}): {self.plan.describe()}", flush=True)
