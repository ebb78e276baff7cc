"""Lowering plans to device transfers, checked by running the program in numpy."""

import numpy as np
import pytest

from meshpar.passes import STRATEGIES, plan_resharding
from meshpar.passes.resharding.transfer_program import lower_plan, split_box, verify_program
from random_tasks import random_task


def run_in_numpy(program, task, x):
    """Interprets the steps: each transfer copies a box between per-device buffers."""
    src = {d: x[tuple(slice(a, b) for a, b in t.bounds)].copy() for t in task.src_tiles for d in t.devices}
    dst = {d: np.full(program.dst_tile_shape, np.nan) for d in program.dst_devices}
    for step in program.steps:
        payloads = []
        for t in step.transfers:
            buf = src[t.src_device] if t.from_source else dst[t.src_device]
            payload = buf[tuple(slice(o, o + n) for o, n in zip(t.src_offset, t.shape))].copy()
            assert not np.isnan(payload).any(), "relay forwards data it has not received yet"
            payloads.append(payload)
        for t, payload in zip(step.transfers, payloads):
            dst[t.dst_device][tuple(slice(o, o + n) for o, n in zip(t.dst_offset, t.shape))] = payload
    return dst


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_lowered_program_delivers_every_destination_tile(seed, strategy):
    task, cluster = random_task(seed, pad=False)
    plan = plan_resharding(task, cluster, strategy=strategy, chunks=3 if strategy == "broadcast" else None)
    program = lower_plan(plan)
    verify_program(program)
    x = np.random.default_rng(seed).standard_normal(task.shape)
    dst = run_in_numpy(program, task, x)
    for t in task.dst_tiles:
        for d in t.devices:
            np.testing.assert_array_equal(dst[d], x[tuple(slice(a, b) for a, b in t.bounds)])


def test_broadcast_chunks_pipeline_along_the_ring():
    from benchmarks.resharding.cases import one_to_m_cases

    case = next(c for c in one_to_m_cases(num_elements=4096) if c.name == "2x2")
    plan = plan_resharding(case.task, case.cluster, chunks=8)
    program = lower_plan(plan)
    # One sender, 4 receivers in a ring, 8 chunks: 8 + 4 - 1 steps, the
    # middle ones moving a chunk on every hop at once.
    assert len(program.steps) == 8 + 4 - 1
    assert max(len(s.transfers) for s in program.steps) == 4
    assert all(t.shape == (512,) for s in program.steps for t in s.transfers)


@pytest.mark.parametrize("length, parts", [(10, 3), (4, 4), (3, 5), (7, 2), (1, 1)])
def test_split_box_covers_with_equal_shapes(length, parts):
    pieces = split_box(((0, 2), (5, 5 + length)), parts)
    shapes = {tuple(b - a for a, b in p) for p in pieces}
    assert len(shapes) == 1 and len(pieces) == min(parts, length)
    covered = set()
    for p in pieces:
        assert p[0] == (0, 2) and 5 <= p[1][0] and p[1][1] <= 5 + length
        covered |= set(range(*p[1]))
    assert covered == set(range(5, 5 + length))


def test_padded_tasks_are_rejected_by_the_lowering():
    task, cluster = random_task(0, pad=True)
    with pytest.raises(ValueError, match="pad=False"):
        lower_plan(plan_resharding(task, cluster))
