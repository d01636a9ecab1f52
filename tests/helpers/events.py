"""Event-plane test helpers shared by the indexer suites."""

from __future__ import annotations

import time
from collections.abc import Sequence

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvmesh.events.publisher import KvEventPublisher


class _Blackhole:
    def send_multipart(self, *a, **k) -> None:  # noqa: ANN002, ANN003
        pass


def publish_lost(pub: KvEventPublisher, events: Sequence[object]) -> int:
    """Publish a batch that never reaches subscribers but stays in the replay buffer (a lost
    message, as a slow joiner or a dropped packet would make it); returns its sequence number."""
    real = pub._pub
    pub._pub = _Blackhole()
    try:
        return pub.publish(list(events))
    finally:
        pub._pub = real


def connect_when_ready(sock: zmq.Socket, addr: str, timeout_s: float = 10.0) -> None:
    """Connect ``sock`` and return once its ZMTP handshake with the peer is done.

    A PUB drops what it sends before the SUB's subscription arrives (ZMQ's slow joiner), and the
    subscription goes out right after the handshake: waiting for the handshake holds on a loaded
    machine, where a fixed sleep may not.
    """
    mon = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sock.connect(addr)
        assert mon.poll(int(timeout_s * 1000)), f"no ZMQ handshake with {addr} in {timeout_s} s"
        recv_monitor_message(mon)
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
    time.sleep(0.05)   # the subscription, sent after the handshake, reaches the PUB
