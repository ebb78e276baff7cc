"""The Galvatron-BMW planner (Wang et al., "Improving Automatic Parallel Training via Balanced
Memory Workload Optimization", seeds/001): its decision-tree strategy space (§III-B), its cost
estimator (§V), the layer-wise dynamic program under a memory budget (§IV-A2, Eq. 4, App. A
Alg. 3), the pipeline cost (Eq. 5, App. C Eq. 9) and the bi-objective partition adjustment
(§IV-B, Alg. 2, App. B).

Strategy space (§III-B). Pipeline parallelism is the first tree level (Takeaway #1: stages
across the slow links), splitting the ``N`` devices into ``pp`` equal groups (Takeaway #2); in a
group of ``g = N / pp`` devices every layer picks one decision tree: an ordered sequence of
distinct levels among DP, SDP and TP (none repeated), each of degree 2, 4, 8, ..., the degrees
multiplying to ``g``; and CKPT on or off. Takeaway #3 removes the trees holding both DP and SDP.
On 8 devices (pp = 1, 2, 4, 8; g = 8, 4, 2, 1) that is (21 + 9 + 3 + 1) · 2 = 68 strategies,
44 after Takeaway #3 (``strategy_space``).

Device layout of a tree. Stage ``j`` owns devices ``j·g .. (j+1)·g - 1`` of the cluster, host
by host. Levels go root to leaf: the leaf level's groups are consecutive devices, each level
above strides over the ones below, so a lower level stays inside a host where an upper one
crosses hosts (Takeaway #1's reasoning, applied inside the stage). A group inside one host
runs at ``intra_host_bandwidth``; one across hosts at ``inter_host_bandwidth`` divided by the
level's cross-host groups touching the busiest host (they all run at once and share its NIC).

Cost of layer ``l`` under strategy ``S`` for one micro-batch of ``b`` examples, ``n = dp·sdp``
data shards, ``e = b / n`` examples per device, ``F`` FLOP/s per device (``layer_cost``):

    comp_f = e · flops / (tp · F)                                  the forward's compute
    ar_tp  = all_reduce(e · tp_bytes, tp)                          one forward's TP all-reduces
    ag_sdp = all_gather(param_bytes / tp, sdp)                     SDP gathers the weights
    sync   = reduce_scatter(param_bytes / tp, sdp) + all_reduce(param_bytes / (tp·sdp), dp)
    fwd    = comp_f + ar_tp + ag_sdp                               (§V: the forward sums)
    bwd    = overlap((2 + ckpt) · comp_f, ag_sdp + sync) + (1 + ckpt) · ar_tp
    overlap(x, y) = max(x, y) + (1.3 - 1) · min(x, y)              (§V: both slow down 1.3x)

``c(l, S) = fwd + bwd``; ``c_no_grad_sync`` drops ``sync`` (App. C: only the last micro-batch
synchronises gradients). Backward compute is twice the forward (§V), CKPT adds one forward
and its TP all-reduces (§III-A3). A ring over ``k`` members (``collectives``, with the
cluster's per-message latency, as §V charges it): ``all_reduce(x, k) = 2(k-1) · (latency + x /
(k β))``, ``all_gather = reduce_scatter = (k-1) · (latency + x / (k β))``.

Memory per device (§III-A1, Eq. 1-3), bytes; gradients are as large as the parameters:

    O_ms = (2 · param_bytes + optimizer_bytes) / (tp · sdp)        parameters, gradients, states
    O_f  = e · activation_bytes / tp,  O_b = 0                     without CKPT
    O_f  = e · boundary_bytes / tp,    O_b = e · (activation_bytes - boundary_bytes) / tp   CKPT

(§III-A2: with CKPT ``c(f) = c(bnd)`` and ``c(b) = c(int)``; TP splits every activation, the
checkpointed input too, as the paper's per-paradigm rules do not say otherwise). Under 1F1B-Flush (§II-B, the
paper's default) stage ``j`` of ``pp`` holds ``k_j = min(pp - j, m)`` micro-batches'
activations, so its peak (Eq. 2 with ``k_j`` micro-batches in flight) is

    E_all = Σ_l O_ms + (k_j - 1) · Σ_l O_f + max_i (Σ_{l<=i} O_f + O_b(i))  (``stage_memory``)

and the DP's forward memory (Eq. 3) charges each layer ``O_ms + k_j · O_f``.

Transformation cost ``R`` (Eq. 4, §VI Slice-Gather): between layers the activation is sharded
over the data shards and replicated over TP, so consecutive strategies with different data
layouts move, per device, the examples it needs and does not hold (``boundary_bytes`` of the
previous layer each), from a device of its host when one holds them, else across the NIC;
``R`` is the slowest device's receive plus one latency, for the forward activation and again
for its gradient in the backward (``transformation_cost``).

Where the paper leaves a choice open, or we depart from it:
  * Eq. 4 writes ``R(L, S_i, S_j)`` but a state ``C(L, E)``; the exact DP needs the previous
    layer's strategy (its data layout, which is all ``R`` depends on) in the state.
  * Alg. 3 raises ``E_fwd`` and stops at the first solution failing Eq. 2; ``layer_dp`` lowers
    it from the budget to the first passing, the largest valid ``E_fwd`` the text asks for.
  * The paper gives no formula for ``R`` (§VI's Slice-Gather), nor for ``Strategy_Init`` (Alg.
    2 l. 6: here each layer's fastest strategy) or ``Init_Microbatch_Num`` (Alg. 1 l. 21: here
    every count dividing the batch is tried). The batch itself is the profile's, not searched.
  * Eq. 5 has no term for the activations crossing stage boundaries; neither has this model.
  * Alg. 2 searches at most ``L`` partitions per PP degree and micro-batch count; PP degree 1
    (Alg. 1's loop) is searched too.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence

import numpy as np

from ..model.cluster import Cluster
from ..pipeline.scheduling.pipeline_schedule import ScheduleKind
from ..simulation.collectives import ring_all_gather_s, ring_all_reduce_s, ring_reduce_scatter_s
from . import planner_meshpar
from .layer_profile import LayerProfile, ModelProfile
from .protocol import Hardware, NoPlanFits, PipelinePlan, PlanConstraints, StagePlan

__all__ = [
    "MAX_MEMORY_UNITS",
    "MIN_MEMORY_UNITS",
    "OVERLAP_SLOWDOWN",
    "UNITS_PER_LAYER",
    "GalvatronPlan",
    "LayerCost",
    "PartitionLoads",
    "Strategy",
    "bi_objective_partition",
    "layer_cost",
    "layer_dp",
    "memory_balanced_partition",
    "pipeline_cost",
    "plan",
    "predict",
    "search",
    "stage_memories",
    "stage_memory",
    "stage_times",
    "strategy_space",
    "time_balanced_partition",
    "transformation_cost",
]

# §V: computation and communication running at once each slow down by this factor.
OVERLAP_SLOWDOWN = 1.3
# §IV-A3 allows "large memory granularity": the search's DP counts memory in units of
# budget / max(MIN_MEMORY_UNITS, UNITS_PER_LAYER · layers of the stage). Layers round up to a
# unit, so a plan never exceeds the budget, and at most 1 / UNITS_PER_LAYER of it goes unused.
MIN_MEMORY_UNITS = 256
UNITS_PER_LAYER = 8
# layer_dp's tables hold (layers x units x layouts) entries: a bound on the units it accepts
MAX_MEMORY_UNITS = 1 << 20

_PARADIGMS = ("dp", "sdp", "tp")


def _is_power_of_two(x: int) -> bool:
    return isinstance(x, int) and x >= 1 and x & (x - 1) == 0


# -- the strategy space ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One layer's hybrid strategy: a decision tree of §III-B.

    Attributes:
      pp: the pipeline degree, the tree's root: the layer runs on a group of
        ``dp · sdp · tp`` devices, one of ``pp``.
      dp, sdp, tp: data-parallel, sharded data-parallel (ZeRO-3) and tensor-parallel degrees,
        powers of two.
      ckpt: activation checkpointing.
      order: the levels of degree above 1, root first: the last is consecutive devices (inside
        a host when it fits), each earlier one strides over the later ones. ``("dp", "tp")``
        is DP over TP: TP groups of neighbours, DP across them; ``("tp", "dp")`` the reverse.
    """

    pp: int = 1
    dp: int = 1
    sdp: int = 1
    tp: int = 1
    ckpt: bool = False
    order: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "sdp", "tp"):
            if not _is_power_of_two(getattr(self, name)):
                raise ValueError(f"{name}: expected a power of two >= 1, got {getattr(self, name)!r}")
        if not isinstance(self.ckpt, bool):
            raise ValueError(f"ckpt: expected a bool, got {self.ckpt!r}")
        object.__setattr__(self, "order", tuple(self.order))
        used = sorted(p for p in _PARADIGMS if getattr(self, p) > 1)
        if sorted(self.order) != used:
            raise ValueError(f"order: expected each of {used} (the degrees above 1) once, got {self.order!r}")

    @property
    def group_size(self) -> int:
        """Devices of the stage group: ``dp · sdp · tp``."""
        return self.dp * self.sdp * self.tp

    @property
    def data_degree(self) -> int:
        """Data shards of a micro-batch: ``dp · sdp``."""
        return self.dp * self.sdp

    @property
    def degrees(self) -> tuple[int, ...]:
        """The degrees of ``order``, root first."""
        return tuple(getattr(self, name) for name in self.order)


def _compositions(total: int, parts: int):
    """Tuples of ``parts`` positive integers summing to ``total``."""
    if parts == 0:
        yield from [()] if total == 0 else []
        return
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


def _trees(group_size: int, apply_takeaway_3: bool):
    """The (order, degrees) of every decision tree over ``group_size`` devices."""
    exponent = group_size.bit_length() - 1
    for depth in range(min(len(_PARADIGMS), exponent) + 1):
        for order in itertools.permutations(_PARADIGMS, depth):
            if apply_takeaway_3 and {"dp", "sdp"} <= set(order):
                continue
            for exponents in _compositions(exponent, depth):
                yield order, tuple(2**x for x in exponents)


def _pipeline_degrees(num_devices: int) -> tuple[int, ...]:
    return tuple(p for p in (2**x for x in range(num_devices.bit_length())) if num_devices % p == 0
                 and _is_power_of_two(num_devices // p))


def strategy_space(num_devices: int, pipeline_degrees: Sequence[int] | None = None,
                   apply_takeaway_3: bool = True) -> tuple[Strategy, ...]:
    """The decision-tree candidates of §III-B for one layer on ``num_devices`` devices.

    For each pipeline degree ``pp`` (default: every power of two leaving a power-of-two group
    ``g = num_devices / pp``, Alg. 1 l. 4), every tree of distinct levels among DP, SDP and TP
    (§III-B rule 2) with degrees in {2, 4, 8, ...} (rule 3) multiplying to ``g`` (Takeaway #2),
    root-to-leaf order distinguished, each with and without CKPT (rule 4). With
    ``apply_takeaway_3`` the trees holding both DP and SDP are left out (Takeaway #3). On 8
    devices: 68 strategies, 44 after Takeaway #3 (§III-B).

    Returns:
      The strategies, by ``pp``, then tree depth, then order, degrees, CKPT off before on.
    """
    if not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices: expected a positive integer, got {num_devices!r}")
    degrees = _pipeline_degrees(num_devices) if pipeline_degrees is None else tuple(pipeline_degrees)
    for pp in degrees:
        if not _is_power_of_two(pp) or num_devices % pp or not _is_power_of_two(num_devices // pp):
            raise ValueError(f"pipeline_degrees: {pp!r} is not a power of two leaving a power-of-two group "
                             f"of the {num_devices} devices (§III-B's trees split by powers of two)")
    if not degrees:
        raise ValueError(f"num_devices: {num_devices} has no power-of-two pipeline degree leaving a "
                         f"power-of-two group; Galvatron's trees split devices by powers of two")
    space = []
    for pp in degrees:
        for order, tree_degrees in _trees(num_devices // pp, apply_takeaway_3):
            sizes = dict(zip(order, tree_degrees))
            for ckpt in (False, True):
                space.append(Strategy(pp, sizes.get("dp", 1), sizes.get("sdp", 1), sizes.get("tp", 1), ckpt, order))
    return tuple(space)


# -- device layout and bandwidths -------------------------------------------------------------


def _flat_hosts(cluster: Cluster) -> np.ndarray:
    """Host of each device, the devices host-major (the order stages take them in)."""
    return np.array([h for h, devs in enumerate(cluster.host_devices) for _ in devs], dtype=np.int64)


def _normalise_hosts(hosts: np.ndarray) -> tuple[int, ...]:
    """Host ids relabelled by first appearance: groups laid out alike get equal keys."""
    labels: dict[int, int] = {}
    return tuple(labels.setdefault(int(h), len(labels)) for h in hosts)


def _level_bandwidths(strategy: Strategy, hosts: tuple[int, ...], cluster: Cluster) -> dict[str, float]:
    """Per paradigm of ``strategy`` on a group whose devices sit on ``hosts`` (normalised): the
    bytes/s of one of its rings (module docstring); ``inf`` for a degree of 1."""
    grid = np.asarray(hosts, dtype=np.int64).reshape(strategy.degrees or (1,))
    num_hosts = int(grid.max()) + 1
    bandwidths = {name: math.inf for name in _PARADIGMS}
    for axis, (name, degree) in enumerate(zip(strategy.order, strategy.degrees)):
        rings = np.moveaxis(grid, axis, -1).reshape(-1, degree)
        crossing = rings[(rings != rings[:, :1]).any(axis=1)]
        if crossing.size == 0:
            bandwidths[name] = cluster.intra_host_bandwidth
            continue
        touches = np.zeros((crossing.shape[0], num_hosts), dtype=bool)
        touches[np.arange(crossing.shape[0])[:, None], crossing] = True
        bandwidths[name] = cluster.inter_host_bandwidth / int(touches.sum(axis=0).max())
    return bandwidths


def _data_shards(strategy: Strategy) -> np.ndarray:
    """Shape ``(group_size,)``: the data shard each device of the group computes on."""
    if not strategy.order:
        return np.zeros(1, dtype=np.int64)
    coords = np.indices(strategy.degrees).reshape(len(strategy.order), -1)  # the leaf level fastest
    shard = np.zeros(coords.shape[1], dtype=np.int64)
    for name, degree, coord in zip(strategy.order, strategy.degrees, coords):
        if name in ("dp", "sdp"):
            shard = shard * degree + coord
    return shard


def _reshard(before: Strategy, after: Strategy, hosts: tuple[int, ...], cluster: Cluster) -> tuple[float, bool]:
    """Moving an activation from ``before``'s data layout to ``after``'s: the seconds per byte
    of the micro-batch's activation of the slowest device, and whether anything moves."""
    host = np.asarray(hosts, dtype=np.int64)
    n_a, n_c = before.data_degree, after.data_degree
    x_a, x_c = _data_shards(before), _data_shards(after)
    overlap = np.minimum((x_c + 1) / n_c, (x_a + 1) / n_a) - np.maximum(x_c / n_c, x_a / n_a)
    missing = 1.0 / n_c - np.clip(overlap, 0.0, None)
    moves = missing > 1e-12
    if not moves.any():
        return 0.0, False
    # the shards of ``before`` a device needs: [first, last); a host covers them if its devices hold all
    first, last = (x_c * n_a) // n_c, -(-(x_c + 1) * n_a // n_c)
    held = np.zeros((int(host.max()) + 1, n_a + 1), dtype=np.int64)
    held[host, x_a + 1] = 1
    held = np.cumsum(held, axis=1)
    local = held[host, last] - held[host, first] == last - first
    remote = moves & ~local
    sharing = np.bincount(host[remote], minlength=held.shape[0])[host].clip(min=1)
    bandwidth = np.where(local, cluster.intra_host_bandwidth, cluster.inter_host_bandwidth / sharing)
    return float(np.max(np.where(moves, missing / bandwidth, 0.0))), True


# -- the cost of one layer ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerCost:
    """One layer's cost under one strategy, for one micro-batch, per device (§V).

    Attributes:
      time_s: ``c(l, S)``, the micro-batch that synchronises gradients (the last of a step).
      time_no_sync_s: ``c_no_grad_sync(l, S)``, every other micro-batch (App. C).
      states_bytes: ``O_ms``, parameters, gradients and optimizer states.
      forward_bytes: ``O_f``, the activations one micro-batch keeps for the backward.
      backward_bytes: ``O_b``, the extra activations its backward rebuilds (CKPT).
    """

    time_s: float
    time_no_sync_s: float
    states_bytes: float
    forward_bytes: float
    backward_bytes: float


def _overlap(compute, communication):
    """§V: both run slowed by ``OVERLAP_SLOWDOWN`` while both run; the longer then finishes alone."""
    return np.maximum(compute, communication) + (OVERLAP_SLOWDOWN - 1.0) * np.minimum(compute, communication)


@dataclasses.dataclass(frozen=True)
class _Layers:
    """A run of layers' figures as arrays, shape ``(L,)`` each."""

    flops: np.ndarray
    params: np.ndarray
    optimizer: np.ndarray
    activations: np.ndarray
    boundary: np.ndarray
    tp_bytes: np.ndarray

    @classmethod
    def of(cls, layers: Sequence[LayerProfile]) -> _Layers:
        def column(name):
            return np.array([getattr(x, name) for x in layers], dtype=np.float64)

        return cls(column("flops"), column("param_bytes"), column("optimizer_bytes"), column("activation_bytes"),
                   column("boundary_bytes"), column("tp_bytes"))


def _costs(layers: _Layers, strategy: Strategy, micro_batch_size: int, device_flops: float,
           bandwidths: dict[str, float], latency: float) -> tuple[np.ndarray, ...]:
    """The module docstring's costs, vectorised over layers: (time, time without gradient
    synchronisation, O_ms, O_f, O_b), each of shape ``(L,)``."""
    tp, sdp, dp, ckpt = strategy.tp, strategy.sdp, strategy.dp, int(strategy.ckpt)
    per_device = micro_batch_size / strategy.data_degree
    comp_f = per_device * layers.flops / (tp * device_flops)
    ar_tp = ring_all_reduce_s(per_device * layers.tp_bytes, tp, bandwidths["tp"], latency)
    ag_sdp = ring_all_gather_s(layers.params / tp, sdp, bandwidths["sdp"], latency)
    sync = (ring_reduce_scatter_s(layers.params / tp, sdp, bandwidths["sdp"], latency)
            + ring_all_reduce_s(layers.params / (tp * sdp), dp, bandwidths["dp"], latency))
    forward = comp_f + ar_tp + ag_sdp
    tp_backward = (1 + ckpt) * ar_tp
    time = forward + _overlap((2 + ckpt) * comp_f, ag_sdp + sync) + tp_backward
    time_no_sync = forward + _overlap((2 + ckpt) * comp_f, ag_sdp) + tp_backward
    states = (2.0 * layers.params + layers.optimizer) / (tp * sdp)
    if ckpt:
        fwd_bytes = per_device * layers.boundary / tp
        bwd_bytes = per_device * np.clip(layers.activations - layers.boundary, 0.0, None) / tp
    else:
        fwd_bytes = per_device * layers.activations / tp
        bwd_bytes = np.zeros_like(fwd_bytes)
    return time, time_no_sync, states, fwd_bytes, bwd_bytes


def _check_group(strategy: Strategy, cluster: Cluster, group: Sequence[int]) -> tuple[int, ...]:
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy: expected a Strategy, got {type(strategy).__name__}")
    ids = tuple(int(d) for d in group)
    if len(ids) != strategy.group_size or len(set(ids)) != len(ids):
        raise ValueError(f"group: expected {strategy.group_size} distinct device ids (dp · sdp · tp), "
                         f"got {tuple(group)!r}")
    return _normalise_hosts(np.array([cluster.host_of(d) for d in ids]))


def _check_micro_batch(micro_batch_size: int, *strategies: Strategy) -> None:
    for strategy in strategies:
        if not isinstance(micro_batch_size, int) or micro_batch_size < 1 or micro_batch_size % strategy.data_degree:
            raise ValueError(f"micro_batch_size: expected a positive multiple of dp · sdp = {strategy.data_degree}, "
                             f"got {micro_batch_size!r}")


def layer_cost(layer: LayerProfile, strategy: Strategy, micro_batch_size: int, device_flops: float,
               cluster: Cluster, group: Sequence[int]) -> LayerCost:
    """``c(l, S)``, ``c_no_grad_sync(l, S)``, ``O_ms``, ``O_f`` and ``O_b`` of the module
    docstring (§V, §III-A) for one micro-batch of ``micro_batch_size`` examples.

    Args:
      group: the stage's device ids in device order (the leaf level fastest), ``dp · sdp · tp``.
    """
    hosts = _check_group(strategy, cluster, group)
    _check_micro_batch(micro_batch_size, strategy)
    if not device_flops > 0:
        raise ValueError(f"device_flops: expected a positive FLOP/s, got {device_flops!r}")
    values = _costs(_Layers.of([layer]), strategy, micro_batch_size, device_flops,
                    _level_bandwidths(strategy, hosts, cluster), cluster.latency)
    return LayerCost(*(float(v[0]) for v in values))


def transformation_cost(before: Strategy, after: Strategy, bytes_per_example: float, micro_batch_size: int,
                        cluster: Cluster, group: Sequence[int]) -> float:
    """``R(l, S_before, S_after)`` of Eq. 4 for one micro-batch: the activation of
    ``bytes_per_example`` per example moved from ``before``'s data layout to ``after``'s in the
    forward, and its gradient back in the backward (module docstring). 0 when the layouts
    agree (e.g. DP and SDP, or CKPT on and off, at the same place in the tree)."""
    hosts = _check_group(before, cluster, group)
    _check_group(after, cluster, group)
    _check_micro_batch(micro_batch_size, before, after)
    if not bytes_per_example >= 0:
        raise ValueError(f"bytes_per_example: expected a number >= 0, got {bytes_per_example!r}")
    total = 0.0
    for a, c in ((before, after), (after, before)):
        per_byte, moves = _reshard(a, c, hosts, cluster)
        total += per_byte * micro_batch_size * bytes_per_example + (cluster.latency if moves else 0.0)
    return total


# -- the layer DP (Eq. 4, Alg. 3) --------------------------------------------------------------


def layer_dp(costs, memories, transition, budget: float, memory_unit: float = 1.0,
             fits: Callable[[tuple[int, ...]], bool] | None = None) -> tuple[float, tuple[int, ...]] | None:
    """Galvatron's DP over one stage's layers (§IV-A2, Eq. 4; App. A3, Alg. 3):

        C(l, E_fwd) = min_{S_j} { C(l - 1, E_fwd - O(l, S_j)) + c(l, S_j) + R(l, S_i, S_j) }

    with ``C(0, ·) = 0``, ``C(·, E < 0) = ∞`` and ``S_i`` the strategy layer ``l - 1`` took; ``O
    = O_f + O_ms`` the forward memory (Eq. 3). ``R`` makes the previous strategy part of the
    state: ``C(l, E, S_j)``; strategies whose ``R`` rows and columns agree share one state
    (a data layout), which leaves the result unchanged.

    Memory is counted in units of ``memory_unit`` bytes, each layer's rounded up, so a solution
    never exceeds ``budget``. Alg. 3 then takes, among the DP's solutions for forward budgets
    ``E_fwd <= budget``, the largest ``E_fwd`` whose solution ``fits`` (its Eq. 2 check;
    always true when ``None``): we scan ``E_fwd`` down from the budget, the first passing being
    the largest, where Alg. 3 scans up and stops at the first failure.

    Args:
      costs: shape ``(L, S)``: ``c(l, S_j)``, seconds.
      memories: shape ``(L, S)``: ``O(l, S_j)``, bytes.
      transition: shape ``(S, S)``, or ``(L, S, S)`` per layer: ``[l, i, j]`` is ``R`` of layer
        ``l`` taking ``S_j`` after ``S_i`` (row 0 is never used).
      budget: bytes, ``inf`` for none.
      fits: whether a solution (a strategy index per layer) is valid.

    Returns:
      ``(Σ_l c(l, S_l) + Σ_{l>=1} R(l, S_{l-1}, S_l), (S_0, ..., S_{L-1}))``, or ``None`` if no
      solution fits. Ties break deterministically (the same arguments, the same solution).
    """
    c = np.asarray(costs, dtype=np.float64)
    if c.ndim != 2 or 0 in c.shape or not np.all(np.isfinite(c)) or np.any(c < 0):
        raise ValueError(f"costs: expected a non-empty (L, S) array of finite seconds >= 0, got shape {c.shape}")
    L, S = c.shape
    mem = np.asarray(memories, dtype=np.float64)
    if mem.shape != (L, S) or not np.all(np.isfinite(mem)) or np.any(mem < 0):
        raise ValueError(f"memories: expected finite bytes >= 0 of shape {(L, S)}, got shape {mem.shape}")
    R = np.asarray(transition, dtype=np.float64)
    if R.shape == (S, S):
        R = np.broadcast_to(R, (L, S, S))
    if R.shape != (L, S, S) or not np.all(np.isfinite(R)) or np.any(R < 0):
        raise ValueError(f"transition: expected finite seconds >= 0 of shape {(S, S)} or {(L, S, S)}, "
                         f"got shape {R.shape}")
    if not budget > 0:
        raise ValueError(f"budget: expected a positive number of bytes (or inf), got {budget!r}")
    if not (memory_unit > 0 and math.isfinite(memory_unit)):
        raise ValueError(f"memory_unit: expected a positive finite number of bytes, got {memory_unit!r}")
    if math.isinf(budget):
        units, top = np.zeros((L, S), dtype=np.int64), 0
    else:
        units = np.ceil(np.round(mem / memory_unit, 9)).astype(np.int64)
        top = int(math.floor(round(budget / memory_unit, 9)))
        if top > MAX_MEMORY_UNITS:
            raise ValueError(f"memory_unit: the budget is {top} units of it, more than {MAX_MEMORY_UNITS}; "
                             f"the DP's tables grow with the units, take a coarser unit")

    # one state per class of strategies with equal R rows and columns; a random projection
    # finds the candidates (equal rows project equally), a full comparison confirms them
    signature = np.concatenate([R.transpose(1, 0, 2).reshape(S, -1), R.transpose(2, 0, 1).reshape(S, -1)], axis=1)
    keys = signature @ np.random.default_rng(0).standard_normal(signature.shape[1])
    classes: dict[float, list[int]] = {}
    cls = np.empty(S, dtype=np.int64)
    reps: list[int] = []
    for s in range(S):
        same = classes.setdefault(float(keys[s]), [])
        k = next((k for k in same if np.array_equal(signature[reps[k]], signature[s])), None)
        if k is None:
            k = len(reps)
            reps.append(s)
            same.append(k)
        cls[s] = k
    first = np.array(reps)
    K = first.size
    R_k = R[:, first][:, :, first]
    width = int(np.bincount(cls).max())
    members = np.full((K, width), S, dtype=np.int64)  # S pads with an infinite cost
    for k in range(K):
        where = np.flatnonzero(cls == k)
        members[k, : where.size] = where
    E = np.arange(top + 1)
    choice = np.empty((L, top + 1, K), dtype=np.int64)
    parent = np.zeros((L, top + 1, K), dtype=np.int64)
    best = np.zeros((top + 1, K))
    for l in range(L):
        if l == 0:
            entry = np.zeros((top + 1, K))
        else:
            through = best[:, :, None] + R_k[l][None]  # [e, k_prev, k]
            parent[l] = np.argmin(through, axis=1)
            entry = np.take_along_axis(through, parent[l][:, None, :], axis=1)[:, 0, :]
        rest = E[:, None] - units[l][None, :]
        value = np.where(rest >= 0, entry[rest.clip(min=0), cls[None, :]] + c[l][None, :], math.inf)
        value = np.concatenate([value, np.full((top + 1, 1), math.inf)], axis=1)[:, members]  # [e, k, member]
        pick = np.argmin(value, axis=2)
        best = np.take_along_axis(value, pick[:, :, None], axis=2)[:, :, 0]
        choice[l] = members[np.arange(K)[None, :], pick]

    for e_fwd in range(top, -1, -1):
        k = int(np.argmin(best[e_fwd]))
        if not math.isfinite(best[e_fwd, k]):
            return None  # fewer units cannot do better
        picks, e = [], e_fwd
        for l in range(L - 1, -1, -1):
            s = int(choice[l, e, k])
            picks.append(s)
            e -= int(units[l, s])
            k = int(parent[l, e, k])
        picks.reverse()
        solution = tuple(picks)
        if fits is None or fits(solution):
            total = float(c[np.arange(L), picks].sum() + sum(R[l, picks[l - 1], picks[l]] for l in range(1, L)))
            return total, solution
    return None


# -- pipeline cost, stage loads and partitions (Eq. 5, 6, 9) ----------------------------------


def pipeline_cost(stage_times_s: Sequence[float], num_micro_batches: int,
                  stage_times_no_sync_s: Sequence[float] | None = None) -> float:
    """Eq. 5, refined as App. C's Eq. 9:

        C(M, B) = (m - 1) · max_i C_no_grad_sync(M_i, B_m) + Σ_i C(M_i, B_m)

    ``stage_times_s[i]`` is ``C(M_i, B_m)``, stage ``i``'s micro-batch that synchronises
    gradients; ``stage_times_no_sync_s[i]`` its other micro-batches (``None``: the same, Eq. 5).
    """
    t = np.asarray(stage_times_s, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"stage_times_s: expected a non-empty 1-D array of finite seconds >= 0, got {stage_times_s!r}")
    ns = t if stage_times_no_sync_s is None else np.asarray(stage_times_no_sync_s, dtype=np.float64)
    if ns.shape != t.shape or not np.all(np.isfinite(ns)) or np.any(ns < 0):
        raise ValueError(f"stage_times_no_sync_s: expected finite seconds >= 0 of shape {t.shape}, "
                         f"got {stage_times_no_sync_s!r}")
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches: expected a positive integer, got {num_micro_batches!r}")
    return float((num_micro_batches - 1) * ns.max() + t.sum())


def stage_memory(states_bytes, forward_bytes, backward_bytes, in_flight: int) -> float:
    """A stage's peak memory per device: Eq. 2 with ``in_flight`` micro-batches' activations
    alive (1F1B-Flush: ``min(pp - j, m)`` for stage ``j``):

        Σ_l O_ms(l) + (in_flight - 1) · Σ_l O_f(l) + max_i { Σ_{l<=i} O_f(l) + O_b(i) }

    Args: per-layer ``O_ms``, ``O_f`` (one micro-batch) and ``O_b``, each of shape ``(L,)``.
    """
    ms, f, b = (np.asarray(x, dtype=np.float64) for x in (states_bytes, forward_bytes, backward_bytes))
    if ms.ndim != 1 or ms.size == 0 or f.shape != ms.shape or b.shape != ms.shape:
        raise ValueError(f"states_bytes, forward_bytes, backward_bytes: expected equal non-empty 1-D shapes, "
                         f"got {ms.shape}, {f.shape}, {b.shape}")
    if not isinstance(in_flight, int) or in_flight < 1:
        raise ValueError(f"in_flight: expected a positive integer, got {in_flight!r}")
    return float(ms.sum() + (in_flight - 1) * f.sum() + np.max(np.cumsum(f) + b))


@dataclasses.dataclass(frozen=True, eq=False)
class PartitionLoads:
    """What Galvatron_Search found for one partition, as Alg. 2 sees it: the step time and,
    per layer under its chosen strategy, one micro-batch's time and memory (shape ``(L,)``).

    Attributes:
      step_s: Eq. 9 for the partition, the objective Alg. 2 keeps the best of.
      layer_time_s: ``c(l, S_l)`` plus ``R`` from the layer before; a stage's time is their sum.
      states_bytes, forward_bytes, backward_bytes: ``O_ms``, ``O_f``, ``O_b``.
      num_micro_batches: ``m``; stage ``j`` of ``P`` holds ``min(P - j, m)`` in flight.
    """

    step_s: float
    layer_time_s: np.ndarray
    states_bytes: np.ndarray
    forward_bytes: np.ndarray
    backward_bytes: np.ndarray
    num_micro_batches: int

    def __post_init__(self) -> None:
        arrays = [np.asarray(getattr(self, n), dtype=np.float64)
                  for n in ("layer_time_s", "states_bytes", "forward_bytes", "backward_bytes")]
        if arrays[0].ndim != 1 or arrays[0].size == 0 or any(a.shape != arrays[0].shape for a in arrays):
            raise ValueError("layer_time_s, states_bytes, forward_bytes, backward_bytes: expected equal non-empty "
                             f"1-D shapes, got {[a.shape for a in arrays]}")
        for name, a in zip(("layer_time_s", "states_bytes", "forward_bytes", "backward_bytes"), arrays):
            object.__setattr__(self, name, a)
        if not isinstance(self.num_micro_batches, int) or self.num_micro_batches < 1:
            raise ValueError(f"num_micro_batches: expected a positive integer, got {self.num_micro_batches!r}")

    @property
    def num_layers(self) -> int:
        return self.layer_time_s.size


def _check_boundaries(boundaries: Sequence[int], num_layers: int) -> tuple[int, ...]:
    b = tuple(int(x) for x in boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"boundaries: expected strictly increasing (0, ..., {num_layers}), got {tuple(boundaries)!r}")
    return b


def _in_flight(num_stages: int, num_micro_batches: int) -> list[int]:
    return [min(num_stages - j, num_micro_batches) for j in range(num_stages)]


def stage_times(loads: PartitionLoads, boundaries: Sequence[int]) -> np.ndarray:
    """Shape ``(P,)``: each stage's ``C(M_i, B_m)`` under ``loads``' strategies."""
    b = _check_boundaries(boundaries, loads.num_layers)
    prefix = np.concatenate([[0.0], np.cumsum(loads.layer_time_s)])
    return np.array([prefix[y] - prefix[x] for x, y in zip(b, b[1:])])


def stage_memories(loads: PartitionLoads, boundaries: Sequence[int]) -> np.ndarray:
    """Shape ``(P,)``: each stage's ``O(M_i, B_m)``, ``stage_memory`` under 1F1B-Flush."""
    b = _check_boundaries(boundaries, loads.num_layers)
    flight = _in_flight(len(b) - 1, loads.num_micro_batches)
    return np.array([stage_memory(loads.states_bytes[x:y], loads.forward_bytes[x:y], loads.backward_bytes[x:y], k)
                     for k, (x, y) in zip(flight, zip(b, b[1:]))])


def _min_max_partition(span: np.ndarray) -> tuple[int, ...]:
    """The contiguous partition minimising its largest stage value: ``span[j, c, i]`` is layers
    ``[c, i)`` as stage ``j``. Ties: each stage ends as late as it can, from the last back."""
    P, n, _ = span.shape
    valid = np.triu(np.ones((n, n), dtype=bool), k=1)
    best = np.full(n, math.inf)
    best[0] = 0.0
    starts = []
    for j in range(P):
        candidates = np.where(valid, np.maximum(best[:, None], span[j]), math.inf)
        start = (n - 1) - np.argmin(candidates[::-1], axis=0)  # the latest start among ties
        best = candidates[start, np.arange(n)]
        starts.append(start)
    cuts, end = [n - 1], n - 1
    for j in range(P - 1, -1, -1):
        end = int(starts[j][end])
        cuts.append(end)
    return tuple(reversed(cuts))


def _check_stages(num_stages: int, loads: PartitionLoads) -> None:
    if not isinstance(num_stages, int) or not 1 <= num_stages <= loads.num_layers:
        raise ValueError(f"num_stages: expected an integer in [1, {loads.num_layers}] (the layers), got {num_stages!r}")


def time_balanced_partition(loads: PartitionLoads, num_stages: int) -> tuple[int, ...]:
    """``p_t`` of §IV-B1: the partition with the least slowest stage (the largest ``α_t`` of
    Eq. 6 under ``loads``' strategies), boundaries ``(0, ..., L)``."""
    _check_stages(num_stages, loads)
    prefix = np.concatenate([[0.0], np.cumsum(loads.layer_time_s)])
    span = prefix[None, :] - prefix[:, None]
    return _min_max_partition(np.broadcast_to(span, (num_stages, *span.shape)))


def memory_balanced_partition(loads: PartitionLoads, num_stages: int) -> tuple[int, ...]:
    """``p_m`` of §IV-B1: the partition with the least largest stage memory (``stage_memory``
    under 1F1B-Flush; the largest ``α_m`` of Eq. 6), boundaries ``(0, ..., L)``."""
    _check_stages(num_stages, loads)
    L = loads.num_layers
    states = np.concatenate([[0.0], np.cumsum(loads.states_bytes)])
    fwd = np.concatenate([[0.0], np.cumsum(loads.forward_bytes)])
    # peak[c, i] = max_{c <= t < i} (fwd[t + 1] + O_b(t)) - fwd[c]
    rise = fwd[1:] + loads.backward_bytes
    peak = np.full((L + 1, L + 1), -math.inf)
    for c in range(L):
        peak[c, c + 1:] = np.maximum.accumulate(rise[c:]) - fwd[c]
    base = states[None, :] - states[:, None]
    total = fwd[None, :] - fwd[:, None]
    flight = np.array(_in_flight(num_stages, loads.num_micro_batches), dtype=np.float64)
    span = base[None] + (flight[:, None, None] - 1) * total[None] + peak[None]
    return _min_max_partition(np.where(np.isfinite(span), span, math.inf))


def _moves(boundaries: tuple[int, ...], stage: int) -> list[tuple[int, ...]]:
    """The partitions moving a boundary layer of ``stage`` to an adjacent stage."""
    b, out = list(boundaries), []
    if b[stage + 1] - b[stage] > 1:
        if stage > 0:
            out.append(tuple(b[:stage] + [b[stage] + 1] + b[stage + 1:]))
        if stage < len(b) - 2:
            out.append(tuple(b[:stage + 1] + [b[stage + 1] - 1] + b[stage + 2:]))
    return out


def bi_objective_partition(search: Callable[[tuple[int, ...]], PartitionLoads | None], start: Sequence[int],
                           memory_budget_bytes: float = math.inf,
                           max_searches: int | None = None) -> tuple[tuple[int, ...], PartitionLoads] | None:
    """Alg. 2's loop over partitions (§IV-B2, App. B) for one PP degree and batch.

    From ``start`` (Alg. 2 l. 7: the memory-balanced ``p_m``), pop a partition ``p`` (l. 10),
    run ``search`` on it (Galvatron_Search, l. 12: its strategies, their loads and Eq. 9's
    step time; ``None`` when no strategies fit), then PP_Partition_Adjust (l. 13): find the
    slowest stage, ``C_max``, and move one of its boundary layers to the adjacent stage. Each
    such ``p'`` is queued (l. 14-15) if, with the layers keeping the strategies found for
    ``p``, (1) no stage takes more than ``C_max``, (2) no stage's memory exceeds
    ``memory_budget_bytes`` and (3) none exceeds the largest stage memory of the
    time-balanced partition ``p_t`` under those strategies. Partitions are searched once each
    (the queue never revisits), at most ``max_searches`` of them (default: the layers).

    Returns:
      The fastest partition searched and its loads, or ``None`` if ``search`` found none fit.
      ``start`` is searched first, so the result is never slower than it.
    """
    first = tuple(int(x) for x in start)
    if len(first) < 2 or first[0] != 0 or any(x >= y for x, y in zip(first, first[1:])):
        raise ValueError(f"start: expected strictly increasing stage boundaries (0, ..., L), got {tuple(start)!r}")
    if not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes: expected a positive number of bytes (or inf), "
                         f"got {memory_budget_bytes!r}")
    limit = first[-1] if max_searches is None else max_searches
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"max_searches: expected a positive integer, got {max_searches!r}")
    num_stages = len(first) - 1
    queue, seen = collections.deque([first]), {first}
    best: tuple[tuple[int, ...], PartitionLoads] | None = None
    searched = 0
    while queue and searched < limit:
        p = queue.popleft()
        loads = search(p)
        searched += 1
        if loads is None:
            continue
        if best is None or loads.step_s < best[1].step_s:
            best = (p, loads)
        times = stage_times(loads, p)
        slowest = int(np.argmax(times))
        cap = float(stage_memories(loads, time_balanced_partition(loads, num_stages)).max())
        for q in _moves(p, slowest):
            if q in seen:
                continue
            memory = stage_memories(loads, q).max()
            if stage_times(loads, q).max() <= times[slowest] and memory <= memory_budget_bytes and memory <= cap:
                seen.add(q)
                queue.append(q)
    return best


# -- the search (Alg. 1, 2) --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GalvatronPlan:
    """One pipeline degree and micro-batch count with its partition and per-layer strategies.

    Attributes:
      pp: pipeline stages, each on ``devices / pp`` devices.
      partition: stage boundaries ``(0, ..., L)``: stage ``i`` runs layers
        ``[partition[i], partition[i + 1])``.
      num_micro_batches: ``m``: the batch splits into micro-batches of ``batch / m``.
      strategies: one per layer, all of degree ``pp``.
      predicted_step_s: Eq. 9.
      peak_memory_bytes: per stage, ``stage_memory`` under 1F1B-Flush.
    """

    pp: int
    partition: tuple[int, ...]
    num_micro_batches: int
    strategies: tuple[Strategy, ...]
    predicted_step_s: float
    peak_memory_bytes: tuple[float, ...]

    @property
    def stage_shapes(self) -> tuple[tuple[int, int], ...]:
        """Per stage one ``(data, model)`` mesh shape, ``(dp · sdp, tp)`` of the strategy most of
        its layers take (the first such layer's on a tie). meshpar's runtime gives a stage one
        ``(data, model)`` mesh, so the per-layer strategies collapse there: SDP and DP both
        become the data axis, the tree order and CKPT are dropped."""
        shapes = []
        for a, b in zip(self.partition, self.partition[1:]):
            common = collections.Counter(self.strategies[a:b]).most_common(1)[0][0]
            shapes.append((common.data_degree, common.tp))
        return tuple(shapes)


@dataclasses.dataclass(frozen=True)
class _StageTables:
    """For one stage group's layout, per layer and strategy (shape ``(L, S)``), and per layer
    and pair (``(L, S, S)``): the figures of one micro-batch."""

    time: np.ndarray
    time_no_sync: np.ndarray
    states: np.ndarray
    forward: np.ndarray
    backward: np.ndarray
    transition: np.ndarray  # [l, i, j]: R of layer l taking strategy j after i, per micro-batch


def _stage_tables(layers: _Layers, strategies: Sequence[Strategy], hosts: tuple[int, ...], cluster: Cluster,
                  micro_batch_size: int, device_flops: float) -> _StageTables:
    columns = [_costs(layers, s, micro_batch_size, device_flops, _level_bandwidths(s, hosts, cluster), cluster.latency)
               for s in strategies]
    time, no_sync, states, fwd, bwd = (np.stack([col[i] for col in columns], axis=1) for i in range(5))
    layouts: dict[tuple, int] = {}
    layout = [layouts.setdefault((s.data_degree, _data_shards(s).tobytes()), len(layouts)) for s in strategies]
    rep = {k: strategies[layout.index(k)] for k in range(len(layouts))}
    per_byte = np.zeros((len(layouts), len(layouts)))
    moves = np.zeros_like(per_byte)
    for a, c in itertools.product(range(len(layouts)), repeat=2):
        if a != c:
            per_byte[a, c], moves[a, c] = _reshard(rep[a], rep[c], hosts, cluster)
    both_ways = (per_byte + per_byte.T)[np.ix_(layout, layout)]
    latency = cluster.latency * (moves + moves.T)[np.ix_(layout, layout)]
    incoming = np.concatenate([[0.0], layers.boundary[:-1]]) * micro_batch_size  # the previous layer's output
    transition = incoming[:, None, None] * both_ways[None] + latency[None]
    transition[0] = 0.0
    return _StageTables(time, no_sync, states, fwd, bwd, transition)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _search_degree(profile: ModelProfile, cluster: Cluster, layers: _Layers, device_flops: float, budget: float,
                   pp: int, num_micro_batches: int, strategies: Sequence[Strategy]) -> GalvatronPlan | None:
    """Galvatron-BMW for one PP degree and micro-batch count (Alg. 2 l. 6-18)."""
    L, m = profile.num_layers, num_micro_batches
    g = cluster.num_devices // pp
    b = profile.batch_size // m
    flat = _flat_hosts(cluster)
    group_hosts = [_normalise_hosts(flat[j * g:(j + 1) * g]) for j in range(pp)]
    tables = {h: _stage_tables(layers, strategies, h, cluster, b, device_flops) for h in dict.fromkeys(group_hosts)}
    flight = _in_flight(pp, m)
    results: dict[tuple[int, int, int], tuple | None] = {}

    def stage(j: int, start: int, stop: int):
        """Galvatron_Search's DP for layers ``[start, stop)`` as stage ``j``: its strategy
        indices, per layer time (``c`` plus ``R``, and without gradient sync) and memories."""
        key = (j, start, stop)
        if key not in results:
            t = tables[group_hosts[j]]
            span = slice(start, stop)
            rows = np.arange(stop - start)
            weighted = (m - 1) * t.time_no_sync[span] + t.time[span]  # this stage's share of Eq. 9
            forward = t.states[span] + flight[j] * t.forward[span]
            transition = m * t.transition[span]

            def fits(choice):
                s = list(choice)
                return stage_memory(t.states[span][rows, s], t.forward[span][rows, s], t.backward[span][rows, s],
                                    flight[j]) <= budget

            unit = budget / max(MIN_MEMORY_UNITS, UNITS_PER_LAYER * (stop - start))
            found = layer_dp(weighted, forward, transition, budget, unit if math.isfinite(budget) else 1.0, fits)
            if found is None:
                results[key] = None
            else:
                s = list(found[1])
                moved = np.concatenate([[0.0], t.transition[span][rows[1:], s[:-1], s[1:]]])
                results[key] = (tuple(s), t.time[span][rows, s] + moved, t.time_no_sync[span][rows, s] + moved,
                                t.states[span][rows, s], t.forward[span][rows, s], t.backward[span][rows, s])
        return results[key]

    def galvatron_search(p: tuple[int, ...]) -> PartitionLoads | None:
        found = [stage(j, a, c) for j, (a, c) in enumerate(zip(p, p[1:]))]
        if any(f is None for f in found):
            return None
        step = pipeline_cost([float(f[1].sum()) for f in found], m, [float(f[2].sum()) for f in found])
        return PartitionLoads(step, *(np.concatenate([f[i] for f in found]) for i in (1, 3, 4, 5)), m)

    # Strategy_Init (Alg. 2 l. 6): each layer's fastest strategy, memory aside; p_m under it (l. 7)
    t0 = tables[group_hosts[0]]
    fastest = np.argmin((m - 1) * t0.time_no_sync + t0.time, axis=1)
    rows = np.arange(L)
    initial = PartitionLoads(0.0, t0.time[rows, fastest], t0.states[rows, fastest], t0.forward[rows, fastest],
                             t0.backward[rows, fastest], m)
    best = bi_objective_partition(galvatron_search, memory_balanced_partition(initial, pp), budget)
    if best is None:
        return None
    p, loads = best
    chosen = [i for j, (a, c) in enumerate(zip(p, p[1:])) for i in stage(j, a, c)[0]]
    return GalvatronPlan(pp, p, m, tuple(strategies[i] for i in chosen), loads.step_s,
                         tuple(float(x) for x in stage_memories(loads, p)))


def search(profile: ModelProfile, cluster: Cluster, device_flops: float, memory_budget_bytes: float | None = None,
           max_micro_batches: int = 64) -> list[GalvatronPlan]:
    """Galvatron-BMW's search (Alg. 2 with Alg. 1's PP degrees) for ``profile``'s batch.

    For every PP degree ``pp`` (a power of two, at most the layers, leaving power-of-two
    groups) and micro-batch count ``m`` (dividing the batch, at most ``max_micro_batches``):
    the layers are partitioned by ``bi_objective_partition`` from the memory-balanced
    partition of each layer's fastest strategy, each candidate partition's stages given
    per-layer strategies by ``layer_dp``. A stage's candidates are ``strategy_space``'s trees
    for its group (Takeaway #3 applied) whose data shards divide the micro-batch. The DP
    minimises the stage's share of Eq. 9, ``Σ_l (m - 1) · c_no_grad_sync + c + m · R``, under
    ``memory_budget_bytes`` (``None``: unlimited) counted in units of the budget over
    ``max(MIN_MEMORY_UNITS, UNITS_PER_LAYER · stage layers)``, rounded up per layer.

    The paper also sweeps the batch size for throughput (Alg. 1-2 l. 2-3); here the batch is
    the profile's.

    Returns:
      One plan per (pp, m) that fits, fastest first (ties: less memory, then fewer stages,
      then fewer micro-batches).

    Raises:
      ValueError: no plan fits ``memory_budget_bytes``; arguments out of range.
    """
    if not isinstance(profile, ModelProfile):
        raise TypeError(f"profile: expected a ModelProfile, got {type(profile).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    if not (device_flops > 0 and math.isfinite(device_flops)):
        raise ValueError(f"device_flops: expected a positive finite FLOP/s, got {device_flops!r}")
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes: expected a positive number of bytes or None, "
                         f"got {memory_budget_bytes!r}")
    if not isinstance(max_micro_batches, int) or max_micro_batches < 1:
        raise ValueError(f"max_micro_batches: expected a positive integer, got {max_micro_batches!r}")
    N, L, B = cluster.num_devices, profile.num_layers, profile.batch_size
    degrees = [p for p in _pipeline_degrees(N) if p <= L]
    if not degrees:
        raise ValueError(f"cluster: {N} devices have no power-of-two pipeline degree leaving power-of-two groups; "
                         f"Galvatron's decision trees split devices by powers of two")
    budget = math.inf if memory_budget_bytes is None else float(memory_budget_bytes)
    layers = _Layers.of(profile.layers)
    plans = []
    for pp in degrees:
        space = strategy_space(N, (pp,))
        for m in (d for d in _divisors(B) if d <= max_micro_batches):
            candidates = [s for s in space if (B // m) % s.data_degree == 0]
            plan = _search_degree(profile, cluster, layers, device_flops, budget, pp, m, candidates)
            if plan is not None:
                plans.append(plan)
    if not plans:
        raise ValueError(f"memory_budget_bytes: {budget:.4g} bytes per device fits no plan for any pipeline degree "
                         f"{degrees} and micro-batch count up to {max_micro_batches}")
    return sorted(plans, key=lambda p: (p.predicted_step_s, max(p.peak_memory_bytes), p.pp, p.num_micro_batches))


def plan(profile: ModelProfile, cluster: Cluster, hardware: Hardware,
         constraints: PlanConstraints = PlanConstraints()) -> list[PipelinePlan]:
    """Galvatron-BMW's search as ``PipelinePlan``s: ``protocol.Planner.plan``. Priced by its own
    model (Eq. 9), 1F1B-Flush on every device as the paper runs it (its gradient
    synchronisation too), whatever ``constraints.schedules``, ``stages_per_mesh``,
    ``device_subsets`` and ``gradient_reduction``. Its per-layer strategies collapse to one
    ``(data, model)`` shape per stage (``GalvatronPlan.stage_shapes``): meshpar gives a stage
    one mesh. Devices run at the calibrated rate, as for meshpar's own planner.

    Raises:
      NoPlanFits: no plan fits the budget, or none has the fixed stage and micro-batch counts.
    """
    try:
        found = search(profile, cluster, hardware.device_flops / hardware.compute_scale,
                       constraints.memory_budget_bytes)
    except ValueError as e:
        raise NoPlanFits(str(e)) from None
    plans = [PipelinePlan(tuple(StagePlan(a, c, shape) for a, c, shape in zip(p.partition, p.partition[1:],
                                                                              p.stage_shapes)),
                          p.num_micro_batches, "1f1b", p.predicted_step_s, p.peak_memory_bytes, "galvatron")
             for p in found]
    plans = [p for p in plans if constraints.admits(p)]
    if not plans:
        raise NoPlanFits(f"num_stages, num_micro_batches: Galvatron-BMW found no plan{constraints.fixed_counts()}")
    return plans


def predict(profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
            num_micro_batches: int, schedule: ScheduleKind) -> PipelinePlan:
    """``protocol.Planner.predict``: meshpar's price of the layout (``planner_meshpar.predict``),
    as Galvatron-BMW's. Galvatron-BMW reads of ``Hardware`` a device's calibrated FLOP/s alone, none of the
    overheads calibration fits: it is calibrated as meshpar's model is."""
    return planner_meshpar.predict(profile, cluster, hardware, stages, num_micro_batches, schedule, "galvatron")
