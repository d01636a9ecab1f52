"""The policies' lazy order (sorted runs under a heap) evicts exactly as a full scan of every key's latest rank."""

from __future__ import annotations

import random

import pytest

from kvmesh.kvstore.eviction import _LazyHeap
from kvmesh.kvstore.eviction_registry import EVICTION_POLICIES


def _scan_victim(pol: _LazyHeap):  # noqa: ANN202
    """The reference: the smallest latest entry over the live keys, by brute force."""
    live = pol._live
    return min(live.values())[3] if live else None


def _twins(name: str, **attrs: int) -> tuple[_LazyHeap, _LazyHeap]:
    """Two fresh policies ``name`` with the same class attributes overridden, driven alike."""
    pair = EVICTION_POLICIES.create(name), EVICTION_POLICIES.create(name)
    for pol in pair:
        for attr, value in attrs.items():
            setattr(pol, attr, value)
    return pair


def _new_batch(name: str, t: float, *pols: _LazyHeap) -> None:
    for pol in pols:
        pol.new_batch(t) if name in ("agent", "session-rate") else pol.new_batch()


@pytest.mark.parametrize("name", EVICTION_POLICIES.names())
@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("slack", [1024, 4])
@pytest.mark.parametrize("small_batch", [4, 0])
def test_victims_equal_a_full_scan(name: str, seed: int, slack: int, small_batch: int) -> None:
    rng = random.Random(seed)
    pol = EVICTION_POLICIES.create(name)
    pol._SLACK = slack   # 4: the stale-entry cleanup runs every few operations
    pol._SMALL_BATCH = small_batch   # 0: every batch becomes a run
    depth: dict[int, int] = {}
    t = 0.0
    checked = 0
    for _ in range(3000):
        op = rng.random()
        if op < 0.05:
            t += rng.choice([0.0, 0.5, 3.0, 40.0])
            _new_batch(name, t, pol)
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
            checked += 1
            if rng.random() < 0.3:   # a tier making room: victim and removal in one call
                assert pol.pop_victim() == expected
                if expected is not None:
                    assert expected not in pol._live
                    depth.pop(expected)
            else:
                assert pol.victim() == expected
                if expected is not None and rng.random() < 0.5:
                    pol.remove(expected)
                    depth.pop(expected)
        assert len(pol) == len(pol._live)
        held = [e for _, _, run in pol._runs for e in run] + pol._open + pol._small
        assert pol._held == len(held) <= 2 * len(pol) + slack
        assert set(pol._live.values()) <= set(held)     # every latest entry is still held
        for head, _, run in pol._runs:
            assert run == sorted(run, reverse=True) and (not run or head <= run[-1])   # emptied by pop_victim
    assert checked > 100
    while len(pol):
        expected = _scan_victim(pol)
        assert pol.victim() == expected
        pol.remove(expected)
    assert pol.victim() is None


def test_touches_keep_memory_bounded_and_cost_no_heap_operation() -> None:
    pol = EVICTION_POLICIES.create("lru")
    for k in range(100):
        pol.insert(k, k)
    assert pol.victim() == 99
    runs = len(pol._runs)
    for _ in range(500):
        pol.new_batch()
        for k in range(100):
            pol.touch(k, k)
    assert len(pol._runs) <= runs                 # touches only append to the open batch (cleanups drop runs)
    assert pol._held <= 2 * len(pol) + pol._SLACK
    assert pol.victim() == 99   # the deepest of the last batch


@pytest.mark.parametrize("name", EVICTION_POLICIES.names())
@pytest.mark.parametrize("seed", range(6))
def test_batch_forms_push_what_one_call_per_key_pushes(name: str, seed: int) -> None:
    """``insert_many``/``touch_many`` (a put's and a restore's blocks in one call) leave every
    key with the same entry, and so the same victims, as ``insert``/``touch`` key by key."""
    rng = random.Random(seed)
    one, many = _twins(name, _SLACK=8)
    depth: dict[int, int] = {}
    t = 0.0
    for _ in range(600):
        op = rng.random()
        session = f"s{rng.randrange(5)}"
        if op < 0.1:
            t += rng.choice([0.0, 0.5, 3.0])
            _new_batch(name, t, one, many)
        elif op < 0.4:
            keys = rng.sample(range(300), rng.randrange(1, 12))
            for k in keys:
                depth.setdefault(k, rng.randrange(60))
            for k in keys:
                one.insert(k, depth[k], session)
            many.insert_many(keys, [depth[k] for k in keys], session)
        elif op < 0.75:
            keys = rng.sample(range(300), rng.randrange(1, 12))   # some not held: skipped
            for k in keys:
                if k in depth:
                    one.touch(k, depth[k], session)
            many.touch_many(keys, session)
        elif op < 0.85:
            k = rng.randrange(300)
            one.remove(k)
            many.remove(k)
            depth.pop(k, None)
        else:
            v = one.victim()
            assert many.victim() == v
            if v is not None:
                one.remove(v)
                many.remove(v)
                depth.pop(v)
        assert one._live == many._live
    while (v := one.victim()) is not None:
        assert many.victim() == v
        one.remove(v)
        many.remove(v)
    assert many.victim() is None


@pytest.mark.parametrize("name", EVICTION_POLICIES.names())
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("slack", [1024, 4])
@pytest.mark.parametrize("small_batch", [4, 0])
def test_pop_victims_takes_what_pop_victim_takes_one_by_one(name: str, seed: int, slack: int,
                                                             small_batch: int) -> None:
    """A tier making room asks for many victims at once (``pop_victims``): the same keys in the
    same order as that many ``pop_victim`` calls, and the same state after."""
    rng = random.Random(seed)
    one, many = _twins(name, _SLACK=slack, _SMALL_BATCH=small_batch)
    depth: dict[int, int] = {}
    t = 0.0
    taken = 0
    for _ in range(800):
        op = rng.random()
        session = f"s{rng.randrange(5)}"
        if op < 0.1:
            t += rng.choice([0.0, 0.5, 3.0])
            _new_batch(name, t, one, many)
        elif op < 0.45:
            keys = [k for k in rng.sample(range(400), rng.randrange(1, 40)) if k not in depth]
            for k in keys:
                depth[k] = rng.randrange(60)
            for pol in (one, many):
                pol.insert_many(keys, [depth[k] for k in keys], session)
        elif op < 0.75:
            keys = rng.sample(range(400), rng.randrange(1, 30))
            for pol in (one, many):
                pol.touch_many(keys, session)
        elif op < 0.8:
            k = rng.randrange(400)
            for pol in (one, many):
                pol.remove(k)
            depth.pop(k, None)
        else:
            count = rng.choice([0, 1, 2, 7, 25, 60, 500])
            expected = []
            while len(expected) < count and (v := one.pop_victim()) is not None:
                expected.append(v)
            assert many.pop_victims(count) == expected
            taken += len(expected)
            for k in expected:
                depth.pop(k)
        assert one._live == many._live and len(one) == len(many) == len(depth)
        for pol in (one, many):
            held = [e for _, _, run in pol._runs for e in run] + pol._open + pol._small
            assert pol._held == len(held) <= 2 * len(pol) + slack
            assert set(pol._live.values()) <= set(held)
        if name == "agent":
            assert one._sharers == many._sharers and one._last_session == many._last_session
    assert taken > 500
    assert many.pop_victims(len(depth) + 5) == [v for v in iter(one.pop_victim, None)]


def test_every_eviction_name_is_its_class_name() -> None:
    from kvmesh.kvstore.eviction import DepthDiscountedPolicy, GreedyDualPolicy
    from kvmesh.kvstore.eviction_registry import make_eviction_policy

    assert EVICTION_POLICIES.load("agent") is DepthDiscountedPolicy
    assert EVICTION_POLICIES.load("greedy-dual") is GreedyDualPolicy
    for name in EVICTION_POLICIES:
        cls = EVICTION_POLICIES.load(name)
        assert cls.name == name and type(make_eviction_policy(name)) is cls
