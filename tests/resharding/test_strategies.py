"""Each strategy's cost against its closed form from §3.1 (no latency, free intra-host copies)."""

import math

import pytest

from meshpar import Cluster
from meshpar.passes.resharding.strategies import Multicast, get_strategy, recv_resource, send_resource

BW = 1e9
S = 3e9  # bytes: t = 3 s
T = S / BW


def _cluster(num_hosts, per_host, latency=0.0, intra=math.inf):
    return Cluster.uniform(num_hosts, per_host, inter_host_bandwidth=BW, intra_host_bandwidth=intra, latency=latency)


def _multicast(cluster, receiver_hosts, per_host, sender=0):
    receivers = [d for h in receiver_hosts for d in cluster.host_devices[h][:per_host]]
    return Multicast.of(int(S), sender, receivers, cluster.host_of)


@pytest.mark.parametrize("A, B", [(1, 1), (1, 4), (2, 2), (3, 2), (4, 4)])
def test_closed_forms(A, B):
    c = _cluster(1 + A, B)
    m = _multicast(c, range(1, 1 + A), B)
    n = A * B
    assert get_strategy("send_recv").cost(m, c) == pytest.approx(A * B * T)
    assert get_strategy("local_allgather").cost(m, c) == pytest.approx(A * T)
    assert get_strategy("global_allgather").cost(m, c) == pytest.approx(T + (n - 1) / n * T if A > 1 else T)
    for K in (1, 4, 100):
        assert get_strategy("broadcast").cost(m, c, K) == pytest.approx(T + (A - 1) * T / K)
        # The paper's t + A t / K is an upper bound of the exact pipeline.
        assert get_strategy("broadcast").cost(m, c, K) <= T + A * T / K + 1e-9


def test_broadcast_approaches_t_and_beats_the_rest():
    c = _cluster(5, 4)
    m = _multicast(c, range(1, 5), 4)
    costs = {name: get_strategy(name).cost(m, c, 256) for name in ("send_recv", "local_allgather", "global_allgather", "broadcast")}
    assert costs["broadcast"] == min(costs.values())
    assert costs["broadcast"] < 1.02 * T


def test_receivers_on_the_sender_host_cost_nothing_across_hosts():
    c = _cluster(2, 4)
    # Sender device 0; receivers 1, 2 on its host and all 4 devices of host 1.
    m = Multicast.of(int(S), 0, [1, 2, 4, 5, 6, 7], c.host_of)
    assert m.remote == ((1, 4),) and m.local_devices == 2
    assert get_strategy("send_recv").cost(m, c) == pytest.approx(4 * T)
    assert get_strategy("local_allgather").cost(m, c) == pytest.approx(T)
    assert get_strategy("broadcast").cost(m, c, 8) == pytest.approx(T)


def test_best_chunks_minimises_cost_under_latency():
    c = _cluster(5, 2, latency=1e-3, intra=1e11)
    m = _multicast(c, range(1, 5), 2)
    bc = get_strategy("broadcast")
    k = bc.best_chunks(m, c, num_elements=10**9)
    assert k > 1
    best = bc.cost(m, c, k)
    assert all(best <= bc.cost(m, c, other) + 1e-12 for other in range(1, 1025))
    assert bc.best_chunks(m, c, num_elements=3) <= 3
    assert get_strategy("send_recv").best_chunks(m, c, 10**9) == 1


def test_resources_follow_eq3_and_ring_forwarding():
    c = _cluster(4, 2)
    m = _multicast(c, [1, 2, 3], 2)
    base = {send_resource(0), recv_resource(1), recv_resource(2), recv_resource(3)}
    assert get_strategy("send_recv").resources(m) == base
    assert get_strategy("local_allgather").resources(m) == base
    # Ring 0 -> 1 -> 2 -> 3: hosts 1 and 2 forward, host 3 is the end.
    assert get_strategy("broadcast").resources(m) == base | {send_resource(1), send_resource(2)}
    assert get_strategy("global_allgather").resources(m) == base | {send_resource(h) for h in (1, 2, 3)}
    local = Multicast.of(int(S), 0, [1], c.host_of)
    assert get_strategy("broadcast").resources(local) == frozenset()


def test_unknown_strategy_names_argument():
    with pytest.raises(ValueError, match=r"strategy: unknown 'ring'; expected one of"):
        get_strategy("ring")
    with pytest.raises(ValueError, match="chunks"):
        get_strategy("broadcast").cost(_multicast(_cluster(2, 1), [1], 1), _cluster(2, 1), 0)
