"""meshpar.distributed.free_port: the transfer server's port is chosen below the kernel's
ephemeral range, where no outgoing connection can take it before the server binds it (the cause
of "bind: Address already in use" on a first cross-process transfer)."""

import random
import socket

from meshpar.distributed import ephemeral_ports, free_port


def test_the_transfer_port_is_free_and_below_the_ephemeral_range():
    low, high = ephemeral_ports()
    assert 0 < low <= high
    ports = {free_port("127.0.0.1", random.Random(seed)) for seed in range(20)}
    assert all(p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_a_taken_port_is_never_chosen():
    low, _ = ephemeral_ports()
    rng = random.Random(0)
    taken = rng.randrange(10000, low)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        # The same seed draws the taken port first: the probe moves on.
        assert free_port("127.0.0.1", random.Random(0)) != taken
