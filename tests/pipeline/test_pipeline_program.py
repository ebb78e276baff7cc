"""The typed per-mesh pipeline program, checked by an independent symbolic interpreter."""

import dataclasses
import re

import numpy as np
import pytest

from meshpar.passes.program.moves import Direction, EdgeTransfer, TransferKind
from meshpar.passes.program.pipeline_instructions import (
    BufferId, BufferKind, Free, Instruction, Recv, ReduceGradients, RunBackward, RunBackwardInput, RunBackwardWeight,
    RunForward, Send,
)
from meshpar.passes.pipeline.lowering.pipeline_program import (
    lower_to_program, stage_io, verify_pipeline_program as verify,
)
from meshpar.passes.pipeline.scheduling.pipeline_schedule import SCHEDULES, make_schedule
from meshpar.passes.program.tasks import TaskKind
from meshpar.passes.verification import PlanVerificationError

F, B, I, W = TaskKind.FORWARD, TaskKind.BACKWARD, TaskKind.BACKWARD_INPUT, TaskKind.BACKWARD_WEIGHT
KIND = {RunForward: F, RunBackward: B, RunBackwardInput: I, RunBackwardWeight: W}


def _chain(S):
    return [(s, s + 1) for s in range(S - 1)]


def _u_shape(S):  # as in test_pipeline_schedule: adjacent stages plus skips i -> S-1-i
    return _chain(S) + [(i, S - 1 - i) for i in range(S // 2) if S - 1 - i > i + 1]


def _build(name, S, M, edges, delays=None, slots="distinct", num_meshes=None, reduced=frozenset()):
    """slots: "distinct" (one output slot per out-edge), "shared" (all out-edges from slot 0),
    "extra" (like distinct, but the last stage has an unread slot 0 and the loss in slot 1)."""
    quads, num_out = [], [1] * S
    for e, (p, c) in enumerate(edges):
        slot = 0 if slots == "shared" else sum(1 for q, _ in edges[:e] if q == p)
        pos = sum(1 for _, d in edges[:e] if d == c)
        quads.append((p, c, slot, pos))
        num_out[p] = max(num_out[p], slot + 1)
    loss_slot = 1 if slots == "extra" else 0
    num_out[S - 1] = loss_slot + 1
    # src/dst shardings are never read by lowering or verification: None stands in for them.
    transfers = [EdgeTransfer(e, d, a, b, slot, (4,), np.dtype("float32"), None, None, TransferKind.P2P)
                 for e, (p, c, slot, _) in enumerate(quads)
                 for d, (a, b) in ((Direction.ACTIVATION, (p, c)), (Direction.COTANGENT, (c, p)))]
    stages = stage_io(S, quads, (S - 1, loss_slot), num_out)
    schedule = make_schedule(name, S, M, edges, delays, num_meshes)
    return lower_to_program(schedule, stages, transfers, reduced), quads, schedule


def _interpret(program, quads, schedule):
    """Runs the launch sequence symbolically (each mesh's compute checked against ``schedule``);
    returns per-stage peaks of live RESIDUALS / WEIGHT_STATE."""
    S, P = len(program.stages), len(program.instructions)
    home = program.stage_mesh
    tr = {(t.edge, t.direction): k for k, t in enumerate(program.transfers)}
    in_edges = [[e for e, q in sorted(enumerate(quads), key=lambda x: x[1][3]) if q[1] == s] for s in range(S)]
    live = [set() for _ in range(P)]
    channel, got, outputs, input_cts = {}, {}, {}, {}
    peak = {BufferKind.RESIDUALS: [0] * S, BufferKind.WEIGHT_STATE: [0] * S}
    computes = [[] for _ in range(P)]
    for mesh, ins in program.launch_sequence():
        if isinstance(ins, Send):
            t = program.transfers[ins.transfer]
            assert mesh == home[t.src_stage] and ins.buffer in live[mesh]
            m = ins.micro_batch
            if t.direction is Direction.ACTIVATION:  # the producer's output of the edge's slot
                assert ins.buffer == outputs[t.src_stage, m][quads[t.edge][2]]
            else:
                assert ins.buffer == input_cts[t.src_stage, m][in_edges[t.src_stage].index(t.edge)]
            assert (ins.transfer, m) not in channel, "a second send"
            channel[ins.transfer, m] = ins.buffer
        elif isinstance(ins, Recv):
            assert mesh == home[program.transfers[ins.transfer].dst_stage]
            assert channel.pop((ins.transfer, ins.micro_batch), None) is not None, "receive before send"
            got[ins.transfer, ins.micro_batch] = ins.buffer
            live[mesh].add(ins.buffer)
        elif isinstance(ins, Free):
            live[mesh].remove(ins.buffer)
        else:
            s, m = ins.stage, ins.micro_batch
            assert home[s] == mesh, "compute on a mesh the schedule does not place its stage on"
            computes[mesh].append((KIND[type(ins)], s, m))
            if isinstance(ins, RunForward):
                assert ins.inputs == tuple(got[tr[e, Direction.ACTIVATION], m] for e in in_edges[s])
                assert set(ins.inputs) <= live[mesh]
                outputs[s, m] = ins.outputs
                live[mesh] |= {*ins.outputs, ins.residuals}
            elif isinstance(ins, RunBackwardWeight):
                assert ins.weight_state in live[mesh]
            else:
                # Cotangents of every out-edge, grouped by slot: a shared slot sums them.
                out_edges = [e for k in range(len(outputs[s, m])) for e, q in enumerate(quads) if q[0] == s and q[2] == k]
                assert ins.cotangents == tuple(got[tr[e, Direction.COTANGENT], m] for e in out_edges)
                assert {ins.residuals, *ins.cotangents} <= live[mesh]
                assert len(ins.input_cotangents) == len(in_edges[s])
                input_cts[s, m] = ins.input_cotangents
                live[mesh] |= set(ins.input_cotangents)
                if isinstance(ins, RunBackwardInput):
                    live[mesh].add(ins.weight_state)
        for kind, per_stage in peak.items():
            for s in schedule.stages_on(mesh):
                per_stage[s] = max(per_stage[s], sum(b.kind is kind and b.index == s for b in live[mesh]))
    assert not channel, "sends never received"
    for mesh in range(P):
        assert computes[mesh] == [(t.kind, t.where, t.micro_batch) for t in schedule.sequences[mesh]]
        assert all(b.kind is BufferKind.RESULT and b.index == S - 1 for b in live[mesh])
        assert len(live[mesh]) == (program.num_micro_batches if mesh == home[S - 1] else 0)
    return peak


ONE_PER_MESH = sorted(n for n, k in SCHEDULES.items() if k.stages_per_mesh is None)
V_SCHEDULES = sorted(n for n, k in SCHEDULES.items() if k.stages_per_mesh == 2)
# Weight delaying applies to the schedules that do not place their weight passes themselves.
CONFIGS = [(n, d) for n in ONE_PER_MESH for d in ((None,) if SCHEDULES[n].places_weight_passes else (None, 0, 1, 2))]
SHAPES = [(_chain, "distinct"), (_chain, "extra"), (_u_shape, "distinct"), (_u_shape, "shared")]


@pytest.mark.parametrize("edges_of,slots", SHAPES)
@pytest.mark.parametrize("M", [1, 2, 3, 5])
@pytest.mark.parametrize("S", [1, 2, 3, 4])
@pytest.mark.parametrize("name,delay", CONFIGS)
def test_program_runs_and_holds_the_schedules_memory(name, delay, S, M, edges_of, slots):
    program, quads, schedule = _build(name, S, M, edges_of(S), None if delay is None else [delay] * S, slots)
    peak = _interpret(program, quads, schedule)
    for s in range(S):
        res = {"gpipe": M, "1f1b": min(M, S - s), "zb_h1": min(M, S - s), "eager_1f1b": min(M, 2 * (S - s) - 1),
               "interleaved_1f1b": M if M == S else min(M, 2 * (S - s) - 1),
               "interleaved_zb": min(M, S - s)}[name]
        assert peak[BufferKind.RESIDUALS][s] == res
        held = best = 0
        for t in schedule.sequences[s]:
            held += {I: 1, W: -1}.get(t.kind, 0)
            best = max(best, held)
        assert peak[BufferKind.WEIGHT_STATE][s] == best
        assert (best > 0) == (SCHEDULES[name].places_weight_passes or delay is not None)


@pytest.mark.parametrize("edges_of,slots", SHAPES)
@pytest.mark.parametrize("P,M", [(1, 2), (2, 4), (2, 6), (3, 6)])
@pytest.mark.parametrize("name", V_SCHEDULES)
def test_v_programs_run_and_hold_the_schedules_memory(name, P, M, edges_of, slots):
    """2P stages on P meshes in a V: the program runs symbolically, every buffer freed, each
    stage holding the residuals its schedule's order keeps alive."""
    S = 2 * P
    program, quads, schedule = _build(name, S, M, edges_of(S), None, slots, num_meshes=P)
    peak = _interpret(program, quads, schedule)
    for s in range(S):
        assert peak[BufferKind.RESIDUALS][s] == SCHEDULES[name].peak_live(s, S, M, P)


def _rebuild(program, seq):
    """A program whose launch sequence is ``seq``, per-mesh lists following it."""
    lists, order = [[] for _ in program.instructions], []
    for mesh, ins in seq:
        order.append((mesh, len(lists[mesh])))
        lists[mesh].append(ins)
    return dataclasses.replace(program, instructions=tuple(map(tuple, lists)), order=tuple(order))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_verifier_rejects_tampered_programs(name):
    if name in V_SCHEDULES:
        program, _, _ = _build(name, 4, 4, _u_shape(4), slots="shared", num_meshes=2)
    else:
        program, _, _ = _build(name, 3, 3, _u_shape(3), slots="shared")
    seq = program.launch_sequence()
    # A Free removed: the buffer is left live.
    k = next(i for i, (_, x) in enumerate(seq) if isinstance(x, Free) and x.buffer.kind is BufferKind.RESIDUALS)
    with pytest.raises(PlanVerificationError, match="live after the program.*" + re.escape(str(seq[k][1].buffer))):
        verify(_rebuild(program, seq[:k] + seq[k + 1:]))
    # A Recv moved before its Send (different meshes, so each mesh keeps its own order).
    k = next(i for i, (_, x) in enumerate(seq) if isinstance(x, Send))
    assert isinstance(seq[k + 1][1], Recv) and seq[k + 1][1].transfer == seq[k][1].transfer
    order = list(program.order)
    order[k], order[k + 1] = order[k + 1], order[k]
    with pytest.raises(PlanVerificationError, match=f"mesh {seq[k + 1][0]}: .*no earlier unmatched send"):
        verify(dataclasses.replace(program, order=tuple(order)))
    # A Send duplicated.
    with pytest.raises(PlanVerificationError, match=f"mesh {seq[k][0]}: .*not the one send"):
        verify(_rebuild(program, seq[:k + 1] + [seq[k]] + seq[k + 1:]))
    # A read after its Free: residuals freed right after the forward that wrote them.
    k = next(i for i, (_, x) in enumerate(seq) if isinstance(x, Free) and x.buffer.kind is BufferKind.RESIDUALS)
    res = seq[k][1].buffer
    f = next(i for i, (_, x) in enumerate(seq) if isinstance(x, RunForward) and x.residuals == res)
    bad = seq[:f + 1] + [seq[k]] + seq[f + 1:k] + seq[k + 1:]
    with pytest.raises(PlanVerificationError,
                       match=f"mesh {program.stage_mesh[res.index]}: .*reads " + re.escape(str(res))):
        verify(_rebuild(program, bad))
    # A launch order that breaks a mesh's own order: two of mesh 0's launches swapped.
    a, b = [i for i, (mesh, _) in enumerate(program.order) if mesh == 0][:2]
    order = list(program.order)
    order[a], order[b] = order[b], order[a]
    with pytest.raises(PlanVerificationError, match="mesh 0: the launch order breaks"):
        verify(dataclasses.replace(program, order=tuple(order)))
    verify(program)  # the untampered program still passes


def test_verifier_rejects_miswired_cotangents_and_sends():
    """A backward reading its cotangents out of StageIO order, or a send of the wrong slot."""
    program, _, _ = _build("1f1b", 3, 2, _u_shape(3))
    seq = program.launch_sequence()
    k = next(i for i, (_, x) in enumerate(seq) if isinstance(x, RunBackward) and len(x.cotangents) > 1)
    swapped = dataclasses.replace(seq[k][1], cotangents=seq[k][1].cotangents[::-1])
    with pytest.raises(PlanVerificationError, match="cotangent_edges order"):
        verify(_rebuild(program, seq[:k] + [(seq[k][0], swapped)] + seq[k + 1:]))
    k = next(i for i, (_, x) in enumerate(seq)
             if isinstance(x, Send) and x.buffer.kind is BufferKind.ACTIVATION and x.buffer.index == 0)
    other = dataclasses.replace(seq[k][1].buffer, slot=1 - seq[k][1].buffer.slot)
    with pytest.raises(PlanVerificationError, match="but transfer .* carries"):
        verify(_rebuild(program, seq[:k] + [(seq[k][0], dataclasses.replace(seq[k][1], buffer=other))] + seq[k + 1:]))


@pytest.mark.parametrize("edges_of,slots", SHAPES)
@pytest.mark.parametrize("P,v,rounds", [(2, 2, 1), (2, 2, 2), (2, 2, 4), (4, 2, 1), (4, 2, 2), (3, 3, 2), (2, 4, 3)])
@pytest.mark.parametrize("delay", [None, 1])
def test_interleaved_program_runs_with_several_stages_per_mesh(P, v, rounds, edges_of, slots, delay):
    """Stage k runs on mesh k mod P; each mesh's compute follows its sequence, and each stage holds
    the residuals its mesh's sequence says (forwards minus backwards so far, at most)."""
    S, M = P * v, P * rounds
    program, quads, schedule = _build("interleaved_1f1b", S, M, edges_of(S), None if delay is None else [delay] * P, slots,
                            num_meshes=P)
    assert program.stage_mesh == tuple(s % P for s in range(S))
    assert len(program.instructions) == P
    peak = _interpret(program, quads, schedule)
    for mesh, seq in enumerate(schedule.sequences):
        for s in schedule.stages_on(mesh):
            live = held = 0
            for t in seq:
                if t.where == s and t.kind is F:
                    live += 1
                elif t.where == s and t.kind in (B, I):
                    live -= 1
                held = max(held, live)
            assert peak[BufferKind.RESIDUALS][s] == held


@pytest.mark.parametrize("name, S, M, num_meshes, reduced", [
    ("1f1b", 3, 4, None, {0, 1, 2}), ("zb_h1", 3, 4, None, {0, 2}), ("gpipe", 2, 1, None, {1}),
    ("interleaved_1f1b", 4, 4, 2, {0, 1, 2, 3}), ("interleaved_1f1b", 4, 4, 2, {1})])
def test_each_mesh_reduces_its_stages_once_right_after_their_last_gradient_pass(name, S, M, num_meshes, reduced):
    program, _, _ = _build(name, S, M, _chain(S), num_meshes=num_meshes, reduced=frozenset(reduced))
    home = program.stage_mesh
    for mesh, instructions in enumerate(program.instructions):
        mine = sorted(s for s in reduced if home[s] == mesh)
        at = [k for k, ins in enumerate(instructions) if isinstance(ins, ReduceGradients)]
        if not mine:
            assert at == []
            continue
        (k,) = at
        assert instructions[k].stages == tuple(mine)
        gradient = [j for j, ins in enumerate(instructions)
                    if isinstance(ins, (RunBackward, RunBackwardWeight)) and ins.stage in mine]
        # After the last gradient pass of its stages, with only frees and transfers in between.
        assert gradient and max(gradient) < k
        assert all(isinstance(ins, (Free, Send, Recv)) for ins in instructions[max(gradient) + 1:k])
        assert len(gradient) == M * len(mine)


def test_the_verifier_rejects_a_missing_misplaced_or_stray_reduction():
    program, _, _ = _build("1f1b", 2, 4, _chain(2), reduced=frozenset({0, 1}))
    verify(program, frozenset({0, 1}))
    with pytest.raises(PlanVerificationError, match="mesh 0: gradient reduction of stages 0, but none"):
        verify(program, frozenset({1}))
    plain, _, _ = _build("1f1b", 2, 4, _chain(2))
    with pytest.raises(PlanVerificationError, match=re.escape("mesh 0: not one gradient reduction of stages (0,)")):
        verify(plain, frozenset({0, 1}))
    # The reduction moved before the mesh's last backward: that backward accumulates too late.
    mesh0 = list(program.instructions[0])
    k = next(j for j, ins in enumerate(mesh0) if isinstance(ins, ReduceGradients))
    last = max(j for j, ins in enumerate(mesh0) if isinstance(ins, RunBackward))
    mesh0.insert(last, mesh0.pop(k))
    moved = dataclasses.replace(program, instructions=(tuple(mesh0), *program.instructions[1:]))
    with pytest.raises(PlanVerificationError, match="accumulates after the step's gradient reduction"):
        verify(moved, frozenset({0, 1}))


def test_each_kind_says_what_it_reads_writes_frees_and_runs():
    """The instruction interface against what each kind's fields say, on a lowered ZB-H1 program
    (every kind but the whole backward) and a 1F1B one (the whole backward)."""
    seen = set()
    for name in ("zb_h1", "1f1b"):
        program, _, _ = _build(name, 2, 2, _chain(2), reduced=frozenset({0, 1}))
        for mesh, ins in program.launch_sequence():
            seen.add(type(ins))
            if isinstance(ins, RunForward):
                want = (ins.inputs, (*ins.outputs, ins.residuals), (), F)
            elif isinstance(ins, RunBackward):
                want = ((ins.residuals, *ins.cotangents), ins.input_cotangents, (), B)
            elif isinstance(ins, RunBackwardInput):
                want = ((ins.residuals, *ins.cotangents), (*ins.input_cotangents, ins.weight_state), (), I)
            elif isinstance(ins, RunBackwardWeight):
                want = ((ins.weight_state,), (), (), W)
            elif isinstance(ins, Send):
                t = program.transfers[ins.transfer]
                kind = TaskKind.SEND_ACT if t.direction is Direction.ACTIVATION else TaskKind.SEND_GRAD
                want = ((ins.buffer,), (), (), kind)
                assert ins.sends == ((ins.transfer, ins.micro_batch),) and ins.tasks[0].where == t.edge
            elif isinstance(ins, Recv):
                want = ((), (ins.buffer,), (), None)
                assert ins.receives == ((ins.transfer, ins.micro_batch),)
            elif isinstance(ins, Free):
                want = ((ins.buffer,), (), (ins.buffer,), None)
            else:
                want = ((), (), (), None)
                assert ins.reduces == ins.stages
            reads, writes, frees, kind = want
            assert (ins.reads, ins.writes, ins.frees) == (reads, writes, frees), ins
            assert [t.kind for t in ins.tasks] == ([] if kind is None else [kind]), ins
            assert ins.accumulates == ((ins.stage,) if isinstance(ins, (RunBackward, RunBackwardWeight)) else ())
    assert len(seen) == 8


def test_a_kind_that_does_not_say_what_it_reads_and_writes_cannot_be_made():
    class Silent(Instruction):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Silent()


def test_the_verifier_reads_a_new_kind_through_its_interface():
    """A kind the verifier has never heard of is checked by what it reads and writes."""

    @dataclasses.dataclass(frozen=True)
    class Peek(Instruction):
        buffer: BufferId

        reads = property(lambda self: (self.buffer,))
        writes = property(lambda self: ())

    program, _, _ = _build("1f1b", 2, 2, _chain(2))
    seq = program.launch_sequence()
    f = next(i for i, (_, x) in enumerate(seq) if isinstance(x, RunForward))
    res = seq[f][1].residuals
    verify(_rebuild(program, seq[:f + 1] + [(seq[f][0], Peek(res))] + seq[f + 1:]))
    with pytest.raises(PlanVerificationError, match=f"Peek.*reads {re.escape(str(res))}, which is not live"):
        verify(_rebuild(program, [(seq[f][0], Peek(res))] + seq))
