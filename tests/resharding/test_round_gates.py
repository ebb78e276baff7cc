"""Round gates (passes.round_gates): which hops wait for which arrivals, checked against a
brute-force reading of the hop program; and gated moves in one process, with hosts emulated by
device groups, equal to numpy bit for bit."""

import random

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from meshpar.passes.program.moves import TransferOrder
from meshpar.passes.resharding.hop_program import lower_to_hops
from meshpar.passes.program.resharding_programs import Gate
from meshpar.passes.resharding.round_gates import round_gates, verify_round_gates
from meshpar.passes.verification import PlanVerificationError
from meshpar.runtime.p2p_executor import P2PReshardExecutable

DEVICES = jax.devices()


def _case(seed):
    """A random move between two (2, 2) meshes on hosts of two devices each."""
    rng = random.Random(seed)
    names = ("x", "y")
    a = Mesh(np.array(DEVICES[:4]).reshape(2, 2), names)
    b = Mesh(np.array(DEVICES[4:]).reshape(2, 2), names)
    specs = [P(), P("x"), P("y"), P(None, "x"), P("x", "y"), P(("x", "y"))]
    src, dst = NamedSharding(a, rng.choice(specs)), NamedSharding(b, rng.choice(specs))
    host_of = {d.id: d.id // 2 for d in DEVICES}
    cluster = meshpar.Cluster.from_devices(DEVICES, host_of=lambda d: host_of[d.id], inter_host_bandwidth=1e9)
    plan = meshpar.plan_between((8, 12), np.float32, src, dst, strategy=rng.choice(list(meshpar.STRATEGIES)),
                                chunks=rng.choice([None, 2, 3]), cluster=cluster)
    return src, dst, host_of, lower_to_hops(plan)


def _expected_gates(program, host_of):
    """Per round r >= 1, by brute force over pairs of hops: (r, host awaited, sender) for every
    cross-host hop a -> b of a piece its sender held before round r, and every cross-host hop
    of an earlier round into b from another host than a, or out of a into another host than b."""
    def hops(k):
        first, end = program.rounds[k]
        return [h for s in range(first, end) for h in program.steps[s]
                if host_of[h.src_device] != host_of[h.dst_device]]

    out = set()
    for r in range(1, len(program.rounds)):
        held = {(c.device, c.piece) for c in program.cuts}
        held |= {(h.dst_device, h.piece) for k in range(r) for s in range(*program.rounds[k]) for h in program.steps[s]}
        for h in hops(r):
            a, b = host_of[h.src_device], host_of[h.dst_device]
            if (h.src_device, h.piece) not in held:
                continue
            for p in (q for k in range(r) for q in hops(k)):
                pa, pb = host_of[p.src_device], host_of[p.dst_device]
                if (pb == b and pa != a) or (pa == a and pb != b):
                    out.add((r, pb, h.src_device))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_gates_are_the_cross_host_hops_after_a_round_with_arrivals(seed):
    _, _, host_of, program = _case(seed)
    gates = round_gates(program, host_of)
    verify_round_gates(program, gates, host_of)
    assert {(g.round, g.host, g.src_device) for g in gates} == _expected_gates(program, host_of)
    assert round_gates(program, {d: 0 for d in host_of}) == (), "one host: nothing is gated"


def test_verifier_rejects_a_gate_on_arrivals_of_another_host():
    for seed in range(40):
        _, _, host_of, program = _case(seed)
        gates = round_gates(program, host_of)
        if gates:
            break
    g = gates[0]
    wrong = Gate(g.round, g.host + 1, g.arrivals, g.collector, g.src_device, g.pieces)
    with pytest.raises(PlanVerificationError, match="arrivals are not"):
        verify_round_gates(program, (wrong,), host_of)


@pytest.mark.parametrize("seed", range(8))
def test_gated_moves_are_bit_exact(seed):
    src, dst, host_of, program = _case(seed)
    gates = round_gates(program, host_of)
    expected = np.arange(96, dtype=np.float32).reshape(8, 12) * (seed + 1)
    x = jax.device_put(expected, src)
    y = P2PReshardExecutable(program, np.float32, src, dst, order=TransferOrder.GATED, gates=gates)(x)
    assert y.sharding == dst
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
