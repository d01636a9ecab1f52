"""Event-plane test helpers shared by the indexer suites."""

from __future__ import annotations

from collections.abc import Sequence

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
