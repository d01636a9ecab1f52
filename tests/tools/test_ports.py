"""Picked ports stay out of the kernel's ephemeral range, where outgoing connections could take them."""

import random
import socket

from kvmesh.rpc.ports import ephemeral_range, free_port


def test_free_port_is_below_the_ephemeral_range_and_bindable() -> None:
    lo, hi = ephemeral_range()
    assert lo < hi
    for _ in range(20):
        port = free_port()
        assert 10_000 <= port < lo
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))


def test_free_port_skips_a_port_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        taken = free_port(rng=random.Random(7))
        held.bind(("127.0.0.1", taken))
        held.listen()
        assert free_port(rng=random.Random(7)) != taken  # same random sequence, first pick is busy
