"""ATP's tensor-parallel cost model (Cheng et al., "ATP: Adaptive Tensor Parallelism for
Foundation Models", 2023; seeds/002): the communication of a transformer layer under
tensor parallelism on a 2D device mesh ``DeviceMesh(d1, d2)``, the bandwidth of each mesh axis
from the hierarchical communication matrix, and the choice of the mesh with the least
communication time; plus the (data, model) shape of a pipeline stage that adds data
parallelism's gradient all-reduce, for meshpar's planner.

The paper's model (units: bytes, bytes/s, seconds; ``h`` is bytes of one token's hidden state,
``h_elements · bytes_per_element``, the paper's FP16 being 2 bytes):

    GEMM Y = X W, X [b, h1], W [h1, h2], forward (§3.2, Fig. 5):
      row-first    (W: [Shard(0), Shard(1)]): all-reduce [b, h2 / d2] along axis 1
      column-first (W: [Shard(1), Shard(0)]): all-reduce [b, h2 / d1] along axis 2
    transformer layer (§3.2.1, Fig. 6): column-first QKV (h -> 3h) and FFN up (h -> 4h),
      row-first attention output (h -> h) and FFN down (4h -> h); L layers, both passes:
    T_comm = 2 L b s · (7h / (d1 B_2) + 2h / (d2 B_1))                               (Eq. 2)
    B'_1   = min(GroupBW_{1..i} / d2),   B'_2 = min(GroupBW_{i(+1)..l})                (Eq. 3)
    B_k    = d_k / (2 (d_k - 1)) · B'_k          (Rabenseifner's all-reduce, latency ignored) (Eq. 4)

The ``2`` of Eq. 2 is forward plus backward: the paper prices the backward's conjugate
all-reduces (§3.2.1, the ``f_i`` of Fig. 6) as the forward's, and counts all-reduces only (not
the attention block's scatter and gather). ``DeviceMesh(N, 1)`` is Megatron-LM's 1D tensor
parallelism: Eq. 2 becomes §2.3's ``4 L b s h / B``. ATP picks, among all ``(d1, d2)`` with
``d1 · d2 = N`` (``n + 1`` meshes for ``2^n`` devices, §3.2.1), the least ``T_comm`` (§3.5).

A ``meshpar.cluster.Cluster`` is a two-layer hierarchical communication matrix (§3.4): layer 1
the hosts, each host's group bandwidth its NIC (``inter_host_bandwidth``, each direction);
layer 2 a host's devices, point-to-point ``intra_host_bandwidth``. Devices are laid out
host-major in the cluster's order, the mesh's last axis fastest (device ``i1 · d2 + i2``).
Where this module departs from the letter of Eq. 3 (``mesh_bandwidths``): a NIC's bandwidth is
divided by the rings actually crossing it, which is Eq. 3's ``d2`` whenever each host holds
whole axis-2 rows (``d2`` divides the devices per host), as in every case the paper works out,
but ``devices_per_host`` when a row spans hosts; and ``Cluster.latency`` is ignored, as Eq. 4
ignores it.

Eqs. 2-4 as written do not reproduce two of §5.3's conclusions (tests/planning/test_planner_atp.py):
on 8 fully connected GPUs (IC3) they prefer ``DeviceMesh(4, 2)`` to Megatron's by 26/28 (the
paper measured ``(8, 1)`` best; its crossover "8" is 7 in the formula), and on NVLink pairs over
PCIe (IC2) ``(4, 2)`` wins once NVLink is 3.5 times PCIe (the paper's argument for ``(8, 1)``
takes ``B_1 = GroupBW / d2``, dropping Eq. 4's factor). This module follows the equations.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers

import numpy as np

from ..model.cluster import Cluster
from ..policies import Policy
from ..simulation.collectives import ring_all_reduce_s

from .layer_profile import LayerProfile

__all__ = [
    "GemmSplit",
    "DataModelShape",
    "LayerComm",
    "MeshBandwidths",
    "MeshChoice",
    "all_reduce_bandwidth",
    "atp_layer_comm",
    "atp_pass_seconds",
    "atp_profile_comm",
    "best_data_model_shape",
    "choose_mesh",
    "gemm_all_reduce",
    "megatron_layer_comm",
    "megatron_profile_comm",
    "mesh_bandwidths",
    "mesh_shapes",
]

# Eq. 2's widths, in hidden sizes: the column-first GEMMs' outputs all-reduced along axis 2
# (QKV 3h + FFN up 4h), the row-first GEMMs' along axis 1 (attention output h + FFN down h).
_AXIS2_WIDTH = 7
_AXIS1_WIDTH = 2


# -- validation ----------------------------------------------------------------------------


def _positive(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (0 < value < math.inf):
        raise ValueError(f"{name}: expected a positive finite number, got {value!r}")
    return float(value)


def _count(name: str, value, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        raise ValueError(f"{name}: expected an integer >= {least}, got {value!r}")
    return int(value)


def _mesh(mesh) -> tuple[int, int]:
    try:
        d1, d2 = mesh
    except (TypeError, ValueError):
        raise ValueError(f"mesh: expected (d1, d2), two positive integers, got {mesh!r}") from None
    if any(isinstance(d, bool) or not isinstance(d, numbers.Integral) or d < 1 for d in (d1, d2)):
        raise ValueError(f"mesh: expected (d1, d2), two positive integers, got {mesh!r}")
    return int(d1), int(d2)


def _cluster(cluster) -> Cluster:
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster: expected a meshpar.cluster.Cluster, got {type(cluster).__name__}")
    return cluster


# -- bandwidths (§3.4-3.5, Eqs. 3-4) ---------------------------------------------------------


def all_reduce_bandwidth(ring_size: int, link_bandwidth: float) -> float:
    """Eq. 4: the algorithm bandwidth of an all-reduce over ``ring_size`` devices whose
    bottleneck link carries ``link_bandwidth`` (``B'_k``), latency ignored:

        B_k = d_k / (2 (d_k - 1)) · B'_k

    so an all-reduce of ``M`` bytes takes ``M / B_k = 2 (d_k - 1) / d_k · M / B'_k`` (a ring's
    reduce-scatter plus all-gather): ``collectives.ring_all_reduce_s`` without latency, kept in
    the paper's bandwidth form because Eq. 5 composes the two axes' bandwidths. ``B_k = B'_k``
    at ``d_k = 2``, tends to ``B'_k / 2`` as ``d_k`` grows, and is ``inf`` at ``d_k = 1``
    (nothing to reduce).
    """
    n = _count("ring_size", ring_size)
    if not link_bandwidth > 0:  # also rejects NaN; inf is a free link
        raise ValueError(f"link_bandwidth: expected a positive number of bytes/s, got {link_bandwidth!r}")
    return math.inf if n == 1 else n / (2.0 * (n - 1)) * float(link_bandwidth)


@dataclasses.dataclass(frozen=True)
class MeshBandwidths:
    """The bandwidths of the two axes of a ``DeviceMesh(d1, d2)`` on a cluster.

    Attributes:
      mesh: ``(d1, d2)``.
      link: ``(B'_1, B'_2)`` (Eq. 3), bytes/s of the bottleneck link of the slowest ring along
        each axis while every ring of that axis runs; ``inf`` for an axis of size 1.
    """

    mesh: tuple[int, int]
    link: tuple[float, float]

    @property
    def all_reduce(self) -> tuple[float, float]:
        """``(B_1, B_2)``, Eq. 4 on ``link``."""
        return (all_reduce_bandwidth(self.mesh[0], self.link[0]), all_reduce_bandwidth(self.mesh[1], self.link[1]))


@functools.lru_cache(maxsize=4096)
def _ring_links(cluster: Cluster, shape: tuple[int, ...], first_device: int) -> tuple[float, ...]:
    """Per axis of devices ``first_device ..`` laid out host-major as ``shape`` (last axis
    fastest): the slowest link of any of its rings while they all run, ``inf`` for size 1."""
    host_of = np.array([h for h, devs in enumerate(cluster.host_devices) for _ in devs], dtype=np.int64)
    hosts = host_of[first_device:first_device + math.prod(shape)].reshape(shape)
    links = []
    for axis, size in enumerate(shape):
        if size == 1:
            links.append(math.inf)
            continue
        # a ring visits its members in id order: host by host, each host entered and left once
        src, dst = hosts, np.roll(hosts, -1, axis=axis)
        across = src != dst
        slowest = cluster.intra_host_bandwidth if not across.all() else math.inf
        if across.any():
            leaving = np.bincount(src[across], minlength=cluster.num_hosts)
            entering = np.bincount(dst[across], minlength=cluster.num_hosts)
            sharing = np.maximum(leaving[src[across]], entering[dst[across]]).max()
            slowest = min(slowest, cluster.inter_host_bandwidth / float(sharing))
        links.append(float(slowest))
    return tuple(links)


def _check_placement(cluster: Cluster, num_devices: int, first_device) -> int:
    first = _count("first_device", first_device, least=0)
    if first + num_devices > cluster.num_devices:
        raise ValueError(f"first_device: devices {first} .. {first + num_devices - 1} do not fit the cluster's "
                         f"{cluster.num_devices} devices")
    return first


def mesh_bandwidths(cluster: Cluster, mesh: tuple[int, int], *, replicas: int = 1,
                    first_device: int = 0) -> MeshBandwidths:
    """Eq. 3 on ``cluster``: ``B'_k``, the bandwidth one ring along mesh axis ``k`` gets.

    The mesh's ``d1 · d2`` devices are the cluster's devices ``first_device ..`` in host-major
    order, axis 2 fastest; ``replicas`` copies of it follow one another (a data-parallel
    outer axis), every copy running its all-reduces at the same time.

    Eq. 3 takes the smallest group bandwidth of the hierarchy's layers an axis spans, dividing
    a layer's by the rings sharing it (§3.4: "d2 groups of all-reduce share the interconnection
    bandwidth, so we need to divide the bandwidth by d2"), the point-to-point matrix capping it
    where a ring cannot use a group's full bandwidth (its example: ``DeviceMesh(8, 2)`` on 4
    hosts of 4 GPUs, 200 Gbit/s between hosts and 200 GB/s between two GPUs, has
    ``B'_2 = 200 GB/s`` and ``B'_1 = 25 / 2 = 12.5 GB/s``). On a ``Cluster`` a ring runs at its
    slowest link:

    - between two devices of a host: ``intra_host_bandwidth`` (point to point: a ring uses one
      link per neighbour, so rings on other devices do not slow it);
    - between hosts: ``inter_host_bandwidth / r``, ``r`` the rings of the axis (of every
      replica) leaving, or entering, the sending (receiving) host's NIC, whichever more.

    ``r`` is Eq. 3's ``d2`` for axis 1 when axis 2 stays in a host (``d2`` divides the
    devices per host and the mesh starts on a host boundary), the paper's case; when axis-2
    rows span hosts only a host's ``devices_per_host`` rings share its NIC, and axis-2 rings
    crossing hosts share it too where a host holds parts of several (Eq. 3 never divides
    ``B'_2``).

    Returns:
      ``B'_1, B'_2`` (``.link``) and Eq. 4's ``B_1, B_2`` (``.all_reduce``).

    Raises:
      ValueError: a malformed mesh, or devices beyond the cluster's.
    """
    cluster = _cluster(cluster)
    d1, d2 = _mesh(mesh)
    copies = _count("replicas", replicas)
    first = _check_placement(cluster, copies * d1 * d2, first_device)
    _, b1, b2 = _ring_links(cluster, (copies, d1, d2), first)
    return MeshBandwidths((d1, d2), (b1, b2))


# -- communication of a layer (§2.3, §3.2-3.3, Eq. 2) ---------------------------------------


class GemmSplit(Policy):
    """Which dimension of a GEMM's weight the mesh's first axis shards (§3.2, Fig. 5)."""

    ROW = "row"  # W [Shard(0), Shard(1)]: the partial products are summed along mesh axis 1
    COLUMN = "column"  # W [Shard(1), Shard(0)]: summed along mesh axis 2

    @property
    def reduced_axis(self) -> int:
        """The mesh axis (1 or 2) the forward all-reduce runs along."""
        return 1 if self is GemmSplit.ROW else 2


def gemm_all_reduce(first: str | GemmSplit, rows: float, out_features: float,
                    mesh: tuple[int, int]) -> tuple[int, float]:
    """The forward all-reduce of one GEMM ``Y = X W`` (``X`` of ``rows`` rows, ``W`` of
    ``out_features`` columns) on ``DeviceMesh(d1, d2)`` (§3.2, Fig. 5):

    - ``first="row"``: ``W`` is ``[Shard(0), Shard(1)]``, ``X`` ``[Shard(1), Replicate]``;
      each device's partial ``Y`` is ``[rows, out_features / d2]``, summed along axis 1;
    - ``first="column"``: ``W`` is ``[Shard(1), Shard(0)]``, ``X`` ``[Replicate, Shard(1)]``;
      the partial ``Y`` is ``[rows, out_features / d1]``, summed along axis 2 (the mesh's
      dimensions transposed in the communication).

    Returns:
      ``(axis, elements)``: the mesh axis (1 or 2) of the all-reduce and the elements each
      device contributes; nothing moves when that axis has size 1.
    """
    dims = _mesh(mesh)
    _positive("rows", rows)
    _positive("out_features", out_features)
    axis = GemmSplit.of(first, "first").reduced_axis
    # Each device's partial Y keeps the output columns the other mesh axis shards.
    return axis, rows * out_features / dims[2 - axis]


def atp_pass_seconds(mesh: tuple[int, int], bandwidths: tuple[float, float], hidden_state_bytes: float) -> float:
    """One pass (forward, or backward) of one transformer layer on ``DeviceMesh(d1, d2)``:
    Eq. 2's bracket,

        T_pass = 7 · hidden_state_bytes / (d1 · B_2) + 2 · hidden_state_bytes / (d2 · B_1)

    Args:
      mesh: ``(d1, d2)``.
      bandwidths: ``(B_1, B_2)``, the all-reduce bandwidths of Eq. 4 (bytes/s; the paper's
        §5.3 calibrates them by measurement where the hierarchical matrix is off); an axis of
        size 1 moves nothing and its bandwidth is not read.
      hidden_state_bytes: bytes of one ``[b, s, h]`` tensor (``b · s · h · bytes_per_element``).
    """
    d1, d2 = _mesh(mesh)
    try:
        b1, b2 = bandwidths
    except (TypeError, ValueError):
        raise ValueError(f"bandwidths: expected (B_1, B_2) in bytes/s, got {bandwidths!r}") from None
    for k, (d, b) in enumerate(((d1, b1), (d2, b2)), start=1):
        if d > 1 and not b > 0:  # also rejects NaN; inf is a free axis
            raise ValueError(f"bandwidths: expected B_{k} > 0 bytes/s for an axis of size {d}, got {b!r}")
    if not 0 <= hidden_state_bytes < math.inf:
        raise ValueError(f"hidden_state_bytes: expected a finite number of bytes >= 0, got {hidden_state_bytes!r}")
    axis1 = 0.0 if d1 == 1 else _AXIS1_WIDTH * hidden_state_bytes / (d2 * b1)
    axis2 = 0.0 if d2 == 1 else _AXIS2_WIDTH * hidden_state_bytes / (d1 * b2)
    return axis1 + axis2


@dataclasses.dataclass(frozen=True)
class LayerComm:
    """Seconds one transformer layer's tensor-parallel all-reduces take on ``mesh``.

    Attributes:
      mesh: ``(d1, d2)``; ``(N, 1)`` is Megatron-LM's 1D tensor parallelism.
      forward_s, backward_s: each pass (Eq. 2 prices them alike).
    """

    mesh: tuple[int, int]
    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        """Eq. 2 for ``L = 1``."""
        return self.forward_s + self.backward_s


def _hidden_state_bytes(batch, seq, hidden, bytes_per_element) -> float:
    return (_positive("batch", batch) * _positive("seq", seq) * _positive("hidden", hidden)
            * _positive("bytes_per_element", bytes_per_element))


def _profile_bytes(layer: LayerProfile, batch_size) -> float:
    if not isinstance(layer, LayerProfile):
        raise ValueError(f"layer: expected a LayerProfile, got {type(layer).__name__}")
    # tp_bytes is Megatron's forward: two all-reduces of the [s, h] hidden state per example
    return _positive("batch_size", batch_size) * layer.tp_bytes / 2.0


def _bandwidths(bandwidths) -> MeshBandwidths:
    if not isinstance(bandwidths, MeshBandwidths):
        raise ValueError(f"bandwidths: expected a MeshBandwidths (mesh_bandwidths), got {type(bandwidths).__name__}")
    return bandwidths


def _atp(bandwidths: MeshBandwidths, hidden_state_bytes: float) -> LayerComm:
    seconds = atp_pass_seconds(bandwidths.mesh, bandwidths.all_reduce, hidden_state_bytes)
    return LayerComm(bandwidths.mesh, seconds, seconds)


def atp_layer_comm(bandwidths: MeshBandwidths, batch: float, seq: float, hidden: float, *,
                   bytes_per_element: float = 2) -> LayerComm:
    """ATP's all-reduces of one transformer layer with input ``[batch, seq, hidden]`` on the
    mesh of ``bandwidths`` (Eq. 2 with ``L = 1``: ``atp_pass_seconds`` each pass, ``B_k``
    from Eqs. 3-4). ``bytes_per_element``: 2 is the paper's FP16."""
    return _atp(_bandwidths(bandwidths), _hidden_state_bytes(batch, seq, hidden, bytes_per_element))


def atp_profile_comm(layer: LayerProfile, bandwidths: MeshBandwidths, batch_size: float) -> LayerComm:
    """``atp_layer_comm`` for ``batch_size`` examples of a profiled layer: its ``tp_bytes``
    (per example, Megatron's forward all-reduces: two of the ``[seq, hidden]`` hidden state)
    gives ``hidden_state_bytes = batch_size · tp_bytes / 2``. Eq. 2's widths assume a
    transformer layer (QKV ``3h``, FFN ``4h``); a layer without ``tp_bytes`` moves nothing."""
    return _atp(_bandwidths(bandwidths), _profile_bytes(layer, batch_size))


def _megatron(bandwidths: MeshBandwidths, hidden_state_bytes: float) -> LayerComm:
    n, d2 = bandwidths.mesh
    if d2 != 1:
        raise ValueError(f"bandwidths: Megatron's 1D tensor parallelism rings over all its devices: expected "
                         f"the bandwidths of an (N, 1) mesh, got {bandwidths.mesh}")
    b = all_reduce_bandwidth(n, bandwidths.link[0])
    seconds = 0.0 if n == 1 else 2.0 * hidden_state_bytes / b
    return LayerComm(bandwidths.mesh, seconds, seconds)


def megatron_layer_comm(bandwidths: MeshBandwidths, batch: float, seq: float, hidden: float, *,
                        bytes_per_element: float = 2) -> LayerComm:
    """Megatron-LM's 1D tensor parallelism, the baseline (§2.3): two all-reduces of the
    ``[batch, seq, hidden]`` hidden state per pass over all ``N`` devices,
    ``2 · b s h / B`` seconds each pass (``4 L b s h / B`` per step), ``B`` Eq. 4's bandwidth
    of the ``N``-device ring: ``bandwidths`` must be those of ``mesh_bandwidths(cluster,
    (N, 1))``. Equals ``atp_layer_comm`` on ``DeviceMesh(N, 1)`` (§3.2.1)."""
    return _megatron(_bandwidths(bandwidths), _hidden_state_bytes(batch, seq, hidden, bytes_per_element))


def megatron_profile_comm(layer: LayerProfile, bandwidths: MeshBandwidths, batch_size: float) -> LayerComm:
    """``megatron_layer_comm`` for ``batch_size`` examples of a profiled layer:
    ``batch_size · tp_bytes / B`` each pass."""
    return _megatron(_bandwidths(bandwidths), _profile_bytes(layer, batch_size))


# -- choosing the mesh (§3.5) ----------------------------------------------------------------


def mesh_shapes(num_devices: int) -> tuple[tuple[int, int], ...]:
    """ATP's search space (§3.2.1): every ``DeviceMesh(d1, d2)`` with ``d1 · d2 =
    num_devices``, both orders, ``d1`` falling (``(N, 1)``, Megatron's, first): ``n + 1``
    meshes for ``2^n`` devices."""
    n = _count("num_devices", num_devices)
    return tuple((d1, n // d1) for d1 in range(n, 0, -1) if n % d1 == 0)


@dataclasses.dataclass(frozen=True)
class MeshChoice:
    """ATP's choice (§3.5): ``best`` has the least ``total_s``; ``ranked`` is every candidate
    mesh, fastest first (ties: smaller ``d2``, closer to Megatron's ``(N, 1)``)."""

    best: LayerComm
    ranked: tuple[LayerComm, ...]


def _rank(comm: LayerComm) -> tuple[float, int]:
    return comm.total_s, comm.mesh[1]


def choose_mesh(cluster: Cluster, num_devices: int, batch: float, seq: float, hidden: float, *,
                bytes_per_element: float = 2, replicas: int = 1, first_device: int = 0) -> MeshChoice:
    """The ``DeviceMesh(d1, d2)`` of ``num_devices`` tensor-parallel devices with the least
    Eq. 2 time for a ``[batch, seq, hidden]`` transformer layer (§3.5): every mesh of
    ``mesh_shapes``, each priced by ``atp_layer_comm`` with ``mesh_bandwidths`` (same
    ``replicas`` and ``first_device``). The ranking does not depend on ``batch · seq · hidden``,
    which scales every time alike."""
    x = _hidden_state_bytes(batch, seq, hidden, bytes_per_element)
    ranked = sorted((_atp(mesh_bandwidths(cluster, mesh, replicas=replicas, first_device=first_device), x)
                     for mesh in mesh_shapes(num_devices)), key=_rank)
    return MeshChoice(ranked[0], tuple(ranked))


# -- a stage's (data, model) shape -----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataModelShape:
    """A stage's devices as ``data`` replicas of a ``model``-device tensor-parallel group,
    the group a ``DeviceMesh(mesh)``, and the communication of one step of one layer on it.

    Attributes:
      data, model: degrees; ``data · model`` is the stage's devices.
      mesh: ATP's ``(d1, d2)``, ``d1 · d2 = model``.
      tp_s: ATP's all-reduces, forward and backward, of one replica's ``batch / data``
        examples (replicas run theirs at once).
      dp_s: the gradient all-reduce, ``2 (data - 1) / data · param_bytes / model / B'``.
    """

    data: int
    model: int
    mesh: tuple[int, int]
    tp_s: float
    dp_s: float

    @property
    def shape(self) -> tuple[int, int]:
        """``(data, model)``, as meshpar's ``StagePlan.shape``."""
        return self.data, self.model

    @property
    def seconds(self) -> float:
        return self.tp_s + self.dp_s


def best_data_model_shape(layer: LayerProfile, cluster: Cluster, num_devices: int, batch_size: int, *,
                          num_micro_batches: int = 1, first_device: int = 0) -> DataModelShape:
    """The (data, model) shape of a stage of ``num_devices`` devices, and its ATP mesh, with
    the least communication per step of ``layer``: ATP's tensor-parallel time plus the
    data-parallel gradient all-reduce (compute, ``flops / num_devices`` per device, is the same
    for every shape). Pure arithmetic on cached bandwidths: cheap enough for a planner's
    inner loop.

    Devices ``first_device .. first_device + num_devices - 1`` of ``cluster`` (host-major) form
    a ``(data, model)`` mesh, model fastest, as meshpar's ``stage_meshes`` lays out stages;
    each model group is a ``DeviceMesh(d1, d2)``, axis 2 fastest. Over every ``model``
    dividing ``num_devices`` whose ``data`` divides each micro-batch, and every
    ``(d1, d2) = mesh_shapes(model)``:

        tp_s = atp_profile_comm(layer, mesh_bandwidths(cluster, (d1, d2), replicas=data),
                                batch_size / data).total_s
        dp_s = 2 (data - 1) / data · param_bytes / model / B'_data

    ``B'_data`` the bandwidth of the slowest data-parallel ring, priced as ``mesh_bandwidths``
    prices a mesh axis. The two never overlap here (the paper's tensor-parallel all-reduces are
    synchronous; the gradient all-reduce is added whole).

    Args:
      layer: per-example ``tp_bytes`` (Megatron's forward all-reduce bytes) and whole-layer
        ``param_bytes``.
      batch_size: examples per step through the stage.
      num_micro_batches: micro-batches per step; ``data`` must divide
        ``batch_size / num_micro_batches``.

    Returns:
      The fastest shape (ties: less tensor parallelism, then smaller ``d2``); seconds per step
      for this one layer (a stage's layers add up, the choice unchanged for identical layers).

    Raises:
      ValueError: malformed arguments, a batch not split into whole micro-batches, or devices
        beyond the cluster's.
    """
    cluster = _cluster(cluster)
    n = _count("num_devices", num_devices)
    batch = _count("batch_size", batch_size)
    micro = _count("num_micro_batches", num_micro_batches)
    if batch % micro:
        raise ValueError(f"num_micro_batches: {micro} does not divide batch_size {batch}")
    first = _check_placement(cluster, n, first_device)
    if not isinstance(layer, LayerProfile):
        raise ValueError(f"layer: expected a LayerProfile, got {type(layer).__name__}")
    best = None
    for model in (t for t in range(1, n + 1) if n % t == 0):
        data = n // model
        if (batch // micro) % data:
            continue
        dp_link = _ring_links(cluster, (data, model), first)[0]
        dp_s = ring_all_reduce_s(layer.param_bytes / model, data, dp_link)
        for mesh in mesh_shapes(model):
            bandwidths = mesh_bandwidths(cluster, mesh, replicas=data, first_device=first)
            tp_s = atp_profile_comm(layer, bandwidths, batch / data).total_s
            candidate = DataModelShape(data, model, mesh, tp_s, dp_s)
            if best is None or (candidate.seconds, model, mesh[1]) < (best.seconds, best.model, best.mesh[1]):
                best = candidate
    return best
