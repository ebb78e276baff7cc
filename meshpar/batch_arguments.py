"""Which arguments of a train step are its batch (``batch_argnums``), checked before tracing.

The batch is cut into micro-batches along dimension 0, so every leaf of every batch argument
must be an array with that one leading dimension. A PRNG key, a scalar, or leaves of several
leading dimensions are never taken as the batch: the error names ``batch_argnums``, what each
argument it points at holds, and which other arguments could be the batch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["batch_size", "check_same_host_batch", "describe_arguments", "host_batch_fingerprint"]


def _is_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    # jax.random.PRNGKey's raw form: two uint32 words.
    return dtype == np.uint32 and tuple(np.shape(x)) == (2,)


def _leading(arg: Any) -> set[int | None]:
    """The leading dimensions of ``arg``'s leaves (``None`` for a scalar)."""
    return {np.shape(x)[0] if np.ndim(x) else None for x in jax.tree.leaves(arg)}


def _could_be_batch(arg: Any) -> bool:
    leaves = jax.tree.leaves(arg)
    dims = _leading(arg)
    return bool(leaves) and len(dims) == 1 and None not in dims and not any(_is_key(x) for x in leaves)


def describe_arguments(args: Sequence[Any]) -> str:
    """Each argument's leading dimensions, for messages:
    ``argument 0: leading dimensions [4, 16]; argument 1: a PRNG key; ...``."""
    def one(i: int, arg: Any) -> str:
        leaves = jax.tree.leaves(arg)
        if len(leaves) == 1 and _is_key(leaves[0]):
            return f"argument {i}: a PRNG key"
        dims = sorted(_leading(arg), key=lambda d: -1 if d is None else d)
        return f"argument {i}: leading dimensions {['scalar' if d is None else d for d in dims] or 'none (no arrays)'}"
    return "; ".join(one(i, a) for i, a in enumerate(args))


def _suggestion(args: Sequence[Any], batch_argnums: Sequence[int]) -> str:
    candidates = [i for i, a in enumerate(args) if i not in batch_argnums and _could_be_batch(a)]
    if not candidates:
        return "pass batch_argnums naming the arguments that hold the batch"
    return f"if the batch is argument {candidates[-1]}, pass batch_argnums=({candidates[-1]},)"


def batch_size(args: Sequence[Any], batch_argnums: Sequence[int]) -> int:
    """The batch size: the one leading dimension of every leaf of the arguments ``batch_argnums``.

    Raises:
      ValueError: naming ``batch_argnums``: not a non-empty sequence of non-negative integers,
        a position beyond the arguments, or an argument
        that cannot be the batch (a PRNG key, a scalar, no arrays, leaves of several leading
        dimensions), with what each argument holds and a likely fix.
    """
    if (isinstance(batch_argnums, (str, bytes)) or not isinstance(batch_argnums, Sequence) or not batch_argnums
            or not all(isinstance(a, int) and not isinstance(a, bool) and a >= 0 for a in batch_argnums)):
        raise ValueError(f"batch_argnums: expected a non-empty sequence of non-negative integers (the positions "
                         f"of the batch arguments), got {batch_argnums!r}; e.g. batch_argnums=(1,)")
    where = f"batch_argnums={tuple(batch_argnums)}"
    if max(batch_argnums) >= len(args):
        raise ValueError(f"batch_argnums: {where} for a step called with {len(args)} arguments; "
                         f"{_suggestion(args, ())}")
    for i in batch_argnums:
        leaves = jax.tree.leaves(args[i])
        if any(_is_key(x) for x in leaves):
            raise ValueError(f"batch_argnums: {where} takes argument {i} as the batch, but it holds a PRNG key, "
                             f"which is never cut into micro-batches; {_suggestion(args, batch_argnums)} "
                             f"({describe_arguments(args)})")
        if not _could_be_batch(args[i]):
            raise ValueError(f"batch_argnums: {where} takes argument {i} as the batch, but its leaves have "
                             f"leading dimensions {sorted(_leading(args[i]), key=str)}, not one shared batch "
                             f"dimension; {_suggestion(args, batch_argnums)} ({describe_arguments(args)})")
    sizes = {d for i in batch_argnums for d in _leading(args[i])}
    if len(sizes) != 1:
        raise ValueError(f"batch_argnums: {where}: the batch arguments have leading dimensions {sorted(sizes)}; "
                         f"expected one shared batch dimension ({describe_arguments(args)})")
    return int(sizes.pop())


def host_batch_fingerprint(args: Sequence[Any], batch_argnums: Sequence[int]) -> list[str]:
    """Per batch leaf held as host data (numpy, lists: not a ``jax.Array``), in order, a hash of
    its shape, dtype and bytes (``""`` for a ``jax.Array`` leaf: JAX checks those itself)."""
    out = []
    for i in batch_argnums:
        for leaf in jax.tree.leaves(args[i]):
            if isinstance(leaf, jax.Array):
                out.append("")
                continue
            host = np.ascontiguousarray(leaf)
            digest = hashlib.blake2b(host.view(np.uint8).reshape(-1) if host.size else b"", digest_size=16)
            out.append(f"{host.shape} {host.dtype} {digest.hexdigest()}")
    return out


def check_same_host_batch(args: Sequence[Any], batch_argnums: Sequence[int], timeout_s: float) -> None:
    """With several processes: raises naming ``batch_argnums`` when processes passed different
    host (numpy) batches. JAX's rule is one global value on every process; rows each process
    loaded for itself belong in a global ``jax.Array`` (``jax.make_array_from_process_local_data``).

    Raises:
      ValueError: processes passed different host batches (naming which leaves).
      CoordinationError: a process did not reach the same call within ``timeout_s``.
    """
    from meshpar.runtime.coordination import CoordinationError, agree

    if jax.process_count() == 1:
        return
    mine = host_batch_fingerprint(args, batch_argnums)
    try:
        agree("batch/host", {"leaves": mine}, list(range(jax.process_count())), timeout_s=timeout_s,
              what="the host batch")
    except CoordinationError as e:
        if "disagree" not in str(e):
            raise
        raise ValueError(
            f"batch_argnums={tuple(batch_argnums)}: the processes passed different numpy batches. A numpy batch "
            f"must be the same global batch on every process (as under jax.jit); to feed each process its own "
            f"rows, build the global batch with jax.make_array_from_process_local_data(sharding, local_rows, "
            f"global_shape) and pass that jax.Array. ({e})") from None
