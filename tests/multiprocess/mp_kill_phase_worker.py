"""One process of the kill-phase tests: python mp_kill_phase_worker.py PID NUM_PROCESSES PORT PHASE [HEARTBEAT_S].

Every process trains an MLP pipeline (``timeout_s = TIMEOUT_S``) for ``STEPS`` steps, laid out as
``PHASES[PHASE]`` says. Process ``VICTIM`` kills itself (SIGKILL) the moment it
enters the phase, printing ``process VICTIM: gone at <time.time()>`` first; each other process
(a survivor) prints what it raised and leaves as any program would, through JAX's exit handlers.
The test times each survivor's exit from the victim's going and reads its output for the dead
process's name. With HEARTBEAT_S (JAX's heartbeat timeout; default the one ``timeout_s`` makes)
long, JAX leaves the survivors to meshpar's own waits for that long.

The phase is entered through a wrapper, installed by the phase's ``arm``, around the runtime
function that starts it: no production code knows of these tests. A new phase is one entry of
``PHASES``: a layout, an ``arm`` and, when the phase is not part of a training step (saving a
checkpoint), a ``drive`` that runs it after the steps.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import jax

import meshpar.distributed

TIMEOUT_S = 10
VICTIM = 1
STEPS = 2

pid, nproc, port, phase_name = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
# JAX's heartbeat timeout when given, else the one timeout_s makes: a long one leaves the survivors
# to meshpar's own waits (JAX then terminates them only that long after the death).
heartbeat = {"heartbeat_timeout_seconds": int(sys.argv[5])} if len(sys.argv) > 5 else {}
# The test asks a process that did not exit in time where its threads are (SIGUSR1).
faulthandler.register(signal.SIGUSR1, all_threads=True)
# The step being run (1-based; 0 while compiling): a phase's hook may fire in one step only.
step_number = 0


def die(where: str) -> None:
    """The victim leaves, here and now, as a killed process does: no exit handler runs."""
    if pid != VICTIM:
        return
    print(f"process {pid}: entering {where} in step {step_number}", flush=True)
    print(f"process {pid}: gone at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)  # not reached


def wrap(owner: Any, name: str, before: Callable[..., None]) -> None:
    """Replaces ``owner.name`` (a module's function or a class's method) by one calling
    ``before`` with its arguments first; installed before anything is compiled, so executables
    built afterwards (which bind their handlers when made) see the wrapper."""
    original = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        before(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, wrapper)


# -- layouts: PipeshardParallel's arguments for this job's devices -------------------------------

def stage_per_process() -> dict:
    """One device per process, one stage per process: every value between the stages crosses
    processes (activations k -> k + 1, gradients back)."""
    return dict(num_stages=jax.process_count(), stage_mesh_shape=(1, 1))


def data_across_processes() -> dict:
    """Two devices per process, each stage's mesh holding one device of every process along its
    data axis: its gradients are reduced across processes (gloo), once per step."""
    from jax.sharding import Mesh
    import numpy as np

    devices = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
    meshes = [Mesh(np.array([own[s] for own in devices]).reshape(-1, 1), ("data", "model")) for s in range(2)]
    return dict(num_stages=2, stage_meshes=meshes, gradient_reduction="per_step")


# -- arms: install the hook that kills the victim as the phase starts ----------------------------

def arm_compile() -> None:
    """The step's compiler starting (the pass pipeline, before any agreement between processes):
    the survivors compile and then wait for the victim at the agreement on the compiled pipeline."""
    import meshpar.step_compiler

    wrap(meshpar.step_compiler, "compile_pipeline", lambda *a, **k: die("compile_pipeline"))


def arm_first_transfer() -> None:
    """The first move of a value between processes in the first step (a p2p move, which every
    process calls in the same order)."""
    from meshpar.runtime.p2p_executor import P2PReshardExecutable

    def before(move: P2PReshardExecutable, *args: Any, **kwargs: Any) -> None:
        if move.cross_process:
            die("the first cross-process transfer (P2PReshardExecutable.__call__)")

    wrap(P2PReshardExecutable, "__call__", before)


def arm_mid_pipeline() -> None:
    """A stage program's launch in the second step, once micro-batches 0 and 1 have gone through
    the victim's stage: the survivors have activations and gradients in flight to and from it."""
    from meshpar.runtime.program_interpreter import ProgramInterpreter

    def before(interpreter: ProgramInterpreter, mesh: int, ins: Any, state: Any) -> None:
        if step_number == 2 and interpreter.local[mesh] and not state.compile_only and ins.micro_batch >= 2:
            die(f"a stage program's launch ({ins})")

    wrap(ProgramInterpreter, "_compute", before)


def arm_gradient_reduction() -> None:
    """The launch of a stage mesh's gradient reduction program, an all-reduce over processes, in
    the first step: the victim dies as XLA would start it (after whatever the runtime does on
    the host before a launch on a mesh spanning processes), so the survivors' all-reduce runs
    without it. The program is the one ``PipelineExecutable._reducer`` makes (``reduce_gradients``)."""
    import meshpar.runtime.pipeline_executor as executor

    on_mesh = executor.on_mesh

    def reducer_on_mesh(fn: Callable, mesh: Any, timeout_s: float) -> Callable:
        if getattr(fn, "__name__", None) == "reduce_gradients":
            fn = _Launching(fn, "the gradient reduction's launch (reduce_gradients)")
        return on_mesh(fn, mesh, timeout_s)

    executor.on_mesh = reducer_on_mesh


class _Launching:
    """A jitted function whose calls on arrays (its launches) kill the victim first; tracing
    and compiling it (``eval_shape``, ``lower``, as compiling ahead does) and everything else
    are the function's own."""

    def __init__(self, fn: Callable, where: str) -> None:
        self._fn, self._where = fn, where

    def __call__(self, *args: Any) -> Any:
        if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            die(self._where)
        return self._fn(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fn, name)


def train(step: Callable, state: Any, batch: dict) -> Any:
    """``STEPS`` steps, each waited for; returns the trained state."""
    global step_number
    for step_number in range(1, STEPS + 1):
        state, loss = step(state, batch)
        jax.block_until_ready((state, loss))
        print(f"process {pid}: step {step_number} done", flush=True)
    return state


@dataclasses.dataclass(frozen=True)
class Phase:
    """Where the victim dies.

    Attributes:
      devices: CPU devices per process.
      layout: PipeshardParallel's layout arguments, made once JAX has started.
      arm: installs the hook calling ``die`` as the phase starts (on every process; ``die``
        acts on the victim only).
      drive: runs the job: ``drive(step, state, batch)``; default ``train``. A phase after the
        steps (saving a checkpoint) trains and then runs it. The working directory is the
        test's own, the same for every process: a checkpoint can go there.
    """

    devices: int
    layout: Callable[[], dict]
    arm: Callable[[], None]
    drive: Callable[[Callable, Any, dict], Any] = train


def arm_checkpoint_save() -> None:
    """The victim's writing of its chunks of the checkpoint starting (orbax has created the
    temporary directory; every process is inside the save): the survivors write theirs and wait
    for the victim's."""
    import meshpar.checkpoint

    handler = meshpar.checkpoint._ProcessChunksHandler
    serialize = handler.serialize

    async def dying(self: Any, *args: Any, **kwargs: Any) -> Any:
        die("the checkpoint save's writing of its chunks")
        return await serialize(self, *args, **kwargs)

    handler.serialize = dying


def train_then_save(step: Callable, state: Any, batch: dict) -> Any:
    """The steps, then every process saves the state in the test's directory."""
    state = train(step, state, batch)
    meshpar.checkpoint.save("checkpoint", state, timeout_s=TIMEOUT_S)
    return state


PHASES: dict[str, Phase] = {
    "compile": Phase(1, stage_per_process, arm_compile),
    "first_transfer": Phase(1, stage_per_process, arm_first_transfer),
    "mid_pipeline": Phase(1, stage_per_process, arm_mid_pipeline),
    "gradient_reduction": Phase(2, data_across_processes, arm_gradient_reduction),
    "checkpoint_save": Phase(1, stage_per_process, arm_checkpoint_save, drive=train_then_save),
}

phase = PHASES[phase_name]
jax.config.update("jax_num_cpu_devices", phase.devices)
meshpar.distributed.initialize(f"127.0.0.1:{port}", nproc, pid, timeout_s=TIMEOUT_S, initialization_timeout=60,
                               **heartbeat)

import numpy as np  # noqa: E402

import meshpar  # noqa: E402
from examples.mlp import MLP  # noqa: E402
from examples.train_step import supervised_step  # noqa: E402
from pipeline_models import make_state, mse  # noqa: E402

rng = np.random.default_rng(0)
batch = {"x": rng.standard_normal((16, 6)).astype(np.float32), "y": rng.standard_normal((16, 4)).astype(np.float32)}
layout = phase.layout()
with jax.default_device(jax.local_devices()[0]):
    state = make_state(MLP(features=(16, 16, 16, 4), num_stages=layout["num_stages"]), batch["x"][:1])
step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
    num_micro_batches=4, timeout_s=TIMEOUT_S, **layout))
phase.arm()
print(f"process {pid}: armed for {phase_name}", flush=True)
start = time.monotonic()
try:
    phase.drive(step, state, batch)
except Exception as e:
    # On one line, for the test to read.
    print(f"process {pid}: raised at {time.time():.3f} ({time.monotonic() - start:.1f} s in): "
          f"{type(e).__name__}: {' '.join(str(e).split())}", flush=True)
    raise
print(f"process {pid}: finished without its peer", flush=True)
