"""benchmarks.hop_trace: hops of several processes laid on one axis, per-round spans and the
text timeline, on hand-made hops; and ArrivalWatch on real arrays."""

import time

import jax
import numpy as np

from benchmarks.hop_trace import ArrivalWatch, format_timeline, hop_timeline, round_spans
from meshpar.runtime.p2p_executor import HopArrival


def _hop(step, rnd, src, dst, t0, t1, nbytes=1 << 20):
    return {"step": step, "round": rnd, "src": src, "dst": dst, "nbytes": nbytes, "dispatched_s": t0, "ready_s": t1}


def test_timeline_and_round_spans_line_up_processes():
    host_of = {0: 0, 1: 0, 8: 2, 12: 3}
    p2 = [_hop(0, 0, 0, 8, 100.000, 100.070), _hop(5, 1, 1, 8, 100.002, 100.140)]
    p3 = [_hop(0, 0, 1, 12, 100.001, 100.069), _hop(5, 1, 0, 12, 100.003, None)]
    timeline = hop_timeline([p2, p3], host_of)
    assert [(h["round"], h["step"], h["dst"]) for h in timeline] == [(0, 0, 8), (0, 0, 12), (1, 5, 8), (1, 5, 12)]
    assert timeline[0]["dispatched_ms"] == 0.0 and abs(timeline[2]["ready_ms"] - 140.0) < 1e-6
    spans = round_spans(timeline)
    assert [(s["round"], s["hops"], s["bytes"]) for s in spans] == [(0, 2, 2 << 20), (1, 2, 2 << 20)]
    assert abs(spans[0]["last_ready_ms"] - 70.0) < 1e-6 and spans[1]["last_ready_ms"] == timeline[2]["ready_ms"]
    # Host 0 sends to two hosts in round 0 (devices 0 and 1 are both on it); each host receives once.
    assert spans[0]["max_sends_per_host"] == 2 and spans[0]["max_receives_per_host"] == 1
    text = format_timeline(timeline, link_rate=30e6).splitlines()
    assert text[0].startswith("round step") and len(text) == 5
    assert text[4].split()[-3:-1] == ["-", "-"], "a hop that never arrived shows no ready time"


def test_arrival_watch_notes_when_arrays_turn_ready():
    watch = ArrivalWatch()
    watch.start()
    square = jax.device_put(np.eye(800, dtype=np.float32), jax.devices()[0])
    slow = jax.jit(lambda m: jax.lax.fori_loop(0, 8, lambda _, a: jax.numpy.tanh(a @ a), m))(square)
    quick = jax.device_put(np.ones(4, np.float32), jax.devices()[1])
    t0 = time.time()
    for k, array in enumerate((slow, quick)):
        watch.add(HopArrival(k, 0, 0, k + 1, 0, 4, t0, array))
    hops = watch.finish(timeout_s=60)
    assert [h["step"] for h in hops] == [0, 1] and all(h["ready_s"] is not None for h in hops)
    assert all(h["ready_s"] >= t0 for h in hops)
