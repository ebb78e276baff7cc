"""The user's stacked leaves in and out of a step that holds them as per-stage pieces.

The compiler (``passes.pipeline.placing.stacked_leaves``) rewrote the step over the pieces of each
stacked leaf that a scan over layers cut into stages reads in slices, and chose how the user
sees each: a ``StackedArray`` (one array over all its pieces' devices, no copy either way) or
a ``GatheredArray`` (one array on its first piece's mesh; pieces cut there and moved by
planned moves, each step). Here inputs are split and outputs joined as it chose. A leaf that
comes back as the last step returned it is taken as the pieces it was joined from (no work);
another over a ``StackedArray``'s sharding is split into views of its shards; any other (the
first step's, or one the user replaced) is sliced. The handlers of ``SplitStackedLeaves`` and
``JoinStackedLeaves`` run them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from meshpar.passes.program.moves import MoveKey
from meshpar.passes.program.stacked_leaves import GatheredArray, LeafPieces, StackedArray
from meshpar.passes.program.step_instructions import JoinStackedLeaves, SplitStackedLeaves
from meshpar.runtime.coordination import Arrival, owns_a_device_of, senders, wait_arrivals
from meshpar.runtime.placement import put, view
from meshpar.runtime.remote import absent
from meshpar.runtime.step_state import AheadWalk, StepExecutable, StepHandler, StepState

__all__ = ["HANDLERS", "StackedLeaves"]


class StackedLeaves:
    """Splits the user's leaves into the rewritten step's, and joins its outputs back.

    Args:
      pieces: which leaves are split where.
      held, gathered: per split input leaf, how the user sees it (exactly one of the two).
      prepare: the prepared move of a ``MoveKey`` (the executor's).
    """

    def __init__(self, pieces: LeafPieces, held: Mapping[int, StackedArray], gathered: Mapping[int, GatheredArray],
                 prepare: Callable[[MoveKey], Callable[[jax.Array], jax.Array]]) -> None:
        self.pieces, self.held, self.gathered = pieces, held, gathered
        self._into = {i: [None if mv is None else prepare(mv.move_key) for mv in g.into] for i, g in gathered.items()}
        self._out_of = {i: [None if mv is None else prepare(mv.move_key) for mv in g.out_of]
                        for i, g in gathered.items()}
        self._cut = {i: [jax.jit(lambda x, a=a, b=b: x[a:b], out_shardings=s)
                         for (a, b), s in zip(zip(pieces.inputs[i], pieces.inputs[i][1:]), g.at_home)]
                     for i, g in gathered.items()}
        self._concatenate = {i: jax.jit(lambda *parts: jnp.concatenate(parts), out_shardings=g.sharding)
                             for i, g in gathered.items()}
        # Per gathered leaf, the outputs of the rewritten step that are its pieces.
        self._outputs_of = {i: [n for n, (j, p) in enumerate(pieces.piece_outputs())
                                if p is not None and pieces.replaces[j] == i] for i in gathered}
        # The stacked arrays the last step returned (by id, alive) and their pieces.
        self._returned: dict[int, tuple[weakref.ref, list[jax.Array]]] = {}

    def split(self, leaves: Sequence[Any], timeout_s: float) -> list[Any]:
        """``leaves`` (the user's) as the rewritten step takes them: each split leaf as its pieces.

        Raises:
          CoordinationError: pieces other processes send here did not arrive within ``timeout_s``
            (waited for here: a stage reading a piece that never comes would wait without end).
        """
        arrivals: list[Arrival] = []
        out = self._split(leaves, arrivals)
        if arrivals:
            wait_arrivals(arrivals, timeout_s, "stacked pieces", "splitting a step's stacked inputs")
        return out

    def _split(self, leaves: Sequence[Any], arrivals: list[Arrival]) -> list[Any]:
        out: list[Any] = []
        for i, x in enumerate(leaves):
            bounds = self.pieces.inputs[i]
            returned = self._returned.get(id(x))
            if bounds is None:
                out.append(x)
            elif returned is not None and returned[0]() is x:
                # The array the last step returned: its pieces are where the step left them.
                out += returned[1]
            elif i in self.held:
                out += self._split_held(x, bounds, self.held[i])
            else:
                out += self._split_gathered(x, bounds, i, arrivals)
        return out

    def join(self, outputs: Sequence[Any], timeout_s: float) -> list[Any]:
        """The rewritten step's ``outputs`` as the user's: each output in pieces joined as the
        input leaf it replaces is held.

        Raises:
          CoordinationError: pieces other processes send here did not arrive within ``timeout_s``.
        """
        arrivals: list[Arrival] = []
        gathered = {i: self._gather(outputs, i, arrivals) for i in self.gathered}
        if arrivals:
            wait_arrivals(arrivals, timeout_s, "stacked pieces", "joining a step's stacked outputs")
        out: list[Any] = []
        it = iter(outputs)
        self._returned = {}
        for j, bounds in enumerate(self.pieces.outputs):
            if bounds is None:
                out.append(next(it))
                continue
            i = self.pieces.replaces[j]
            parts = [next(it) for _ in range(len(bounds) - 1)]
            joined = (self._join_held(parts, bounds, self.held[i]) if i in self.held
                      else self._join_gathered(gathered[i], bounds, i))
            self._returned[id(joined)] = (weakref.ref(joined), parts)
            out.append(joined)
        return out

    def _gather(self, outputs: Sequence[Any], i: int, arrivals: list[Arrival]) -> list[jax.Array]:
        """The pieces of the output replacing gathered leaf ``i``, moved to its home mesh."""
        moved = []
        for n, move, mv in zip(self._outputs_of[i], self._out_of[i], self.gathered[i].out_of):
            moved.append(outputs[n] if move is None else self._moved(move, outputs[n], mv.what, mv.src, mv.dst,
                                                                     arrivals))
        return moved

    @staticmethod
    def _moved(move: Callable[[jax.Array], jax.Array], value: jax.Array, what: str, src: NamedSharding,
               dst: NamedSharding, arrivals: list[Arrival]) -> jax.Array:
        moved = move(value)
        sending = senders(src)
        if sending and owns_a_device_of(dst.mesh):
            arrivals.append(Arrival(moved, what, sending))
        return moved

    @staticmethod
    def _split_held(x: Any, bounds: tuple[int, ...], stack: StackedArray) -> list[jax.Array]:
        spans = list(zip(bounds, bounds[1:]))
        if isinstance(x, jax.Array) and (x.sharding == stack.sharding
                                         or x.sharding.is_equivalent_to(stack.sharding, x.ndim)):
            return [view(x, s, (b - a, *x.shape[1:])) for (a, b), s in zip(spans, stack.pieces)]
        return [put(x[a:b], s) for (a, b), s in zip(spans, stack.pieces)]

    @staticmethod
    def _join_held(parts: Sequence[jax.Array], bounds: tuple[int, ...], stack: StackedArray) -> jax.Array:
        parts = [put(part, s) for part, s in zip(parts, stack.pieces)]
        shards = [s.data for part in parts for s in part.addressable_shards]
        return jax.make_array_from_single_device_arrays((bounds[-1], *parts[0].shape[1:]), stack.sharding, shards,
                                                        dtype=parts[0].dtype)

    def _split_gathered(self, x: Any, bounds: tuple[int, ...], i: int, arrivals: list[Arrival]) -> list[jax.Array]:
        g = self.gathered[i]
        whole = put(x, g.sharding)
        home = owns_a_device_of(g.sharding.mesh)
        out = []
        for p, (a, b) in enumerate(zip(bounds, bounds[1:])):
            piece = self._cut[i][p](whole) if home else absent((b - a, *whole.shape[1:]), whole.dtype, g.at_home[p])
            move, mv = self._into[i][p], g.into[p]
            out.append(piece if move is None else self._moved(move, piece, mv.what, mv.src, mv.dst, arrivals))
        return out

    def _join_gathered(self, moved: Sequence[jax.Array], bounds: tuple[int, ...], i: int) -> jax.Array:
        g = self.gathered[i]
        if not owns_a_device_of(g.sharding.mesh):
            return absent((bounds[-1], *moved[0].shape[1:]), moved[0].dtype, g.sharding)
        return self._concatenate[i](*moved)


def prepare_split(ex: StepExecutable, ins: SplitStackedLeaves) -> StackedLeaves:
    """The leaves' splitter and joiner, one object (a joined leaf handed back is split into the
    pieces it was joined from), kept as ``ex.stacked_leaves`` for the join."""
    ex.stacked_leaves = StackedLeaves(ins.pieces, dict(ins.held), dict(ins.gathered), ex.move)
    return ex.stacked_leaves


def split_stacked(ex: StepExecutable, ins: SplitStackedLeaves, leaves: StackedLeaves, state: StepState) -> None:
    state.leaves = leaves.split(state.leaves, ex.timeout_s)


def join_stacked(ex: StepExecutable, ins: JoinStackedLeaves, ready: None, state: StepState) -> None:
    state.outputs = ex.stacked_leaves.join(state.outputs, ex.timeout_s)


def split_ahead(walk: AheadWalk, ins: SplitStackedLeaves, ready: Any) -> None:
    walk.leaves = None  # the leaves' pieces: not followed


HANDLERS = {SplitStackedLeaves: StepHandler(split_stacked, prepare_split, split_ahead),
            JoinStackedLeaves: StepHandler(join_stacked)}
