"""Lowering plans to point-to-point hops, checked by running the program in numpy."""

import numpy as np
import pytest

from meshpar.passes import STRATEGIES, PlanVerificationError, plan_resharding
from meshpar.passes.program.resharding_programs import Hop
from meshpar.passes.resharding.hop_program import lower_to_hops, replicate_scalar, verify_hop_program
from meshpar.passes.resharding.transfer_program import split_box_exact
from random_tasks import random_task


def run_in_numpy(program, task, x):
    """Interprets the program: cut pieces, forward whole pieces hop by hop, place them."""
    src = {d: x[tuple(slice(a, b) for a, b in t.bounds)] for t in task.src_tiles for d in t.devices}
    have = {}
    for c in program.cuts:
        box = tuple(slice(o, o + n) for o, n in zip(c.offset, program.piece_shapes[c.piece]))
        have[c.device, c.piece] = src[c.device][box].copy()
    for step in program.steps:
        arrived = {(h.dst_device, h.piece): have[h.src_device, h.piece] for h in step}
        have.update(arrived)
    out = {d: np.full(shape, np.nan) for d, shape in program.dst_tiles}
    for p in program.places:
        box = tuple(slice(o, o + n) for o, n in zip(p.offset, program.piece_shapes[p.piece]))
        out[p.device][box] = have[p.device, p.piece]
    return out


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_hops_deliver_every_destination_tile(seed, strategy, pad):
    task, cluster = random_task(seed, pad=pad)
    plan = plan_resharding(task, cluster, strategy=strategy, chunks=3 if strategy == "broadcast" else None)
    program = lower_to_hops(plan)
    verify_hop_program(program)
    x = np.random.default_rng(seed).standard_normal(task.shape)
    out = run_in_numpy(program, task, x)
    for t in task.dst_tiles:
        for d in t.devices:
            np.testing.assert_array_equal(out[d], x[tuple(slice(a, b) for a, b in t.bounds)])


@pytest.mark.parametrize("seed", range(10))
def test_no_element_crosses_a_link_twice_per_receiver(seed):
    """Exact pieces: each destination device receives exactly its tile's elements once."""
    task, cluster = random_task(seed, pad=False)
    program = lower_to_hops(plan_resharding(task, cluster, strategy="broadcast", chunks=3))
    received = {}
    for step in program.steps:
        for h in step:
            received[h.dst_device] = received.get(h.dst_device, 0) + int(np.prod(program.piece_shapes[h.piece]))
    for d, shape in program.dst_tiles:
        assert received[d] == int(np.prod(shape))


@pytest.mark.parametrize("length, parts", [(10, 3), (4, 4), (3, 5), (7, 2), (1, 1), (10, 4)])
def test_split_box_exact_is_a_partition(length, parts):
    pieces = split_box_exact(((0, 2), (5, 5 + length)), parts)
    lengths = [p[1][1] - p[1][0] for p in pieces]
    assert len(pieces) == min(parts, length) and max(lengths) - min(lengths) <= 1
    assert [p[1] for p in pieces] == sorted(p[1] for p in pieces)
    assert sum(lengths) == length and pieces[0][1][0] == 5 and pieces[-1][1][1] == 5 + length


def test_scalar_goes_to_every_destination():
    program = replicate_scalar((0, 1), (4, 5, 6))
    verify_hop_program(program)
    assert [h for s in program.steps for h in s] == [Hop(0, 0, 4), Hop(0, 4, 5), Hop(0, 5, 6)]


def test_verifier_rejects_a_hop_from_a_device_without_the_piece():
    task, cluster = random_task(3, pad=False)
    program = lower_to_hops(plan_resharding(task, cluster, strategy="broadcast", chunks=2))
    first = program.steps[0][0]
    bad = Hop(first.piece, program.dst_devices[-1] if program.dst_devices[-1] != first.dst_device else program.dst_devices[0], first.dst_device)
    import dataclasses
    broken = dataclasses.replace(program, steps=((bad, *program.steps[0][1:]), *program.steps[1:]))
    with pytest.raises(PlanVerificationError, match="does not hold"):
        verify_hop_program(broken)


def test_verifier_rejects_a_gap_in_a_destination_tile():
    task, cluster = random_task(4, pad=False)
    program = lower_to_hops(plan_resharding(task, cluster, strategy="send_recv"))
    import dataclasses
    last = program.steps[-1]
    dropped = last[0]
    broken = dataclasses.replace(
        program,
        steps=(*program.steps[:-1], last[1:]),
        places=tuple(p for p in program.places if (p.device, p.piece) != (dropped.dst_device, dropped.piece)),
    )
    with pytest.raises(PlanVerificationError, match="empty|differ"):
        verify_hop_program(broken)
