"""Choosing each boundary value's move, and meshpar.distributed's argument checks (no devices)."""

import pytest

import meshpar.distributed
from meshpar.passes.pipeline.placing.edge_transfer import Executor, choose_transfer
from meshpar.passes.program.moves import TransferKind


@pytest.mark.parametrize("executor, processes, ndim, expected", [
    ("auto", [0, 0, 0, 0], 2, TransferKind.DEVICE_PUT),
    ("auto", [0, 0, 1, 1], 2, TransferKind.P2P),
    ("auto", [0, 1], 0, TransferKind.P2P),
    ("p2p", [0, 0], 3, TransferKind.P2P),
    ("collective", [0, 1], 2, TransferKind.COLLECTIVE),
    ("collective", [0, 0], 1, TransferKind.COLLECTIVE),
    ("collective", [0, 1], 0, TransferKind.P2P),  # no plan for a scalar
])
def test_choose_transfer(executor, processes, ndim, expected):
    assert choose_transfer(Executor.of(executor, "executor"), processes, ndim) is expected


@pytest.mark.parametrize("processes, ndim", [([0, 0], 2), ([0, 1], 2), ([0, 1], 0)])
def test_the_signal_executor_always_sends_signals(processes, ndim):
    assert choose_transfer(Executor.SIGNAL, processes, ndim) is TransferKind.SIGNAL
    assert choose_transfer(Executor.SIGNAL, processes, ndim, same_mesh=True) is TransferKind.LOCAL


def test_executor_names_resolve_at_the_api_only():
    with pytest.raises(ValueError, match=r"^executor: expected one of \('auto', 'p2p', 'collective', 'signal'\), "
                                         r"got 'nccl'$"):
        Executor.of("nccl", "executor")
    # Past the API a name is refused, not compared.
    with pytest.raises(TypeError, match="executor: expected an Executor"):
        choose_transfer("auto", [0], 1)


@pytest.mark.parametrize("kwargs, match", [
    ({"coordinator_address": "localhost", "num_processes": 2, "process_id": 0}, "coordinator_address: expected 'host:port'"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 0, "process_id": 0}, "num_processes"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 2}, r"process_id: expected an integer in \[0, 2\)"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 0, "transfer_address": 5},
     "transfer_address: expected 'ip:port'"),
    ({"coordinator_address": "127.0.0.1:1234", "num_processes": 2, "process_id": 0, "transport_addresses": "10.0.0.1:0"},
     "transport_addresses: expected a sequence of 'ip:port' strings"),
])
def test_distributed_initialize_checks_arguments_before_touching_jax(kwargs, match):
    with pytest.raises(ValueError, match=match):
        meshpar.distributed.initialize(**kwargs)


def test_own_address_is_the_route_to_the_coordinator():
    assert meshpar.distributed.own_address("127.0.0.1:1234") == "127.0.0.1"
