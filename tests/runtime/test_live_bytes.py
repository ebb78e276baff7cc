"""Peak live bytes per device: measured by the runtime (``runtime.live_bytes_meter``), predicted
from the program and a profile (``passes.simulation.live_bytes``)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from examples.mlp import MLP
from examples.train_step import supervised_step
from meshpar.passes.program.pipeline_instructions import BufferKind
from meshpar.passes.program.live_bytes import LiveBytes, MemoryProfile
from meshpar.passes.simulation.live_bytes import predict_live_bytes
from meshpar.runtime.live_bytes_meter import device_bytes
from pipeline_models import make_state, mse

S, M = 3, 8


def _shard_bytes(tree) -> dict[int, int]:
    """Per device, the bytes of the shards ``tree``'s arrays hold there (read off the shards)."""
    out: dict[int, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
    return out


def test_device_bytes_counts_shards_and_replicas():
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    split = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    half = jax.device_put(x, NamedSharding(mesh, P("data")))
    assert device_bytes(split) == {d.id: 64 for d in jax.devices()[:4]}
    assert device_bytes(half) == {d.id: 128 for d in jax.devices()[:4]}  # replicated over model
    assert device_bytes(half) == _shard_bytes(half)
    assert device_bytes(x) == {}  # host data
    half.delete()
    assert device_bytes(half) == {}


@pytest.fixture(scope="module")
def traces():
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(32, 64)).astype(np.float32), "y": rng.normal(size=(32, 4)).astype(np.float32)}
    out = {}
    for schedule in ("gpipe", "1f1b", "zb_h1"):
        state = make_state(MLP(features=(64, 64, 64, 64, 4), num_stages=S), batch["x"][:1])
        step = meshpar.parallelize(supervised_step(mse), method=meshpar.PipeshardParallel(
            num_micro_batches=M, num_stages=S, stage_mesh_shape=(2, 1), devices=jax.devices()[:2 * S],
            schedule=schedule))
        state, _ = step(state, batch)
        _, trace = step.trace("/tmp/meshpar_live_bytes.json", state, batch)
        out[schedule] = (state, trace, step.get_executable(state, batch), step.get_compiled(state, batch).schedule)
    return out


def test_resident_bytes_hold_the_state_as_placed(traces):
    state, trace, executable, _ = traces["1f1b"]
    held = _shard_bytes((state.params, state.opt_state))
    for d, n in held.items():
        assert trace.live_bytes.total[d] >= n
    # Resident bytes while the pipeline runs: at least the placed state, per mesh.
    for m, devices in enumerate(executable.mesh_devices):
        assert trace.memory_profile.resident_in_pipeline[m] >= max(held.get(d, 0) for d in devices)


def test_first_stage_holds_micro_batches_as_the_schedule_says(traces):
    """GPipe keeps every micro-batch's residuals on the first stage; 1F1B at most S of them."""
    first = traces["1f1b"][2].mesh_devices[0][0]
    residuals = {k: traces[k][1].memory_profile.buffer_bytes[(BufferKind.RESIDUALS, 0, 0)] for k in traces}
    assert residuals["gpipe"] > 0
    gpipe = traces["gpipe"][1].live_bytes.activations[first]
    one_f_one_b = traces["1f1b"][1].live_bytes.activations[first]
    assert gpipe >= M * residuals["gpipe"]
    assert S * residuals["1f1b"] <= one_f_one_b < (S + 1) * residuals["1f1b"]
    assert one_f_one_b < gpipe


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_prediction_from_the_profile_equals_the_measured_peaks(traces, schedule):
    _, trace, executable, _ = traces[schedule]
    predicted = predict_live_bytes(executable.program, trace.memory_profile)
    assert predicted.source == "predicted" and trace.live_bytes.source == "measured"
    assert dict(predicted.activations) == dict(trace.live_bytes.activations)
    assert dict(predicted.total) == dict(trace.live_bytes.total)


def test_prediction_follows_the_schedule(traces):
    """One profile, another schedule's program: GPipe's predicted activations exceed 1F1B's by
    about the M - S extra micro-batches of first-stage residuals."""
    profile = traces["1f1b"][1].memory_profile
    gpipe = predict_live_bytes(traces["gpipe"][2].program, profile)
    one_f_one_b = predict_live_bytes(traces["1f1b"][2].program, profile)
    first = traces["1f1b"][2].mesh_devices[0][0]
    extra = gpipe.activations[first] - one_f_one_b.activations[first]
    residuals = profile.buffer_bytes[(BufferKind.RESIDUALS, 0, 0)]
    assert (M - S) * residuals <= extra <= (M - S + 1) * residuals


def test_profile_checks_and_peaks(traces):
    with pytest.raises(ValueError, match="resident_peak"):
        MemoryProfile({}, (0, 0), (0,), ((0,), (1,)))
    with pytest.raises(ValueError, match="negative"):
        MemoryProfile({(BufferKind.RESIDUALS, 0, 0): -1}, (0,), (0,), ((0,),))
    with pytest.raises(ValueError, match=f"profile: expected {S} meshes"):
        predict_live_bytes(traces["1f1b"][2].program, MemoryProfile({}, (0,), (0,), ((0,),)))
    peaks = LiveBytes({0: 5, 1: 3, 2: 4}, {0: 1, 2: 2}, "measured")
    assert peaks.peak_bytes == 5 and peaks.peak_activation_bytes == 2
    assert LiveBytes({}, {}, "measured").peak_bytes == 0


def test_running_programs_temporaries_count_in_the_total(traces):
    """XLA's memory analysis of each stage program (its scratch space) is counted on its mesh's
    devices while it runs: one measured program per compute task, and a total that covers the
    resident bytes plus the largest program's temporaries."""
    _, trace, executable, schedule = traces["1f1b"]
    temps = trace.memory_profile.program_temp_bytes
    tasks = {(t.kind.value, t.where) for seq in schedule.sequences for t in seq}
    assert set(temps) == {(task,) for task in tasks} and all(v >= 0 for v in temps.values())
    assert any(v > 0 for v in temps.values())
    for m, devices in enumerate(executable.mesh_devices):
        largest = max(v for ((_, stage),), v in temps.items() if executable.home[stage] == m)
        assert trace.live_bytes.total[devices[0]] >= trace.memory_profile.resident_in_pipeline[m] + largest
