"""Checkpoint and resume of a parallelized step's state, as one global orbax checkpoint.

::

    abstract = meshpar.checkpoint.state_shardings(step, state, batch)  # where the step keeps the state
    meshpar.checkpoint.save("ckpt/2", state)
    state = meshpar.checkpoint.restore("ckpt/2", abstract)             # resumes bit for bit

A checkpoint is the one orbax writes for the state as a whole (``ocp.StandardCheckpointer``'s
format: OCDBT, every leaf one global array, the tree's metadata), so plain orbax reads it with no
meshpar installed, into any sharding::

    target = jax.eval_shape(lambda: state)           # with the shardings wanted, e.g. one device
    state = ocp.StandardCheckpointer().restore("ckpt/2", target)

Each process writes its own chunks of every array: the shards its devices hold that are their
box's first replica, so every box is written once, by the process holding it. orbax's own array
handler cannot: it refuses an array whose devices are all one process's, and fails on one with no
shard here, and an MPMD pipeline's stage meshes hold only such arrays (``_ProcessChunksHandler``
writes them through orbax's tensorstore specs instead). orbax commits the checkpoint atomically:
it is written under a temporary name, renamed once every process finished, so a save cut short
leaves no checkpoint at ``directory`` and the previous one readable.

``restore`` reads, per leaf, only the boxes the target sharding puts on this process's devices,
so it restores under any layout and number of processes: the saving job's, another stage count,
or a plain ``jax.jit`` state on one device.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from meshpar.parallelize import ParallelizedStep
from meshpar.runtime.coordination import CoordinationError, agree, kv_client, named_processes
from meshpar.runtime.remote import absent

__all__ = ["state_shardings", "save", "restore"]

# Leaves of an abstract state that ``restore`` returns as the saved number, of their own type.
_NUMBER_TYPES = (bool, int, float, complex, np.number, np.bool_)

# Saves made by this process: names each save's coordination keys.
_saves = 0


def state_shardings(step: ParallelizedStep, *args: Any, argnum: int = 0) -> Any:
    """Where ``step`` keeps argument ``argnum``'s leaves between calls: the abstract state to restore into.

    Compiles ``step`` for ``args`` as a call with them would (nothing runs), so a fresh process
    can call it before any step; with several processes every process calls it, as it would the
    step. A leaf lives where the step places it and returns it: on its stage mesh with its flax
    partitioning, or, read by several meshes, replicated over all their devices as one array.

    Args:
      step: a ``meshpar.parallelize``d step.
      args: the step's arguments, as for a call (arrays, or anything with ``shape`` and ``dtype``).
      argnum: which argument: by default the first, the train state.

    Returns:
      A pytree like ``args[argnum]`` of ``jax.ShapeDtypeStruct(shape, dtype, sharding=...)``, the
      dtype JAX gives the leaf (a Python int step counter: int32).

    Raises:
      TypeError: ``step`` is not a parallelized step.
      ValueError: ``argnum`` is no argument's index, or a leaf of the argument lives on no mesh
        (a batch leaf, placed per micro-batch), naming it.
    """
    if not isinstance(step, ParallelizedStep):
        raise TypeError(f"step: expected a meshpar.parallelize(...) step, got {type(step).__name__}")
    if not isinstance(argnum, int) or not 0 <= argnum < len(args):
        raise ValueError(f"argnum: expected the index of one of the {len(args)} arguments, got {argnum!r}")
    kept = step.get_executable(*args).leaf_shardings
    first = len(jax.tree.leaves(args[:argnum]))
    flat, treedef = jax.tree_util.tree_flatten_with_path(args[argnum])
    structs = []
    for k, (path, leaf) in enumerate(flat):
        sharding = kept[first + k]
        if sharding is None:
            raise ValueError(
                f"args[{argnum}]{jax.tree_util.keystr(path)}: the step keeps it on no mesh (a batch leaf, "
                f"placed per micro-batch); state_shardings is for arguments it keeps, like the train state")
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype if hasattr(leaf, "dtype") else np.result_type(leaf),
                                            allow_extended_dtype=True)
        structs.append(jax.ShapeDtypeStruct(np.shape(leaf), dtype, sharding=sharding))
    return jax.tree_util.tree_unflatten(treedef, structs)


def save(directory: str | os.PathLike, state: Any, *, timeout_s: float = 120.0) -> None:
    """Writes ``state`` as a new global orbax checkpoint at ``directory``; returns once it is committed.

    Every process calls it with the same path, on a file system all of them share, and the same
    state: the one a step returned, or any pytree of arrays and numbers. Each process writes the
    chunks of every array its devices hold (each box once, by the holder of its first replica);
    process 0 writes the numbers (Python and numpy scalars, in the dtype a step places them in: a
    Python int as int32) and the tree's metadata, and commits the checkpoint by renaming it into
    place once every process finished.

    Args:
      directory: the checkpoint's directory; must not exist (its parent is created if needed).
      state: the pytree to save; the leaves of a flax ``TrainState``, not its ``apply_fn``/``tx``.
      timeout_s: how long a process waits for the others to reach and finish the save.

    Raises:
      TypeError: ``directory`` is not a path; a leaf is neither an array nor a number, or is a
        typed PRNG key array, naming it.
      FileExistsError: ``directory`` exists.
      meshpar.runtime.coordination.CoordinationError: another process did not reach, or did not
        finish, the same save within ``timeout_s``, naming it.
    """
    global _saves
    directory = _path(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"directory: {directory} already exists; save writes a new checkpoint directory")
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = [_array(jax.tree_util.keystr(path), leaf) if isinstance(leaf, jax.Array)
              else _host_value(jax.tree_util.keystr(path), leaf) for path, leaf in flat]
    everyone = list(range(jax.process_count()))
    what = f"meshpar.checkpoint.save({directory!r})"
    # Every process checked that the directory is absent before any creates it.
    agree("checkpoint/save", {"directory": directory, "leaves": len(flat)}, everyone, timeout_s=timeout_s,
          what=what)
    written = f"meshpar/checkpoint/{_saves}/written"
    _saves += 1
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    handler = _ProcessChunksHandler(written)
    tree = jax.tree_util.tree_unflatten(treedef, leaves)
    saving = _InThread(lambda: _checkpointer(handler).save(directory, args=ocp.args.PyTreeSave(tree)),
                       name=f"meshpar checkpoint save {directory}")
    # orbax's own barriers wait 300 s; a peer that dies while saving is named sooner: once this
    # process's chunks are on disk, each other process has timeout_s to record that its are.
    while not saving.done.wait(0.05):
        if handler.written.is_set():
            late = _not_written(written, everyone, timeout_s)
            if late:
                raise CoordinationError(
                    f"{what}: {named_processes(late)} did not write {'their' if len(late) > 1 else 'its'} chunks "
                    f"within {timeout_s:g} s of process {jax.process_index()} (exited, or not saving); no "
                    f"checkpoint was committed at {directory}")
            if not saving.done.wait(timeout_s):
                raise CoordinationError(f"{what}: the commit did not finish within {timeout_s:g} s of every "
                                        f"process writing its chunks (is process 0 alive?)")
            break
    if saving.error is not None:
        late = _not_written(written, everyone, 0.0)
        if late:
            raise CoordinationError(f"{what}: {named_processes(late)} did not write {'their' if len(late) > 1 else 'its'} "
                                    f"chunks (exited, or not saving); no checkpoint was committed at {directory}"
                                    ) from saving.error
        raise saving.error


def restore(directory: str | os.PathLike, abstract_state: Any, *, timeout_s: float = 120.0) -> Any:
    """The state saved in ``directory``, bit for bit, as arrays shaped, typed and sharded as ``abstract_state`` says.

    Every process calls it with the same arguments; each reads only the boxes of each leaf that
    its sharding puts on this process's devices, whatever layout and number of processes saved
    it. A leaf with no shard here comes back without shards here, as a step returns such leaves.
    Any orbax checkpoint of a tree like ``abstract_state`` restores, not only meshpar's.

    Args:
      directory: a checkpoint ``save`` (or orbax) wrote.
      abstract_state: a pytree of ``jax.ShapeDtypeStruct`` with shardings, like the saved state
        (``state_shardings`` gives the one a step keeps its state in); its other parts, such as a
        ``TrainState``'s ``apply_fn`` and ``tx``, are returned as they are. A leaf may also be a
        number (Python ``int``, ``float``, ``bool``, ``complex`` or a numpy scalar), such as a
        fresh ``TrainState``'s step counter: it comes back as the saved scalar, a number of the
        same type, as ``jax.jit`` takes it (on no device until a step places it).
      timeout_s: how long a process waits for the others to finish restoring.

    Returns:
      A pytree like ``abstract_state`` of ``jax.Array``, and numbers where it holds numbers.

    Raises:
      FileNotFoundError: ``directory`` holds no committed checkpoint.
      TypeError: a leaf of ``abstract_state`` is neither a ``jax.ShapeDtypeStruct`` with a
        sharding nor a number, naming it.
      ValueError: a leaf is not in the checkpoint, or was saved with another shape or dtype (a
        number: other than a scalar of the dtype JAX gives it, e.g. int32 for an ``int``),
        naming it.
      meshpar.runtime.coordination.CoordinationError: another process did not finish the same
        restore within ``timeout_s``.
    """
    directory = _path(directory)
    saved = _saved_leaves(directory)
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    restored = []
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        stored = ".".join(ocp.tree.str_keypath(path))
        if isinstance(leaf, _NUMBER_TYPES):
            # A number saved by save() or returned by a step is a scalar of JAX's dtype for it (an int: int32).
            dtype = jax.dtypes.canonicalize_dtype(np.result_type(leaf))
            _check_saved(name, stored, saved, (), dtype, directory)
            restored.append(type(leaf)(_open(directory, stored)[()].read().result().item()))
            continue
        if not isinstance(leaf, jax.ShapeDtypeStruct) or not isinstance(leaf.sharding, jax.sharding.Sharding):
            raise TypeError(f"abstract_state{name}: expected a jax.ShapeDtypeStruct with a sharding "
                            f"(meshpar.checkpoint.state_shardings gives them) or a number, got {leaf!r}")
        _check_saved(name, stored, saved, leaf.shape, leaf.dtype, directory)
        if not leaf.sharding.addressable_devices:
            restored.append(absent(leaf.shape, leaf.dtype, leaf.sharding))
            continue
        store = _open(directory, stored)
        restored.append(jax.make_array_from_callback(
            leaf.shape, leaf.sharding, lambda index, store=store: np.asarray(store[index].read().result()),
            dtype=leaf.dtype))
    agree("checkpoint/restored", {"directory": directory, "leaves": len(flat)}, list(range(jax.process_count())),
          timeout_s=timeout_s, what=f"meshpar.checkpoint.restore({directory!r})")
    return jax.tree_util.tree_unflatten(treedef, restored)


def _path(directory: Any) -> str:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError(f"directory: expected a path, got {directory!r}")
    return os.path.abspath(os.fspath(directory))


def _array(name: str, leaf: jax.Array) -> jax.Array:
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        # orbax restores one as a key only with its array metadata store, which it does not export.
        raise TypeError(f"state{name}: a typed PRNG key array; keep jax.random.key_data(key) in the state "
                        f"instead (uint32 data, saved and restored bit for bit)")
    return leaf


def _host_value(name: str, leaf: Any) -> np.ndarray:
    value = np.asarray(leaf)
    if value.dtype.kind in "OSU":
        raise TypeError(f"state{name}: expected an array or a number, got {type(leaf).__name__}")
    return value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)


def _saved_leaves(directory: str) -> dict[str, Any]:
    """Per stored leaf name (orbax's: the key path joined by dots), its metadata (shape, dtype)."""
    if not os.path.isfile(os.path.join(directory, "_METADATA")):
        if any(entry.startswith("process_") for entry in (os.listdir(directory) if os.path.isdir(directory) else ())):
            raise FileNotFoundError(
                f"directory: {directory} holds one part per process, the format meshpar wrote before its "
                f"checkpoints were global orbax checkpoints; restore it with the meshpar release that wrote it")
        raise FileNotFoundError(f"directory: no checkpoint at {directory} (none, or one not committed)")
    tree = ocp.PyTreeCheckpointHandler().metadata(epath.Path(directory)).tree
    return {meta.name: meta for meta in jax.tree.leaves(tree, is_leaf=lambda x: hasattr(x, "name"))
            if hasattr(meta, "name")}


def _check_saved(name: str, stored: str, saved: dict[str, Any], shape: tuple[int, ...], dtype: Any,
                 directory: str) -> None:
    if stored not in saved:
        raise ValueError(f"abstract_state{name}: not in the checkpoint at {directory}, whose {len(saved)} "
                         f"leaves are named like {sorted(saved)[:3]} (orbax's names: key paths joined by dots)")
    meta = saved[stored]
    if tuple(meta.shape) != tuple(shape) or np.dtype(meta.dtype) != np.dtype(dtype):
        raise ValueError(f"abstract_state{name}: expected {np.dtype(dtype)}{list(shape)}, "
                         f"but the checkpoint holds {np.dtype(meta.dtype)}{list(meta.shape)}")


def _open(directory: str, stored: str) -> ts.TensorStore:
    """Leaf ``stored`` of the checkpoint, opened for reading with the spec orbax reads it with."""
    path = epath.Path(directory)
    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(path)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt)
    info = ocp.type_handlers.ParamInfo(name=stored, parent_dir=path, ts_context=context)
    return ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt), context=context).result()


def _not_written(written: str, processes: list[int], timeout_s: float) -> list[int]:
    """The processes that did not record under ``written``, within ``timeout_s`` from now, that their chunks are on disk."""
    client = kv_client()
    if client is None:
        return []
    deadline = time.monotonic() + timeout_s
    late = []
    for p in processes:
        try:
            client.blocking_key_value_get(f"{written}/{p}", max(1, int(1000 * (deadline - time.monotonic()))))
        except Exception:  # noqa: BLE001 -- the client raises DEADLINE_EXCEEDED for a key not set in time
            late.append(p)
    return late


class _InThread:
    """``run()`` in a daemon thread: ``done`` is set when it returned or raised (``error``)."""

    def __init__(self, run: Callable[[], Any], name: str) -> None:
        self.done, self.error = threading.Event(), None

        def target() -> None:
            try:
                run()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller
                self.error = e
            finally:
                self.done.set()

        threading.Thread(target=target, daemon=True, name=name).start()


class _ProcessChunksHandler(ocp.type_handlers.ArrayHandler):
    """orbax's array handler, writing a global array's chunks from the processes holding them.

    Each process writes the shards it holds that are their box's first replica (so each box
    once, whichever process holds it) into the array's OCDBT database of this process, which
    orbax merges into the checkpoint's on commit; chunks are shards, as orbax writes them. Then
    it records under ``written`` that its chunks are on disk (named by ``save`` when a process
    did not). Reading is orbax's.
    """

    def __init__(self, written: str) -> None:
        super().__init__(enable_write_sharding_file=False)
        self._written = written
        self.written = threading.Event()

    async def serialize(self, values: Any, infos: Any, args: Any = None) -> list:
        args = args or [ocp.type_handlers.SaveArgs()] * len(values)
        writes = []
        for value, info, arg in zip(values, infos, args):
            mine = [shard for shard in value.addressable_shards if shard.replica_id == 0]
            if not mine:
                continue
            await info.await_path_creation()
            tspec = ocp.type_handlers.get_json_tspec_write(
                info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape,
                local_shape=value.sharding.shard_shape(value.shape), dtype=value.dtype,
                process_index=jax.process_index() if info.is_ocdbt_checkpoint else None, arg=arg)
            store = await ts.open(ts.Spec(tspec), create=True, open=True, context=info.ts_context)
            writes += [store[shard.index].write(np.asarray(shard.data)) for shard in mine]
        for write in writes:
            await write
        client = kv_client()
        if client is not None:
            client.key_value_set(f"{self._written}/{jax.process_index()}", "1")
        self.written.set()
        return []


def _checkpointer(handler: _ProcessChunksHandler) -> ocp.Checkpointer:
    """A synchronous orbax checkpointer of one global checkpoint, run by every process, its arrays
    written by ``handler``."""
    options = ocp.options.MultiprocessingOptions(primary_host=0, active_processes=set(range(jax.process_count())))
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, handler), (np.ndarray, ocp.type_handlers.NumpyHandler()))
    return ocp.Checkpointer(
        ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=registry),
        multiprocessing_options=options)
