"""When each hop of a p2p move arrived: per-hop timestamps across processes, for finding a tail.

    python -m benchmarks.resharding real --hop-trace ...   # records gain "hops" per repeat

Worker side: :class:`ArrivalWatch` is handed to ``P2PReshardExecutable.__call__`` as
``on_arrival``; a thread polls each arriving array's ``is_ready()`` every ``poll_s`` and notes
when it turned ready. Times are ``time.time()`` (one clock for every process on a machine; the
emulated hosts are namespaces of one kernel), so the parent lines the processes up.

Parent side: :func:`hop_timeline` lays one repeat's hops from every process on one axis (ms
from the earliest dispatch) and :func:`round_spans` sums them per plan round: when the round's
first hop was dispatched, when its last arrived, and the hops in flight at once per sending
and receiving host (the plan assumes one per NIC per round).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["ArrivalWatch", "hop_timeline", "round_spans", "format_timeline"]


class ArrivalWatch:
    """Notes when each hop a p2p move dispatches into this process arrives.

    Use: ``watch.start()`` before a timed call, pass ``watch.add`` as ``on_arrival``, then
    ``watch.finish(timeout_s)`` returns the hops as dicts (``step``, ``round``, ``src``,
    ``dst``, ``nbytes``, ``dispatched_s``, ``ready_s``; ``ready_s`` is ``None`` for a hop
    not ready within the timeout).
    """

    def __init__(self, poll_s: float = 2e-4) -> None:
        self.poll_s = poll_s
        self._pending: list[tuple[Any, dict]] = []
        self._done: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._pending, self._done = [], []
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def add(self, arrival: Any) -> None:
        hop = {"step": arrival.step, "round": arrival.round, "src": arrival.src_device, "dst": arrival.dst_device,
               "nbytes": arrival.nbytes, "dispatched_s": arrival.dispatched_s, "ready_s": None}
        with self._lock:
            self._pending.append((arrival.array, hop))

    def _poll(self) -> None:
        while True:
            with self._lock:
                still = []
                for array, hop in self._pending:
                    if array.is_ready():
                        hop["ready_s"] = time.time()
                        self._done.append(hop)
                    else:
                        still.append((array, hop))
                self._pending = still
                idle = not still
            if idle and self._stop.is_set():
                return
            time.sleep(self.poll_s)

    def finish(self, timeout_s: float) -> list[dict]:
        """Every hop added since ``start``, once all arrived (or ``timeout_s`` passed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            return sorted([*self._done, *(hop for _, hop in self._pending)], key=lambda h: h["step"])


def hop_timeline(per_process: Sequence[Sequence[dict]], host_of: dict[int, int]) -> list[dict]:
    """One repeat's hops of every process, times in ms from the earliest dispatch, each with its
    source and destination host (``host_of`` maps device ids to hosts)."""
    hops = [dict(h) for hs in per_process for h in hs]
    if not hops:
        return []
    t0 = min(h["dispatched_s"] for h in hops)
    for h in hops:
        h["dispatched_ms"] = (h["dispatched_s"] - t0) * 1e3
        h["ready_ms"] = None if h["ready_s"] is None else (h["ready_s"] - t0) * 1e3
        h["src_host"], h["dst_host"] = host_of[h["src"]], host_of[h["dst"]]
    return sorted(hops, key=lambda h: (h["round"], h["step"], h["dst"]))


def round_spans(timeline: Sequence[dict]) -> list[dict]:
    """Per plan round: first dispatch, first and last arrival (ms), bytes, and the most hops
    of the round that one host sent or received (the plan keeps that to one per link)."""
    rounds: dict[int, list[dict]] = {}
    for h in timeline:
        rounds.setdefault(h["round"], []).append(h)
    out = []
    for r, hops in sorted(rounds.items()):
        ready = [h["ready_ms"] for h in hops if h["ready_ms"] is not None]
        per_src: dict[int, int] = {}
        per_dst: dict[int, int] = {}
        for h in hops:
            per_src[h["src_host"]] = per_src.get(h["src_host"], 0) + 1
            per_dst[h["dst_host"]] = per_dst.get(h["dst_host"], 0) + 1
        out.append({"round": r, "hops": len(hops), "bytes": sum(h["nbytes"] for h in hops),
                    "first_dispatch_ms": min(h["dispatched_ms"] for h in hops),
                    "first_ready_ms": min(ready, default=None), "last_ready_ms": max(ready, default=None),
                    "max_sends_per_host": max(per_src.values()), "max_receives_per_host": max(per_dst.values())})
    return out


def format_timeline(timeline: Sequence[dict], link_rate: float) -> str:
    """A text table of one repeat's hops: round, step, hosts, MiB, dispatch and arrival (ms), and
    how long the hop took against its bytes at the link rate."""
    lines = ["round step  src->dst host   MiB   dispatched  ready    took  alone"]
    for h in timeline:
        alone = h["nbytes"] / link_rate * 1e3
        ready = "      -" if h["ready_ms"] is None else f"{h['ready_ms']:7.1f}"
        took = "     -" if h["ready_ms"] is None else f"{h['ready_ms'] - h['dispatched_ms']:6.1f}"
        lines.append(f"{h['round']:5d} {h['step']:4d}  {h['src_host']:3d}->{h['dst_host']:<3d}      "
                     f"{h['nbytes'] / 2**20:5.2f}  {h['dispatched_ms']:9.1f}  {ready}  {took}  {alone:5.1f}")
    return "\n".join(lines)
