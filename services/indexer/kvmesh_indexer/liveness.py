"""Endpoint registrations, heartbeats and TTLs.

Why: an engine that died without a goodbye still has entries in the index;
routing to it wastes a request and the retry. A registered endpoint that
misses its heartbeat TTL is excluded from every answer immediately (checked at
lookup time, no sweep needed) and then purged by the sweeper. Statically
configured engines that never registered need no heartbeat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EndpointRecord:
    endpoint_id: str
    info: Any = None                 # the service keeps its proto Endpoint here
    ttl_s: float = 10.0
    registered_at: float = 0.0
    last_heartbeat: float = 0.0
    static: bool = False             # from configuration: no heartbeat required
    purged: bool = False
    left: bool = False               # the endpoint said it is leaving: expired now, whatever its TTL
    labels: dict[str, str] = field(default_factory=dict)


class Liveness:
    def __init__(self, default_ttl_s: float = 10.0, now: Callable[[], float] = time.monotonic) -> None:
        if default_ttl_s <= 0:
            raise ValueError("default_ttl_s must be > 0")
        self.default_ttl_s = default_ttl_s
        self.now = now
        self.records: dict[str, EndpointRecord] = {}

    def add_static(self, endpoint_id: str, info: Any = None) -> EndpointRecord:
        t = self.now()
        rec = EndpointRecord(endpoint_id, info, self.default_ttl_s, t, t, static=True)
        self.records[endpoint_id] = rec
        return rec

    def register(self, endpoint_id: str, info: Any = None, ttl_s: float = 0.0) -> EndpointRecord:
        t = self.now()
        rec = EndpointRecord(endpoint_id, info, ttl_s if ttl_s > 0 else self.default_ttl_s, t, t)
        self.records[endpoint_id] = rec
        return rec

    def heartbeat(self, endpoint_id: str) -> bool:
        """Refresh an endpoint's TTL.

        False when it is unknown (never registered, deregistered) or was purged
        after missing its TTL: the caller must register again, which also
        re-subscribes to its events.
        """
        rec = self.records.get(endpoint_id)
        if rec is None or rec.purged or rec.left:
            return False
        rec.last_heartbeat = self.now()
        return True

    def expire(self, endpoint_id: str) -> bool:
        """The endpoint leaves (its own shutdown): dead from now on, purged like a missed TTL;
        it must register again to come back. False when it is not registered."""
        rec = self.records.get(endpoint_id)
        if rec is None or rec.static:
            return False
        rec.left = True
        return True

    def deregister(self, endpoint_id: str) -> bool:
        return self.records.pop(endpoint_id, None) is not None

    def is_alive(self, endpoint_id: str) -> bool:
        rec = self.records.get(endpoint_id)
        if rec is None:
            return True  # unknown to liveness (e.g. gRPC-only producer): judged by its events only
        return rec.static or (not rec.left and (self.now() - rec.last_heartbeat) <= rec.ttl_s)

    def seconds_since_heartbeat(self, endpoint_id: str) -> float:
        rec = self.records.get(endpoint_id)
        return -1.0 if rec is None else max(0.0, self.now() - rec.last_heartbeat)

    def dead(self) -> list[str]:
        """Registered endpoints past their TTL (purged or not)."""
        t = self.now()
        return [r.endpoint_id for r in self.records.values()
                if not r.static and (r.left or t - r.last_heartbeat > r.ttl_s)]

    def to_purge(self) -> list[str]:
        return [ep for ep in self.dead() if not self.records[ep].purged]

    def mark_purged(self, endpoint_id: str) -> None:
        rec = self.records.get(endpoint_id)
        if rec is not None:
            rec.purged = True
