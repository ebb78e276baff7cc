"""A stage's compute parts (``passes.program.stage_kernel.StageParts``) as jitted functions on its mesh.

The functions take operands grouped as the program's buffers hold them:

- ``forward(fixed, batch, acts) -> (outputs, residuals)``: ``fixed`` are the
  stage's per-step operands (``StageKernel.fixed_operands``), ``batch`` its
  micro-batch slices (``StageKernel.batch_operands``), ``acts`` its received
  activations in ``StageIO.in_edges`` order;
- ``backward(residuals, cotangents, grads) -> (input_cotangents, grads)``:
  ``cotangents`` as ``StageIO.cotangent_edges`` lists them; each output's are
  summed, and the loss output's seeded with the loss reduction's weight
  (``1 / num_micro_batches`` for a mean, 1 for a sum); ``input_cotangents``
  as ``StageIO.cotangent_in_edges`` lists them;
  ``grads`` (donated) gain this micro-batch's parameter cotangents;
- ``backward_input(residuals, cotangents) -> (input_cotangents, computed)``:
  the weight pass's state is ``weight_state(residuals, computed)``: residuals
  it reads are passed on as they are, since a jitted function that returns
  an input copies it (JAX 0.10);
- ``backward_weight(weight_state, grads) -> grads``.

Activations and outputs are in wire format (``passes.program.wire_format``: keys as key data).

A stage run as data-parallel replicas (``passes.program.stage_kernel.StageReplicas``) keeps
these signatures at the micro-batch's shapes: inside, its per-replica parts run as a
``shard_map`` over the data axis, each device on its replica's block of the micro-batch, so
each replica's parameter cotangents stay its own partial sums.
Residuals and weight state are led by the replica count, and so are ``grads``
(``(D, *param)``, reduced once per step by the mesh's ``ReduceGradients``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from meshpar.passes import jax_ir
from meshpar.passes.program.stage_kernel import StageKernel, StageReplicas
from meshpar.passes.program.wire_format import from_wire, to_wire
from meshpar.runtime.coordination import LaunchRendezvous, raise_lost_collective_peer, wait_ready
from meshpar.passes.program.flat_values import flatten, unflatten

__all__ = ["StageExecutables", "compile_stage", "on_mesh", "runs_alone"]


def runs_alone(mesh: Mesh) -> bool:
    """Whether a program on ``mesh`` must finish before this process launches the next one.

    True on CPU meshes spanning processes. XLA:CPU runs cross-process collectives through gloo
    with one tag for every collective of a communicator (``GlooCommunicator``: "how to do
    tags?"), and it orders only the launches of programs with collectives, not their runs: two
    such programs running at once on one process pair their messages in whichever order each
    process's threads reach them. Processes that pair them differently hang, one of them inside
    an all-reduce its peer already finished (caught with gdb in the four-process test), or sum
    the wrong values when the sizes agree. NCCL orders a communicator's collectives on its
    stream, so GPU meshes keep their launches in flight.
    """
    devices = list(mesh.devices.flat)
    return devices[0].platform == "cpu" and len({d.process_index for d in devices}) > 1


def on_mesh(fn: Callable, mesh: Mesh, timeout_s: float) -> Callable:
    """``fn`` traced with ``mesh`` in context: bare ``PartitionSpec`` constraints in the user's
    step resolve to the stage's own mesh. Where ``runs_alone(mesh)``, each call first meets the
    mesh's other processes on the host (``LaunchRendezvous``: no device thread waits in a
    collective for a peer that is not ready to launch it) and returns once its program has
    finished (each wait at most ``timeout_s``, then ``CoordinationError`` naming the late process).
    ``run.temp_bytes(*args)`` is the bytes per device the compiled program for ``args`` needs
    besides its arguments and results (XLA's memory analysis; compiled once more for it, so
    for measurements only)."""
    alone = runs_alone(mesh)
    where = f"mesh {dict(mesh.shape)} of devices {[d.id for d in mesh.devices.flat]}"
    # The other processes its collectives run with: a failure in them names these (a killed
    # peer fails gloo's collectives at once; without this the step raised gloo's bare error).
    peers = tuple(sorted({d.process_index for d in mesh.devices.flat} - {jax.process_index()}))
    waiting = f"a program on {where} finishing before the next launch (its collectives run with " \
              f"process{'es' if len(peers) > 1 else ''} {', '.join(map(str, peers))})"
    rendezvous = _rendezvous(mesh, peers, timeout_s, where) if alone else None

    def run(*args):
        if rendezvous is not None:
            rendezvous.meet()
        try:
            with jax.set_mesh(mesh):
                out = fn(*args)
            if alone:
                wait_ready(jax.tree.leaves(out), timeout_s, waiting)
        except jax.errors.JaxRuntimeError as e:
            if peers:
                raise_lost_collective_peer(e, peers, f"a program on {where}")
            raise
        return out

    def temp_bytes(*args) -> int:
        with jax.set_mesh(mesh):
            return int(fn.lower(*args).compile().memory_analysis().temp_size_in_bytes)

    # The jitted function itself (for compiled_count, and to be traced inside a program that
    # enters the mesh itself: a fused run of passes), and the mesh.
    run.jitted, run.mesh, run.temp_bytes = fn, mesh, temp_bytes  # type: ignore[attr-defined]
    return run


# One rendezvous per mesh (by its devices) and timeout: every program launched on a mesh counts
# its meetings, whichever executable launched it.
_rendezvous_of: dict[tuple, LaunchRendezvous] = {}


def _rendezvous(mesh: Mesh, peers: tuple[int, ...], timeout_s: float, where: str) -> LaunchRendezvous:
    ids = tuple(d.id for d in mesh.devices.flat)
    if ids not in _rendezvous_of:
        _rendezvous_of[ids] = LaunchRendezvous("-".join(map(str, ids)), peers, timeout_s, where)
    return _rendezvous_of[ids]


@dataclasses.dataclass(frozen=True)
class StageExecutables:
    forward: Callable
    backward: Callable
    backward_input: Callable
    backward_weight: Callable
    # Per weight-state value, the residual it is, or None; None for all: the input pass returns
    # the whole state (packed).
    state_from_residual: tuple[int | None, ...] | None

    def weight_state(self, residuals: Sequence[jax.Array], computed: Sequence[jax.Array]) -> list[jax.Array]:
        """The weight pass's operands: passed-on residuals and what the input pass computed."""
        if self.state_from_residual is None:
            return list(computed)
        rest = iter(computed)
        return [next(rest) if k is None else residuals[k] for k in self.state_from_residual]

    def traceable(self) -> StageExecutables:
        """The same functions without entering the mesh: to be called while a program that
        entered it is traced (``jax.set_mesh`` cannot be entered inside ``jax.jit``)."""
        return dataclasses.replace(self, forward=self.forward.jitted, backward=self.backward.jitted,
                                   backward_input=self.backward_input.jitted,
                                   backward_weight=self.backward_weight.jitted)

    @property
    def mesh(self) -> Mesh:
        """The stage's mesh."""
        return self.forward.mesh

    def compiled_count(self) -> int:
        """Executables compiled so far (constant across steps once the first has run)."""
        return sum(jax_ir.compiled_count(f.jitted)
                   for f in (self.forward, self.backward, self.backward_input, self.backward_weight))


def compile_stage(kernel: StageKernel, timeout_s: float) -> StageExecutables:
    """Jits a stage's kernel (its parts, on its mesh; ``on_mesh`` with ``timeout_s``); outputs and input cotangents are
    constrained to the shardings their transfers expect, accumulated gradients to their
    accumulators' (so every micro-batch's pass reads them as the first did, and compiles
    once). With ``accumulation.replicas``, its parts are a replica's, run side by side (module
    doc), and the loss seed is the replicas'."""
    parts, io = kernel.parts, kernel.io
    output_shardings, input_cotangent_shardings = kernel.output_shardings, kernel.input_cotangent_shardings
    mesh, loss_seed, accumulation = kernel.mesh, kernel.loss_seed, kernel.accumulation
    replicas = accumulation.replicas if accumulation is not None else None
    accumulators = [a.sharding for a in accumulation.accumulators] if accumulation is not None else None
    if replicas is not None:
        loss_seed = replicas.loss_seed
    split = _Replication(replicas, mesh)
    fixed_pos = [o.position for o in kernel.fixed_operands]
    batch_pos = [o.position for o in kernel.batch_operands]
    act_pos = list(kernel.act_inputs)
    out_avals = kernel.out_avals
    forward_fn = jax_ir.staged_fun(parts.forward)
    backward_fn = jax_ir.staged_fun(parts.backward)
    input_fn = jax_ir.staged_fun(parts.backward_input)
    weight_fn = jax_ir.staged_fun(parts.backward_weight)
    num_acts = parts.num_act_cotangents
    in_avals = kernel.in_avals
    state_from_residual = tuple(
        k if k is not None and k < parts.num_residuals else None for k in parts.forwarded_state)
    # On a mesh of one device the small residuals and weight state travel packed: a program's
    # outputs each cost the host about 2 us (a small GPT stage's forward has 155), one flat
    # array per dtype costs it one. Large ones stay apart (copying them costs more: packing
    # every residual made a medium GPT's step 1.8x slower). On larger meshes they are sharded
    # as XLA chose: left alone.
    residuals = _Packing(parts.forward.out_avals[parts.num_outputs:]) if _packs(mesh, replicas) else None
    state = _Packing(parts.backward_input.out_avals[num_acts:]) if residuals is not None else None
    if state is not None:
        state_from_residual = None

    def forward(fixed, batch, acts):
        args = [None] * len(in_avals)
        for group, positions in ((fixed, fixed_pos), (batch, batch_pos), (acts, act_pos)):
            for value, k in zip(group, positions):
                args[k] = value
        for k in act_pos:
            args[k] = from_wire(args[k], in_avals[k])
        positions = (*parts.diff_inputs, *parts.other_inputs)
        values, axes = zip(*(split.input(args[k], k) for k in positions)) if positions else ((), ())
        outs = split.map(forward_fn, list(axes), [*map(split.output_axis, range(parts.num_outputs)),
                                                  *[STACKED] * parts.num_residuals])(*values)
        results = [to_wire(o) if split.stacked(k) else jax.lax.with_sharding_constraint(to_wire(o), s)
                   for k, (o, s) in enumerate(zip(outs[: parts.num_outputs], output_shardings))]
        kept = list(outs[parts.num_outputs :])
        return results, kept if residuals is None else residuals.pack(kept)

    # The received cotangents meet the replicas as their outputs left them.
    cotangent_axes = [split.output_axis(slot) for slot in parts.diff_outputs for e in io.out_edges[slot]
                      if e not in io.no_cotangent]

    def output_cotangents(cotangents):
        flat = iter(cotangents)
        out = []
        for slot in parts.diff_outputs:
            terms = [next(flat) for _ in io.out_edges[slot]]
            if slot == io.loss_slot:
                terms.append(jnp.full((), loss_seed, out_avals[slot].dtype))
            total = terms[0]
            for t in terms[1:]:
                total = total + t
            out.append(total)
        return out

    act_axes = [split.input_axis(k) for k in parts.act_inputs]

    def constrain(input_cts):
        return [jax.lax.with_sharding_constraint(c, s) for c, s in zip(input_cts, input_cotangent_shardings)]

    def accumulate(grads, cts):
        # Narrower cotangents (bfloat16) add into wider accumulators (data_replicas.accumulation_dtype).
        sums = [g + c.astype(g.dtype) for g, c in zip(grads, cts)]
        if accumulators is None:
            return sums
        return [jax.lax.with_sharding_constraint(g, sh) for g, sh in zip(sums, accumulators)]

    def backward(kept, cotangents, grads):
        kept = kept if residuals is None else residuals.unpack(kept)
        outs = split.map(lambda r, c: backward_fn(*r, *output_cotangents(c)), [STACKED, cotangent_axes],
                         [*act_axes, *[STACKED] * parts.num_param_cotangents])(kept, cotangents)
        return constrain(outs[:num_acts]), accumulate(grads, outs[num_acts:])

    def backward_input(kept, cotangents):
        kept = kept if residuals is None else residuals.unpack(kept)
        outs = split.map(lambda r, c: input_fn(*r, *output_cotangents(c)), [STACKED, cotangent_axes],
                         [*act_axes, *[STACKED] * parts.num_weight_state])(kept, cotangents)
        computed = outs[num_acts:]
        if state is not None:
            return constrain(outs[:num_acts]), state.pack(list(computed))
        return constrain(outs[:num_acts]), [v for v, k in zip(computed, state_from_residual) if k is None]

    def backward_weight(weight_state, grads):
        weight_state = weight_state if state is None else state.unpack(weight_state)
        return accumulate(grads, split.map(lambda w: weight_fn(*w), [STACKED],
                                           [STACKED] * parts.num_param_cotangents)(weight_state))

    # The shardings the compiler fixed are declared as the programs' own (``None``: as XLA lays
    # it out), so a program reading them compiles ahead without waiting for its producer's
    # compile (``compile_ahead.AheadOfTime``); the constraints above stay for the replicas' map.
    declared_outputs = [None if split.stacked(k) else s for k, s in enumerate(output_shardings)]
    declared_cotangents = list(input_cotangent_shardings)
    return StageExecutables(
        on_mesh(jax.jit(forward, out_shardings=(declared_outputs, None)), mesh, timeout_s),
        on_mesh(jax.jit(backward, donate_argnums=(2,), out_shardings=(declared_cotangents, accumulators)), mesh,
                timeout_s),
        on_mesh(jax.jit(backward_input, out_shardings=(declared_cotangents, None)), mesh, timeout_s),
        on_mesh(jax.jit(backward_weight, donate_argnums=(1,), out_shardings=accumulators), mesh, timeout_s),
        state_from_residual,
    )


def _packs(mesh: Mesh, replicas: StageReplicas | None) -> bool:
    """Whether a stage on ``mesh`` passes its residuals packed (``_Packing``)."""
    return mesh.devices.size == 1 and replicas is None


# The largest value ``_Packing`` copies into a flat array: about what a CPU copies in the 2 us
# a separate output costs the host (measured: packing every residual of a medium GPT, 64 KiB
# to 2 MiB each, cost 300 ms a step; packing those of the tiny GPT saved 10 ms).
PACK_MAX_BYTES = 16 * 1024


class _Packing:
    """Values of the avals ``avals`` carried as one flat array per dtype, in order of first
    appearance (those of at most ``PACK_MAX_BYTES``), then the others (larger ones, and those
    of extended dtypes: keys) as they are."""

    def __init__(self, avals: Sequence[Any]) -> None:
        self.avals = tuple(avals)
        plain = [k for k, a in enumerate(self.avals) if not jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended)
                 and math.prod(a.shape) * a.dtype.itemsize <= PACK_MAX_BYTES]
        self.groups: dict[Any, list[int]] = {}
        for k in plain:
            self.groups.setdefault(self.avals[k].dtype, []).append(k)
        self.loose = [k for k in range(len(self.avals)) if k not in plain]

    def pack(self, values: Sequence[jax.Array]) -> list[jax.Array]:
        flat = [flatten([values[k] for k in group]) for group in self.groups.values()]
        return [*flat, *(values[k] for k in self.loose)]

    def unpack(self, packed: Sequence[jax.Array]) -> list[jax.Array]:
        values: list[Any] = [None] * len(self.avals)
        for flat, group in zip(packed, self.groups.values()):
            for k, value in zip(group, unflatten(flat, [self.avals[k] for k in group])):
                values[k] = value
        for value, k in zip(packed[len(self.groups):], self.loose):
            values[k] = value
        return values


class _Stacked:
    """A value the replicas hold one each of, led by the replica count (residuals, weight
    state, accumulated gradients, keys folded per replica)."""


STACKED = _Stacked()
# How a value meets the replicas: ``None`` every replica reads it whole, an ``int`` it splits
# along that dimension into the replicas' contiguous blocks (replica r the r-th), or STACKED.
Axis = Union[int, None, _Stacked]


class _Replication:
    """How a stage's values meet its replicas (``StageReplicas``); with none, the identity.

    The replicas run as a ``shard_map`` over the data axis only (each device computing its
    replica on its block; the other mesh axes stay automatic, so tensor parallelism inside a
    replica is partitioned as before), not as a ``vmap``: batching would rewrite every
    convolution of a backward into a grouped one, which XLA's SPMD partitioner (JAX 0.10)
    miscompiles once the groups are sharded.
    """

    def __init__(self, replicas: StageReplicas | None, mesh: Mesh) -> None:
        self.replicas, self.mesh = replicas, mesh

    def _spec(self, axis: Axis) -> P:
        if axis is None:
            return P()
        if isinstance(axis, _Stacked):
            return P(self.replicas.axis)
        return P(*[None] * axis, self.replicas.axis)

    def map(self, fn: Callable, in_axes: Sequence[Axis | Sequence[Axis]], out_axes: Sequence[Axis]) -> Callable:
        """``fn`` run per replica, or ``fn`` itself: argument ``i`` meets the replicas as
        ``in_axes[i]`` (one axis for all its leaves, or one per element of a list argument),
        output ``j`` as ``out_axes[j]``."""
        if self.replicas is None:
            return fn

        def mapped(*args):
            leaves, tree = jax.tree.flatten(list(args))
            axes = [a for arg, axis in zip(args, in_axes) for a in _leaf_axes(arg, axis)]

            def body(*blocks):
                blocks = [b[0] if isinstance(a, _Stacked) else b for b, a in zip(blocks, axes)]
                outs = fn(*jax.tree.unflatten(tree, blocks))
                return [o[None] if isinstance(a, _Stacked) else o for o, a in zip(outs, out_axes)]

            return jax.shard_map(body, mesh=self.mesh, in_specs=tuple(self._spec(a) for a in axes),
                                 out_specs=[self._spec(a) for a in out_axes], axis_names={self.replicas.axis},
                                 check_vma=False)(*leaves)

        return mapped

    def input_axis(self, k: int) -> Axis:
        """How stage input ``k`` meets the replicas (keys folded per replica are stacked)."""
        if self.replicas is None:
            return None
        return STACKED if k in self.replicas.folded_keys else self.replicas.input_dims[k]

    def output_axis(self, slot: int) -> Axis:
        """How output ``slot`` leaves the replicas: split along its dimension, else one per replica."""
        if self.replicas is None:
            return None
        return STACKED if self.replicas.per_replica(slot) else self.replicas.output_dims[slot]

    def input(self, x: jax.Array, k: int) -> tuple[jax.Array, Axis]:
        """Stage input ``k`` as the replicas read it, and how."""
        if self.replicas is not None and k in self.replicas.folded_keys:
            # Replicas are micro-batches side by side: each draws from its own fold of the key.
            return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(x, jnp.arange(self.replicas.count)), STACKED
        return x, self.input_axis(k)

    def stacked(self, slot: int) -> bool:
        """Whether output ``slot`` leaves one value per replica (the loss, an aux value): the step
        combines them with the micro-batches' (``CombineMicroBatches``), so no forward waits on
        the other replicas' devices."""
        return self.replicas is not None and self.replicas.per_replica(slot)


def _leaf_axes(arg: Any, axis: Axis | Sequence[Axis]) -> list[Axis]:
    """Per leaf of ``arg``, its axis: ``axis`` for all, or per element of a list argument."""
    if isinstance(axis, (list, tuple)):
        return [a for element, ax in zip(arg, axis) for a in _leaf_axes(element, ax)]
    return [axis] * len(jax.tree.leaves(arg))
