"""The policies' lazy heap evicts in exactly the order of a full scan of every key's latest rank."""

from __future__ import annotations

import random

import pytest

from kvmesh.kvstore.eviction import POLICIES, _LazyHeap


def _scan_victim(pol: _LazyHeap):  # noqa: ANN202
    """The reference: the smallest latest entry over the live keys, by brute force."""
    live = pol._live
    return min(live.values())[3] if live else None


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("seed", range(8))
def test_victims_equal_a_full_scan(name: str, seed: int) -> None:
    rng = random.Random(seed)
    pol = POLICIES[name]()
    depth: dict[int, int] = {}
    t = 0.0
    checked = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.05:
            t += rng.choice([0.0, 0.5, 3.0, 40.0])
            pol.new_batch(t) if name in ("agent", "session-rate") else pol.new_batch()
        elif op < 0.35:
            key = rng.randrange(200)
            depth.setdefault(key, rng.randrange(50))
            pol.insert(key, depth[key], f"s{rng.randrange(6)}")
        elif op < 0.75:
            key = rng.randrange(200)
            if key in depth:
                pol.touch(key, depth[key], f"s{rng.randrange(6)}")
        elif op < 0.85:
            key = rng.randrange(200)
            pol.remove(key)
            depth.pop(key, None)
        else:
            expected = _scan_victim(pol)
            assert pol.victim() == expected
            checked += 1
            if expected is not None and rng.random() < 0.5:
                pol.remove(expected)
                depth.pop(expected)
        assert len(pol) == len(pol._live)
        # One representative per live key, at or below its latest entry.
        for key, ent in pol._live.items():
            assert pol._rep[key] <= ent
    assert checked > 100
    while len(pol):
        expected = _scan_victim(pol)
        assert pol.victim() == expected
        pol.remove(expected)
    assert pol.victim() is None


def test_touches_between_evictions_cost_no_heap_entries() -> None:
    pol = POLICIES["lru"]()
    for k in range(100):
        pol.insert(k, k)
    size = len(pol._heap)
    for _ in range(50):
        pol.new_batch()
        for k in range(100):
            pol.touch(k, k)
    assert len(pol._heap) == size
    assert pol.victim() == 99   # the deepest of the last batch
