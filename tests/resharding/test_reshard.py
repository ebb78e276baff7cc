"""meshpar.reshard on 8 virtual CPU devices in one process, against numpy."""

import logging
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import meshpar
from benchmarks.resharding.cases import TABLE2, FIG5
from random_tasks import random_spec

DEVICES = jax.devices()
STRATEGIES = list(meshpar.STRATEGIES)
EXECUTORS = ["p2p", "collective"]


def _cluster(hosts_of):
    """Emulated hosts: devices the test does not place get a host of their own."""
    return meshpar.Cluster.from_devices(DEVICES, host_of=lambda d: hosts_of.get(d.id, 100 + d.id))


def _values(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.random(shape) < 0.5
    if np.issubdtype(np.dtype(dtype), np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, size=shape, dtype=dtype, endpoint=True)
    return rng.standard_normal(shape).astype(dtype)


def _check(y, expected, dst):
    assert y.sharding == dst
    assert y.dtype == expected.dtype
    for shard in y.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index])
    np.testing.assert_array_equal(np.asarray(y), expected)


def _spec_text_to_pspec(text, names):
    return meshpar.ShardingSpec.parse(text).to_partition_spec(names)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("case", TABLE2, ids=[c[0] for c in TABLE2])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_paper_table2_cases_scaled_down(case, strategy, executor):
    """Table 2 on 8 devices: meshes of up to 4 devices each, 2 devices per emulated host."""
    name, src_spec, dst_spec, src_shape, dst_shape = case
    # Scale (hosts, devices/host) down so both meshes fit in 8 devices.
    fit = {(2, 4): (2, 2), (3, 4): (2, 2), (1, 4): (1, 4), (2, 3): (2, 2), (3, 2): (2, 2)}
    sm, dm = fit[src_shape], fit[dst_shape]
    src_devs = np.array(DEVICES[: sm[0] * sm[1]]).reshape(sm)
    dst_devs = np.array(DEVICES[4 : 4 + dm[0] * dm[1]]).reshape(dm)
    names = ("x", "y")
    src = NamedSharding(Mesh(src_devs, names), _spec_text_to_pspec(src_spec, names))
    dst = NamedSharding(Mesh(dst_devs, names), _spec_text_to_pspec(dst_spec, names))
    shape = (8, 12, 4)
    expected = _values(shape, np.float32)
    x = jax.device_put(expected, src)
    # Rows of each mesh are hosts, as in the paper's (hosts, devices/host).
    hosts = {d.id: k for k, row in enumerate([*src_devs, *dst_devs]) for d in row}
    y = meshpar.reshard(x, dst, strategy=strategy, cluster=_cluster(hosts), executor=executor)
    _check(y, expected, dst)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("receivers", FIG5, ids=[f"{a}x{b}" for a, b in FIG5])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_paper_fig5_one_to_many_scaled_down(receivers, strategy, executor):
    hosts, per_host = receivers
    if hosts * per_host > 7:
        hosts, per_host = 3, 2  # 4x2 needs 8 receivers; keep one device for the sender
    src = NamedSharding(Mesh(np.array(DEVICES[:1]), ("s",)), P())
    dst_devs = np.array(DEVICES[1 : 1 + hosts * per_host]).reshape(hosts, per_host)
    dst = NamedSharding(Mesh(dst_devs, ("h", "d")), P())
    expected = _values((3 * 1000 + 7,), np.float32)
    x = jax.device_put(expected, src)
    host_of = {DEVICES[0].id: 0, **{d.id: 1 + k for k, row in enumerate(dst_devs) for d in row}}
    for chunks in (None, 5):
        if chunks and strategy != "broadcast":
            continue
        y = meshpar.reshard(x, dst, strategy=strategy, chunks=chunks, cluster=_cluster(host_of), executor=executor)
        _check(y, expected, dst)


DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int8, np.int32, np.uint8, np.uint32, np.bool_]


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("seed", range(24))
def test_random_shapes_meshes_specs_dtypes(seed, executor):
    rng = random.Random(seed)
    perm = rng.sample(range(8), 8)
    n_src = rng.randrange(1, 8)
    n_dst = rng.randrange(1, 8 - n_src + 1)

    def mesh(ids):
        n = len(ids)
        shape = rng.choice([(a, n // a) for a in range(1, n + 1) if n % a == 0])
        return Mesh(np.array([DEVICES[i] for i in ids]).reshape(shape), ("a", "b"))

    sm, dm = mesh(perm[:n_src]), mesh(perm[n_src : n_src + n_dst])
    rank = rng.randrange(1, 4)
    ss, ds = random_spec(rng, rank, 2), random_spec(rng, rank, 2)
    sp, dp = ss.num_shards(sm.devices.shape), ds.num_shards(dm.devices.shape)
    shape = tuple(np.lcm(a, b) * rng.randrange(1, 3) for a, b in zip(sp, dp))
    dtype = DTYPES[seed % len(DTYPES)]
    expected = _values(shape, dtype, seed)
    src = NamedSharding(sm, ss.to_partition_spec(sm.axis_names))
    dst = NamedSharding(dm, ds.to_partition_spec(dm.axis_names))
    x = jax.device_put(expected, src)
    hosts = {d.id: rng.randrange(3) for d in DEVICES}
    strategy = STRATEGIES[seed % 4]
    chunks = rng.choice([None, 1, 3])
    order = rng.choice(["gated", "eager", "rounds"])
    kwargs = {"order": order} if executor == "p2p" else {}
    y = meshpar.reshard(x, dst, strategy=strategy, cluster=_cluster(hosts), chunks=chunks, executor=executor, **kwargs)
    _check(y, np.asarray(expected), dst)


def test_source_buffers_are_not_copied_and_result_is_reused_across_calls():
    src = NamedSharding(Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("x", "y")), P("x"))
    dst = NamedSharding(Mesh(np.array(DEVICES[4:]).reshape(2, 2), ("x", "y")), P(None, "y"))
    expected = _values((8, 8), np.float32)
    x = jax.device_put(expected, src)
    a = meshpar.reshard(x, dst)
    b = meshpar.reshard(x + 1, dst)
    np.testing.assert_array_equal(np.asarray(a), expected)
    np.testing.assert_array_equal(np.asarray(b), expected + 1)
    from meshpar.reshard import _executable

    assert _executable.cache_info().currsize >= 1
    before = _executable.cache_info().hits
    meshpar.reshard(x, dst)
    assert _executable.cache_info().hits == before + 1


def test_single_device_source_array():
    expected = _values((6, 4), np.int32)
    x = jax.device_put(expected, DEVICES[0])
    dst = NamedSharding(Mesh(np.array(DEVICES[2:8]).reshape(3, 2), ("x", "y")), P("x", "y"))
    _check(meshpar.reshard(x, dst), expected, dst)


def test_bad_arguments_name_themselves():
    src = NamedSharding(Mesh(np.array(DEVICES[:2]), ("x",)), P("x"))
    x = jax.device_put(np.zeros((4, 4), np.float32), src)
    dst = NamedSharding(Mesh(np.array(DEVICES[4:7]), ("x",)), P("x"))
    with pytest.raises(TypeError, match="x: expected a jax.Array"):
        meshpar.reshard(np.zeros((4, 4)), dst)
    with pytest.raises(TypeError, match="dst: expected a jax.sharding.NamedSharding"):
        meshpar.reshard(x, P("x"))
    with pytest.raises(ValueError, match=r"dst_spec: 'S0R' cuts dimension 0 \(size 4\) into 3 shards"):
        meshpar.reshard(x, dst)
    # Meshes sharing devices: a collective program needs disjoint ones; point to point, a piece
    # already on its destination device stays there.
    overlapping = NamedSharding(Mesh(np.array(DEVICES[1:3]), ("x",)), P("x"))
    with pytest.raises(ValueError, match="dst_mesh: shares devices.*jax.device_put"):
        meshpar.reshard(x, overlapping, executor="collective")
    _check(meshpar.reshard(x, overlapping), np.zeros((4, 4), np.float32), overlapping)
    ok = NamedSharding(Mesh(np.array(DEVICES[4:6]), ("x",)), P("x"))
    with pytest.raises(ValueError, match="strategy: unknown"):
        meshpar.reshard(x, ok, strategy="magic")
    with pytest.raises(ValueError, match="balancer: unknown"):
        meshpar.reshard(x, ok, balancer="magic")
    with pytest.raises(TypeError, match="cluster"):
        meshpar.reshard(x, ok, cluster="aws")
    with pytest.raises(ValueError, match="executor: expected one of"):
        meshpar.reshard(x, ok, executor="nccl")
    with pytest.raises(ValueError, match="order: expected one of"):
        meshpar.reshard(x, ok, order="random")
    from meshpar.reshard import prepare_reshard

    with pytest.raises(TypeError, match="src: expected a jax.sharding.NamedSharding"):
        prepare_reshard((4, 4), np.float32, P("x"), ok)
    scalar = jax.device_put(np.float32(2), DEVICES[0])
    with pytest.raises(ValueError, match="0-d.*executor='p2p'"):
        meshpar.reshard(scalar, NamedSharding(Mesh(np.array(DEVICES[4:6]), ("x",)), P()), executor="collective")


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_scalars_are_replicated_onto_every_destination_device(dtype):
    expected = np.asarray(_values((), dtype, 3))
    src = NamedSharding(Mesh(np.array(DEVICES[:2]), ("x",)), P())
    dst = NamedSharding(Mesh(np.array(DEVICES[4:8]).reshape(2, 2), ("x", "y")), P())
    x = jax.device_put(expected, src)
    y = meshpar.reshard(x, dst)
    assert y.shape == () and len(y.addressable_shards) == 4
    _check(y, expected, dst)


def test_p2p_pieces_leave_the_source_tile_untouched_and_reuse_compiled_programs():
    """Sources stay valid after a move, and a second call compiles nothing new."""
    from meshpar.reshard import _prepare

    src = NamedSharding(Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("x", "y")), P("x", "y"))
    dst = NamedSharding(Mesh(np.array(DEVICES[4:]).reshape(1, 4), ("x", "y")), P(None, "y"))
    expected = _values((8, 16), np.float32)
    x = jax.device_put(expected, src)
    executable, _ = _prepare(x, dst, chunks=2)
    first = executable(x)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("jax").addHandler(handler)
    try:
        with jax.log_compiles(True):
            second = executable(x)
            jax.jit(lambda v: v * 3)(x)  # the one compile this block may log
    finally:
        logging.getLogger("jax").removeHandler(handler)
    compiles = [r.getMessage() for r in records if "Compiling" in r.getMessage()]
    assert len(compiles) == 1 and "<lambda>" in compiles[0], compiles
    _check(first, expected, dst)
    _check(second, expected, dst)
    np.testing.assert_array_equal(np.asarray(x), expected)


@pytest.mark.parametrize("seed", range(10))
def test_device_memory_stays_within_one_tile_plus_four_boxes(seed):
    """Per-device program memory (XLA's own accounting): inputs are the source tile, outputs the
    destination tile, temporaries at most one destination tile plus four transfer boxes."""
    from meshpar.reshard import _prepare

    rng = random.Random(seed)
    sm = Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("a", "b"))
    dm = Mesh(np.array(DEVICES[4:]).reshape(rng.choice([(2, 2), (1, 4), (4, 1)])), ("a", "b"))
    ss, ds = random_spec(rng, 2, 2), random_spec(rng, 2, 2)
    shape = tuple(int(np.lcm(a, b)) * 32 for a, b in zip(ss.num_shards(sm.devices.shape), ds.num_shards(dm.devices.shape)))
    x = jax.device_put(np.zeros(shape, np.float32), NamedSharding(sm, ss.to_partition_spec(("a", "b"))))
    dst = NamedSharding(dm, ds.to_partition_spec(("a", "b")))
    for strategy in STRATEGIES:
        executable, _ = _prepare(x, dst, strategy=strategy, chunks=rng.choice([None, 4]), executor="collective")
        stats = executable._compiled.memory_analysis()
        program = executable.program
        src_tile = int(np.prod(program.src_tile_shape)) * 4
        dst_tile = int(np.prod(program.dst_tile_shape)) * 4
        box = max(int(np.prod(t.shape)) for step in program.steps for t in step.transfers) * 4
        assert stats.argument_size_in_bytes == src_tile
        assert stats.output_size_in_bytes == dst_tile
        assert stats.temp_size_in_bytes <= dst_tile + 4 * box + 1024, strategy
