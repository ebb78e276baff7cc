"""Checkpoint and resume of a parallelized step's state with orbax-checkpoint.

::

    abstract = meshpar.checkpoint.state_shardings(step, state, batch)  # where the step keeps the state
    meshpar.checkpoint.save("ckpt/2", state)
    state = meshpar.checkpoint.restore("ckpt/2", abstract)             # resumes bit for bit

A checkpoint directory holds one orbax checkpoint per process, ``process_<i>``, which process
``i`` writes alone from the shards its devices hold: a stage mesh's leaves are written by the
process owning the mesh, a leaf spanning several processes' devices by each of them (its own
shards). Not one orbax checkpoint for the job: orbax, like JAX's array serialization, writes
only SPMD arrays, with shards on every process; it refuses an array whose devices are all this
process's ("host local") and fails on one with no shard here, and an MPMD pipeline's stage
meshes hold only such arrays. Each part is written with the setup of orbax's local (emergency)
checkpoints: this process its part's primary, each of its shards written once. With several
processes an array one process holds whole goes as a numpy array, the only form in which orbax
writes it, written by its holder (orbax's numpy handler writes from process 0 only).

Beside its part each process writes ``process_<i>.regions.json``: per leaf, the boxes of it
its part holds. A leaf restores from this process's own part when that holds every shard the
target layout puts here (the same layout: each process reads only what it wrote). Otherwise
(another number of processes, other stage meshes or stage count, or a plain ``jax.jit`` state
on one device) it is read from every part holding a box of it and assembled on the host, bit
for bit; that needs every part readable from this process (a file system all hosts share)
and host memory for the whole leaf.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from meshpar.parallelize import ParallelizedStep
from meshpar.runtime.coordination import agree
from meshpar.runtime.remote import absent

__all__ = ["state_shardings", "save", "restore"]

# Leaves of an abstract state that ``restore`` returns as the saved number, of their own type.
_NUMBER_TYPES = (bool, int, float, complex, np.number, np.bool_)

# The array format the parts are written in, named once: a leaf split between parts is read box
# by box straight from tensorstore (``_read_boxes``), which must open it as it was written.
_USE_ZARR3 = False


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
    """Writes ``state`` as a new checkpoint in ``directory``; returns once every process's part is on disk.

    Every process calls it with the same path (on a file system all of them share, or on each
    host's own disk) and the same state: the one a step returned, or any pytree of arrays and
    numbers. Process ``i`` writes ``directory/process_<i>``: the leaves it holds shards of, and
    every host value (Python and numpy numbers, in the dtype the step would place them as: a
    Python int as int32). Nothing is written until every process has seen ``directory`` absent.

    Args:
      directory: the checkpoint's directory; must not exist (its parent is created if needed).
      state: the pytree to save; the leaves of a flax ``TrainState``, not its ``apply_fn``/``tx``.
      timeout_s: how long a process waits for the others to reach and finish the save.

    Raises:
      TypeError: ``directory`` is not a path; a leaf is neither an array nor a number, or is a
        typed PRNG key array, naming it.
      FileExistsError: ``directory`` exists.
      meshpar.runtime.coordination.CoordinationError: another process did not reach, or did not
        finish, the same save within ``timeout_s``.
    """
    directory = _path(directory)
    if os.path.exists(directory):
        raise FileExistsError(f"directory: {directory} already exists; save writes a new checkpoint directory")
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    held = {}
    for path, leaf in flat:
        name = jax.tree_util.keystr(path)
        value = _writable(name, leaf) if isinstance(leaf, jax.Array) else _host_value(name, leaf)
        if value is not None:
            held[name] = value
    everyone = list(range(jax.process_count()))
    # Every process checked that the directory is absent before any creates it.
    agree("checkpoint/save", {"directory": directory, "leaves": len(flat)}, everyone, timeout_s=timeout_s,
          what=f"meshpar.checkpoint.save({directory!r})")
    os.makedirs(directory, exist_ok=True)
    if held:  # orbax refuses an empty tree: a process holding nothing writes no part
        with _checkpointer() as checkpointer:
            checkpointer.save(_part(directory, jax.process_index()), args=ocp.args.PyTreeSave(held))
    with open(_regions_path(directory, jax.process_index()), "w") as f:
        json.dump({name: _regions(value) for name, value in held.items()}, f)
    agree("checkpoint/saved", {"directory": directory}, everyone, timeout_s=timeout_s,
          what=f"meshpar.checkpoint.save({directory!r}) finishing")


def restore(directory: str | os.PathLike, abstract_state: Any, *, timeout_s: float = 120.0) -> Any:
    """The state saved in ``directory``, bit for bit, as arrays shaped, typed and sharded as ``abstract_state`` says.

    Every process calls it with the same arguments; each reads only its own part, and only the
    leaves with shards on its devices; a leaf it holds no shard of comes back without shards
    here, as a step returns such leaves.

    Args:
      directory: a checkpoint ``save`` wrote.
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
      FileNotFoundError: ``directory`` does not exist.
      TypeError: a leaf of ``abstract_state`` is neither a ``jax.ShapeDtypeStruct`` with a
        sharding nor a number, naming it.
      ValueError: a leaf is not in this process's part (saved with another layout or number of
        processes), or was saved with another shape or dtype (a number: other than a scalar of
        the dtype JAX gives it, e.g. int32 for an ``int``), naming it.
      meshpar.runtime.coordination.CoordinationError: another process did not finish the same
        restore within ``timeout_s``.
    """
    directory = _path(directory)
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"directory: no checkpoint at {directory}")
    flat, treedef = jax.tree_util.tree_flatten_with_path(abstract_state)
    names = [jax.tree_util.keystr(path) for path, _ in flat]
    wanted, numbers = {}, {}
    for name, (_, leaf) in zip(names, flat):
        if isinstance(leaf, _NUMBER_TYPES):
            numbers[name] = leaf
            continue
        if not isinstance(leaf, jax.ShapeDtypeStruct) or not isinstance(leaf.sharding, jax.sharding.Sharding):
            raise TypeError(f"abstract_state{name}: expected a jax.ShapeDtypeStruct with a sharding "
                            f"(meshpar.checkpoint.state_shardings gives them) or a number, got {leaf!r}")
        if leaf.sharding.addressable_devices:
            wanted[name] = leaf
    restored = {}
    if wanted or numbers:
        me = jax.process_index()
        part = _part(directory, me)
        regions = _saved_regions(directory)
        with _checkpointer() as checkpointer:
            saved = checkpointer.metadata(part).item_metadata.tree if os.path.isdir(part) else {}
            if regions is None:  # written before regions were recorded: this process's own part only
                own, elsewhere = wanted, {}
            else:
                own = {n: leaf for n, leaf in wanted.items() if _covers(regions.get(me, {}).get(n), leaf)}
                elsewhere = {n: leaf for n, leaf in wanted.items() if n not in own}
            _check_saved(own, saved, part)
            if own:
                restored = checkpointer.restore(part, args=ocp.args.PyTreeRestore(
                    item=own, partial_restore=True,
                    restore_args={name: ocp.ArrayRestoreArgs(sharding=leaf.sharding, global_shape=leaf.shape,
                                                             dtype=leaf.dtype) for name, leaf in own.items()}))
            for name, leaf in elsewhere.items():
                restored[name] = _assembled(checkpointer, directory, regions, name, leaf)
            for name, leaf in numbers.items():
                restored[name] = _number(checkpointer, directory, regions, name, leaf)
    agree("checkpoint/restored", {"directory": directory, "leaves": len(flat)}, list(range(jax.process_count())),
          timeout_s=timeout_s, what=f"meshpar.checkpoint.restore({directory!r})")
    return jax.tree_util.tree_unflatten(treedef, [
        restored[name] if name in restored else absent(leaf.shape, leaf.dtype, leaf.sharding)
        for name, (_, leaf) in zip(names, flat)])


def _path(directory: Any) -> str:
    if not isinstance(directory, (str, os.PathLike)) or not os.fspath(directory):
        raise TypeError(f"directory: expected a path, got {directory!r}")
    return os.path.abspath(os.fspath(directory))


def _part(directory: str, process: int) -> str:
    return os.path.join(directory, f"process_{process}")


def _regions_path(directory: str, process: int) -> str:
    return os.path.join(directory, f"process_{process}.regions.json")


def _regions(value: Any) -> list[list[list[int]]]:
    """The boxes of a leaf a part holds (per dimension ``[start, stop)``): a host value whole,
    an array the distinct boxes of its shards here."""
    shape = np.shape(value)
    if not isinstance(value, jax.Array):
        return [[[0, int(n)] for n in shape]]
    boxes = {tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(shard.index, shape))
             for shard in value.addressable_shards}
    return [[[int(a), int(b)] for a, b in box] for box in sorted(boxes)]


def _saved_regions(directory: str) -> dict[int, dict[str, list]] | None:
    """Per process that saved, per leaf, the boxes its part holds; ``None`` for a checkpoint
    written without them."""
    found = {}
    for entry in os.listdir(directory):
        if entry.startswith("process_") and entry.endswith(".regions.json"):
            with open(os.path.join(directory, entry)) as f:
                found[int(entry[len("process_"):-len(".regions.json")])] = json.load(f)
    return found or None


def _boxes_here(leaf: jax.ShapeDtypeStruct) -> list[tuple[tuple[int, int], ...]]:
    """The boxes of ``leaf`` its sharding puts on this process's devices."""
    return [tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, leaf.shape))
            for index in leaf.sharding.addressable_devices_indices_map(leaf.shape).values()]


def _covers(regions: list | None, leaf: jax.ShapeDtypeStruct) -> bool:
    """Whether a part holding ``regions`` of a leaf holds each box ``leaf`` needs here whole."""
    if regions is None:
        return False
    return all(any(all(r[0] <= a and b <= r[1] for (a, b), r in zip(box, region)) for region in regions)
               for box in _boxes_here(leaf))


def _assembled(checkpointer: ocp.Checkpointer, directory: str, regions: dict[int, dict[str, list]], name: str,
               leaf: jax.ShapeDtypeStruct) -> jax.Array:
    """Leaf ``name`` read from every part holding a box of it, assembled on the host, laid out as ``leaf``.

    Raises:
      ValueError: naming the leaf, when no part holds it, or the parts leave part of it unsaved.
    """
    value = np.zeros(leaf.shape, leaf.dtype)
    filled = np.zeros(leaf.shape, bool)
    holders = sorted(p for p, leaves in regions.items() if name in leaves)
    if not holders:
        raise ValueError(f"abstract_state{name}: in no part of the checkpoint at {directory}")
    for p in holders:
        part = _part(directory, p)
        saved = checkpointer.metadata(part).item_metadata.tree
        _check_saved({name: leaf}, saved, part)
        boxes = [tuple(slice(a, b) for a, b in region) for region in regions[p][name]]
        for box, data in zip(boxes, _read_boxes(part, name, boxes)):
            value[box] = data
            filled[box] = True
    if not filled.all():
        raise ValueError(f"abstract_state{name}: the checkpoint's parts hold only part of it "
                         f"({int(filled.sum())} of {filled.size} elements)")
    return jax.make_array_from_callback(leaf.shape, leaf.sharding, lambda index: value[index], dtype=leaf.dtype)


def _number(checkpointer: ocp.Checkpointer, directory: str, regions: dict[int, dict[str, list]] | None, name: str,
            leaf: Any) -> Any:
    """Scalar leaf ``name`` as saved, as a number of ``leaf``'s type: read from this process's
    part when it holds it, else from the first part that does (every part holds a scalar whole).

    Raises:
      ValueError: naming the leaf, when no part holds it, or it was saved as other than a scalar
        of the dtype JAX gives ``leaf``.
    """
    me = jax.process_index()
    holders = [me] if regions is None or name in regions.get(me, {}) else sorted(
        p for p, leaves in regions.items() if name in leaves)
    if not holders:
        raise ValueError(f"abstract_state{name}: in no part of the checkpoint at {directory}")
    part = _part(directory, holders[0])
    saved = checkpointer.metadata(part).item_metadata.tree if os.path.isdir(part) else {}
    # A number saved by save() or returned by a step is a scalar of JAX's dtype for it (an int: int32).
    dtype = jax.dtypes.canonicalize_dtype(np.result_type(leaf))
    _check_saved({name: jax.ShapeDtypeStruct((), dtype)}, saved, part)
    (value,) = _read_boxes(part, name, [()])
    return type(leaf)(value.item())


def _read_boxes(part: str, name: str, boxes: Sequence[tuple[slice, ...]]) -> list[np.ndarray]:
    """The ``boxes`` of leaf ``name`` that part ``part`` holds, each read alone: a part holds only
    the chunks its process wrote, and orbax reads a leaf whole (a missing chunk is an error)."""
    path = epath.Path(part)
    ocdbt = ocp.type_handlers.is_ocdbt_checkpoint(path)
    context = ocp.type_handlers.get_ts_context(use_ocdbt=ocdbt)
    info = ocp.type_handlers.ParamInfo(name=name, parent_dir=path, use_zarr3=_USE_ZARR3, ts_context=context)
    store = ts.open(ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=ocdbt), context=context).result()
    return [np.asarray(store[box].read().result()) for box in boxes]


def _writable(name: str, leaf: jax.Array) -> jax.Array | np.ndarray | None:
    """``leaf`` as orbax can write it from this process alone; ``None`` if it has no shard here."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        # orbax restores one as a key only with its array metadata store, which it does not export.
        raise TypeError(f"state{name}: a typed PRNG key array; keep jax.random.key_data(key) in the state "
                        f"instead (uint32 data, saved and restored bit for bit)")
    if not leaf.addressable_shards:
        return None
    return np.asarray(leaf) if leaf.is_fully_addressable and jax.process_count() > 1 else leaf


def _host_value(name: str, leaf: Any) -> np.ndarray:
    value = np.asarray(leaf)
    if value.dtype.kind in "OSU":
        raise TypeError(f"state{name}: expected an array or a number, got {type(leaf).__name__}")
    return value.astype(jax.dtypes.canonicalize_dtype(value.dtype), copy=False)


def _check_saved(wanted: dict[str, jax.ShapeDtypeStruct], saved: Any, part: str) -> None:
    for name, leaf in wanted.items():
        if name not in saved:
            raise ValueError(
                f"abstract_state{name}: not in {part}, which holds what this process held when saved; "
                f"restore with the processes and the step layout the checkpoint was saved with")
        meta = saved[name]
        if tuple(meta.shape) != tuple(leaf.shape) or np.dtype(meta.dtype) != np.dtype(leaf.dtype):
            raise ValueError(f"abstract_state{name}: expected {leaf.dtype}{list(leaf.shape)}, "
                             f"but the checkpoint holds {np.dtype(meta.dtype)}{list(meta.shape)}")


class _NumpyHandler(ocp.type_handlers.NumpyHandler):
    """orbax's numpy handler, written by the process saving: orbax's writes from process 0 only,
    taking a numpy value for one every process has the same of, but a part here is one process's."""

    async def _background_serialize(self, values: Sequence[np.ndarray], infos: Sequence[Any],
                                     args: Sequence[Any]) -> None:
        writes = []
        for value, info, arg in zip(values, infos, args):
            await info.await_path_creation()
            tspec = ocp.type_handlers.get_json_tspec_write(
                info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape, local_shape=value.shape,
                dtype=value.dtype, process_index=jax.process_index() if info.is_ocdbt_checkpoint else None, arg=arg)
            writes.append(self._open_and_write(value, tspec, info.ts_context))
        await asyncio.gather(*writes)


def _checkpointer() -> ocp.Checkpointer:
    """A synchronous orbax checkpointer of this process's part, run by this process alone."""
    options = ocp.options.MultiprocessingOptions(primary_host=None, active_processes={jax.process_index()})
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(primary_host=None, replica_id=None, use_replica_parallel=False)),
        (np.ndarray, _NumpyHandler()),
    )
    handler = ocp.PyTreeCheckpointHandler(multiprocessing_options=options, type_handler_registry=registry,
                                          use_zarr3=_USE_ZARR3)
    return ocp.Checkpointer(handler, multiprocessing_options=options)
