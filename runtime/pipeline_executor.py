"""Runs a compiled pipeline: stage executables, cross-mesh transfers, gradient
accumulation and the per-mesh update, in the schedule's launch order.

Every process runs the same loop over the same launch order (multi-
controller); work for meshes a process does not own is skipped, and every
process calls every cross-mesh move (p2p moves need that; the others skip
themselves where they have no part). Each move was chosen and prepared when
the pipeline compiled (``passes.edge_transfer``): ``jax.device_put`` inside
one process, asynchronous point-to-point moves across processes. Launches
are asynchronous, so stages on different meshes, and the moves between
them, overlap as the schedule allows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.apply_split import ApplySplit, OuterRef
from meshpar.passes.edge_transfer import TransferKind, choose_transfer
from meshpar.passes.mesh_assignment import batch_sharding, param_sharding
from meshpar.passes.pipeline_schedule import PipelineSchedule, Task
from meshpar.passes.stage_graph import Ref, StageGraph
from meshpar.runtime.coordination import wait_ready
from meshpar.runtime.remote import absent

__all__ = ["Placement", "PipelineExecutable", "PrepareMove"]

# (kind, shape, dtype, src, dst) -> a callable moving such a value from src to dst.
PrepareMove = Callable[[TransferKind, tuple, Any, NamedSharding, NamedSharding], Callable[[jax.Array], jax.Array]]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a step input or output leaf lives: one sharding per mesh it is on.

    A leaf on several meshes is one array replicated over all their devices.
    """

    shardings: tuple[NamedSharding, ...]
    meshes: tuple[int, ...]

    def on(self, mesh: int) -> NamedSharding:
        return self.shardings[self.meshes.index(mesh)]


def _union_sharding(shardings: Sequence[NamedSharding]) -> NamedSharding:
    devices = [d for s in shardings for d in s.mesh.devices.flat]
    return NamedSharding(Mesh(np.array(devices), ("union",)), P())


def _fits(x: Any, sharding: NamedSharding) -> bool:
    return isinstance(x, jax.Array) and x.sharding == sharding


def _put(value: Any, sharding: NamedSharding) -> jax.Array:
    """``value`` (host data, or an array anywhere) placed with ``sharding``, in any process."""
    if _fits(value, sharding):
        return value
    if isinstance(value, jax.Array) and value.is_fully_addressable and jax.process_count() == 1:
        return jax.device_put(value, sharding)
    host = np.asarray(value)
    host = host.astype(jax.dtypes.canonicalize_dtype(host.dtype), copy=False)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index], dtype=host.dtype)


def _view(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    """The part of a union-replicated array that lives on ``sharding``'s mesh, without copies."""
    wanted = {d.id for d in sharding.mesh.devices.flat}
    shards = [s.data for s in x.addressable_shards if s.device.id in wanted]
    return jax.make_array_from_single_device_arrays(x.shape, sharding, shards, dtype=x.dtype)


def _absent(aval: Any, sharding: NamedSharding) -> jax.Array:
    """What this process holds of a value computed on a mesh it does not own."""
    return absent(aval.shape, aval.dtype, sharding)


def _join(parts: Sequence[jax.Array], shardings: Sequence[NamedSharding]) -> jax.Array:
    """Per-mesh replicated copies of one value, as one array over all their devices."""
    union = _union_sharding(shardings)
    shards = [s.data for x in parts for s in x.addressable_shards]
    return jax.make_array_from_single_device_arrays(parts[0].shape, union, shards, dtype=parts[0].dtype)


def _on_mesh(fn: Callable, mesh: Mesh) -> Callable:
    """``fn`` traced with ``mesh`` in context: bare ``PartitionSpec`` constraints in the user's
    step resolve to the stage's own mesh."""

    def run(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    run._cache_size = fn._cache_size  # type: ignore[attr-defined]
    return run


class PipelineExecutable:
    """A traced, split and scheduled train step, ready to run.

    Args:
      graph: forward stages of the loss.
      split: the gradient equation's operands and the per-mesh update.
      schedule: launch order and per-mesh instruction lists.
      meshes: one mesh per stage.
      in_placements: where each flattened step input leaf lives.
      out_placements: where each flattened step output leaf should live
        (``None``: where it is computed).
      batch_inputs: loss operand indices that are batch leaves (cut into
        micro-batches along dimension 0).
      num_micro_batches: micro-batches per step.
      prepare_move: builds each cross-mesh move once, at construction.
      executor: ``"auto"``, ``"p2p"`` or ``"collective"``
        (``passes.edge_transfer.choose_transfer``).
      strategy: the resharding strategy (``"signal"`` selects one-byte moves).
      out_tree: the step's output treedef.
      out_avals: the step's output shapes and dtypes.
      timeout_s: how long a process waits, at the end of a step, for values
        other processes send it (multi-process runs only).
    """

    def __init__(
        self,
        graph: StageGraph,
        split: ApplySplit,
        schedule: PipelineSchedule,
        meshes: Sequence[Mesh],
        in_placements: Sequence[Placement],
        out_placements: Sequence[Placement | None],
        batch_inputs: frozenset[int],
        num_micro_batches: int,
        micro_batch_size: int,
        prepare_move: PrepareMove,
        executor: str,
        out_tree: Any,
        out_avals: Sequence[Any],
        timeout_s: float = 120.0,
        strategy: str = "broadcast",
    ) -> None:
        self.graph, self.split, self.schedule = graph, split, schedule
        self.meshes = tuple(meshes)
        self.in_placements = tuple(in_placements)
        self.out_placements = tuple(out_placements)
        self.batch_inputs = batch_inputs
        self.num_micro_batches = num_micro_batches
        self.micro_batch_size = micro_batch_size
        self._prepare_move, self.executor, self.timeout_s = prepare_move, executor, timeout_s
        self.strategy = strategy
        self._moves: dict[tuple, Callable[[jax.Array], jax.Array]] = {}
        self.move_kinds: dict[tuple, TransferKind] = {}
        self.out_tree = out_tree
        self.out_avals = tuple(out_avals)
        self.edges = graph.edges()
        me = jax.process_index()
        # Stages whose mesh has a device here; the rest are skipped, except
        # that this process still joins transfers touching its devices.
        self.local = [any(d.process_index == me for d in m.devices.flat) for m in self.meshes]
        self._stage_fns = [self._compile_stage(s) for s in graph.stages]
        self._apply_fns = {a.mesh: self._compile_apply(a) for a in split.stages}
        self._frees = self._free_lists()
        # Per stage, the most micro-batches whose forward residuals were alive
        # at once during the last step (what the schedule costs in memory);
        # 0 for stages on meshes of other processes.
        self.peak_live_activations: list[int] = [0] * graph.num_stages
        # Every boundary value's move, both ways, prepared now: nothing is
        # planned, compiled or looked up by sharding on the hot path.
        self._edge_moves = []
        for p, c, ref in self.edges:
            aval = graph.stages[p].jaxpr.out_avals[ref.slot]
            forward = self._move(aval, self.act_sharding(ref, p), self.act_sharding(ref, c))
            backward = self._move(aval, self.act_sharding(ref, c), self.act_sharding(ref, p))
            self._edge_moves.append((forward, backward))

    def _move(self, aval: Any, src: NamedSharding, dst: NamedSharding) -> Callable[[jax.Array], jax.Array]:
        """The prepared move of an ``aval`` value from ``src`` to ``dst`` (made on first request)."""
        key = (tuple(aval.shape), np.dtype(aval.dtype), src, dst)
        if key not in self._moves:
            processes = [d.process_index for s in (src, dst) for d in s.mesh.devices.flat]
            kind = choose_transfer(self.executor, processes, len(aval.shape), self.strategy)
            self.move_kinds[key] = kind
            self._moves[key] = self._prepare_move(kind, tuple(aval.shape), aval.dtype, src, dst)
        return self._moves[key]

    # -- shardings ------------------------------------------------------------

    def act_sharding(self, ref: Ref, mesh: int) -> NamedSharding:
        """Sharding of an activation (or its cotangent) on ``mesh``."""
        aval = self.graph.stages[ref.index].jaxpr.out_avals[ref.slot]
        return batch_sharding(self.meshes[mesh], aval.shape, self.micro_batch_size)

    def input_sharding(self, ref: Ref, stage: int) -> NamedSharding:
        """Sharding of a loss operand (parameter or input) on ``stage``'s mesh."""
        if ref.kind == "param":
            leaf = self.split.param_inputs[ref.index]
            placement = self.in_placements[leaf]
            if stage in placement.meshes:
                return placement.on(stage)
            owner = placement.meshes[0]
            spec = placement.on(owner).spec
            aval = self.graph.stages[stage].jaxpr.in_avals[self.graph.stages[stage].inputs.index(ref)]
            return param_sharding(self.meshes[stage], spec, aval.shape)
        aval = self.graph.stages[stage].jaxpr.in_avals[self.graph.stages[stage].inputs.index(ref)]
        if ref.index in self.batch_inputs:
            return batch_sharding(self.meshes[stage], aval.shape, self.micro_batch_size)
        return NamedSharding(self.meshes[stage], P())

    # -- compilation ------------------------------------------------------------

    def _compile_stage(self, stage) -> tuple[Callable, Callable]:
        fn = core.jaxpr_as_fun(stage.jaxpr)
        diff = [k for k, r in enumerate(stage.inputs) if r.kind in ("param", "act")]
        out_shardings = [self.act_sharding(r, stage.index) for r in stage.outputs]

        def forward(diff_args, other_args):
            def f(d):
                args = list(other_args)
                for k, v in zip(diff, d):
                    args.insert(k, v)
                return fn(*args)

            outs, vjp = jax.vjp(f, list(diff_args))
            outs = [jax.lax.with_sharding_constraint(o, s) for o, s in zip(outs, out_shardings)]
            return outs, vjp

        def backward(vjp, cotangents, grads):
            (d_args,) = vjp(list(cotangents))
            param_slots = [j for j, k in enumerate(diff) if stage.inputs[k].kind == "param"]
            act_slots = [j for j, k in enumerate(diff) if stage.inputs[k].kind == "act"]
            new_grads = [g + d_args[j] for g, j in zip(grads, param_slots)]
            return [d_args[j] for j in act_slots], new_grads

        return _on_mesh(jax.jit(forward), self.meshes[stage.index]), _on_mesh(
            jax.jit(backward, donate_argnums=(2,)), self.meshes[stage.index]
        )

    def _compile_apply(self, apply) -> Callable:
        fn = core.jaxpr_as_fun(apply.jaxpr)
        targets = [self.out_placements[j] for j in apply.outputs]

        def run(*args):
            outs = fn(*args)
            return [
                o if t is None or apply.mesh not in t.meshes else jax.lax.with_sharding_constraint(o, t.on(apply.mesh))
                for o, t in zip(outs, targets)
            ]

        return _on_mesh(jax.jit(run), self.meshes[apply.mesh])

    def _param_aval(self, stage, k: int) -> Any:
        return stage.jaxpr.in_avals[stage.inputs.index(Ref("param", k))]

    def _output_elsewhere(self, j: int, parts: dict[int, jax.Array]) -> jax.Array:
        """Output ``j`` when some of the meshes computing it belong to other processes."""
        meshes = self.split.producers[j]
        placement = self.out_placements[j]
        shardings = [placement.on(m) if placement and m in placement.meshes else NamedSharding(self.meshes[m], P())
                     for m in meshes]
        if len(meshes) == 1:
            return _absent(self.out_avals[j], shardings[0])
        union = _union_sharding(shardings)
        shards = [s.data for x in parts.values() for s in x.addressable_shards]
        return jax.make_array_from_single_device_arrays(self.out_avals[j].shape, union, shards, dtype=self.out_avals[j].dtype)

    def _free_lists(self) -> dict[Task, list[str]]:
        """Buffers to drop after each task, from every mesh's instruction list."""
        out: dict[Task, list[str]] = {}
        for instructions in self.schedule.per_mesh:
            last = None
            for ins in instructions:
                if ins.op == "free":
                    out.setdefault(last, []).append(ins.buffer)
                else:
                    last = ins.task
        return out

    # -- execution ------------------------------------------------------------

    def _place_inputs(self, leaves: Sequence[Any]) -> list[dict[int, jax.Array]]:
        """Per input leaf, its array on each mesh it is needed on (none for a batch leaf
        only read per micro-batch)."""
        placed = []
        for value, placement in zip(leaves, self.in_placements):
            if not placement.meshes:
                placed.append({})
            elif len(placement.meshes) == 1:
                (m,) = placement.meshes
                placed.append({m: _put(value, placement.shardings[0])})
            else:
                union = _put(value, _union_sharding(placement.shardings))
                placed.append({m: _view(union, placement.on(m)) for m in placement.meshes})
        return placed

    def __call__(self, leaves: Sequence[Any]) -> list[Any]:
        graph, split, M = self.graph, self.split, self.num_micro_batches
        placed = self._place_inputs(leaves)
        consts = split.consts
        # Micro-batches go from where the batch is straight to the stage that
        # reads them: host data is converted once per step, an array already on
        # devices is sliced there, never pulled to the host.
        batch = {}
        for k in self.batch_inputs:
            leaf = split.loss_inputs[k].index
            value = leaves[leaf]
            on_devices = isinstance(value, jax.Array) and value.is_fully_addressable and jax.process_count() == 1
            batch[leaf] = value if on_devices else np.asarray(value)

        def operand(ref: OuterRef, mesh: int, sharding: NamedSharding, micro_batch: int | None = None) -> jax.Array:
            if micro_batch is not None:
                size = self.micro_batch_size
                value = batch[ref.index][micro_batch * size : (micro_batch + 1) * size]
            elif ref.kind == "const":
                value = consts[ref.index]
            else:
                arrays = placed[ref.index]
                value = arrays[mesh] if mesh in arrays else next(iter(arrays.values()))
            if _fits(value, sharding):
                return value
            if isinstance(value, jax.Array) and not value.is_fully_addressable:
                return self._move(value.aval, value.sharding, sharding)(value)
            return _put(value, sharding)

        # Loss operands each stage reads: parameters once per step, batch
        # leaves per micro-batch.
        stage_args: list[dict[Ref, Any]] = []
        for stage in graph.stages:
            args: dict[Ref, Any] = {}
            for r in stage.inputs:
                if r.kind == "param":
                    leaf = split.param_inputs[r.index]
                    args[r] = operand(OuterRef("in", leaf), stage.index, self.input_sharding(r, stage.index))
                elif r.kind == "input" and r.index not in self.batch_inputs:
                    args[r] = operand(split.loss_inputs[r.index], stage.index, self.input_sharding(r, stage.index))
            stage_args.append(args)

        grads = [
            [jnp.zeros(self._param_aval(stage, k).shape, self._param_aval(stage, k).dtype,
                       device=self.input_sharding(Ref("param", k), stage.index))
             for k in stage.param_inputs] if self.local[stage.index] else None
            for stage in graph.stages
        ]
        buffers: dict[str, Any] = {}
        # Values other processes send here, checked before the step returns so
        # that a peer that never sends makes this process fail, not hang.
        arriving: list[tuple[jax.Array, str]] = []
        watch = jax.process_count() > 1

        def received(value: jax.Array, task: Task) -> jax.Array:
            if watch and value.addressable_shards:
                p, c, ref = self.edges[task.where]
                what = (f"activation {ref} stage {p} -> {c}" if task.kind == "send_act"
                        else f"gradient of {ref} stage {c} -> {p}")
                arriving.append((value, f"{what}, micro-batch {task.micro_batch}"))
            return value

        loss_parts = []
        live = [0] * graph.num_stages
        peak = [0] * graph.num_stages
        loss_stage = graph.loss.index
        seed = None

        def value_of(name: str, slot: int | None, aval: Any, sharding: NamedSharding) -> jax.Array:
            value = buffers.get(name)
            if value is None:  # computed on a mesh of another process
                return _absent(aval, sharding)
            return value if slot is None else value[slot]

        for task in self.schedule.order:
            m = task.micro_batch
            if task.kind in ("forward", "backward") and not self.local[task.where]:
                pass
            elif task.kind == "forward":
                stage = graph.stages[task.where]
                args = []
                for r in stage.inputs:
                    if r.kind == "act":
                        e = next(i for i, (p, c, ref) in enumerate(self.edges) if c == stage.index and ref == r)
                        args.append(buffers[f"act{e}.{m}@in"])
                    elif r.kind == "input" and r.index in self.batch_inputs:
                        args.append(operand(split.loss_inputs[r.index], stage.index,
                                            self.input_sharding(r, stage.index), micro_batch=m))
                    else:
                        args.append(stage_args[stage.index][r])
                diff = [a for a, r in zip(args, stage.inputs) if r.kind in ("param", "act")]
                other = [a for a, r in zip(args, stage.inputs) if r.kind not in ("param", "act")]
                outs, vjp = self._stage_fns[stage.index][0](diff, other)
                buffers[f"res{stage.index}.{m}"] = vjp
                live[stage.index] += 1
                peak[stage.index] = max(peak[stage.index], live[stage.index])
                buffers[f"out{stage.index}.{m}"] = outs
                if stage.index == loss_stage:
                    loss_parts.append(outs[graph.loss.slot])
            elif task.kind == "send_act":
                p, c, ref = self.edges[task.where]
                aval = graph.stages[p].jaxpr.out_avals[ref.slot]
                value = value_of(f"out{p}.{m}", ref.slot, aval, self.act_sharding(ref, p))
                buffers[f"act{task.where}.{m}@in"] = received(self._edge_moves[task.where][0](value), task)
            elif task.kind == "backward":
                s = task.where
                stage = graph.stages[s]
                cts = []
                for ref in stage.outputs:
                    sharding = self.act_sharding(ref, s)
                    ct = None
                    if ref == graph.loss:
                        if seed is None:
                            seed = jnp.full((), 1.0 / M, stage.jaxpr.out_avals[ref.slot].dtype, device=sharding)
                        ct = seed
                    for e, (p, c, r) in enumerate(self.edges):
                        if p == s and r == ref:
                            got = buffers[f"ct{e}.{m}@in"]
                            ct = got if ct is None else ct + got
                    cts.append(ct)
                act_cts, grads[s] = self._stage_fns[s][1](buffers[f"res{s}.{m}"], cts, grads[s])
                live[s] -= 1
                act_inputs = [r for r in stage.inputs if r.kind == "act"]
                for e, (p, c, r) in enumerate(self.edges):
                    if c == s:
                        buffers[f"ct{e}.{m}@out"] = act_cts[act_inputs.index(r)]
            else:  # send_grad
                p, c, ref = self.edges[task.where]
                aval = graph.stages[p].jaxpr.out_avals[ref.slot]
                value = value_of(f"ct{task.where}.{m}@out", None, aval, self.act_sharding(ref, c))
                buffers[f"ct{task.where}.{m}@in"] = received(self._edge_moves[task.where][1](value), task)
            for name in self._frees.get(task, ()):
                buffers.pop(name, None)

        loss_sharding = NamedSharding(self.meshes[loss_stage], P())
        loss_aval = graph.stages[loss_stage].jaxpr.out_avals[graph.loss.slot]
        if loss_parts:
            loss = loss_parts[0]
            for part in loss_parts[1:]:
                loss = loss + part
            loss = loss / M
        else:
            loss = _absent(loss_aval, loss_sharding)

        # Gradients of a parameter several stages read go home and add up.
        param_grad: dict[int, jax.Array] = {}
        for stage, gs in zip(graph.stages, grads):
            for n, k in enumerate(stage.param_inputs):
                owner = graph.param_owner(k)
                home = self.input_sharding(Ref("param", k), owner)
                if stage.index == owner:
                    g = gs[n] if gs is not None else _absent(self._param_aval(stage, k), home)
                else:
                    here = self.input_sharding(Ref("param", k), stage.index)
                    g = self._move(self._param_aval(stage, k), here, home)(
                        gs[n] if gs is not None else _absent(self._param_aval(stage, k), here))
                param_grad[k] = g if k not in param_grad or not self.local[owner] else param_grad[k] + g

        # Every process joins the loss's moves before any update runs.
        loss_on = {loss_stage: loss}
        for apply in split.stages:
            if OuterRef("loss") in apply.inputs and apply.mesh not in loss_on:
                loss_on[apply.mesh] = self._move(loss_aval, loss_sharding, NamedSharding(self.meshes[apply.mesh], P()))(loss)

        def apply_operand(ref: OuterRef, mesh: int) -> Any:
            if ref.kind == "grad":
                return param_grad[ref.index]
            if ref.kind == "loss":
                return loss_on[mesh]
            if ref.kind == "const":
                return consts[ref.index]
            arrays = placed[ref.index]
            return arrays[mesh] if mesh in arrays else next(iter(arrays.values()))

        computed: dict[int, dict[int, jax.Array]] = {}
        for apply in split.stages:
            if not self.local[apply.mesh]:
                continue
            outs = self._apply_fns[apply.mesh](*[apply_operand(r, apply.mesh) for r in apply.inputs])
            for j, value in zip(apply.outputs, outs):
                computed.setdefault(j, {})[apply.mesh] = value

        self.peak_live_activations = peak
        if arriving:
            wait_ready([v for v, _ in arriving], self.timeout_s, "pipeline transfers", names=[w for _, w in arriving])

        results = []
        for j, source in enumerate(split.sources):
            if source is None:
                parts = computed.get(j, {})
                if len(split.producers[j]) != len(parts):
                    results.append(self._output_elsewhere(j, parts))
                elif len(parts) == 1:
                    results.append(next(iter(parts.values())))
                else:
                    meshes = sorted(parts)
                    results.append(_join([parts[m] for m in meshes], [NamedSharding(self.meshes[m], P()) for m in meshes]))
            elif source.kind == "loss":
                results.append(loss)
            elif source.kind == "grad":
                results.append(param_grad[source.index])
            elif source.kind == "in":
                arrays = placed[source.index]
                if not arrays:  # a batch leaf returned as it came
                    results.append(leaves[source.index])
                elif len(arrays) == 1:
                    results.append(next(iter(arrays.values())))
                else:
                    meshes = sorted(arrays)
                    results.append(_join([arrays[m] for m in meshes], [self.in_placements[source.index].on(m) for m in meshes]))
            elif source.kind == "const":
                results.append(consts[source.index])
            else:
                raise AssertionError(f"unexpected output source {source}")
        return results
