"""Alpa's inter-operator pass (Zheng et al., OSDI 2022, §5.2) as a baseline planner.

Alpa cuts the layers into stages and gives each a submesh of the cluster by a DP over
(stages, layers, devices), minimising the pipeline's latency

    T* = min_{t_max} { min_S F(S, 0, D; t_max) + (B - 1) · t_max }                 (Alpa Eq. 2)

    F(s, k, d; t_max) = min_{k < i <= K, (n, m) : n·m <= d}                          (Alpa Eq. 3)
        { t_intra(layers k..i-1, Mesh(n, m), s) + F(s - 1, i, d - n·m; t_max)  |  t_intra <= t_max }
    F(0, K, 0; t_max) = 0

with ``B`` micro-batches, ``D`` devices, ``t_intra`` a stage's forward-plus-backward time per
micro-batch on its fastest logical (data, model) shape whose memory fits when ``s`` stages
(itself included) follow it, so that it keeps ``s`` micro-batches alive under 1F1B. Submesh
shapes are Alpa's: ``(1, 2^j)`` within a host and ``(n, devices_per_host)`` for ``n`` whole
hosts; the submeshes cover the cluster exactly.

What Alpa's model leaves out, and meshpar's planner prices: the stages' cross-mesh transfers
(Alpa assumes them cheap beside compute), the schedule's overlap, and the data-parallel
gradient synchronisation. ``t_intra`` here is meshpar's per-stage compute and tensor-parallel
cost (``planner_meshpar``), so the two planners differ in exactly those terms.

Two bounds keep it tractable on large clusters, as Alpa's implementation does: the layers are
clustered into at most ``max_layers`` consecutive groups of balanced FLOPs (Alpa's layer
construction), and the ``t_max`` candidates are the distinct stage times thinned so that
consecutive ones differ by at least ``gap`` (relative), starting from the smallest feasible one
(bisection: a larger ``t_max`` only admits more stages) and stopping once ``(B - 1) · t_max``
alone exceeds the best latency found.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..model.cluster import Cluster
from ..pipeline.scheduling.pipeline_schedule import ScheduleKind
from . import planner_meshpar
from .layer_profile import ModelProfile
from .planner_meshpar import _memory, _Prefix, _stage_seconds, tensor_parallel_bandwidth
from .protocol import Hardware, NoPlanFits, PipelinePlan, PlanConstraints, StagePlan

__all__ = ["submesh_shapes", "cluster_layers", "stage_dp", "plan", "predict"]


def submesh_shapes(cluster: Cluster) -> list[tuple[int, int]]:
    """Alpa's submesh shapes ``(hosts, devices per host)``: ``(1, 2^j)`` up to a host's devices,
    then ``(n, devices_per_host)`` for 2..num_hosts hosts."""
    per_host = cluster.devices_per_host
    shapes = [(1, 2**j) for j in range(int(math.log2(per_host)) + 1) if 2**j < per_host]
    return shapes + [(n, per_host) for n in range(1, cluster.num_hosts + 1)]


def cluster_layers(profile: ModelProfile, max_layers: int) -> list[int]:
    """Boundaries ``[0, ..., L]`` of at most ``max_layers`` consecutive groups of ``profile``'s
    layers with balanced FLOPs (each group at least one layer)."""
    L = profile.num_layers
    if max_layers < 1:
        raise ValueError(f"max_layers: expected a positive integer, got {max_layers!r}")
    if L <= max_layers:
        return list(range(L + 1))
    cumulative = np.cumsum([x.flops for x in profile.layers])
    targets = cumulative[-1] * np.arange(1, max_layers) / max_layers
    cuts = sorted({int(np.searchsorted(cumulative, t)) + 1 for t in targets} - {0, L})
    return [0, *cuts, L]


def stage_dp(stage_s: np.ndarray, sizes: list[int], num_devices: int, num_micro_batches: int,
             gap: float = 0.02, num_stages: int | None = None) -> tuple[float, list[tuple[int, int, int]]] | None:
    """Alpa's DP (Eq. 2-3) over precomputed stage times.

    Args:
      stage_s: ``[s, k, i, j]`` seconds of layers ``k..i-1`` on submesh shape ``j`` as the
        ``s``-th stage from the end (``s`` from 1; ``inf`` where it does not fit or ``i <= k``);
        shape ``(S_max + 1, K + 1, K + 1, len(sizes))``.
      sizes: devices per submesh shape.
      num_devices: ``D``, all of which the submeshes use.
      num_micro_batches: ``B``.
      gap: relative spacing of the ``t_max`` candidates.
      num_stages: exactly this many stages; ``None``: any number up to ``S_max``.

    Returns:
      ``(T*, stages)`` with ``stages`` as ``(k, i, j)`` in pipeline order, or ``None`` when no
      partition fits.
    """
    S_max, K = stage_s.shape[0] - 1, stage_s.shape[1] - 1
    D, B = num_devices, num_micro_batches
    finite = np.unique(stage_s[np.isfinite(stage_s)])
    candidates = []
    for t in finite:
        if not candidates or t > candidates[-1] * (1 + gap):
            candidates.append(float(t))
    if candidates and candidates[-1] < finite[-1]:
        candidates.append(float(finite[-1]))
    # Feasibility only grows with t_max: the smallest feasible candidate by bisection.
    lo, hi = 0, len(candidates)
    while lo < hi:
        mid = (lo + hi) // 2
        if _dp_at(stage_s, sizes, D, candidates[mid], S_max, K, num_stages) is None:
            lo = mid + 1
        else:
            hi = mid
    best: tuple[float, list[tuple[int, int, int]]] | None = None
    for t_max in candidates[lo:]:
        if best is not None and (B - 1) * t_max >= best[0]:
            break
        found = _dp_at(stage_s, sizes, D, t_max, S_max, K, num_stages)
        if found is not None and (best is None or found[0] + (B - 1) * t_max < best[0]):
            best = (found[0] + (B - 1) * t_max, found[1])
    return best


def _dp_at(stage_s: np.ndarray, sizes: list[int], D: int, t_max: float, S_max: int, K: int,
           num_stages: int | None):
    """``min_S F(S, 0, D; t_max)`` and its stages. ``F[s][k, d]``: the least summed time of
    layers ``k..K-1`` cut into ``s`` stages on exactly ``d`` devices."""
    INF = math.inf
    F = np.full((K + 1, D + 1), INF)
    F[K, 0] = 0.0
    tables, choices = [F], []
    best = (INF, 0)
    for s in range(1, S_max + 1):
        G = np.full((K + 1, D + 1), INF)
        choice = np.full((K + 1, D + 1, 2), -1, dtype=np.int64)
        prev = tables[-1]
        for j, size in enumerate(sizes):
            if size > D:
                continue
            cost = np.where(stage_s[s, :, :, j] <= t_max, stage_s[s, :, :, j], INF)  # [k, i]
            # total[k, i, d] = cost[k, i] + prev[i, d - size]
            shifted = np.full((K + 1, D + 1), INF)
            shifted[:, size:] = prev[:, :D + 1 - size]
            total = cost[:, :, None] + shifted[None, :, :]
            at = np.argmin(total, axis=1)
            value = np.take_along_axis(total, at[:, None, :], axis=1)[:, 0, :]
            better = value < G
            G = np.where(better, value, G)
            choice[..., 0] = np.where(better, at, choice[..., 0])
            choice[..., 1] = np.where(better, j, choice[..., 1])
        tables.append(G)
        choices.append(choice)
        if G[0, D] < best[0] and num_stages in (None, s):
            best = (float(G[0, D]), s)
    if not math.isfinite(best[0]):
        return None
    stages, k, d = [], 0, D
    for s in range(best[1], 0, -1):
        i, j = choices[s - 1][k, d]
        stages.append((int(k), int(i), int(j)))
        k, d = int(i), d - sizes[int(j)]
    return best[0], stages


def plan(profile: ModelProfile, cluster: Cluster, hardware: Hardware,
         constraints: PlanConstraints = PlanConstraints(), *, max_micro_batches: int = 64, max_layers: int = 16,
         gap: float = 0.02) -> list[PipelinePlan]:
    """Alpa's plan for every micro-batch count (dividing the batch, up to
    ``max_micro_batches``), ranked by Alpa's latency ``T*``: ``protocol.Planner.plan``.
    ``constraints.num_stages`` / ``num_micro_batches`` fix one; Alpa plans 1F1B on every device
    (its submeshes cover the cluster), whatever ``constraints.schedules``,
    ``stages_per_mesh`` and ``device_subsets``, and no gradient synchronisation. Each stage's
    (data, model) shape is the logical shape of its submesh that Alpa's intra-op cost found
    fastest.

    Raises:
      NoPlanFits: no partition fits ``constraints.memory_budget_bytes``.
    """
    num_stages, num_micro_batches = constraints.num_stages, constraints.num_micro_batches
    budget = constraints.budget
    bounds = cluster_layers(profile, max_layers)
    K, D, batch = len(bounds) - 1, cluster.num_devices, profile.batch_size
    shapes = submesh_shapes(cluster)
    sizes = [n * m for n, m in shapes]
    S_max = min(K, D) if num_stages is None else num_stages
    pre = _Prefix(profile)
    lo, hi = np.meshgrid(np.array(bounds), np.array(bounds), indexing="ij")
    valid = np.arange(K + 1)[:, None] < np.arange(K + 1)[None, :]
    plans = []
    counts = ([num_micro_batches] if num_micro_batches is not None else
              [m for m in range(1, min(batch, max_micro_batches) + 1) if batch % m == 0])
    for B in counts:
        b = batch // B
        stage_s = np.full((S_max + 1, K + 1, K + 1, len(shapes)), math.inf)
        logical = np.zeros((S_max + 1, K + 1, K + 1, len(shapes)), dtype=np.int64)
        for j, size in enumerate(sizes):
            for k_log, (d, t) in enumerate(_logical(size)):
                if b % d:
                    continue
                f, bw = _stage_seconds(pre, lo, hi, (d, t), b, hardware, tensor_parallel_bandwidth(cluster, (d, t)))
                for s in range(1, S_max + 1):
                    fits = valid & (_memory(pre, lo, hi, (d, t), b, min(s, B)) <= budget)
                    better = fits & (f + bw < stage_s[s, :, :, j])
                    stage_s[s, :, :, j] = np.where(better, f + bw, stage_s[s, :, :, j])
                    logical[s, :, :, j] = np.where(better, k_log, logical[s, :, :, j])
        found = stage_dp(stage_s, sizes, D, B, gap, num_stages)
        if found is None:
            continue
        latency, chosen = found
        stages, memory = [], []
        for position, (k, i, j) in enumerate(chosen):
            s = len(chosen) - position
            shape = _logical(sizes[j])[int(logical[s, k, i, j])]
            stages.append(StagePlan(bounds[k], bounds[i], shape))
            memory.append(float(_memory(pre, bounds[k], bounds[i], shape, b, min(s, B))))
        plans.append(PipelinePlan(tuple(stages), B, "1f1b", latency, tuple(memory), "alpa_dp"))
    if not plans:
        raise NoPlanFits(f"memory_budget_bytes: {budget:.4g} bytes per device fits no plan of Alpa's stage DP")
    return sorted(plans, key=lambda p: (p.predicted_step_s, max(p.peak_memory_bytes)))


def _logical(size: int) -> list[tuple[int, int]]:
    """The logical (data, model) shapes of a submesh of ``size`` devices."""
    return [(d, size // d) for d in range(1, size + 1) if size % d == 0]


def predict(profile: ModelProfile, cluster: Cluster, hardware: Hardware, stages: Sequence[StagePlan],
            num_micro_batches: int, schedule: ScheduleKind) -> PipelinePlan:
    """``protocol.Planner.predict``: meshpar's price of the layout (``planner_meshpar.predict``),
    as Alpa's. Alpa's ``t_intra`` is meshpar's per-stage cost, and what else calibration fits
    (the per-task, per-move and per-step overheads) is not in Alpa's model: it is calibrated as
    meshpar's."""
    return planner_meshpar.predict(profile, cluster, hardware, stages, num_micro_batches, schedule, "alpa_dp")
