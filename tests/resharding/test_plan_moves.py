"""The plan_moves pass and the runtime's move handlers: each executor's entry plans, lowers and
verifies its move, and its handler moves a value bit for bit."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from meshpar.passes.program.moves import TransferKind
from meshpar.passes.pipeline.placing.plan_moves import (
    MOVE_EXECUTORS, MoveKey, MoveOptions, move_plan, plan_move, plan_moves, verify_planned_move,
)
from meshpar.passes.program.moves import PlannedMove
from meshpar.passes.resharding.strategies import STRATEGIES
from meshpar.passes.program.resharding_programs import HopProgram
from meshpar.passes.program.resharding_programs import TransferProgram
from meshpar.passes.verification import PlanVerificationError
from meshpar.runtime.move_handlers import MOVE_HANDLERS, prepare_move


def _meshes():
    devices = np.array(jax.devices())
    return (Mesh(devices[:4].reshape(2, 2), ("data", "model")), Mesh(devices[4:].reshape(4, 1), ("data", "model")))


def _key(kind, shape=(8, 6), src_spec=P("data", "model"), dst_spec=P("data"), same_mesh=False):
    a, b = _meshes()
    return MoveKey.of(kind, shape, np.float32, NamedSharding(a, src_spec), NamedSharding(a if same_mesh else b, dst_spec))


def test_every_transfer_kind_has_an_executor_and_a_handler():
    assert set(MOVE_EXECUTORS) == set(TransferKind) == set(MOVE_HANDLERS)


def test_each_executor_lowers_what_it_runs():
    p2p = plan_move(_key(TransferKind.P2P), MoveOptions())
    plan = move_plan(_key(TransferKind.P2P), MoveOptions())
    assert isinstance(p2p.program, HopProgram) and plan is not None and p2p.fingerprint
    assert p2p.summary() == f"p2p: {plan.summary()}"
    collective = plan_move(_key(TransferKind.COLLECTIVE), MoveOptions())
    assert isinstance(collective.program, TransferProgram)
    assert collective.fingerprint == move_plan(_key(TransferKind.COLLECTIVE), MoveOptions()).fingerprint
    scalar_key = _key(TransferKind.P2P, shape=(), src_spec=P(), dst_spec=P())
    scalar = plan_move(scalar_key, MoveOptions())
    assert move_plan(scalar_key, MoveOptions()) is None and isinstance(scalar.program, HopProgram)
    assert scalar.summary() == "p2p: a scalar, replicated to every device"
    signal = plan_move(_key(TransferKind.SIGNAL), MoveOptions())
    assert signal.carry is not None and signal.carry.key.kind is TransferKind.DEVICE_PUT
    assert signal.carry.key.shape == () and signal.carry.key.dtype == np.uint8
    local_key = _key(TransferKind.LOCAL, same_mesh=True)
    local = plan_move(local_key, MoveOptions())
    assert move_plan(local_key, MoveOptions()) is None and local.program is None and local.fingerprint is None
    device_put = plan_move(_key(TransferKind.DEVICE_PUT), MoveOptions())
    assert device_put.program is None and device_put.fingerprint is None
    assert "across processes the plan is" in device_put.summary()
    with pytest.raises(ValueError, match="executor: a 0-d value"):
        plan_move(_key(TransferKind.COLLECTIVE, shape=(), src_spec=P(), dst_spec=P()), MoveOptions())


def test_the_strategy_reaches_the_plan():
    for name in ("broadcast", "send_recv"):
        strategy = STRATEGIES[name]
        assert move_plan(_key(TransferKind.P2P), MoveOptions(strategy=strategy)).strategy is strategy
        assert f"{name}/" in plan_move(_key(TransferKind.P2P), MoveOptions(strategy=strategy)).summary()


def test_plan_moves_plans_each_distinct_move_once():
    keys = [_key(TransferKind.P2P), _key(TransferKind.P2P), _key(TransferKind.DEVICE_PUT)]
    table = plan_moves(keys, MoveOptions())
    assert len(table.moves) == 2
    assert table.of(keys[1]) is table.moves[0]
    with pytest.raises(PlanVerificationError, match="no planned move"):
        table.of(_key(TransferKind.COLLECTIVE))


@pytest.mark.parametrize("broken,match", [
    (lambda m: dataclasses.replace(m, program=None), "carries NoneType"),
    (lambda m: dataclasses.replace(m, carry=m), "a carry only a signal has"),
])
def test_verifier_rejects_a_move_without_what_its_executor_runs(broken, match):
    move = plan_move(_key(TransferKind.P2P), MoveOptions())
    with pytest.raises(PlanVerificationError, match=match):
        verify_planned_move(broken(move))


def test_a_local_move_between_two_meshes_is_rejected():
    with pytest.raises(PlanVerificationError, match="local move .* between two meshes"):
        verify_planned_move(PlannedMove(_key(TransferKind.LOCAL), "local: both stages on one mesh, no move"))


@pytest.mark.parametrize("kind", [TransferKind.DEVICE_PUT, TransferKind.P2P, TransferKind.COLLECTIVE,
                                  TransferKind.LOCAL])
def test_each_handler_moves_the_value_bit_for_bit(kind):
    key = _key(kind, same_mesh=kind is TransferKind.LOCAL)
    x = jax.device_put(np.arange(48, dtype=np.float32).reshape(8, 6) * 1.5, key.src)
    moved = prepare_move(plan_move(key, MoveOptions()), timeout_s=60)(x)
    assert moved.sharding.is_equivalent_to(key.dst, 2)
    np.testing.assert_array_equal(np.asarray(moved), np.asarray(x))


def test_signal_handler_delivers_zeros_where_the_value_goes():
    key = _key(TransferKind.SIGNAL)
    x = jax.device_put(np.ones((8, 6), np.float32), key.src)
    moved = prepare_move(plan_move(key, MoveOptions()), timeout_s=60)(x)
    assert moved.sharding.is_equivalent_to(key.dst, 2)
    np.testing.assert_array_equal(np.asarray(moved), np.zeros((8, 6), np.float32))
