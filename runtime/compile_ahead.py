"""Compiling a step's programs before it runs, several at once.

XLA releases the GIL while it compiles, so programs compiled from threads compile side by side.
``AheadOfTime`` stands in for the programs a run would launch (a run walked with shapes only:
``ProgramInterpreter.compile_ahead``, ``PipelineExecutable.compile_ahead``): each call returns
its results' shapes at once (``Pending``: traced, not yet compiled) and queues its program;
the program is traced and lowered on the calling thread once the shardings of its operands are
known, then compiled on a thread of a pool shared by the process (``compile_threads``). A
result's sharding is known once its program is traced where the program declares it
(``out_shardings``: what the compiler fixed, such as accumulated gradients and the values
that leave a stage), else once its program has compiled (as XLA laid it out: a stage's
residuals). So the stages' chains of passes (forward, then the backward reading its residuals)
compile side by side, each as soon as what it reads is known; what reads only declared
results (the programs around the pipeline) compiles without waiting for its producers; and a
program called again with the same operand types is compiled once. Every compiled program
lands in JAX's caches (in memory, and the persistent compilation cache when
``jax_compilation_cache_dir`` is set): the real run finds it there.

``deferred_compile`` compiles one lowered program on the pool for a caller that needs it only
later (the transfer programs a move prepares); ``wait_deferred`` waits for every such compile.
Tracing and lowering stay on the calling thread, under the caller's JAX configuration and
contexts, as the real run's calls would trace them; the compile on the pool runs under the
same (``jax_ir.ThreadContext``: the mesh ``jax.set_mesh`` entered, configuration context
managers). JAX's compilation cache keys on them: a program compiled on a pool thread without
them was found by the run's first calls (whose operand types hit the lowering itself), not by
a later call typed alike but spelled otherwise (the state the first step returns: ``P()`` where
the compiler said ``P(None, None)``), which compiled it again.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import jax

from meshpar.passes import jax_ir

__all__ = ["AheadOfTime", "Deferred", "NotCompiledAhead", "Pending", "beside_python_pool", "compile_threads",
           "deferred_compile", "wait_deferred"]

logger = logging.getLogger(__name__)


def compile_threads() -> int:
    """Threads compiling programs side by side: ``MESHPAR_COMPILE_THREADS`` when set (1: one
    at a time, as before), else the CPUs this process may use."""
    configured = os.environ.get("MESHPAR_COMPILE_THREADS")
    if configured:
        return max(1, int(configured))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


_pool: concurrent.futures.ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
# Compiles ``deferred_compile`` started and no one has waited for yet.
_deferred: set[concurrent.futures.Future] = set()


def _compile_pool() -> concurrent.futures.ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(compile_threads(), thread_name_prefix="meshpar-compile")
        return _pool


_beside: concurrent.futures.ThreadPoolExecutor | None = None


def beside_python_pool() -> concurrent.futures.ThreadPoolExecutor:
    """A pool of threads compiling while this process's Python keeps working (the compiler's
    passes): one fewer than ``compile_threads``, so the Python thread keeps a CPU (measured on
    2 cores: the main job's first step 6.78 s, against 6.95 s with both threads compiling). Shared
    by the process; with one compile thread, that one."""
    if compile_threads() == 1:
        return _compile_pool()
    global _beside
    with _pool_lock:
        if _beside is None:
            _beside = concurrent.futures.ThreadPoolExecutor(compile_threads() - 1,
                                                            thread_name_prefix="meshpar-compile-beside")
        return _beside


class Deferred:
    """A lowered program compiling on the pool: ``get()`` is the compiled program (waiting for it;
    a compile error is raised here)."""

    __slots__ = ("_future", "_compiled")

    def __init__(self, future: concurrent.futures.Future) -> None:
        self._future, self._compiled = future, None

    def get(self) -> Any:
        if self._compiled is None:
            self._compiled = self._future.result()
            with _pool_lock:
                _deferred.discard(self._future)
        return self._compiled


def _submit_compile(lowered: Any, pool: concurrent.futures.Executor | None = None) -> concurrent.futures.Future:
    """``lowered.compile()`` started on ``pool`` (``None``: the process's compile pool), under the
    calling thread's JAX context (where ``lowered`` was lowered): the compiled program is cached
    under the key this thread's calls look it up by."""
    context = jax_ir.ThreadContext()

    def compile_there() -> Any:
        with context as same:
            if not same:
                logger.debug("compiling %s under a JAX context other than its caller's", lowered)
            return lowered.compile()

    return (pool or _compile_pool()).submit(compile_there)


def deferred_compile(lowered: Any) -> Deferred:
    """``lowered.compile()`` started on the pool (under the calling thread's JAX context)."""
    future = _submit_compile(lowered)
    with _pool_lock:
        _deferred.add(future)
    return Deferred(future)


def wait_deferred() -> None:
    """Waits for every compile ``deferred_compile`` started (raising the first error)."""
    with _pool_lock:
        pending = list(_deferred)
    for future in pending:
        future.result()
        with _pool_lock:
            _deferred.discard(future)


class Pending:
    """A result of a program compiled ahead: its shape, dtype and weak type (from tracing); its
    sharding is the compiled program's (``AheadOfTime.resolve``)."""

    __slots__ = ("task", "index", "shape", "dtype", "weak_type")

    def __init__(self, task: _Task, index: int, shape: tuple[int, ...], dtype: Any, weak_type: bool) -> None:
        self.task, self.index, self.shape, self.dtype, self.weak_type = task, index, shape, dtype, weak_type

    def __repr__(self) -> str:
        return f"Pending({self.shape}, {self.dtype}, result {self.index} of {self.task.name})"


class _Task:
    """One program to compile: ``jitted`` for ``args`` (leaves ``jax.ShapeDtypeStruct``s, or
    ``Pending`` results of other tasks), inside ``mesh``."""

    __slots__ = ("jitted", "mesh", "args", "deps", "name", "future", "lowered", "outputs", "error", "optional",
                 "same_as", "out_tree", "out_avals", "declared")

    def __init__(self, jitted: Any, mesh: Any, args: tuple, deps: list[_Task], optional: bool) -> None:
        self.jitted, self.mesh, self.args, self.deps, self.optional = jitted, mesh, args, deps, optional
        self.name = getattr(jitted, "__name__", "program")
        self.future: concurrent.futures.Future | None = None
        # What it compiles, once lowered, until compiled (``compile_on`` may move it to another pool).
        self.lowered: Any = None
        # The compiled program's results (``ShapeDtypeStruct``s with shardings), once compiled.
        self.outputs: list[jax.ShapeDtypeStruct] | None = None
        self.error: BaseException | None = None
        # An earlier task compiling the same program for the same operand types.
        self.same_as: _Task | None = None
        # Its results' structure and types, as traced.
        self.out_tree: Any = None
        self.out_avals: list[Any] = []
        # Per result, the sharding the traced program declares (``None``: XLA's to choose).
        self.declared: list[Any] = []

    @property
    def submitted(self) -> bool:
        return self.future is not None or self.same_as is not None or self.error is not None


def _declared_shardings(out_info: Any) -> list[Any]:
    """Per result of a traced or lowered program, the sharding it declares (``out_shardings``),
    or ``None`` where XLA chooses."""
    return [o.sharding if isinstance(o.sharding, jax.sharding.Sharding) else None for o in jax.tree.leaves(out_info)]


def _leaf_key(x: Any) -> Any:
    if isinstance(x, Pending):
        return ("pending", id(x.task), x.index)
    if isinstance(x, jax.ShapeDtypeStruct):
        return (x.shape, x.dtype, x.sharding, x.weak_type)
    return ("value", id(x))


class AheadOfTime:
    """Stands in for the programs a run launches (the interpreter's launch hooks call
    ``watch(fn)`` instead of ``fn``, a program made by ``on_mesh``, or call ``program`` with a
    plain ``jax.jit``): each call queues ``fn``'s program for its operands and returns its
    results as ``Pending``s; one compile per program and operand types. ``finish()`` waits for
    every compile. ``optional`` programs (compiled ahead from shapes the caller inferred) that
    fail to trace, lower or compile are dropped (debug-logged), with what reads their results:
    the real run compiles them instead, as it would have."""

    def __init__(self, pool: concurrent.futures.Executor | None = None) -> None:
        # Where its programs compile (``None``: the process's compile pool); ``compile_on``.
        self._pool = pool
        self._tasks: list[_Task] = []
        self._by_call: dict[tuple, Any] = {}
        self._by_operands: dict[tuple, _Task] = {}
        self._held: list[Any] = []  # functions keyed by id, kept alive while their ids are keys

    def compile_on(self, pool: concurrent.futures.Executor | None) -> None:
        """Compiles on ``pool`` (``None``: the process's compile pool) the programs queued from now
        on, and those still waiting for a thread of the pool they were queued on; those already
        compiling finish where they are (so the pools never compile more programs at once than
        the new one has threads, and one more per program already started)."""
        self._pool = pool
        for task in self._tasks:
            if task.future is not None and task.outputs is None and task.future.cancel():
                task.future = _submit_compile(task.lowered, pool)

    @property
    def compiled(self) -> int:
        """Programs compiled (or found in JAX's caches), one per program and operand types."""
        return sum(1 for t in self._tasks if t.same_as is None and t.outputs is not None)

    def watch(self, fn: Callable) -> Callable:
        """``fn`` (made by ``on_mesh``: its ``jitted`` and ``mesh``) as the run calls it."""
        def call(*args: Any) -> Any:
            return self.program(fn.jitted, *args, mesh=fn.mesh)

        return call

    def take(self) -> None:
        return None

    def watched(self, executables: Any) -> Any:
        """A stage's four passes, each watched."""
        return dataclasses.replace(executables, forward=self.watch(executables.forward),
                                   backward=self.watch(executables.backward),
                                   backward_input=self.watch(executables.backward_input),
                                   backward_weight=self.watch(executables.backward_weight))

    def program(self, jitted: Any, *args: Any, mesh: Any = None, optional: bool = False) -> Any:
        """``jitted``'s results for ``args`` (leaves ``jax.ShapeDtypeStruct``s with shardings,
        ``Pending``s, or concrete values), as ``Pending``s; its compile queued."""
        leaves, tree = jax.tree.flatten(args)
        key = (id(jitted), mesh, tree, tuple(_leaf_key(x) for x in leaves))
        if key in self._by_call:
            return self._by_call[key]
        deps = list({id(x.task): x.task for x in leaves if isinstance(x, Pending)}.values())
        task = _Task(jitted, mesh, args, deps, optional)
        try:
            with self._in(mesh):
                if deps:
                    # Its results' types from tracing, with the operands' shardings unknown yet;
                    # the shardings it declares are known already.
                    shaped = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type)
                                                       if isinstance(x, Pending) else x for x in leaves])
                    traced = jitted.trace(*shaped)
                    task.declared = _declared_shardings(traced.out_info)
                    out = traced.out_avals
                else:
                    out = self._start(task, args)
        except Exception:
            if not optional:
                raise
            logger.debug("not compiled ahead: %s", task.name, exc_info=True)
            raise NotCompiledAhead() from None
        out_leaves, out_tree = jax.tree.flatten(out)
        results = jax.tree.unflatten(out_tree, [Pending(task, k, o.shape, o.dtype, o.weak_type)
                                                for k, o in enumerate(out_leaves)])
        self._tasks.append(task)
        self._held.append(jitted)
        self._by_call[key] = results
        self._pump()
        return results

    def _start(self, task: _Task, args: tuple) -> Any:
        """Traces and lowers ``task`` for ``args`` (operands' types all known) here, and starts
        compiling it on the pool, or finds an earlier task compiling the same; returns its
        results' types (traced)."""
        leaves, tree = jax.tree.flatten(args)
        key = (id(task.jitted), task.mesh, tree, tuple(_leaf_key(x) for x in leaves))
        if key in self._by_operands:
            task.same_as = self._by_operands[key]
            return jax.tree.unflatten(task.same_as.out_tree, task.same_as.out_avals)
        traced = task.jitted.trace(*args)
        lowered = traced.lower()
        task.out_tree, task.out_avals = traced.out_tree, jax.tree.leaves(traced.out_avals)
        task.declared = _declared_shardings(traced.out_info)
        self._by_operands[key] = task
        task.lowered = lowered
        task.future = _submit_compile(lowered, self._pool)
        return traced.out_avals

    @staticmethod
    def _in(mesh: Any) -> Any:
        return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()

    @staticmethod
    def _declared(x: Pending) -> Any:
        """The sharding ``x``'s program declares for it, once traced (``None``: not known yet)."""
        task = x.task.same_as or x.task
        return task.declared[x.index] if task.declared else None

    def _known(self, x: Any) -> bool:
        """Whether ``x``'s sharding is known without waiting (a declared one, or compiled)."""
        if not isinstance(x, Pending):
            return True
        return self._declared(x) is not None or (x.task.same_as or x.task).outputs is not None

    def resolve(self, tree: Any) -> Any:
        """``tree`` with every ``Pending`` as the ``ShapeDtypeStruct`` its program gives it: the
        sharding it declares, else its compiled one (waiting for the compile)."""
        def one(x: Any) -> Any:
            if not isinstance(x, Pending):
                return x
            declared = self._declared(x)
            if declared is not None:
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=declared, weak_type=x.weak_type)
            task = self._wait(x.task)
            out = task.outputs[x.index]
            return jax.ShapeDtypeStruct(out.shape, out.dtype, sharding=out.sharding, weak_type=x.weak_type)

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, Pending))

    def _wait(self, task: _Task) -> _Task:
        """``task`` compiled (its results' shardings known); raises ``NotCompiledAhead`` for an optional
        task that failed (or one reading its results), and the error of one that is not."""
        while True:
            if task.same_as is not None:
                task = task.same_as
            elif task.error is not None:
                if task.optional or isinstance(task.error, NotCompiledAhead):
                    raise NotCompiledAhead()
                raise task.error
            elif task.outputs is not None:
                return task
            elif task.future is not None:
                # Any compile finishing may let a queued program start: start those at once
                # rather than only once this one is done.
                if not task.future.done():
                    self._wait_any()
                    self._pump()
                self._collect(task, block=False)
            else:
                self._pump()
                if not task.submitted:
                    self._wait_any()

    def _collect(self, task: _Task, block: bool) -> None:
        if task.future is None or (not block and not task.future.done()):
            return
        try:
            compiled = task.future.result()
            task.lowered = None
            # The compiled results' types drop weak typing, which JAX's cache keys on: the traced
            # weak types are kept (``resolve``).
            task.outputs = jax.tree.leaves(compiled.out_info)
        except Exception as e:
            task.error = e
            if task.optional:
                logger.debug("not compiled ahead: %s", task.name, exc_info=True)

    def _wait_any(self) -> None:
        running = [t.future for t in self._tasks if t.future is not None and t.outputs is None and t.error is None]
        if running:
            concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for t in self._tasks:
            if t.future is not None and t.outputs is None and t.error is None:
                self._collect(t, block=False)

    def _pump(self) -> None:
        """Lowers and starts compiling every queued task whose operands' shardings are known."""
        for task in self._tasks:
            if task.submitted:
                continue
            deps = [d.same_as or d for d in task.deps]
            for d in deps:
                if d.future is not None and d.outputs is None and d.error is None:
                    self._collect(d, block=False)
            failed = [d for d in deps if d.error is not None]
            if failed:
                task.error = NotCompiledAhead() if failed[0].optional else failed[0].error
                continue
            if not all(self._known(x) for x in jax.tree.leaves(task.args)):
                continue
            try:
                with self._in(task.mesh):
                    self._start(task, self.resolve(task.args))
            except Exception as e:
                task.error = e
                if task.optional:
                    logger.debug("not compiled ahead: %s", task.name, exc_info=True)

    def finish(self) -> int:
        """Waits for every queued program to compile; raises the first error of one that is not
        optional. Returns how many programs compiled."""
        for task in self._tasks:
            try:
                self._wait(task)
            except NotCompiledAhead:
                pass
        return self.compiled


class NotCompiledAhead(Exception):
    """An optional program (or one reading its results) not compiled ahead: the caller takes
    its results as unknown."""
