"""Behaviour of both block-index backends (memory and a real redis-server)."""

from __future__ import annotations

import time

import pytest

from kvmesh.index.base import BlockIndex, Tier
from kvmesh.index.memory import MemoryIndex
from kvmesh_indexer.copy_ledger import CopyCountingIndex

pytestmark = pytest.mark.timeout(60)

M = "tiny"


def chain(seed: int, n: int) -> list[int]:
    return [(seed << 32) + i + 1 for i in range(n)]


def test_leading_match_per_endpoint_and_tier(any_index) -> None:
    c = chain(1, 10)
    any_index.add(M, "a", Tier.GPU, c[:6])
    any_index.add(M, "b", Tier.GPU, c[:3])
    any_index.add(M, "b", Tier.CPU, c[3:8], chain_starts=[(0, c[2])])
    any_index.add(M, "c", Tier.GPU, c[1:9], chain_starts=[(0, c[0])])  # no block 0: never a leading match
    res = any_index.lookup(M, c)
    assert res.chain_length == 10
    assert set(res.matches) == {"a", "b"}
    a, b = res.matches["a"], res.matches["b"]
    assert a.tiers == {Tier.GPU: 6} and a.combined == 6
    assert b.tiers[Tier.GPU] == 3
    assert b.tiers.get(Tier.CPU, 0) == 0  # CPU run does not start at block 0
    assert b.combined == 8  # GPU then CPU covers blocks 0..7


def test_hole_stops_the_match(any_index) -> None:
    c = chain(2, 6)
    any_index.add(M, "a", Tier.GPU, c[:2] + c[3:])
    assert any_index.lookup(M, c).matches["a"].combined == 2


def test_filter_exclude_and_models_are_separate(any_index) -> None:
    c = chain(3, 4)
    any_index.add(M, "a", Tier.GPU, c)
    any_index.add(M, "b", Tier.GPU, c[:2])
    any_index.add("other", "z", Tier.GPU, c)
    assert set(any_index.lookup(M, c, endpoint_filter=["b"]).matches) == {"b"}
    assert set(any_index.lookup(M, c, exclude=["a"]).matches) == {"b"}
    assert set(any_index.lookup("other", c).matches) == {"z"}
    assert any_index.lookup("nope", c).matches == {}


def test_remove_and_clear_endpoint(any_index) -> None:
    c = chain(4, 5)
    any_index.add(M, "a", Tier.GPU, c)
    any_index.add(M, "a", Tier.DISK, c)
    any_index.add(M, "b", Tier.GPU, c)
    assert any_index.remove(M, "a", Tier.GPU, [c[2]]) == 1
    m = any_index.lookup(M, c).matches["a"]
    assert m.tiers == {Tier.GPU: 2, Tier.DISK: 5} and m.combined == 5
    assert any_index.endpoint_blocks("a") == 9
    assert any_index.clear_endpoint("a") == 9
    assert any_index.endpoint_blocks("a") == 0
    assert set(any_index.lookup(M, c).matches) == {"b"}
    st = any_index.stats()
    assert st.entries == 5 and st.entries_by_tier[Tier.GPU] == 5


def test_speculative_entries_expire(any_index) -> None:
    c = chain(6, 4)
    any_index.put_speculative(M, "s", c[:3], ttl_s=0.3)
    m = any_index.lookup(M, c, include_speculative=True).matches["s"]
    assert m.speculative == 3 and 0 < m.speculative_ttl_s <= 0.3 and m.combined == 0
    assert "s" not in any_index.lookup(M, c).matches  # only on request
    time.sleep(0.35)
    assert "s" not in any_index.lookup(M, c, include_speculative=True).matches


def test_long_chain_lookup(any_index) -> None:
    c = chain(7, 6000)
    for i in range(0, 3000, 500):
        any_index.add(M, "a", Tier.GPU, c[i:i + 500], chain_starts=[(0, c[i - 1] if i else None)])
    any_index.add(M, "b", Tier.GPU, c[:100])
    res = any_index.lookup(M, c)
    assert res.matches["a"].combined == 3000 and res.matches["b"].combined == 100


def test_memory_budget_evicts_lru_and_exports_size(clock) -> None:
    idx = MemoryIndex(max_entries=1000, now=clock)
    old, hot, new = chain(8, 400), chain(9, 400), chain(10, 400)
    idx.add(M, "a", Tier.GPU, old)
    idx.add(M, "a", Tier.GPU, hot)
    assert idx.lookup(M, hot).matches["a"].combined == 400  # touches `hot`
    idx.add(M, "a", Tier.GPU, new)
    st = idx.stats()
    assert st.entries <= 1000 and st.counters["evicted"] > 0
    assert idx.lookup(M, hot).matches["a"].combined == 400
    assert idx.lookup(M, new).matches["a"].combined == 400
    assert "a" not in idx.lookup(M, old).matches or idx.lookup(M, old).matches["a"].combined < 400


def test_memory_slot_reuse_after_clear() -> None:
    idx = MemoryIndex()
    c = chain(11, 3)
    idx.add(M, "a", Tier.GPU, c)
    idx.clear_endpoint("a")
    idx.add(M, "b", Tier.GPU, c)  # reuses a's slot; must not resurrect "a"
    assert set(idx.lookup(M, c).matches) == {"b"}


def test_memory_speculative_uses_injected_clock(clock) -> None:
    idx = MemoryIndex(now=clock)
    c = chain(12, 2)
    idx.put_speculative(M, "s", c, ttl_s=2.0)
    assert idx.lookup(M, c, include_speculative=True).matches["s"].speculative == 2
    clock.advance(2.5)
    assert idx.lookup(M, c, include_speculative=True).matches == {}


def test_extra_model_namespaces_merge_in_one_lookup(any_index) -> None:
    c = chain(13, 6)
    any_index.add(M, "engine", Tier.GPU, c[:2])
    any_index.add("any", "store", Tier.CPU, c[:5])
    res = any_index.lookup(M, c, extra_models=["any", "*"])
    assert res.matches["engine"].combined == 2
    assert res.matches["store"].tiers == {Tier.CPU: 5} and res.matches["store"].combined == 5
    assert "store" not in any_index.lookup(M, c).matches


def test_redis_auth_and_url_validation() -> None:
    from kvmesh.index.base import IndexUnavailable
    from kvmesh_indexer.redis_backend import RedisIndex
    from kvmesh_tools.testing.redis_server import RedisProcess

    proc = RedisProcess(password="s3cret").start()
    try:
        idx = RedisIndex(proc.url, namespace="auth")
        assert idx.add(M, "a", Tier.GPU, [1, 2]) == 2
        assert idx.lookup(M, [1, 2]).matches["a"].combined == 2
        noauth = RedisIndex(f"redis://127.0.0.1:{proc.port}/0", namespace="auth")
        with pytest.raises(IndexUnavailable, match="authenticat"):
            noauth.lookup(M, [1, 2])
        with pytest.raises(ValueError, match="authentication"):
            noauth.check_auth()
    finally:
        proc.stop()
    with pytest.raises(ValueError, match="redis://, rediss://"):
        RedisIndex("http://localhost:6379")
    RedisIndex("rediss://user:pw@127.0.0.1:1/0")  # TLS URLs are accepted (connects lazily)


def test_redis_down_raises_unavailable_quickly() -> None:
    from kvmesh.index.base import IndexUnavailable
    from kvmesh_indexer.redis_backend import RedisIndex
    from kvmesh_tools.testing.ports import free_port

    idx = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    t0 = time.monotonic()
    with pytest.raises(IndexUnavailable):
        idx.lookup(M, [1, 2, 3])
    assert time.monotonic() - t0 < 5.0   # 0.2 s bound; slack for a loaded machine
    assert not idx.ping()


def as_deployed(idx: BlockIndex) -> BlockIndex:
    """The backend as the indexer runs it: GPU copies counted by the backend or by the ledger."""
    return idx if idx.counts_copies else CopyCountingIndex(idx)


def test_duplicate_adds_count_once(any_index) -> None:
    c = chain(5, 3)
    assert any_index.add(M, "a", Tier.GPU, c) == 3
    assert any_index.add(M, "a", Tier.GPU, c) == 0
    assert any_index.stats().entries == 3


def test_a_gpu_block_is_held_until_its_last_copy_goes(any_index) -> None:
    # vLLM's block pool holds two blocks with one hash when a cached block is computed again (a
    # fully cached prompt's last block); it announces each store and each eviction.
    idx = as_deployed(any_index)
    c = chain(15, 4)
    assert idx.add(M, "a", Tier.GPU, c, [(0, None)]) == 4
    assert idx.add(M, "a", Tier.GPU, c[:2], [(0, None)]) == 0   # a second copy of the first two
    assert idx.stats().counters["gpu_extra_copies"] == 2
    assert idx.remove(M, "a", Tier.GPU, c[::-1]) == 2              # one copy of each evicted, tail first
    assert idx.lookup(M, c).matches["a"].tiers == {Tier.GPU: 2}    # the engine still serves the copies
    assert idx.remove(M, "a", Tier.GPU, c[:2][::-1]) == 2
    assert "a" not in idx.lookup(M, c).matches
    # Other tiers keep one entry per block: a store holds one copy of a key.
    idx.add(M, "a", Tier.CPU, c, [(0, None)])
    idx.add(M, "a", Tier.CPU, c, [(0, None)])
    assert idx.remove(M, "a", Tier.CPU, c) == 4 and "a" not in idx.lookup(M, c).matches
    # Clearing the endpoint (an engine reset) forgets its copies: a later store is one copy.
    idx.add(M, "a", Tier.GPU, c, [(0, None)])
    idx.add(M, "a", Tier.GPU, c, [(0, None)])
    idx.clear_endpoint("a")
    assert idx.stats().counters["gpu_extra_copies"] == 0
    idx.add(M, "a", Tier.GPU, c, [(0, None)])
    assert idx.remove(M, "a", Tier.GPU, c) == 4 and "a" not in idx.lookup(M, c).matches


class _Reference:
    """Obviously-correct model of the index: a set of (model, key, endpoint, tier), and the
    GPU entries' copies beyond the first."""

    def __init__(self) -> None:
        self.s: set[tuple[str, int, str, Tier]] = set()
        self.copies: dict[tuple[str, int, str, Tier], int] = {}

    def add(self, model: str, ep: str, tier: Tier, keys: list[int]) -> int:
        added = 0
        for k in keys:
            e = (model, k, ep, tier)
            if e not in self.s:
                self.s.add(e)
                added += 1
            elif tier == Tier.GPU:
                self.copies[e] = self.copies.get(e, 0) + 1
        return added

    def remove(self, model: str, ep: str, tier: Tier, keys: list[int]) -> int:
        removed = 0
        for k in keys:
            e = (model, k, ep, tier)
            if self.copies.get(e):
                self.copies[e] -= 1
            elif e in self.s:
                self.s.discard(e)
                self.copies.pop(e, None)
                removed += 1
        return removed

    def clear(self, ep: str) -> int:
        gone = {x for x in self.s if x[2] == ep}
        self.s -= gone
        self.copies = {e: n for e, n in self.copies.items() if e[2] != ep}
        return len(gone)

    def lookup(self, model: str, keys: list[int], filt=None, exclude=()) -> dict:  # noqa: ANN001
        out = {}
        eps = {e for (_, _, e, _) in self.s if (not filt or e in filt) and e not in exclude}
        for e in eps:
            tiers = {}
            for t in Tier:
                n = 0
                while n < len(keys) and (model, keys[n], e, t) in self.s:
                    n += 1
                if n:
                    tiers[t] = n
            comb = 0
            while comb < len(keys) and any((model, keys[comb], e, t) in self.s for t in Tier):
                comb += 1
            if comb:
                out[e] = (tiers, comb)
        return out


@pytest.mark.positionless_keys
@pytest.mark.parametrize("steps", [400])
def test_random_operations_match_a_reference_model(any_index, steps: int) -> None:
    import random

    rng = random.Random(1234)
    any_index = as_deployed(any_index)
    ref = _Reference()
    eps = ["a", "b", "c", "d", "e"]
    models = [M, "m2"]
    space = list(range(1, 40))
    for _ in range(steps):
        op = rng.random()
        model, ep, tier = rng.choice(models), rng.choice(eps), rng.choice(list(Tier))
        if op < 0.45:
            start = rng.randrange(len(space))
            keys = space[start:start + rng.randrange(1, 12)]
            assert any_index.add(model, ep, tier, keys) == ref.add(model, ep, tier, keys)
        elif op < 0.75:
            keys = rng.sample(space, rng.randrange(1, 6))
            assert any_index.remove(model, ep, tier, keys) == ref.remove(model, ep, tier, keys)
        elif op < 0.8:
            assert any_index.clear_endpoint(ep) == ref.clear(ep)
        else:
            start = rng.randrange(len(space))
            chain = space[start:start + rng.randrange(1, 30)]
            filt = rng.sample(eps, 2) if rng.random() < 0.3 else None
            excl = [rng.choice(eps)] if rng.random() < 0.2 else []
            got = any_index.lookup(model, chain, filt, exclude=excl)
            want = ref.lookup(model, chain, filt, excl)
            assert {e: (m.tiers, m.combined) for e, m in got.matches.items()} == want
        assert any_index.stats().entries == len(ref.s)
        assert any_index.stats().counters["gpu_extra_copies"] == sum(ref.copies.values())
    for ep in eps:
        assert any_index.endpoint_blocks(ep) == sum(1 for x in ref.s if x[2] == ep)


@pytest.mark.parametrize("seed", range(40))
def test_memory_rows_answer_as_lookup(seed: int) -> None:
    """``lookup_rows`` (the simulator's array answer) equals ``lookup``, slot by slot, also
    after endpoints leave and their slots are reused."""
    import random

    rng = random.Random(seed)
    idx = MemoryIndex()
    chains = [chain(rng.randrange(4), rng.randrange(1, 40)) for _ in range(6)]
    eps = [f"e{i}" for i in range(rng.randrange(1, 12))]
    for _ in range(rng.randrange(1, 60)):
        ep, c, tier = rng.choice(eps), rng.choice(chains), rng.choice(list(Tier))
        op = rng.random()
        if op < 0.7:
            a = rng.randrange(len(c))
            idx.add(M, ep, tier, c[a:rng.randrange(a, len(c)) + 1] if rng.random() < 0.3 else c[:rng.randrange(len(c)) + 1])
        elif op < 0.9:
            idx.remove(M, ep, tier, rng.sample(c, rng.randrange(len(c))))
        else:
            had, version = idx.slot_of(ep), idx.slots_version
            idx.clear_endpoint(ep)
            assert idx.slot_of(ep) is None
            assert idx.slots_version == version + (had is not None)   # rows moved: the reader re-maps
    for c in chains + [chain(99, 5), []]:
        rows = idx.lookup_rows(M, c)
        res = idx.lookup(M, c)
        for ep in eps:
            slot = idx.slot_of(ep)
            m = res.matches.get(ep)
            if slot is None:
                assert m is None
                continue
            row = rows[slot].tolist()
            want = [0, 0, 0, 0] if m is None else [m.combined, *(m.tiers.get(t, 0) for t in (Tier.GPU, Tier.CPU, Tier.DISK))]
            assert row == want, (ep, row, want)
    assert idx.lookup_rows("other", chains[0]).sum() == 0


def _chain_tree(rng, roots: int, leaves: int, length: int) -> list[list[int]]:
    """Chains as a router hashes them: a block key fixes its whole prefix, so chains share
    a prefix, then differ at every later block."""
    chains = [[rng.getrandbits(63) for _ in range(rng.randint(1, length))] for _ in range(roots)]
    while len(chains) < leaves:
        base = rng.choice(chains)
        cut = rng.randint(0, len(base))
        chains.append(base[:cut] + [rng.getrandbits(63) for _ in range(rng.randint(1, length))])
    return chains


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_runs_match_the_memory_backend(any_index, seed: int) -> None:
    """Speculative entries written as a router writes them (a chain from its first block), some
    overwritten by shorter-lived writes of a shared prefix, some expired: every backend finds the
    same leading run per endpoint as the in-memory index, with and without filters."""
    import random

    rng = random.Random(seed)
    ref = MemoryIndex()
    chains = _chain_tree(rng, roots=2, leaves=8, length=150)
    eps = ["e0", "e1", "e2"]
    for _ in range(60):
        c = rng.choice(chains)
        keys = c[: rng.randint(1, len(c))]
        ep, ttl = rng.choice(eps), rng.choice([0.05, 60.0, 120.0])
        for idx in (any_index, ref):
            idx.put_speculative(M, ep, keys, ttl_s=ttl)
    # A long-lived write, then a short-lived one over its prefix: once that expires, the
    # run is 0 although the long write's tail is still live (the newest write of a block wins).
    over = chains[0]
    for idx in (any_index, ref):
        idx.put_speculative(M, "e3", over, ttl_s=60.0)
        idx.put_speculative(M, "e3", over[: max(1, len(over) // 2)], ttl_s=0.05)
    sentinel = [rng.getrandbits(63)]
    for idx in (any_index, ref):
        idx.put_speculative(M, "sentinel", sentinel, ttl_s=0.05)

    def gone() -> bool:
        return all("sentinel" not in idx.lookup(M, sentinel, include_speculative=True).matches
                   for idx in (any_index, ref))

    deadline = time.monotonic() + 10
    while not gone():
        assert time.monotonic() < deadline, "short-lived speculative entries never expired"
        time.sleep(0.02)

    queries = chains + [c[: rng.randint(1, len(c))] for c in chains] + [c + [rng.getrandbits(63)] for c in chains]
    for q in queries:
        for filt, excl in ((None, None), (["e0", "e1"], None), (None, ["e1"])):
            want = ref.lookup(M, q, filt, True, excl).matches
            got = any_index.lookup(M, q, filt, True, excl).matches
            assert {e: m.speculative for e, m in got.items()} == {e: m.speculative for e, m in want.items()}
            for e, m in got.items():
                assert abs(m.speculative_ttl_s - want[e].speculative_ttl_s) < 5.0
    assert "e3" not in any_index.lookup(M, over, include_speculative=True).matches


def _same_namespace(kind: str, request, ns: str, stride: int):  # noqa: ANN001, ANN202
    """A Redis (or Redis Cluster) index on the session's server in namespace ``ns``."""
    if kind == "redis":
        from kvmesh_indexer.redis_backend import RedisIndex

        return RedisIndex(request.getfixturevalue("redis_server").url, namespace=ns, probe_stride=stride)
    from kvmesh_indexer.redis_cluster_backend import RedisClusterIndex

    return RedisClusterIndex(request.getfixturevalue("redis_cluster").url, namespace=ns, anchor_depth=4,
                             probe_stride=stride)


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
def test_redis_speculative_probe_strides_agree(kind: str, request) -> None:  # noqa: ANN001
    """Both Redis layouts probe speculative entries every ``probe_stride``-th block: each stride,
    down to reading every block, gives the same runs."""
    import random

    rng = random.Random(7)
    chains = _chain_tree(rng, roots=2, leaves=10, length=90)
    ns = f"probe{rng.getrandbits(32)}"
    idxs = [_same_namespace(kind, request, ns, s) for s in (1, 2, 5, 32)]
    for _ in range(50):
        c = rng.choice(chains)
        idxs[0].put_speculative(M, rng.choice(["a", "b"]), c[: rng.randint(1, len(c))], ttl_s=60.0)
    for q in chains:
        runs = [{e: m.speculative for e, m in i.lookup(M, q, include_speculative=True).matches.items()}
                for i in idxs]
        assert all(r == runs[0] for r in runs)
    assert any(idxs[0].lookup(M, q, include_speculative=True).matches for q in chains)
    for i in idxs:
        i.close()


def test_clearing_an_endpoint_voids_its_speculative_entries(any_index) -> None:
    """A whole-endpoint clear (AllBlocksCleared, a restart, a purge) drops the endpoint's
    speculative entries in every backend: the picks made for it are void. A one-tier clear keeps
    them, and other endpoints' entries on the same blocks (names sharing a prefix included) stay."""
    long_c, short_c, other = chain(20, 80), chain(21, 3), chain(22, 40)
    any_index.add(M, "a", Tier.GPU, long_c[:10])
    for ep in ("a", "ab", "xa"):
        any_index.put_speculative(M, ep, long_c, ttl_s=60.0)
        any_index.put_speculative(M, ep, short_c, ttl_s=60.0)
    any_index.put_speculative(M, "only-spec", other, ttl_s=60.0)   # no blocks of its own

    def spec(keys: list[int]) -> dict[str, int]:
        return {e: m.speculative for e, m in any_index.lookup(M, keys, include_speculative=True).matches.items()
                if m.speculative}

    assert spec(long_c) == {"a": 80, "ab": 80, "xa": 80}
    any_index.clear_endpoint("a", Tier.CPU)
    assert spec(long_c) == {"a": 80, "ab": 80, "xa": 80}
    any_index.clear_endpoint("a")
    assert spec(long_c) == {"ab": 80, "xa": 80}
    assert spec(short_c) == {"ab": 3, "xa": 3}
    assert "a" not in any_index.lookup(M, long_c, include_speculative=True).matches
    any_index.clear_endpoint("only-spec")
    assert spec(other) == {}
    any_index.put_speculative(M, "a", short_c, ttl_s=60.0)   # a new pick after the reset counts
    assert spec(short_c) == {"a": 3, "ab": 3, "xa": 3}


@pytest.mark.parametrize("kind", ["redis", "redis-cluster"])
def test_redis_reads_speculative_entries_of_the_previous_form(kind: str, request) -> None:  # noqa: ANN001
    """Rolling upgrade: entries an indexer before write numbers wrote (written here in its form)
    are found by the new lookup, block by block, each endpoint keeping its longer run."""
    import random

    rng = random.Random(11)
    c = [rng.getrandbits(63) for _ in range(70)]
    idx = _same_namespace(kind, request, f"old{rng.getrandbits(32)}", 8)
    r = idx.r
    sec, usec = r.time()
    exp = sec * 1000 + usec // 1000 + 60_000
    ns = idx.namespace
    if kind == "redis":
        for k in c[:50]:
            key = f"{ns}:{{{M}}}:s:".encode() + k.to_bytes(8, "big")
            r.hset(key, mapping={"old": exp, "both": exp})
            r.pexpire(key, 60_000)
    else:
        key = f"{ns}:{{{c[0]:016x}}}:s:{M}"
        r.hset(key, mapping={k.to_bytes(8, "big"): f"old={exp};both={exp}" for k in c[:50]})
        r.pexpire(key, 60_000)
    idx.put_speculative(M, "both", c[:20], ttl_s=30.0)
    idx.put_speculative(M, "new", c, ttl_s=30.0)
    got = idx.lookup(M, c, include_speculative=True).matches
    assert {e: m.speculative for e, m in got.items()} == {"old": 50, "both": 50, "new": 70}
    # the old entries' run carries their TTL (60 s), the new write's its own (30 s)
    assert 30 < got["old"].speculative_ttl_s <= 60 and 0 < got["new"].speculative_ttl_s <= 30
    assert {e: m.speculative for e, m in idx.lookup(M, c, ["new", "old"], True).matches.items()} == \
        {"old": 50, "new": 70}
    idx.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_redis_lookup_async_answers_as_lookup(any_index, seed: int) -> None:
    """The servicer's loop-side lookup (an asyncio client, no thread) gives the thread path's answer:
    holders per tier, speculative entries, filters and the store's extra model, over random chains."""
    import asyncio
    import random

    if not getattr(any_index, "native_async", False):
        pytest.skip("the backend has no loop-side lookup")
    rng = random.Random(seed)
    trees = _chain_tree(rng, 3, 6, 300)
    eps = ["a", "b", "c"]
    for ch in trees:
        for ep in rng.sample(eps, 2):
            any_index.add(M, ep, rng.choice([Tier.GPU, Tier.CPU]), ch[:rng.randrange(1, len(ch))], [(0, None)])
        any_index.put_speculative(M, rng.choice(eps), ch[:rng.randrange(1, len(ch))], 60)
        any_index.add("store", "s", Tier.CPU, ch[:rng.randrange(1, len(ch))], [(0, None)])

    def view(res):  # noqa: ANN001, ANN202
        return {e: (m.tiers, m.combined, m.speculative) for e, m in res.matches.items()}

    async def both() -> None:
        for ch in trees:
            for filt, excl in ((None, ()), (["a", "b"], ()), (None, ["c"])):
                want = any_index.lookup(M, ch, filt, True, excl, ["store"])
                got = await any_index.lookup_async(M, ch, filt, True, excl, ["store"])
                assert view(got) == view(want) and want.matches
        any_index.close()   # closes this loop's asyncio client as a task of the loop
        await any_index._closing

    asyncio.run(both())
    asyncio.run(both())   # a new loop gets a client of its own


def test_redis_lookup_async_down_raises_unavailable() -> None:
    import asyncio

    from kvmesh.index.base import IndexUnavailable
    from kvmesh_indexer.redis_backend import RedisIndex
    from kvmesh_tools.testing.ports import free_port

    idx = RedisIndex(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.2)
    with pytest.raises(IndexUnavailable):
        asyncio.run(idx.lookup_async(M, [1, 2, 3]))
