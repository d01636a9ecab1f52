"""Heartbeat TTLs on an injected clock (what the simulator uses)."""

from __future__ import annotations

import pytest

from kvmesh_indexer.liveness import Liveness

pytestmark = pytest.mark.timeout(10)


def test_ttl_expiry_purge_and_reregistration(clock) -> None:
    lv = Liveness(default_ttl_s=5, now=clock)
    lv.add_static("static")
    lv.register("w", ttl_s=2)
    lv.register("d")
    clock.advance(1.5)
    assert lv.heartbeat("w") and lv.is_alive("w")
    clock.advance(2.5)
    assert not lv.is_alive("w") and lv.is_alive("d") and lv.is_alive("static")
    assert lv.to_purge() == ["w"]
    lv.mark_purged("w")
    assert lv.to_purge() == [] and lv.dead() == ["w"]
    assert not lv.heartbeat("w")          # purged: must register again
    lv.register("w")
    assert lv.is_alive("w") and lv.seconds_since_heartbeat("w") == 0
    clock.advance(10)
    assert sorted(lv.dead()) == ["d", "w"] and lv.is_alive("static") and lv.is_alive("never-registered")
    assert lv.deregister("d") and not lv.deregister("d") and not lv.heartbeat("d")
    with pytest.raises(ValueError):
        Liveness(default_ttl_s=0)
