"""The AMP planner (Li et al., "AMP: Automatically finding model parallel strategies with
heterogeneity awareness", NeurIPS 2022): its cost model of a (dp, tp, pp) strategy, its dynamic
program over contiguous layer partitions, and its simulated annealing over the parallel degrees,
the micro-batch size and the device placement.

Our copy of the paper (seeds/003) is its supplement only: Algorithm 2 (§6.3), the procedure
(§6.2), the DP's proof (§6.4, Eqs. 10-14) and the experiments' tables (§6.5). The main text's
cost model (§3.4, Eqs. 1-6) is known here through §6.4's restatement of Eq. 6 (Eq. 10) and
through the authors' public implementation, which fixes what the terms below price.

Cost of one strategy (``estimate``; units: seconds, bytes, FLOP/s, bytes/s):

    step_s = g + max_i a_i                         (§6.2's estimate(), "using Equation 4")
    g      = (gas - 1) · max_{i=1..pp} t_i + Σ_{i=1}^{pp-1} e_i + Σ_{i=1}^{pp} t_i      (Eq. 6)
    t_i    = Σ_{l in stage i} [ 3 · b · flops_l / (tp · F)
                                + 2 · 2 (tp - 1) / tp · b · tp_bytes_l / β_tp ]
    e_i    = b · cut_bytes(after stage i) / β_pp,i
    a_i    = 2 (dp - 1) / dp · param_bytes(stage i) / tp / β_dp,i

where ``b`` is the micro-batch size (examples per data-parallel replica per micro-batch),
``gas = batch / (dp · b)`` the micro-batches per step (gradient accumulation steps), ``F`` one
device's FLOP/s. ``t_i`` is one micro-batch's forward and backward on stage ``i`` (backward
priced at twice the forward, as AMP does) plus its Megatron all-reduces (``tp_bytes`` per
forward, as much again in the backward, each a ring: ``2 (n - 1) / n · bytes / β``,
``collectives.ring_all_reduce_s`` without latency, as AMP prices it); ``e_i``
one micro-batch's activation across the stage edge; ``a_i`` the gradient all-reduce ending the
step. ``g`` is 1F1B's critical path: the slowest stage's ``gas - 1`` steady micro-batches plus
one micro-batch through every stage and edge. ``g`` is Eq. 6 as §6.4 (Eq. 10) restates it;
Eq. 4 itself is not in our copy, so ``a_i`` (the slowest stage's all-reduce, added once after
the pipeline) and what ``t_i`` and ``e_i`` price follow the authors' implementation.

Bandwidths ``β`` come from the placement: a ring or edge runs at its slowest link; a link in a
host at ``intra_host_bandwidth``; a link between hosts at the host's NIC
(``inter_host_bandwidth``) divided by the transfers of that kind crossing it at once (every
ring of a kind, or every stage edge, runs concurrently). ``β_tp`` is the slowest tensor-parallel
ring of the placement, one figure for every stage, so layer costs stay stage-independent, as
the DP needs.

Memory per device (1F1B): stage ``i`` (0-based) keeps ``min(pp - i, gas)`` micro-batches'
activations alive: ``(param_bytes + optimizer_bytes)(stage) / tp + min(pp - i, gas) · b ·
activation_bytes(stage) / tp``.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence

import numpy as np

from ..model.cluster import Cluster
from ..pipeline.scheduling.pipeline_schedule import ScheduleKind
from ..simulation.collectives import ring_all_reduce_s
from . import planner_meshpar
from .layer_profile import ModelProfile
from .protocol import Hardware, NoPlanFits, PipelinePlan, PlanConstraints, StagePlan

__all__ = [
    "MEGATRON_PLACEMENT",
    "PLACEMENTS",
    "AmpPlan",
    "estimate",
    "megatron_uniform_partition",
    "partition_layers",
    "pipeline_cost",
    "plan",
    "predict",
    "search",
]

# A placement orders the three axes fastest-varying first over the cluster's devices, host
# by host. Megatron's heuristic (§6.2's placement()) puts tensor-parallel ranks next to each
# other, then data-parallel ones, stages outermost.
MEGATRON_PLACEMENT = ("tp", "dp", "pp")
# Each is a domino tiling of the (host, device) grid (§6.3, Fig. 5) with every domino the same
# way round: pp outermost makes each stage a block of tp x dp devices, one orientation per
# inner order; pp inside interleaves the stages' dominoes across hosts.
PLACEMENTS = (
    ("tp", "dp", "pp"),
    ("dp", "tp", "pp"),
    ("tp", "pp", "dp"),
    ("dp", "pp", "tp"),
    ("pp", "tp", "dp"),
    ("pp", "dp", "tp"),
)


@dataclasses.dataclass(frozen=True)
class AmpPlan:
    """One strategy and what AMP's cost model predicts for it.

    Attributes:
      dp, tp, pp: data-, tensor- and pipeline-parallel degrees; ``dp · tp · pp`` devices.
      micro_batch_size: examples per micro-batch on one data-parallel replica.
      num_micro_batches: ``gas``, micro-batches per step: ``batch / (dp · micro_batch_size)``.
      partition: stage boundaries ``(0, ..., num_layers)``: stage ``i`` runs layers
        ``[partition[i], partition[i + 1])``.
      predicted_step_s: ``step_s`` of the module docstring.
      peak_memory_bytes: the most bytes one device holds, over the stages.
      placement: the axes fastest-varying first over the devices (``PLACEMENTS``).
    """

    dp: int
    tp: int
    pp: int
    micro_batch_size: int
    num_micro_batches: int
    partition: tuple[int, ...]
    predicted_step_s: float
    peak_memory_bytes: float
    placement: tuple[str, str, str] = MEGATRON_PLACEMENT

    def device_grid(self, cluster: Cluster) -> np.ndarray:
        """The device ids as a ``(pp, dp, tp)`` array: ``[i, d, k]`` is tensor rank ``k`` of
        replica ``d`` of stage ``i``."""
        return _device_grid(cluster, self.pp, self.dp, self.tp, self.placement)


# -- the pipeline cost and its DP ---------------------------------------------------------


def _check_partition_inputs(layer_seconds, edge_seconds, num_stages: int, num_micro_batches: int):
    t = np.asarray(layer_seconds, dtype=np.float64)
    if t.ndim != 1 or t.size == 0 or not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"layer_seconds: expected a non-empty 1-D array of finite seconds >= 0, got {layer_seconds!r}")
    L = t.size
    if not isinstance(num_stages, int) or not 1 <= num_stages <= L:
        raise ValueError(f"num_stages: expected an integer in [1, {L}] (the layers), got {num_stages!r}")
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
        raise ValueError(f"num_micro_batches: expected a positive integer, got {num_micro_batches!r}")
    e = np.asarray(edge_seconds, dtype=np.float64)
    if e.ndim == 1:
        # one figure per cut, whichever stage boundary it becomes
        e = np.repeat(e[:, None], num_stages - 1, axis=1)
    if e.shape != (L - 1, num_stages - 1) or not np.all(np.isfinite(e)) or np.any(e < 0):
        raise ValueError(f"edge_seconds: expected finite seconds >= 0 of shape ({L - 1},) or "
                         f"({L - 1}, {num_stages - 1}), got shape {e.shape}")
    return t, e


def _check_boundaries(boundaries: Sequence[int], num_layers: int) -> tuple[int, ...]:
    b = tuple(int(x) for x in boundaries)
    if len(b) < 2 or b[0] != 0 or b[-1] != num_layers or any(x >= y for x, y in zip(b, b[1:])):
        raise ValueError(f"boundaries: expected strictly increasing (0, ..., {num_layers}), got {tuple(boundaries)!r}")
    return b


def pipeline_cost(layer_seconds, edge_seconds, boundaries: Sequence[int], num_micro_batches: int) -> float:
    """AMP's pipeline time ``g`` (Eq. 6, restated in §6.4 as Eq. 10), in seconds:

        g = (gas - 1) · max_i t_i + Σ_{i=1}^{pp-1} e_i + Σ_{i=1}^{pp} t_i

    Args:
      layer_seconds: shape ``(L,)``: one micro-batch's forward + backward on each layer,
        tensor-parallel communication included; ``t_i`` sums its stage's layers.
      edge_seconds: shape ``(L - 1,)``, or ``(L - 1, pp - 1)`` when boundaries differ:
        ``[l, j]`` moves one micro-batch across a cut after layer ``l`` that is the boundary
        between stages ``j`` and ``j + 1``; ``e_j`` is the entry of the cut chosen there.
      boundaries: ``(0, ..., L)``, ``pp + 1`` strictly increasing stage boundaries.
      num_micro_batches: ``gas``.
    """
    b = _check_boundaries(boundaries, np.asarray(layer_seconds).size)
    t, e = _check_partition_inputs(layer_seconds, edge_seconds, len(b) - 1, num_micro_batches)
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    stage = np.array([prefix[j] - prefix[i] for i, j in zip(b, b[1:])])
    edges = sum(e[cut - 1, j] for j, cut in enumerate(b[1:-1]))
    return float((num_micro_batches - 1) * stage.max() + edges + prefix[-1])


def _least_edges(span: np.ndarray, bound: float, edge_in: np.ndarray, allowed: np.ndarray, num_stages: int):
    """The least ``Σ e_i`` over partitions into ``num_stages`` stages allowed by ``allowed``
    (``[j, c, i]``: layers ``[c, i)`` may be stage ``j``) whose every stage takes at most
    ``bound``; and per stage, each end's best start (for backtracking)."""
    L = span.shape[0] - 1
    within = span <= bound
    best = np.full(L + 1, math.inf)
    best[0] = 0.0
    starts = []
    columns = np.arange(L + 1)
    for j in range(num_stages):
        enter = best if j == 0 else best + edge_in[:, j - 1]
        candidates = np.where(allowed[j] & within, enter[:, None], math.inf)
        start = np.argmin(candidates, axis=0)
        best = candidates[start, columns]
        starts.append(start)
    return float(best[L]), starts


def partition_layers(layer_seconds, edge_seconds, num_stages: int, num_micro_batches: int,
                     stage_fits: np.ndarray | None = None) -> tuple[int, ...]:
    """The contiguous partition into ``num_stages`` stages minimising ``pipeline_cost`` (§3.5's
    DP; the other arguments as for ``pipeline_cost``). Returns its boundaries ``(0, ..., L)``;
    among equal costs, the one found at the smallest bound ``T`` (below), each stage then
    starting as early as it can, chosen from the last stage back: deterministic.

    ``stage_fits``, shape ``(num_stages, L + 1, L + 1)`` of bool: ``[j, c, i]`` whether layers
    ``[c, i)`` may form stage ``j`` (a memory budget); ``None`` allows every stage.

    Method. AMP's DP (§6.4) carries, besides the prefix and the stage count, the slowest stage
    time ``m`` of the stages already placed; its candidate values are the sums of contiguous
    layers. Here that value is the outer loop instead: for a bound ``T`` on every stage, the
    least ``Σ e_i``, ``E(T)``, is an O(pp · L²) DP, and

        min_partition g = Σ_l t_l + min_T [(gas - 1) · T + E(T)]

    over the same candidates (at the optimum's slowest stage ``T*``, ``E(T*)`` is at most its
    edges; any ``T`` bounds the slowest stage of ``E(T)``'s partition). ``E`` never rises with
    ``T``, so only each run of equal ``E`` values' smallest ``T`` counts: bisection finds them,
    and no ``T`` past ``T_0 + (E(T_0) - E(∞)) / (gas - 1)`` (``T_0`` the least feasible) can win.

    Raises:
      ValueError: no partition is allowed by ``stage_fits``, or malformed arguments.
    """
    t, e = _check_partition_inputs(layer_seconds, edge_seconds, num_stages, num_micro_batches)
    L, gas = t.size, num_micro_batches
    prefix = np.concatenate([[0.0], np.cumsum(t)])
    span = prefix[None, :] - prefix[:, None]  # [c, i]: layers [c, i)
    valid = np.triu(np.ones((L + 1, L + 1), dtype=bool), k=1)
    if stage_fits is None:
        allowed = np.broadcast_to(valid, (num_stages, L + 1, L + 1))
    else:
        fits = np.asarray(stage_fits)
        if fits.shape != (num_stages, L + 1, L + 1) or fits.dtype != bool:
            raise ValueError(f"stage_fits: expected bool of shape {(num_stages, L + 1, L + 1)}, got "
                             f"{fits.dtype} of shape {fits.shape}")
        allowed = fits & valid
    # edge_in[c, j]: a stage starting at layer c enters across boundary j (a cut after c - 1)
    edge_in = np.full((L + 1, max(num_stages - 1, 1)), math.inf)
    edge_in[1:L, : num_stages - 1] = e
    bounds = np.unique(span[valid])
    least: dict[int, float] = {}

    def edges_at(k: int) -> float:
        if k not in least:
            least[k] = _least_edges(span, bounds[k], edge_in, allowed, num_stages)[0]
        return least[k]

    top = bounds.size - 1
    if not math.isfinite(edges_at(top)):
        raise ValueError("stage_fits: allows no partition of the layers into num_stages stages")
    lo, hi = 0, top
    while lo < hi:  # the least feasible bound
        mid = (lo + hi) // 2
        if math.isfinite(edges_at(mid)):
            hi = mid
        else:
            lo = mid + 1
    first = lo
    if gas > 1:
        reach = bounds[first] + (edges_at(first) - edges_at(top)) / (gas - 1)
        top = max(first, int(np.searchsorted(bounds, reach, side="right")) - 1)
    pending = [(first, top)]
    while pending:  # visit the smallest bound of every run of equal E
        a, c = pending.pop()
        if edges_at(a) != edges_at(c) and c - a > 1:
            mid = (a + c) // 2
            pending += [(a, mid), (mid, c)]
    best = min((k for k in least if first <= k <= top), key=lambda k: ((gas - 1) * bounds[k] + least[k], k))
    _, starts = _least_edges(span, bounds[best], edge_in, allowed, num_stages)
    cuts, end = [L], L
    for j in range(num_stages - 1, -1, -1):
        end = int(starts[j][end])
        cuts.append(end)
    return tuple(reversed(cuts))


def megatron_uniform_partition(is_block: Sequence[bool], num_stages: int) -> tuple[int, ...]:
    """The partition Megatron/DeepSpeed uses in AMP's baselines (§6.5 Tables 6, 8, 10): the
    repeated blocks (transformer layers) split evenly, the first ``num_blocks % num_stages``
    stages taking one more; each stage from its first block to the next stage's first block,
    so other layers join the stage of the block before them, leading ones the first stage.

    AMP numbers GPT-2's layers as DeepSpeed's pipeline module lists them: 2 before the 24
    transformer layers (the embedding, a transpose), 4 after (a transpose, the final
    layernorm, the tied output embedding, a cast), 30 in all, the blocks being layers 3-26
    counted from 1 (§6.5.1):
    ``is_block = [False] * 2 + [True] * 24 + [False] * 4`` gives ``(0, 14, 30)`` for 2 stages
    and ``(0, 8, 14, 20, 30)`` for 4.

    Returns:
      boundaries ``(0, ..., len(is_block))``.
    """
    positions = [k for k, block in enumerate(is_block) if block]
    if not isinstance(num_stages, int) or not 1 <= num_stages <= len(positions):
        raise ValueError(f"num_stages: expected an integer in [1, {len(positions)}] (the blocks), got {num_stages!r}")
    each, extra = divmod(len(positions), num_stages)
    first_block, cuts = 0, [0]
    for stage in range(num_stages - 1):
        first_block += each + (stage < extra)
        cuts.append(positions[first_block])
    return (*cuts, len(is_block))


# -- placement and bandwidths --------------------------------------------------------------


def _device_grid(cluster: Cluster, pp: int, dp: int, tp: int, placement: Sequence[str]) -> np.ndarray:
    if sorted(placement) != ["dp", "pp", "tp"]:
        raise ValueError(f"placement: expected an order of ('tp', 'dp', 'pp'), got {tuple(placement)!r}")
    if pp * dp * tp != cluster.num_devices:
        raise ValueError(f"dp, tp, pp: {dp} x {tp} x {pp} != the cluster's {cluster.num_devices} devices")
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    slowest_first = list(reversed(placement))
    flat = np.array([d for host in cluster.host_devices for d in host])
    grid = flat.reshape([sizes[a] for a in slowest_first])
    return grid.transpose([slowest_first.index(a) for a in ("pp", "dp", "tp")])


def _link_bandwidths(cluster: Cluster, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """Bytes/s of concurrent transfers host ``src`` -> host ``dst`` (same shapes): in a host
    the intra-host rate; across hosts the NIC split over the transfers leaving the sender's
    host or entering the receiver's, whichever is more."""
    across = src != dst
    out = np.bincount(src[across], minlength=cluster.num_hosts)
    into = np.bincount(dst[across], minlength=cluster.num_hosts)
    sharing = np.maximum(out[src], into[dst]).clip(min=1)
    return np.where(across, cluster.inter_host_bandwidth / sharing, cluster.intra_host_bandwidth)


@dataclasses.dataclass(frozen=True)
class _Bandwidths:
    tp: float  # the slowest tensor-parallel ring
    dp: np.ndarray  # (pp,): per stage, its slowest data-parallel ring
    pp: np.ndarray  # (pp - 1,): per boundary, its slowest link


def _bandwidths(cluster: Cluster, grid: np.ndarray) -> _Bandwidths:
    host_of = {d: h for h, devs in enumerate(cluster.host_devices) for d in devs}
    hosts = np.vectorize(host_of.__getitem__, otypes=[np.int64])(grid)

    def ring(axis: int) -> np.ndarray:
        if hosts.shape[axis] == 1:
            return np.full(hosts.shape, math.inf)
        return _link_bandwidths(cluster, hosts, np.roll(hosts, -1, axis=axis))

    tp = float(ring(2).min())
    dp = ring(1).min(axis=(1, 2))
    pp = _link_bandwidths(cluster, hosts[:-1], hosts[1:]).min(axis=(1, 2))
    return _Bandwidths(tp, dp, pp)


# -- the cost model --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layers:
    """A profile's per-layer figures as arrays, and their prefix sums (a span's total in O(1))."""

    flops: np.ndarray
    tp_bytes: np.ndarray
    cut_bytes: np.ndarray  # (L - 1,): per example, what crosses a cut after each layer
    params: np.ndarray  # prefix sums, (L + 1,)
    static: np.ndarray  # prefix sums of parameter + optimizer bytes
    acts: np.ndarray  # prefix sums of activation bytes

    @classmethod
    def of(cls, profile: ModelProfile) -> _Layers:
        def prefix(values):
            return np.concatenate([[0.0], np.cumsum(values)])

        layers = profile.layers
        cut = np.zeros(max(profile.num_layers - 1, 0))
        for value in profile.crossing():
            # a value crosses every cut from its producer to its last consumer
            cut[value.producer:max(value.consumers)] += value.bytes_per_example
        return cls(
            flops=np.array([x.flops for x in layers]),
            tp_bytes=np.array([x.tp_bytes for x in layers]),
            cut_bytes=cut,
            params=prefix([x.param_bytes for x in layers]),
            static=prefix([x.param_bytes + x.optimizer_bytes for x in layers]),
            acts=prefix([x.activation_bytes for x in layers]),
        )


def _stage_memory(layers: _Layers, tp: int, pp: int, mbs: int, gas: int) -> np.ndarray:
    """Shape ``(pp, L + 1, L + 1)``: ``[j, c, i]`` bytes per device of layers ``[c, i)`` as
    stage ``j`` (negative entries, ``i < c``, are no stage)."""
    static = layers.static[None, :] - layers.static[:, None]
    acts = layers.acts[None, :] - layers.acts[:, None]
    live = np.minimum(pp - np.arange(pp), gas)
    return (static[None] + live[:, None, None] * mbs * acts[None]) / tp


def estimate(profile: ModelProfile, cluster: Cluster, device_flops: float, *, dp: int, tp: int,
             micro_batch_size: int, placement: Sequence[str] = MEGATRON_PLACEMENT,
             partition: Sequence[int] | None = None, memory_budget_bytes: float | None = None) -> AmpPlan:
    """AMP's estimate (§6.2) of one strategy: ``pp = devices / (dp · tp)``; the layers split
    by ``partition`` (boundaries ``(0, ..., L)``), or by ``partition_layers`` when ``None``, then
    only into stages whose per-device memory fits ``memory_budget_bytes``.

    Raises:
      ValueError: degrees that do not fit the cluster, the layers or the batch; no partition
        fitting the budget.
    """
    N, L, B = cluster.num_devices, profile.num_layers, profile.batch_size
    if not all(isinstance(x, int) and x >= 1 for x in (dp, tp, micro_batch_size)) or N % (dp * tp):
        raise ValueError(f"dp, tp, micro_batch_size: expected positive integers with dp · tp dividing the {N} "
                         f"devices, got {dp}, {tp}, {micro_batch_size}")
    if N // (dp * tp) > L:
        raise ValueError(f"dp, tp: pp = {N // (dp * tp)} stages exceed the {L} layers")
    if B % (dp * micro_batch_size):
        raise ValueError(f"micro_batch_size: {micro_batch_size} does not divide batch / dp = {B} / {dp}")
    if not device_flops > 0:
        raise ValueError(f"device_flops: expected a positive FLOP/s, got {device_flops!r}")
    pp, b = cluster.num_devices // (dp * tp), micro_batch_size
    gas = B // (dp * b)
    layers = _Layers.of(profile)
    bw = _bandwidths(cluster, _device_grid(cluster, pp, dp, tp, placement))
    layer_s = 3.0 * b * layers.flops / (tp * device_flops) + ring_all_reduce_s(2.0 * b * layers.tp_bytes, tp, bw.tp)
    edge_s = b * layers.cut_bytes[:, None] / bw.pp[None, :]
    memory = _stage_memory(layers, tp, pp, b, gas)
    if partition is None:
        fits = None if memory_budget_bytes is None else memory <= memory_budget_bytes
        partition = partition_layers(layer_s, edge_s, pp, gas, fits)
    bounds = _check_boundaries(partition, L)
    if len(bounds) != pp + 1:
        raise ValueError(f"partition: expected {pp} stages (pp), got {len(bounds) - 1}")
    starts, stops = np.array(bounds[:-1]), np.array(bounds[1:])
    sync = ring_all_reduce_s((layers.params[stops] - layers.params[starts]) / tp, dp, bw.dp)
    step = pipeline_cost(layer_s, edge_s, bounds, gas) + float(np.max(sync))
    peak = float(memory[np.arange(pp), starts, stops].max())
    return AmpPlan(dp, tp, pp, b, gas, bounds, step, peak, tuple(placement))


# -- the search ------------------------------------------------------------------------------


def _least_memory(memory: np.ndarray) -> float:
    """The least, over contiguous partitions, of the largest stage's memory: ``memory`` as
    ``_stage_memory`` returns it."""
    pp, n, _ = memory.shape
    valid = np.triu(np.ones((n, n), dtype=bool), k=1)
    best = np.full(n, math.inf)
    best[0] = 0.0
    for j in range(pp):
        best = np.where(valid, np.maximum(best[:, None], memory[j]), math.inf).min(axis=0)
    return float(best[-1])


def _space(profile: ModelProfile, cluster: Cluster, budget: float | None):
    """The strategies that fit: ``{(tp, dp): micro-batch sizes}``, each size leaving some
    partition within ``budget``; and the least memory any strategy needs (``inf`` if not
    computed: no budget)."""
    N, B = cluster.num_devices, profile.batch_size
    layers = _Layers.of(profile) if budget is not None else None
    space, least = {}, math.inf
    for tp in (t for t in range(1, N + 1) if N % t == 0):
        for dp in (d for d in range(1, N // tp + 1) if (N // tp) % d == 0 and B % d == 0):
            pp = N // (dp * tp)
            if pp > profile.num_layers:
                continue
            sizes = [m for m in range(1, B // dp + 1) if (B // dp) % m == 0]
            if layers is not None:
                fitting = []
                for m in sizes:  # memory grows with the micro-batch size: stop at the first miss
                    need = _least_memory(_stage_memory(layers, tp, pp, m, B // (dp * m)))
                    least = min(least, need)
                    if need > budget:
                        break
                    fitting.append(m)
                sizes = fitting
            if sizes:
                space[(tp, dp)] = tuple(sizes)
    return space, least


def _canonical(placement: tuple[str, str, str], sizes: dict[str, int]) -> tuple[str, str, str]:
    """The first of ``PLACEMENTS`` ordering the axes of degree above 1 as ``placement`` does."""
    def used(order):
        return [a for a in order if sizes[a] > 1]

    return next(p for p in PLACEMENTS if used(p) == used(placement))


def search(profile: ModelProfile, cluster: Cluster, device_flops: float, memory_budget_bytes: float | None = None,
           seed: int = 0, iterations: int = 200, cooling: float = 0.97) -> list[AmpPlan]:
    """AMP's randomized optimization (§6.3, Algorithm 2) over (tp, dp, micro-batch size,
    placement), each strategy priced by ``estimate`` with its optimal partition.

    From a random strategy, each iteration draws a neighbour: with probability 1/2 another
    ``tp`` for the same ``dp`` (Alg. 2 l. 9), else another ``dp`` for the same ``tp`` with a
    new micro-batch size and placement (l. 11-13); it is accepted with probability
    ``exp(min(cost - next, 0) / (cost · temperature))`` (l. 16-17), the temperature starting at
    1 and multiplied by ``cooling`` each iteration. Only strategies with some partition
    fitting the budget are drawn: ``dp · tp · pp`` the cluster's devices, ``pp`` at most the
    layers, the micro-batch size dividing ``batch / dp``.

    Returns:
      Every strategy visited, fastest first (ties: less memory, then the degrees); the same
      arguments give the same list.

    Raises:
      ValueError: no strategy fits ``memory_budget_bytes``, naming the least memory any needs.
    """
    if not isinstance(profile, ModelProfile):
        raise TypeError(f"profile: expected a ModelProfile, got {type(profile).__name__}")
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster: expected a Cluster, got {type(cluster).__name__}")
    if memory_budget_bytes is not None and not memory_budget_bytes > 0:
        raise ValueError(f"memory_budget_bytes: expected a positive number of bytes or None, "
                         f"got {memory_budget_bytes!r}")
    if not isinstance(iterations, int) or iterations < 0:
        raise ValueError(f"iterations: expected an integer >= 0, got {iterations!r}")
    if not 0 < cooling <= 1:
        raise ValueError(f"cooling: expected a factor in (0, 1], got {cooling!r}")
    space, least = _space(profile, cluster, memory_budget_bytes)
    if not space:
        raise ValueError(f"memory_budget_bytes: {memory_budget_bytes:.4g} bytes per device fits no strategy; "
                         f"the least any needs is {least:.4g} bytes")
    rng = random.Random(seed)
    plans: dict[tuple, AmpPlan] = {}

    def cost(state: tuple) -> float:
        tp, dp, mbs, placement = state
        pp = cluster.num_devices // (tp * dp)
        # orders differing only in where a degree-1 axis goes lay the devices out alike
        state = (tp, dp, mbs, _canonical(placement, {"tp": tp, "dp": dp, "pp": pp}))
        if state not in plans:
            plans[state] = estimate(profile, cluster, device_flops, dp=dp, tp=tp, micro_batch_size=mbs,
                                    placement=state[3], memory_budget_bytes=memory_budget_bytes)
        return plans[state].predicted_step_s

    pairs = sorted(space)
    tp, dp = rng.choice(pairs)
    state = (tp, dp, rng.choice(space[(tp, dp)]), MEGATRON_PLACEMENT)
    current, temperature = cost(state), 1.0
    for _ in range(iterations):
        temperature *= cooling
        tp, dp, mbs, placement = state
        tps = [t for t, d in pairs if d == dp and t != tp and mbs in space[(t, dp)]]
        dps = [d for t, d in pairs if t == tp and d != dp]
        if tps and (rng.random() < 0.5 or not dps):
            proposal = (rng.choice(tps), dp, mbs, placement)
        elif dps:
            new_dp = rng.choice(dps)
            proposal = (tp, new_dp, rng.choice(space[(tp, new_dp)]), rng.choice(PLACEMENTS))
        else:
            break  # a single (tp, dp): nothing to anneal
        following = cost(proposal)
        accept = 1.0 if following <= current else (
            math.exp((current - following) / (current * temperature)) if current > 0 else 0.0)
        if rng.random() < accept:
            state, current = proposal, following
    return sorted(plans.values(), key=lambda p: (p.predicted_step_s, p.peak_memory_bytes, p.tp, p.dp,
                                                 p.micro_batch_size, p.placement))


def plan(profile: ModelProfile, cluster: Cluster, hardware: Hardware,
         constraints: PlanConstraints = PlanConstraints()) -> list[PipelinePlan]:
    """AMP's search as ``PipelinePlan``s: ``protocol.Planner.plan``. Its plans with Megatron's
    placement (the stage meshes meshpar cuts), on every device, priced by AMP's own model,
    1F1B, with its paper's gradient synchronisation whatever ``constraints.schedules``,
    ``stages_per_mesh``, ``device_subsets`` and ``gradient_reduction``. AMP knows a device by
    its FLOP/s: the calibrated rate (``Hardware.compute_scale``), as meshpar's own.

    Raises:
      NoPlanFits: no strategy fits the budget, or none has Megatron's placement and the fixed
        stage and micro-batch counts.
    """
    try:
        found = search(profile, cluster, hardware.device_flops / hardware.compute_scale,
                       constraints.memory_budget_bytes)
    except ValueError as e:
        raise NoPlanFits(str(e)) from None
    plans = [PipelinePlan(tuple(StagePlan(a, c, (p.dp, p.tp)) for a, c in zip(p.partition, p.partition[1:])),
                          p.num_micro_batches, "1f1b", p.predicted_step_s, (p.peak_memory_bytes,) * p.pp, "amp")
             for p in found if p.placement == MEGATRON_PLACEMENT]
    plans = [p for p in plans if constraints.admits(p)]
    if not plans:
        raise NoPlanFits(f"num_stages, num_micro_batches: AMP found no plan with Megatron's placement"
                         f"{constraints.fixed_counts()}")
    return plans


def predict(profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
            num_micro_batches: int, schedule: ScheduleKind) -> PipelinePlan:
    """``protocol.Planner.predict``: meshpar's price of the layout (``planner_meshpar.predict``),
    as AMP's. AMP reads of ``Hardware`` a device's calibrated FLOP/s alone, none of the
    overheads calibration fits: it is calibrated as meshpar's model is."""
    return planner_meshpar.predict(profile, cluster, hardware, stages, num_micro_batches, schedule, "amp")
