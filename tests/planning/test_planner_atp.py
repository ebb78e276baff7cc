"""ATP's cost model (passes.planner_atp): the paper's own numbers (seeds/002: §3.4's worked
example, §5.3's calibrated IC1 and mesh choices, §5.4's closed form and Fig. 12's trends),
Eqs. 2-4 on hand-computed cases, the mesh choice against brute force, and the stage shape
against a by-hand enumeration. Pure arithmetic: no devices."""

import itertools
import math

import numpy as np
import pytest

from meshpar.cluster import Cluster
from meshpar.passes.planning.layer_profile import LayerProfile
from meshpar.passes.planning.planner_atp import (DataModelShape, LayerComm, MeshBandwidths, all_reduce_bandwidth,
                                        atp_layer_comm, atp_pass_seconds, atp_profile_comm, best_data_model_shape,
                                        choose_mesh, gemm_all_reduce, megatron_layer_comm, megatron_profile_comm,
                                        mesh_bandwidths, mesh_shapes)

GB = 1e9


def _one_level(n, bandwidth=GB):
    """§5.4's fully connected interconnect (IC5, NVLink-Network Switch): a one-layer matrix,
    ``B'_1 = B'_2 = GroupBW``; as a cluster, one host whose devices all talk at ``bandwidth``."""
    return Cluster.uniform(1, n, inter_host_bandwidth=bandwidth, intra_host_bandwidth=bandwidth)


def _closed_form(d1, d2):
    """§5.4: T_comm = 2 L b s h / GroupBW · (14 d2 + 4 d1 - 18) / (d1 d2); this is the factor."""
    return (14 * d2 + 4 * d1 - 18) / (d1 * d2)


def _factor(cluster, mesh):
    """A layer's Eq. 2 time on ``cluster`` in units of ``2 b s h / GroupBW`` (GroupBW = 1 GB/s)."""
    comm = atp_layer_comm(mesh_bandwidths(cluster, mesh), 1, 1, 1, bytes_per_element=1)
    return comm.total_s * GB / 2


# -- Eq. 4 -----------------------------------------------------------------------------------


def test_all_reduce_bandwidth_eq4_by_hand():
    assert all_reduce_bandwidth(2, 10 * GB) == 10 * GB  # d/(2(d-1)) = 1
    assert all_reduce_bandwidth(4, 6 * GB) == pytest.approx(4 * GB)  # 4/6
    assert all_reduce_bandwidth(8, 14 * GB) == pytest.approx(8 * GB)
    assert all_reduce_bandwidth(10**6, 10 * GB) == pytest.approx(5 * GB, rel=1e-5)  # -> B'/2
    assert all_reduce_bandwidth(1, 10 * GB) == math.inf
    # an all-reduce of M bytes over d devices: 2 (d - 1) / d · M / B'
    assert 3e6 / all_reduce_bandwidth(3, GB) == pytest.approx(2 * 2 / 3 * 3e6 / GB)


# -- Eq. 3 on a cluster (§3.4) ----------------------------------------------------------------


def test_worked_example_of_section_3_4():
    # Fig. 7(a): 4 nodes over 200 Gbit/s HDR (25 GB/s), 4 GPUs per node each pair joined by 4
    # NVLinks of 50 GB/s (P2P 200 GB/s). For DeviceMesh(8, 2) the paper gives B'_2 = 200 GB/s
    # (between two GPUs) and B'_1 = 12.5 GB/s (two all-reduce groups share the inter-node link).
    fig7a = Cluster.uniform(4, 4, inter_host_bandwidth=25 * GB, intra_host_bandwidth=200 * GB)
    bw = mesh_bandwidths(fig7a, (8, 2))
    assert bw.link == (12.5 * GB, 200 * GB)
    assert bw.all_reduce == pytest.approx((8 / 14 * 12.5 * GB, 200 * GB))


def test_eq3_divides_by_d2_when_axis_2_stays_in_a_host():
    cluster = Cluster.uniform(8, 8, inter_host_bandwidth=GB, intra_host_bandwidth=100 * GB)
    for d2 in (1, 2, 4, 8):
        for d1 in (2 * 8 // d2, 4 * 8 // d2, 64 // d2):  # axis 1 crosses hosts
            link = mesh_bandwidths(cluster, (d1, d2)).link
            assert link[0] == GB / d2  # min(GroupBW_1 / d2, intra)
            assert link[1] == (100 * GB if d2 > 1 else math.inf)
    # everything in one host: the point-to-point bandwidth on both axes
    assert mesh_bandwidths(cluster, (4, 2)).link == (100 * GB, 100 * GB)
    # one device per host (a one-layer matrix over the NICs): nothing shares a NIC
    flat = Cluster.uniform(16, 1, inter_host_bandwidth=GB, intra_host_bandwidth=100 * GB)
    assert mesh_bandwidths(flat, (4, 4)).link == (GB, GB)


def test_nic_sharing_counts_the_rings_that_cross_it():
    aws = Cluster.aws_p3_8xlarge(4)  # 4 V100 per host, 10 Gbit/s between hosts
    assert aws.devices_per_host == 4
    # (2, 8): a row spans two hosts, so only a host's 4 column rings cross its NIC (Eq. 3's
    # literal d2 would be 8), and each row crosses both its hosts' NICs alone
    assert mesh_bandwidths(aws, (2, 8)).link == (1.25e9 / 4, 1.25e9)
    # 3 hosts of 2: two 2-device rows from device 1, each spanning a host boundary; host 1's
    # NIC carries both (Eq. 3 never divides B'_2)
    c = Cluster.uniform(3, 2, inter_host_bandwidth=GB, intra_host_bandwidth=10 * GB)
    assert mesh_bandwidths(c, (1, 2), replicas=2, first_device=1).link == (math.inf, GB / 2)
    assert mesh_bandwidths(c, (1, 2), first_device=1).link == (math.inf, GB)
    # data-parallel replicas on other hosts do not share: (2, 2) on hosts {0, 1} and {2, 3}
    c = Cluster.uniform(4, 2, inter_host_bandwidth=GB, intra_host_bandwidth=10 * GB)
    assert mesh_bandwidths(c, (2, 2), replicas=2).link == mesh_bandwidths(c, (2, 2)).link == (GB / 2, 10 * GB)


def _reference_links(cluster, shape, first=0):
    """Slowest link per axis, ring by ring in plain Python: a ring visits its members in id
    order and wraps; a hop between hosts gets the NIC over the hops leaving its source host
    or entering its destination host, whichever more."""
    hosts = [h for h, devs in enumerate(cluster.host_devices) for _ in devs][first:]
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    out = []
    for axis, size in enumerate(shape):
        if size == 1:
            out.append(math.inf)
            continue
        hops = []
        for index in itertools.product(*(range(n) if k != axis else [0] for k, n in enumerate(shape))):
            base = sum(i * s for i, s in zip(index, strides))
            ring = [hosts[base + j * strides[axis]] for j in range(size)]
            hops += [(ring[j], ring[(j + 1) % size]) for j in range(size)]
        leaving = {h: sum(1 for a, b in hops if a == h and a != b) for h in set(hosts)}
        entering = {h: sum(1 for a, b in hops if b == h and a != b) for h in set(hosts)}
        out.append(min(cluster.intra_host_bandwidth if a == b else
                       cluster.inter_host_bandwidth / max(leaving[a], entering[b]) for a, b in hops))
    return tuple(out)


@pytest.mark.parametrize("seed", range(12))
def test_bandwidths_equal_a_ring_by_ring_reference(seed):
    rng = np.random.default_rng(seed)
    hosts, per = int(rng.integers(1, 5)), int(rng.integers(1, 7))
    c = Cluster.uniform(hosts, per, inter_host_bandwidth=float(rng.uniform(1, 10)) * GB,
                        intra_host_bandwidth=float(rng.uniform(0.5, 50)) * GB)
    for _ in range(10):
        first = int(rng.integers(0, c.num_devices))
        n = c.num_devices - first
        sizes = [k for k in range(1, n + 1) if n % k == 0]
        replicas = int(rng.choice(sizes))
        d1 = int(rng.choice([k for k in sizes if (n // replicas) % k == 0]))
        d2 = int(rng.integers(1, n // (replicas * d1) + 1))
        got = mesh_bandwidths(c, (d1, d2), replicas=replicas, first_device=first).link
        assert got == pytest.approx(_reference_links(c, (replicas, d1, d2), first)[1:])


# -- Eq. 2 (§3.2-3.3) ------------------------------------------------------------------------


def test_row_and_column_first_gemms_of_section_3_2():
    # Y = X W, X [b, h1], W [h1, h2] on DeviceMesh(d1, d2): row-first reduces [b, h2 / d2]
    # along axis 1, column-first [b, h2 / d1] along axis 2
    assert gemm_all_reduce("row", 6, 12, (2, 3)) == (1, 6 * 12 / 3)
    assert gemm_all_reduce("column", 6, 12, (2, 3)) == (2, 6 * 12 / 2)
    # column-first is row-first with the mesh transposed in the communication
    for d1, d2 in [(1, 8), (2, 4), (4, 2), (3, 5)]:
        axis, volume = gemm_all_reduce("column", 4, 16, (d1, d2))
        axis_t, volume_t = gemm_all_reduce("row", 4, 16, (d2, d1))
        assert (axis, axis_t, volume) == (2, 1, volume_t)
    # on a square mesh both move the same
    assert gemm_all_reduce("row", 4, 16, (4, 4))[1] == gemm_all_reduce("column", 4, 16, (4, 4))[1]


@pytest.mark.parametrize("seed", range(10))
def test_eq2_is_the_layer_of_section_3_2_1(seed):
    # column-first QKV (h -> 3h) and FFN up (h -> 4h), row-first attention output and FFN
    # down (-> h): Eq. 2's bracket is their forward all-reduces
    rng = np.random.default_rng(seed)
    d1, d2 = (int(x) for x in rng.integers(1, 9, 2))
    b1, b2 = (float(x) for x in rng.uniform(0.5, 50, 2) * GB)
    tokens, h, e = 4 * 2048, 1024, 2
    bandwidth = {1: b1, 2: b2}
    by_gemm = 0.0
    for first, width in [("column", 3), ("row", 1), ("column", 4), ("row", 1)]:
        axis, elements = gemm_all_reduce(first, tokens, width * h, (d1, d2))
        if (d1, d2)[axis - 1] > 1:
            by_gemm += elements * e / bandwidth[axis]
    assert atp_pass_seconds((d1, d2), (b1, b2), tokens * h * e) == pytest.approx(by_gemm)


def test_megatron_is_the_n_by_1_mesh():
    # §2.3: 4 all-reduces of [b, s, h] per layer (2 forward, 2 backward): 4 b s h / B;
    # §3.2.1: DeviceMesh(N, 1) is Megatron-LM's tensor parallelism
    aws = Cluster.aws_p3_8xlarge(2)
    b, s, h = 4, 2048, 4096
    bw = mesh_bandwidths(aws, (8, 1))
    megatron = megatron_layer_comm(bw, b, s, h)
    B = 8 / 14 * 1.25e9  # one ring over both hosts' NICs
    assert megatron.total_s == pytest.approx(4 * b * s * h * 2 / B)
    assert megatron.forward_s == megatron.backward_s
    assert atp_layer_comm(bw, b, s, h) == megatron
    layer = LayerProfile(1.0, 0.0, 0.0, 0.0, 0.0, tp_bytes=2 * s * h * 2)
    assert megatron_profile_comm(layer, bw, b) == pytest.approx(megatron)
    assert atp_profile_comm(layer, bw, b) == pytest.approx(megatron)
    assert megatron_layer_comm(mesh_bandwidths(aws, (1, 1)), b, s, h).total_s == 0.0


def test_profile_comm_equals_explicit_shapes():
    cluster = Cluster.dgx_h100(2)
    b, s, h = 3, 512, 2048
    layer = LayerProfile(1.0, 0.0, 0.0, 0.0, 0.0, tp_bytes=2 * s * h * 2)  # Megatron: 2 FP16 [s, h]
    for mesh in mesh_shapes(16):
        bw = mesh_bandwidths(cluster, mesh)
        assert atp_profile_comm(layer, bw, b) == pytest.approx(atp_layer_comm(bw, b, s, h))
    assert atp_profile_comm(LayerProfile(1.0, 0.0, 0.0, 0.0, 0.0), bw, b).total_s == 0.0


# -- the paper's numbers (§5.3-5.4) ------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64])
def test_closed_form_of_section_5_4(n):
    # IC5/IC6: B'_1 = B'_2 = GroupBW; Eqs. 2 and 4 give 2 L b s h / GroupBW · (14 d2 + 4 d1 - 18) / (d1 d2)
    for d1, d2 in mesh_shapes(n):
        assert _factor(_one_level(n), (d1, d2)) == pytest.approx(_closed_form(d1, d2))
        # the same matrix as one device per host: the NICs never shared
        flat = Cluster.uniform(n, 1, inter_host_bandwidth=GB, intra_host_bandwidth=GB)
        assert _factor(flat, (d1, d2)) == pytest.approx(_closed_form(d1, d2))


def test_mesh_choice_of_section_5_3_on_one_layer_interconnects():
    # §5.3: on one-layer (fully connected) matrices "ATP selects ATP-1 when the number of
    # devices is less than 8 and ATP-2 when it is greater than 8" (ATP-i is DeviceMesh(N/i, i)),
    # ATP-2 for IC4's 16 GPUs
    for n in (2, 4):
        assert choose_mesh(_one_level(n), n, 4, 2048, 4096).best.mesh == (n, 1)
    assert choose_mesh(_one_level(16), 16, 4, 2048, 4096).best.mesh == (8, 2)
    # at exactly 8 (IC3), where the paper measured ATP-1 best, Eqs. 2 and 4 already prefer
    # ATP-2 by 26/28: ATP-2 beats ATP-1 iff (2N + 10) / N < (4N - 4) / N, i.e. N > 7
    ranked = choose_mesh(_one_level(8), 8, 4, 2048, 4096).ranked
    assert [c.mesh for c in ranked[:2]] == [(4, 2), (8, 1)]
    assert ranked[0].total_s / ranked[1].total_s == pytest.approx(26 / 28)
    # past 16 the full search leaves ATP-2: ATP-4 at 32 and 64 (70/32 < 74/32, 102/64 < 138/64)
    assert choose_mesh(_one_level(32), 32, 1, 1, 1).best.mesh == (8, 4)
    assert choose_mesh(_one_level(64), 64, 1, 1, 1).best.mesh == (16, 4)


def test_trends_of_figure_12():
    # "the communication cost increases with scaling in ATP-1, while the cost decreases in ATP-2
    # and ATP-4"; ATP-OPT falls as ATP scales (from 8 devices on); Megatron's curve is ATP-1's
    sizes = [2**k for k in range(3, 11)]
    atp = {i: [_factor(_one_level(n), (n // i, i)) for n in sizes] for i in (1, 2, 4)}
    assert all(x < y for x, y in zip(atp[1], atp[1][1:]))
    assert all(x > y for x, y in zip(atp[2], atp[2][1:]))
    assert all(x > y for x, y in zip(atp[4], atp[4][1:]))
    best = [choose_mesh(_one_level(n), n, 1, 1, 1, bytes_per_element=1).best.total_s * GB / 2 for n in sizes]
    assert all(x > y for x, y in zip(best, best[1:]))
    # their limits in units of Δ = 2 L b s h / GroupBW: 4, 2, 1
    assert atp[1][-1] == pytest.approx(4 * (1 - 1 / 1024))
    assert atp[2][-1] == pytest.approx(2 + 10 / 1024)
    assert atp[4][-1] == pytest.approx(1 + 38 / 1024)
    megatron = [megatron_layer_comm(mesh_bandwidths(_one_level(n), (n, 1)), 1, 1, 1, bytes_per_element=1).total_s
                * GB / 2 for n in sizes]
    assert megatron == pytest.approx(atp[1])


def test_calibrated_ic1_of_section_5_3():
    # IC1 (PCIe): calibrated B_1 = 1.20 GB/s, B_2 = 4.95 GB/s on DeviceMesh(2, 4) and
    # B_1 = 0.97 GB/s on DeviceMesh(8, 1); "Using Equation 2, the T_comm of ATP-4 was
    # theoretically 46% lower than that of ATP-1"
    atp4 = atp_pass_seconds((2, 4), (1.20 * GB, 4.95 * GB), 1.0)
    atp1 = atp_pass_seconds((8, 1), (0.97 * GB, math.nan), 1.0)  # axis 2 of size 1: unread
    assert 1 - atp4 / atp1 == pytest.approx(0.46, abs=0.006)


def test_search_space_of_section_3_2_1():
    # "if we have 2^n devices, then we will have n + 1 kinds of 2D device meshes"
    for n in range(7):
        assert len(mesh_shapes(2**n)) == n + 1
    assert mesh_shapes(8) == ((8, 1), (4, 2), (2, 4), (1, 8))
    assert mesh_shapes(12) == ((12, 1), (6, 2), (4, 3), (3, 4), (2, 6), (1, 12))
    # Google's 2D-torus inference layout on q^2 TPUs is DeviceMesh(q/2, 2q): in the space
    for q in (2, 4, 8):
        assert (q // 2, 2 * q) in mesh_shapes(q * q)
        assert (q // 2, 2 * q) in [c.mesh for c in choose_mesh(_one_level(q * q), q * q, 1, 1, 1).ranked]


def test_single_host_megatron_is_beaten_only_as_the_closed_form_allows():
    # one host, one bandwidth: ATP's best over Megatron is min (14 d2 + 4 d1 - 18) / (4 N - 4);
    # 1 below 8 devices (Megatron optimal), 26/28 at 8, falling beyond
    for n in (2, 3, 4, 6, 8, 12, 16, 32):
        choice = choose_mesh(_one_level(n, 300 * GB), n, 4, 2048, 4096)
        megatron = megatron_layer_comm(mesh_bandwidths(_one_level(n, 300 * GB), (n, 1)), 4, 2048, 4096)
        ratio = choice.best.total_s / megatron.total_s
        assert ratio == pytest.approx(min(_closed_form(d1, d2) for d1, d2 in mesh_shapes(n)) / _closed_form(n, 1))
        assert ratio <= 1.0
        if n < 8:
            assert choice.best.mesh == (n, 1) and ratio == 1.0


# -- hierarchical clusters by hand -------------------------------------------------------------


def test_ic2_like_pairs_pick_by_eq4():
    # IC2: 4 NVLink pairs over PCIe. Per pass (units b s h): ATP-1 = 2 / (4/7 G1) = 3.5 / G1;
    # ATP-2 = 7 / (4 G2) + 2 / (2 · 4/6 · G1 / 2) = 1.75 / G2 + 3 / G1; ATP-4, ATP-8 cross PCIe
    # on axis 2 (5.25 / G1 and more). So ATP-2 wins iff G2 > 3.5 G1. The paper concludes ATP-1
    # for IC2 by taking B_1 = GroupBW / d2 (Eq. 3 without Eq. 4's factor), which makes the
    # second term equal for all meshes: Eqs. 2-4 as written do not give it.
    for ratio, best in [(3.4, (8, 1)), (3.6, (4, 2)), (20.0, (4, 2))]:
        pairs = Cluster.uniform(4, 2, inter_host_bandwidth=GB, intra_host_bandwidth=ratio * GB)
        choice = choose_mesh(pairs, 8, 1, 1, 1, bytes_per_element=1)
        assert choice.best.mesh == best
        per_pass = {c.mesh: c.forward_s * GB for c in choice.ranked}
        assert per_pass[(8, 1)] == pytest.approx(3.5)
        assert per_pass[(4, 2)] == pytest.approx(1.75 / ratio + 3)
        assert per_pass[(2, 4)] == pytest.approx(5.25 + 2 / (4 * GB / 2) * GB)


def test_nvlink_hosts_over_a_slow_network_pick_a_host_wide_axis_2():
    # 4 V100 per host, 10 Gbit/s NICs: axis 1's time is 4 (1 - d2 / N) / B'_NIC per b s h,
    # falling as d2 grows to a host; wider d2 sends axis 2 across the NICs. (4, 4) on 16:
    # 7 / (4 · 4/6 · 130 GB/s) + 2 / (4 · 4/6 · 1.25 GB/s / 4) per pass
    aws = Cluster.aws_p3_8xlarge(4)
    choice = choose_mesh(aws, 16, 1, 1, 1, bytes_per_element=1)
    assert choice.best.mesh == (4, 4)
    assert choice.best.forward_s == pytest.approx(7 / (4 * 4 / 6 * 130e9) + 2 / (4 * 4 / 6 * 1.25e9 / 4))
    for hosts in (2, 8):
        assert choose_mesh(Cluster.aws_p3_8xlarge(hosts), 4 * hosts, 1, 1, 1).best.mesh == (hosts, 4)
    # IC4 as a two-layer matrix (2 hosts of 8 A100, 200 Gbit/s IB, NVLink): (2, 8), a
    # hierarchical all-reduce, where §5.3's one-layer reading of IC4 gives ATP-2
    ic4 = Cluster.uniform(2, 8, inter_host_bandwidth=25 * GB, intra_host_bandwidth=300 * GB)
    choice = choose_mesh(ic4, 16, 1, 1, 1, bytes_per_element=1)
    assert choice.best.mesh == (2, 8)
    assert choice.best.forward_s == pytest.approx(7 / (2 * 8 / 14 * 300 * GB) + 2 / (8 * 25 * GB / 8))
    # H100 hosts whose NICs nearly match NVLink: Megatron's (16, 1), 2 / (16/30 · 400 GB/s)
    dgx = choose_mesh(Cluster.dgx_h100(2), 16, 1, 1, 1, bytes_per_element=1)
    assert dgx.best.mesh == (16, 1)
    assert dgx.best.forward_s == pytest.approx(2 / (16 / 30 * 400 * GB))


@pytest.mark.parametrize("seed", range(10))
def test_choose_mesh_is_the_brute_force_minimum(seed):
    rng = np.random.default_rng(seed)
    c = Cluster.uniform(int(rng.integers(1, 5)), int(rng.integers(1, 9)),
                        inter_host_bandwidth=float(rng.uniform(1, 50)) * GB,
                        intra_host_bandwidth=float(rng.uniform(1, 500)) * GB)
    n = int(rng.integers(1, c.num_devices + 1))
    first = int(rng.integers(0, c.num_devices - n + 1))
    b, s, h = 2, 128, 256
    choice = choose_mesh(c, n, b, s, h, first_device=first)
    times = {}
    for d1, d2 in itertools.product(range(1, n + 1), repeat=2):  # every ordered factorisation
        if d1 * d2 == n:
            links = _reference_links(c, (1, d1, d2), first)[1:]
            B1, B2 = (all_reduce_bandwidth(d, x) for d, x in zip((d1, d2), links))
            per_pass = (2 / (d2 * B1) if d1 > 1 else 0) + (7 / (d1 * B2) if d2 > 1 else 0)
            times[(d1, d2)] = 2 * b * s * h * 2 * per_pass
    assert choice.best.total_s == pytest.approx(min(times.values()))
    assert {r.mesh: r.total_s for r in choice.ranked} == pytest.approx(times)
    assert [r.total_s for r in choice.ranked] == sorted(r.total_s for r in choice.ranked)


# -- a stage's (data, model) shape -------------------------------------------------------------

SMALL = Cluster.uniform(2, 2, inter_host_bandwidth=GB, intra_host_bandwidth=10 * GB)


def _layer(tp_bytes, param_bytes):
    return LayerProfile(flops=1.0, param_bytes=param_bytes, optimizer_bytes=0.0, activation_bytes=0.0,
                        boundary_bytes=0.0, tp_bytes=tp_bytes)


def test_best_data_model_shape_by_hand():
    # 2 hosts of 2, batch 4; T = tp_bytes, P = param_bytes, times in 1 / GB:
    #   (4, 1): DP ring over both NICs alone, 2 · 3/4 · P = 1.5 P
    #   (2, 2), mesh (2, 1): DP rings {0, 2}, {1, 3} share the NICs: 2 · 1/2 · P/2 / 0.5 = P;
    #                        TP in a host: 2 passes · 2 · (2 examples · T/2) / 10 = 0.4 T
    #   (1, 4), mesh (2, 2): 2 passes · (7 · 2T / (2 · 10) + 2 · 2T / (2 · 0.5)) = 9.4 T
    for T, P, shape, mesh, seconds in [(1e5, 1e6, (1, 4), (2, 2), 9.4e5), (2e5, 1e6, (2, 2), (2, 1), 1.08e6),
                                       (2e6, 1e6, (4, 1), (1, 1), 1.5e6)]:
        best = best_data_model_shape(_layer(T, P), SMALL, 4, 4)
        assert (best.shape, best.mesh) == (shape, mesh)
        assert best.seconds == pytest.approx(seconds / GB)
    # nothing to move: no tensor parallelism; only parameters: no data parallelism
    assert best_data_model_shape(_layer(0.0, 0.0), SMALL, 4, 4).shape == (4, 1)
    assert best_data_model_shape(_layer(0.0, 1e6), SMALL, 4, 4).shape == (1, 4)


def _brute_force_shape(layer, cluster, n, batch, micro, first):
    best = None
    for t in range(1, n + 1):
        d = n // t
        if n % t or (batch // micro) % d:
            continue
        B = _reference_links(cluster, (d, t), first)[0]
        dp = 0.0 if d == 1 else 2 * (d - 1) / d * layer.param_bytes / t / B
        for d1, d2 in mesh_shapes(t):
            bw = MeshBandwidths((d1, d2), _reference_links(cluster, (d, d1, d2), first)[1:])
            tp = 2 * atp_pass_seconds((d1, d2), bw.all_reduce, batch / d * layer.tp_bytes / 2)
            if best is None or dp + tp < best[0] - 1e-15:
                best = (dp + tp, (d, t))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_best_data_model_shape_is_the_brute_force_minimum(seed):
    rng = np.random.default_rng(50 + seed)
    c = Cluster.uniform(int(rng.integers(1, 5)), int(rng.integers(1, 9)),
                        inter_host_bandwidth=float(rng.uniform(1, 50)) * GB,
                        intra_host_bandwidth=float(rng.uniform(1, 500)) * GB)
    n = int(rng.integers(1, c.num_devices + 1))
    first = int(rng.integers(0, c.num_devices - n + 1))
    micro = int(rng.choice([1, 2, 4]))
    batch = micro * int(rng.choice([1, 2, 4, 6, 8, 16]))
    layer = _layer(float(rng.uniform(0, 1e7)), float(rng.uniform(0, 1e9)))
    got = best_data_model_shape(layer, c, n, batch, num_micro_batches=micro, first_device=first)
    seconds, _ = _brute_force_shape(layer, c, n, batch, micro, first)
    assert isinstance(got, DataModelShape)
    assert got.seconds == pytest.approx(seconds)
    assert got.data * got.model == n and got.mesh[0] * got.mesh[1] == got.model
    assert (batch // micro) % got.data == 0


# -- validation --------------------------------------------------------------------------------


def test_invalid_inputs_raise_value_error_naming_the_argument():
    layer = _layer(1e5, 1e6)
    bw = mesh_bandwidths(SMALL, (2, 2))
    cases = [
        ("ring_size", lambda: all_reduce_bandwidth(0, GB)),
        ("link_bandwidth", lambda: all_reduce_bandwidth(2, -1.0)),
        ("link_bandwidth", lambda: all_reduce_bandwidth(2, math.nan)),
        ("mesh", lambda: mesh_bandwidths(SMALL, (2, 0))),
        ("mesh", lambda: mesh_bandwidths(SMALL, (2, 2, 1))),
        ("mesh", lambda: mesh_bandwidths(SMALL, 4)),
        ("mesh", lambda: mesh_bandwidths(SMALL, (2.0, 2))),
        ("first_device", lambda: mesh_bandwidths(SMALL, (2, 2), first_device=1)),
        ("first_device", lambda: mesh_bandwidths(SMALL, (1, 1), first_device=-1)),
        ("replicas", lambda: mesh_bandwidths(SMALL, (1, 2), replicas=0)),
        ("first_device", lambda: mesh_bandwidths(SMALL, (1, 2), replicas=3)),
        ("cluster", lambda: mesh_bandwidths("cluster", (1, 1))),
        ("first", lambda: gemm_all_reduce("diagonal", 4, 4, (2, 2))),
        ("rows", lambda: gemm_all_reduce("row", 0, 4, (2, 2))),
        ("bandwidths", lambda: atp_pass_seconds((2, 2), (GB, 0.0), 1.0)),
        ("bandwidths", lambda: atp_pass_seconds((2, 2), GB, 1.0)),
        ("hidden_state_bytes", lambda: atp_pass_seconds((2, 2), (GB, GB), math.inf)),
        ("hidden_state_bytes", lambda: atp_pass_seconds((2, 2), (GB, GB), -1.0)),
        ("bandwidths", lambda: atp_layer_comm((GB, GB), 1, 1, 1)),
        ("batch", lambda: atp_layer_comm(bw, 0, 1, 1)),
        ("bytes_per_element", lambda: atp_layer_comm(bw, 1, 1, 1, bytes_per_element=0)),
        ("hidden", lambda: atp_layer_comm(bw, 1, 1, math.inf)),
        ("bandwidths", lambda: megatron_layer_comm(bw, 1, 1, 1)),  # not an (N, 1) mesh
        ("layer", lambda: atp_profile_comm("layer", bw, 1)),
        ("batch_size", lambda: megatron_profile_comm(layer, mesh_bandwidths(SMALL, (4, 1)), -2)),
        ("num_devices", lambda: mesh_shapes(0)),
        ("num_devices", lambda: choose_mesh(SMALL, 0, 1, 1, 1)),
        ("first_device", lambda: choose_mesh(SMALL, 4, 1, 1, 1, first_device=2)),
        ("seq", lambda: choose_mesh(SMALL, 4, 1, 0, 1)),
        ("num_devices", lambda: best_data_model_shape(layer, SMALL, 0, 4)),
        ("first_device", lambda: best_data_model_shape(layer, SMALL, 5, 4)),
        ("batch_size", lambda: best_data_model_shape(layer, SMALL, 4, 0)),
        ("num_micro_batches", lambda: best_data_model_shape(layer, SMALL, 4, 4, num_micro_batches=3)),
        ("num_micro_batches", lambda: best_data_model_shape(layer, SMALL, 4, 4, num_micro_batches=0)),
        ("layer", lambda: best_data_model_shape(None, SMALL, 4, 4)),
        ("cluster", lambda: best_data_model_shape(layer, None, 4, 4)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=rf"^{name}:"):
            call()


def test_results_are_frozen():
    comm = atp_layer_comm(mesh_bandwidths(SMALL, (2, 2)), 1, 1, 1)
    assert isinstance(comm, LayerComm)
    with pytest.raises(AttributeError):
        comm.forward_s = 0.0
